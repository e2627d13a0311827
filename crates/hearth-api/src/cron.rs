//! Cron expressions for snapshot schedules, evaluated in the wall time of an
//! IANA time zone (docs/schedules.md, "Cron expressions and time zones").
//!
//! A schedule is a set of wall-clock minutes, and each of them fires once: at
//! the first instant the zone's clock shows that minute or a later one. Both
//! daylight-saving rules follow from that one definition:
//! - a wall time that does not exist (spring forward) fires at the first
//!   instant after the gap, as cronie runs the fixed-time jobs of a skipped
//!   hour; several such times in one gap fire together, once;
//! - a wall time that occurs twice (fall back) fires at its first occurrence
//!   only. The repeated hour fires nothing again, for `*/30` as for `30 2`.
//!
//! One rule for every expression makes the spelling irrelevant (`*/30` and
//! `0,30` behave alike, where Vixie cron treats a job whose minute or hour
//! starts with `*` differently) and gives each slot exactly one instant, so
//! "the latest slot that fell due" is well defined.

use std::fmt;
use std::str::FromStr;

use chrono::{
    DateTime, Datelike, MappedLocalTime, NaiveDate, NaiveDateTime, TimeDelta, TimeZone, Timelike,
    Utc,
};
use chrono_tz::Tz;

/// How far the searches look. The Gregorian calendar, weekdays included,
/// repeats every 400 years, so a schedule that fires at all fires within any
/// 400 consecutive years; the extra year covers a search starting mid-year.
const SEARCH_YEARS: i32 = 401;

/// The longest gap a zone's clock is searched across: Pacific/Apia skipped a
/// whole day in 2011; two days leave a margin.
const MAX_GAP_MINUTES: i64 = 2 * 24 * 60;

/// One of the five fields of a cron expression.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Field {
    Minute,
    Hour,
    DayOfMonth,
    Month,
    DayOfWeek,
}

const MONTH_NAMES: [&str; 12] = [
    "jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec",
];
const DAY_NAMES: [&str; 7] = ["sun", "mon", "tue", "wed", "thu", "fri", "sat"];

impl Field {
    /// The field's place in the expression, counted from 1 as users count.
    pub fn position(self) -> usize {
        match self {
            Field::Minute => 1,
            Field::Hour => 2,
            Field::DayOfMonth => 3,
            Field::Month => 4,
            Field::DayOfWeek => 5,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Field::Minute => "minute",
            Field::Hour => "hour",
            Field::DayOfMonth => "day of month",
            Field::Month => "month",
            Field::DayOfWeek => "day of week",
        }
    }

    fn min(self) -> u32 {
        match self {
            Field::DayOfMonth | Field::Month => 1,
            Field::Minute | Field::Hour | Field::DayOfWeek => 0,
        }
    }

    /// The largest value an expression may write; day of week accepts 7 for
    /// Sunday, stored as 0.
    fn max(self) -> u32 {
        match self {
            Field::Minute => 59,
            Field::Hour => 23,
            Field::DayOfMonth => 31,
            Field::Month => 12,
            Field::DayOfWeek => 7,
        }
    }

    fn names(self) -> &'static [&'static str] {
        match self {
            Field::Month => &MONTH_NAMES,
            Field::DayOfWeek => &DAY_NAMES,
            Field::Minute | Field::Hour | Field::DayOfMonth => &[],
        }
    }

    fn expected_value(self) -> &'static str {
        match self {
            Field::Month => "a number or a month name (jan-dec)",
            Field::DayOfWeek => "a number or a day name (sun-sat)",
            Field::Minute | Field::Hour | Field::DayOfMonth => "a number",
        }
    }

    /// Every value the field can hold (`*`).
    fn all(self) -> ValueSet {
        ValueSet::stepped(self, self.min(), self.max(), 1)
    }
}

/// What is wrong with one field of an expression.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FieldProblem {
    #[error("empty list item")]
    EmptyItem,
    #[error("{value} is out of range {min}-{max}")]
    OutOfRange { value: String, min: u32, max: u32 },
    #[error("step {step} is out of range 1-{max}")]
    StepOutOfRange { step: String, max: u32 },
    #[error("range {0} is reversed")]
    ReversedRange(String),
    #[error("{value:?} is not {expected}")]
    InvalidValue {
        value: String,
        expected: &'static str,
    },
    #[error("malformed item {0:?}")]
    Malformed(String),
}

/// Why an expression or a time zone was refused; the message is what a user
/// reads as the reason their manifest was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CronError {
    #[error("the schedule is empty")]
    Empty,
    #[error(
        "unknown macro {0:?} (expected @yearly, @annually, @monthly, @weekly, @daily, @midnight or @hourly)"
    )]
    UnknownMacro(String),
    #[error(
        "expected 5 fields (minute hour day-of-month month day-of-week), found {found}{}",
        if *.found == 6 { "; a seconds field is not supported" } else { "" }
    )]
    FieldCount { found: usize },
    #[error("field {} ({}): {problem}", .field.position(), .field.name())]
    Field { field: Field, problem: FieldProblem },
    #[error("the schedule never fires: day of month {days} does not occur in month {months}")]
    NeverFires { days: String, months: String },
    #[error("unknown time zone {0:?} (expected an IANA name such as Europe/Berlin or UTC)")]
    UnknownTimeZone(String),
}

/// An IANA time zone by name (`Europe/Berlin`, `UTC`); names are
/// case-sensitive, as in the tz database.
pub fn parse_time_zone(name: &str) -> Result<Tz, CronError> {
    name.parse::<Tz>()
        .map_err(|_| CronError::UnknownTimeZone(name.to_owned()))
}

/// The values of one field, one bit each (bit 0 is value 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct ValueSet(u64);

impl ValueSet {
    const EMPTY: ValueSet = ValueSet(0);

    /// `first`, `first + step`, … up to `last`, with day of week's 7 as 0.
    fn stepped(field: Field, first: u32, last: u32, step: u32) -> ValueSet {
        let mut bits = 0u64;
        for value in (first..=last).step_by(step as usize) {
            let value = if field == Field::DayOfWeek && value == 7 {
                0
            } else {
                value
            };
            bits |= 1 << value;
        }
        ValueSet(bits)
    }

    fn contains(self, value: u32) -> bool {
        value < 64 && (self.0 >> value) & 1 == 1
    }

    fn union(self, other: ValueSet) -> ValueSet {
        ValueSet(self.0 | other.0)
    }

    fn is_subset_of(self, other: ValueSet) -> bool {
        self.0 & !other.0 == 0
    }

    fn without(self, other: ValueSet) -> ValueSet {
        ValueSet(self.0 & !other.0)
    }

    fn len(self) -> u32 {
        self.0.count_ones()
    }

    fn next_at_or_after(self, value: u32) -> Option<u32> {
        if value >= 64 {
            return None;
        }
        let above = self.0 & (u64::MAX << value);
        (above != 0).then(|| above.trailing_zeros())
    }

    fn previous_at_or_before(self, value: u32) -> Option<u32> {
        let below = if value >= 63 {
            self.0
        } else {
            self.0 & ((1u64 << (value + 1)) - 1)
        };
        (below != 0).then(|| 63 - below.leading_zeros())
    }

    fn values(self) -> impl Iterator<Item = u32> {
        (0..64).filter(move |&value| self.contains(value))
    }
}

/// How day of month and day of week combine (Vixie cron): when both are
/// restricted, that is neither is written starting with `*`, a day matches if
/// either matches (`0 0 1 * mon`: the 1st and every Monday); otherwise it
/// must match both (`0 0 */2 * mon`: Mondays with an odd date).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum DayRule {
    Both,
    Either,
}

/// A parsed 5-field cron expression. Expressions that differ only in
/// spelling (names, ranges, steps, macros) give equal schedules, and
/// `Display` writes the canonical form.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Schedule {
    minutes: ValueSet,
    hours: ValueSet,
    days_of_month: ValueSet,
    months: ValueSet,
    /// Sunday is 0.
    days_of_week: ValueSet,
    day_rule: DayRule,
}

impl Schedule {
    /// Parses `minute hour day-of-month month day-of-week` or a macro
    /// (`@hourly`, `@daily`, `@midnight`, `@weekly`, `@monthly`, `@yearly`,
    /// `@annually`). A schedule that can never fire (`0 0 30 2 *`) is refused.
    pub fn parse(text: &str) -> Result<Schedule, CronError> {
        let text = text.trim();
        if text.is_empty() {
            return Err(CronError::Empty);
        }
        let expanded = if text.starts_with('@') {
            expand_macro(text)?
        } else {
            text
        };
        let fields: Vec<&str> = expanded.split_whitespace().collect();
        let [minute, hour, day_of_month, month, day_of_week] = fields[..] else {
            return Err(CronError::FieldCount {
                found: fields.len(),
            });
        };
        let parse = |field: Field, text: &str| {
            parse_field(field, text).map_err(|problem| CronError::Field { field, problem })
        };
        let day_rule = if day_of_month.starts_with('*') || day_of_week.starts_with('*') {
            DayRule::Both
        } else {
            DayRule::Either
        };
        let schedule = Schedule {
            minutes: parse(Field::Minute, minute)?,
            hours: parse(Field::Hour, hour)?,
            days_of_month: parse(Field::DayOfMonth, day_of_month)?,
            months: parse(Field::Month, month)?,
            days_of_week: parse(Field::DayOfWeek, day_of_week)?,
            day_rule,
        }
        .normalized();
        schedule.check_fires()?;
        Ok(schedule)
    }

    /// The first fire instant strictly after `after`, in the wall time of
    /// `tz` (the module comment has the daylight-saving rule). `None` only
    /// past the dates chrono can represent.
    pub fn next_after(&self, after: DateTime<Utc>, tz: Tz) -> Option<DateTime<Utc>> {
        let local_after = after.with_timezone(&tz).naive_local();
        let mut from = start_of_minute(local_after).checked_add_signed(TimeDelta::minutes(1))?;
        // Wall times after `local_after` fire after `after`, except in a
        // repeated hour: those the clock already showed before it fell back
        // fired then. At most an overlap's worth of them is passed over.
        loop {
            let wall = self.next_wall_match(from)?;
            if let Some(fire) = fire_instant(tz, wall)
                && fire > after
            {
                return Some(fire);
            }
            from = wall.checked_add_signed(TimeDelta::minutes(1))?;
        }
    }

    /// The latest fire instant at or before `at`: the slot that fell due last,
    /// for instance while the daemon was down. Consistent with `next_after`:
    /// for the result `s`, `next_after(s - 1ns) == s` and `next_after(s) > at`.
    pub fn previous_slot_at_or_before(&self, at: DateTime<Utc>, tz: Tz) -> Option<DateTime<Utc>> {
        let local_at = at.with_timezone(&tz).naive_local();
        let mut before = start_of_minute(local_at);
        // A wall time no later than the clock at `at` has fired by `at`.
        let mut slot = loop {
            let wall = self.previous_wall_match(before)?;
            if let Some(fire) = fire_instant(tz, wall)
                && fire <= at
            {
                break fire;
            }
            before = wall.checked_sub_signed(TimeDelta::minutes(1))?;
        };
        // After a fall back the clock at `at` is behind what it showed
        // earlier: the wall times in between fired before `at` too.
        while let Some(next) = self.next_after(slot, tz)
            && next <= at
        {
            slot = next;
        }
        Some(slot)
    }

    /// In OR mode a field that matches every day makes the other irrelevant;
    /// folding that into `* *` keeps equal schedules equal.
    fn normalized(mut self) -> Schedule {
        if self.day_rule == DayRule::Either
            && (self.days_of_month == Field::DayOfMonth.all()
                || self.days_of_week == Field::DayOfWeek.all())
        {
            self.days_of_month = Field::DayOfMonth.all();
            self.days_of_week = Field::DayOfWeek.all();
            self.day_rule = DayRule::Both;
        }
        self
    }

    /// Every month has every weekday, so in OR mode a schedule always fires.
    /// In AND mode it fires if one of its days of month exists in one of its
    /// months: over 400 years each date falls on every weekday (29 February
    /// too).
    fn check_fires(&self) -> Result<(), CronError> {
        if self.day_rule == DayRule::Either {
            return Ok(());
        }
        let fires = self.months.values().any(|month| {
            self.days_of_month
                .values()
                .any(|day| day <= longest_month(month))
        });
        if fires {
            Ok(())
        } else {
            Err(CronError::NeverFires {
                days: render_plain(self.days_of_month),
                months: render_plain(self.months),
            })
        }
    }

    fn matches_date(&self, date: NaiveDate) -> bool {
        if !self.months.contains(date.month()) {
            return false;
        }
        let day_of_month = self.days_of_month.contains(date.day());
        let day_of_week = self
            .days_of_week
            .contains(date.weekday().num_days_from_sunday());
        match self.day_rule {
            DayRule::Both => day_of_month && day_of_week,
            DayRule::Either => day_of_month || day_of_week,
        }
    }

    /// The first matching wall-clock minute at or after `from` (a whole
    /// minute), skipping months, days and hours that cannot match.
    fn next_wall_match(&self, from: NaiveDateTime) -> Option<NaiveDateTime> {
        let last_year = from.year().checked_add(SEARCH_YEARS)?;
        let mut date = from.date();
        let (mut hour, mut minute) = (from.hour(), from.minute());
        loop {
            if date.year() > last_year {
                return None;
            }
            if !self.months.contains(date.month()) {
                date = first_of_next_month(date)?;
                (hour, minute) = (0, 0);
                continue;
            }
            if !self.matches_date(date) {
                date = date.succ_opt()?;
                (hour, minute) = (0, 0);
                continue;
            }
            let Some(next_hour) = self.hours.next_at_or_after(hour) else {
                date = date.succ_opt()?;
                (hour, minute) = (0, 0);
                continue;
            };
            if next_hour != hour {
                (hour, minute) = (next_hour, 0);
            }
            if let Some(next_minute) = self.minutes.next_at_or_after(minute) {
                return date.and_hms_opt(hour, next_minute, 0);
            }
            (hour, minute) = (hour + 1, 0);
            if hour == 24 {
                date = date.succ_opt()?;
                hour = 0;
            }
        }
    }

    /// The last matching wall-clock minute at or before `from` (a whole
    /// minute): `next_wall_match` run backwards.
    fn previous_wall_match(&self, from: NaiveDateTime) -> Option<NaiveDateTime> {
        let first_year = from.year().checked_sub(SEARCH_YEARS)?;
        let mut date = from.date();
        let (mut hour, mut minute) = (from.hour(), from.minute());
        loop {
            if date.year() < first_year {
                return None;
            }
            if !self.months.contains(date.month()) {
                date = date.with_day(1)?.pred_opt()?;
                (hour, minute) = (23, 59);
                continue;
            }
            if !self.matches_date(date) {
                date = date.pred_opt()?;
                (hour, minute) = (23, 59);
                continue;
            }
            let Some(previous_hour) = self.hours.previous_at_or_before(hour) else {
                date = date.pred_opt()?;
                (hour, minute) = (23, 59);
                continue;
            };
            if previous_hour != hour {
                (hour, minute) = (previous_hour, 59);
            }
            if let Some(previous_minute) = self.minutes.previous_at_or_before(minute) {
                return date.and_hms_opt(hour, previous_minute, 0);
            }
            if hour == 0 {
                date = date.pred_opt()?;
                (hour, minute) = (23, 59);
            } else {
                (hour, minute) = (hour - 1, 59);
            }
        }
    }
}

impl FromStr for Schedule {
    type Err = CronError;

    fn from_str(text: &str) -> Result<Schedule, CronError> {
        Schedule::parse(text)
    }
}

/// The canonical form: five numeric fields (macros and names spelled out,
/// day of week 7 as 0), each value set written one way only. Parsing it gives
/// back an equal schedule.
impl fmt::Display for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (days_of_month, days_of_week) = match self.day_rule {
            // Neither may start with `*`, which would turn OR into AND.
            DayRule::Either => (
                render_plain(self.days_of_month),
                render_plain(self.days_of_week),
            ),
            DayRule::Both => {
                let days_of_month = render(Field::DayOfMonth, self.days_of_month);
                let days_of_week = render(Field::DayOfWeek, self.days_of_week);
                if days_of_month.starts_with('*') || days_of_week.starts_with('*') {
                    (days_of_month, days_of_week)
                } else if self.days_of_month.contains(Field::DayOfMonth.min()) {
                    // AND needs a field that starts with `*`; a star step
                    // always holds the field's first value.
                    (
                        render_star_prefixed(Field::DayOfMonth, self.days_of_month),
                        days_of_week,
                    )
                } else {
                    (
                        days_of_month,
                        render_star_prefixed(Field::DayOfWeek, self.days_of_week),
                    )
                }
            }
        };
        write!(
            f,
            "{} {} {} {} {}",
            render(Field::Minute, self.minutes),
            render(Field::Hour, self.hours),
            days_of_month,
            render(Field::Month, self.months),
            days_of_week
        )
    }
}

fn expand_macro(text: &str) -> Result<&'static str, CronError> {
    match text.to_ascii_lowercase().as_str() {
        "@yearly" | "@annually" => Ok("0 0 1 1 *"),
        "@monthly" => Ok("0 0 1 * *"),
        "@weekly" => Ok("0 0 * * 0"),
        "@daily" | "@midnight" => Ok("0 0 * * *"),
        "@hourly" => Ok("0 * * * *"),
        _ => Err(CronError::UnknownMacro(text.to_owned())),
    }
}

/// One field: a comma-separated list of `*`, `a`, `a-b`, each optionally
/// followed by `/step` (`a/step` runs to the field's end).
fn parse_field(field: Field, text: &str) -> Result<ValueSet, FieldProblem> {
    let mut set = ValueSet::EMPTY;
    for item in text.split(',') {
        if item.is_empty() {
            return Err(FieldProblem::EmptyItem);
        }
        let (range, step) = match item.split_once('/') {
            Some((range, step)) => (range, Some(parse_step(field, item, step)?)),
            None => (item, None),
        };
        let (first, last) = if range == "*" {
            (field.min(), field.max())
        } else if let Some((first, last)) = range.split_once('-') {
            let first = parse_value(field, item, first, false)?;
            let last = parse_value(field, item, last, true)?;
            if first > last {
                return Err(FieldProblem::ReversedRange(range.to_owned()));
            }
            (first, last)
        } else {
            let value = parse_value(field, item, range, false)?;
            (value, if step.is_some() { field.max() } else { value })
        };
        set = set.union(ValueSet::stepped(field, first, last, step.unwrap_or(1)));
    }
    Ok(set)
}

fn parse_step(field: Field, item: &str, text: &str) -> Result<u32, FieldProblem> {
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return Err(FieldProblem::Malformed(item.to_owned()));
    }
    match text.parse::<u32>() {
        Ok(step) if (1..=field.max()).contains(&step) => Ok(step),
        _ => Err(FieldProblem::StepOutOfRange {
            step: text.to_owned(),
            max: field.max(),
        }),
    }
}

/// A number or a name. `sun` ending a range is 7, so that `fri-sun` reads
/// as written.
fn parse_value(
    field: Field,
    item: &str,
    text: &str,
    ends_range: bool,
) -> Result<u32, FieldProblem> {
    if text.is_empty() || text.contains(['*', '-', '/']) {
        return Err(FieldProblem::Malformed(item.to_owned()));
    }
    if text.bytes().all(|b| b.is_ascii_digit()) {
        return match text.parse::<u32>() {
            Ok(value) if (field.min()..=field.max()).contains(&value) => Ok(value),
            _ => Err(FieldProblem::OutOfRange {
                value: text.to_owned(),
                min: field.min(),
                max: field.max(),
            }),
        };
    }
    let index = field
        .names()
        .iter()
        .position(|name| name.eq_ignore_ascii_case(text))
        .ok_or_else(|| FieldProblem::InvalidValue {
            value: text.to_owned(),
            expected: field.expected_value(),
        })?;
    let value = field.min() + index as u32;
    Ok(if field == Field::DayOfWeek && ends_range && value == 0 {
        7
    } else {
        value
    })
}

/// A set in `*` forms where they fit (`*`, `*/15`), for every field except
/// the day fields under the OR rule, where a leading `*` would change the rule.
fn render(field: Field, set: ValueSet) -> String {
    if set == field.all() {
        return "*".to_owned();
    }
    if set.len() >= 2
        && let Some(step) = (2..=field.max()).find(|&step| star_step(field, step) == set)
    {
        return format!("*/{step}");
    }
    render_plain(set)
}

/// `*/n` followed by what the step leaves out, for a day field that must
/// start with `*` to keep the AND rule; `n` is the smallest step whose values
/// all belong to the set (the largest step holds the first value only).
fn render_star_prefixed(field: Field, set: ValueSet) -> String {
    let step = (2..=field.max())
        .find(|&step| star_step(field, step).is_subset_of(set))
        .unwrap_or(field.max());
    let rest = set.without(star_step(field, step));
    if rest == ValueSet::EMPTY {
        format!("*/{step}")
    } else {
        format!("*/{step},{}", render_plain(rest))
    }
}

fn star_step(field: Field, step: u32) -> ValueSet {
    ValueSet::stepped(field, field.min(), field.max(), step)
}

/// A set without `*`: `a-b/n` for an arithmetic run of three or more, else a
/// list of values and ranges of three or more consecutive values.
fn render_plain(set: ValueSet) -> String {
    let values: Vec<u32> = set.values().collect();
    if values.len() >= 3 {
        let step = values[1] - values[0];
        if step >= 2 && values.windows(2).all(|pair| pair[1] - pair[0] == step) {
            return format!("{}-{}/{step}", values[0], values[values.len() - 1]);
        }
    }
    let mut parts = Vec::new();
    let mut index = 0;
    while index < values.len() {
        let mut end = index;
        while end + 1 < values.len() && values[end + 1] == values[end] + 1 {
            end += 1;
        }
        if end - index >= 2 {
            parts.push(format!("{}-{}", values[index], values[end]));
        } else {
            parts.extend(values[index..=end].iter().map(u32::to_string));
        }
        index = end + 1;
    }
    parts.join(",")
}

fn longest_month(month: u32) -> u32 {
    match month {
        2 => 29,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

fn first_of_next_month(date: NaiveDate) -> Option<NaiveDate> {
    if date.month() == 12 {
        NaiveDate::from_ymd_opt(date.year().checked_add(1)?, 1, 1)
    } else {
        NaiveDate::from_ymd_opt(date.year(), date.month() + 1, 1)
    }
}

fn start_of_minute(time: NaiveDateTime) -> NaiveDateTime {
    time.date()
        .and_hms_opt(time.hour(), time.minute(), 0)
        .expect("hour and minute come from a valid time")
}

/// When the wall time `wall` fires in `tz`: the first instant the clock
/// shows `wall` or later.
fn fire_instant(tz: Tz, wall: NaiveDateTime) -> Option<DateTime<Utc>> {
    match tz.from_local_datetime(&wall) {
        MappedLocalTime::Single(instant) => Some(instant.with_timezone(&Utc)),
        MappedLocalTime::Ambiguous(first, second) => Some(first.min(second).with_timezone(&Utc)),
        MappedLocalTime::None => end_of_gap(tz, wall),
    }
}

/// The instant the clock jumps over `wall` (which does not exist): found to
/// the minute as the first existing wall minute after it, then to the second,
/// since old offsets (local mean time) are not whole minutes.
fn end_of_gap(tz: Tz, wall: NaiveDateTime) -> Option<DateTime<Utc>> {
    let after_gap = (1..=MAX_GAP_MINUTES).find_map(|minutes| {
        let later = wall.checked_add_signed(TimeDelta::minutes(minutes))?;
        tz.from_local_datetime(&later).earliest()
    })?;
    // The clock passes `wall` within the minute before `after_gap` (the
    // minute before that one does not exist either).
    let shows_wall_or_later = |seconds: i64| {
        DateTime::from_timestamp(seconds, 0)
            .is_some_and(|instant| instant.with_timezone(&tz).naive_local() >= wall)
    };
    let (mut before, mut reached) = (after_gap.timestamp() - 60, after_gap.timestamp());
    while reached - before > 1 {
        let middle = before + (reached - before) / 2;
        if shows_wall_or_later(middle) {
            reached = middle;
        } else {
            before = middle;
        }
    }
    DateTime::from_timestamp(reached, 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::Offset;
    use proptest::prelude::*;

    fn utc(text: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(text)
            .unwrap_or_else(|e| panic!("{text}: {e}"))
            .with_timezone(&Utc)
    }

    fn zone(name: &str) -> Tz {
        parse_time_zone(name).unwrap()
    }

    fn schedule(text: &str) -> Schedule {
        Schedule::parse(text).unwrap_or_else(|e| panic!("{text:?}: {e}"))
    }

    fn next_n(schedule: &Schedule, start: DateTime<Utc>, tz: Tz, n: usize) -> Vec<DateTime<Utc>> {
        let mut fires = Vec::new();
        let mut after = start;
        for _ in 0..n {
            let Some(fire) = schedule.next_after(after, tz) else {
                break;
            };
            fires.push(fire);
            after = fire;
        }
        fires
    }

    /// Whether the wall-clock minute `wall` is in the schedule.
    fn matches(schedule: &Schedule, wall: NaiveDateTime) -> bool {
        schedule.matches_date(wall.date())
            && schedule.hours.contains(wall.hour())
            && schedule.minutes.contains(wall.minute())
    }

    fn local(instant: DateTime<Utc>, tz: Tz) -> NaiveDateTime {
        instant.with_timezone(&tz).naive_local()
    }

    // Expression, zone, start, the next three fire times (UTC), each worked
    // out by hand from the zone's offsets (local times in the comments).
    const NEXT_FIRES: &[(&str, &str, &str, [&str; 3])] = &[
        (
            "*/15 * * * *",
            "UTC",
            "2026-01-01T00:07:00Z",
            [
                "2026-01-01T00:15:00Z",
                "2026-01-01T00:30:00Z",
                "2026-01-01T00:45:00Z",
            ],
        ),
        // Strictly after: a start on a slot does not return it.
        (
            "*/15 * * * *",
            "UTC",
            "2026-01-01T00:15:00Z",
            [
                "2026-01-01T00:30:00Z",
                "2026-01-01T00:45:00Z",
                "2026-01-01T01:00:00Z",
            ],
        ),
        // A start inside a minute: that minute's slot is past.
        (
            "* * * * *",
            "UTC",
            "2026-01-01T00:15:00.000000001Z",
            [
                "2026-01-01T00:16:00Z",
                "2026-01-01T00:17:00Z",
                "2026-01-01T00:18:00Z",
            ],
        ),
        // +05:30: 05:37 local, then 06:00, 07:00, 08:00.
        (
            "0 * * * *",
            "Asia/Kolkata",
            "2026-01-01T00:07:00Z",
            [
                "2026-01-01T00:30:00Z",
                "2026-01-01T01:30:00Z",
                "2026-01-01T02:30:00Z",
            ],
        ),
        // 2026-01-01 is a Thursday: Sundays 4, 11, 18 January.
        (
            "0 0 * * 0",
            "UTC",
            "2026-01-01T00:00:00Z",
            [
                "2026-01-04T00:00:00Z",
                "2026-01-11T00:00:00Z",
                "2026-01-18T00:00:00Z",
            ],
        ),
        (
            "0 0 * * 7",
            "UTC",
            "2026-01-01T00:00:00Z",
            [
                "2026-01-04T00:00:00Z",
                "2026-01-11T00:00:00Z",
                "2026-01-18T00:00:00Z",
            ],
        ),
        // Midnight EST (-05:00) on those Sundays.
        (
            "0 0 * * sun",
            "America/New_York",
            "2026-01-01T00:00:00Z",
            [
                "2026-01-04T05:00:00Z",
                "2026-01-11T05:00:00Z",
                "2026-01-18T05:00:00Z",
            ],
        ),
        // OR rule: Monday 26 January is past noon; then Sunday 1 February
        // (the 1st), Monday 2 and Monday 9 February.
        (
            "0 12 1 * mon",
            "UTC",
            "2026-01-26T13:00:00Z",
            [
                "2026-02-01T12:00:00Z",
                "2026-02-02T12:00:00Z",
                "2026-02-09T12:00:00Z",
            ],
        ),
        // The same at 12:00 CET (+01:00).
        (
            "0 12 1 * mon",
            "Europe/Berlin",
            "2026-01-26T13:00:00Z",
            [
                "2026-02-01T11:00:00Z",
                "2026-02-02T11:00:00Z",
                "2026-02-09T11:00:00Z",
            ],
        ),
        (
            "0 0 29 2 *",
            "UTC",
            "2026-01-01T00:00:00Z",
            [
                "2028-02-29T00:00:00Z",
                "2032-02-29T00:00:00Z",
                "2036-02-29T00:00:00Z",
            ],
        ),
        // 2100 is not a leap year.
        (
            "0 0 29 2 *",
            "UTC",
            "2096-03-01T00:00:00Z",
            [
                "2104-02-29T00:00:00Z",
                "2108-02-29T00:00:00Z",
                "2112-02-29T00:00:00Z",
            ],
        ),
        // AND rule (`*/7` is Sunday only): 29 February on a Sunday, 28 years
        // apart, then 40 across 2100.
        (
            "0 0 29 2 */7",
            "UTC",
            "2033-01-01T00:00:00Z",
            [
                "2060-02-29T00:00:00Z",
                "2088-02-29T00:00:00Z",
                "2128-02-29T00:00:00Z",
            ],
        ),
        // Midnight on the 1st: CET (+01:00) in February and March, CEST
        // (+02:00) on 1 April.
        (
            "@monthly",
            "Europe/Berlin",
            "2026-01-15T00:00:00Z",
            [
                "2026-01-31T23:00:00Z",
                "2026-02-28T23:00:00Z",
                "2026-03-31T22:00:00Z",
            ],
        ),
        // Friday 2 January 16:00 EST: 17:00 that day, then Monday 09:00 and
        // 11:00.
        (
            "0 9-17/2 * * mon-fri",
            "America/New_York",
            "2026-01-02T21:00:00Z",
            [
                "2026-01-02T22:00:00Z",
                "2026-01-05T14:00:00Z",
                "2026-01-05T16:00:00Z",
            ],
        ),
        // Berlin springs forward on 2026-03-29 at 02:00 CET → 03:00 CEST
        // (01:00 UTC): 02:30 CET on the 28th, 03:00 CEST on the 29th (02:30
        // does not exist; once), 02:30 CEST on the 30th.
        (
            "30 2 * * *",
            "Europe/Berlin",
            "2026-03-28T00:00:00Z",
            [
                "2026-03-28T01:30:00Z",
                "2026-03-29T01:00:00Z",
                "2026-03-30T00:30:00Z",
            ],
        ),
        // 02:00 and 02:30 do not exist: one fire at 03:00 CEST, then 03:30
        // and 04:00.
        (
            "*/30 * * * *",
            "Europe/Berlin",
            "2026-03-29T00:45:00Z",
            [
                "2026-03-29T01:00:00Z",
                "2026-03-29T01:30:00Z",
                "2026-03-29T02:00:00Z",
            ],
        ),
        // Berlin falls back on 2026-10-25 at 03:00 CEST → 02:00 CET (01:00
        // UTC): 02:30 CEST on the 24th, the first 02:30 (CEST) on the 25th
        // only, 02:30 CET on the 26th.
        (
            "30 2 * * *",
            "Europe/Berlin",
            "2026-10-24T00:00:00Z",
            [
                "2026-10-24T00:30:00Z",
                "2026-10-25T00:30:00Z",
                "2026-10-26T01:30:00Z",
            ],
        ),
        // From inside the repeated hour (02:10 CET): today's 02:30 fired at
        // 02:30 CEST, before the start; the next is tomorrow's.
        (
            "30 2 * * *",
            "Europe/Berlin",
            "2026-10-25T01:10:00Z",
            [
                "2026-10-26T01:30:00Z",
                "2026-10-27T01:30:00Z",
                "2026-10-28T01:30:00Z",
            ],
        ),
        // Each wall time fires once, at its first occurrence: 02:00 and 02:30
        // CEST fire, the repeated 02:00 and 02:30 CET (01:00 and 01:30 UTC)
        // do not, the next is 03:00 CET. A 90-minute pause, once a year.
        (
            "*/30 * * * *",
            "Europe/Berlin",
            "2026-10-24T23:45:00Z",
            [
                "2026-10-25T00:00:00Z",
                "2026-10-25T00:30:00Z",
                "2026-10-25T02:00:00Z",
            ],
        ),
        // From inside the repeated hour (02:10 CET, the second pass).
        (
            "*/30 * * * *",
            "Europe/Berlin",
            "2026-10-25T01:10:00Z",
            [
                "2026-10-25T02:00:00Z",
                "2026-10-25T02:30:00Z",
                "2026-10-25T03:00:00Z",
            ],
        ),
        // New York springs forward on 2026-03-08 at 02:00 EST → 03:00 EDT
        // (07:00 UTC).
        (
            "30 2 * * *",
            "America/New_York",
            "2026-03-07T12:00:00Z",
            [
                "2026-03-08T07:00:00Z",
                "2026-03-09T06:30:00Z",
                "2026-03-10T06:30:00Z",
            ],
        ),
        // New York falls back on 2026-11-01 at 02:00 EDT → 01:00 EST (06:00
        // UTC): 01:30 EDT once, then 01:30 EST.
        (
            "30 1 * * *",
            "America/New_York",
            "2026-10-31T12:00:00Z",
            [
                "2026-11-01T05:30:00Z",
                "2026-11-02T06:30:00Z",
                "2026-11-03T06:30:00Z",
            ],
        ),
        // São Paulo sprang forward at midnight on 2018-11-04 (00:00 -03 →
        // 01:00 -02, 03:00 UTC): that day's midnight fires at 01:00.
        (
            "0 0 * * *",
            "America/Sao_Paulo",
            "2018-11-02T12:00:00Z",
            [
                "2018-11-03T03:00:00Z",
                "2018-11-04T03:00:00Z",
                "2018-11-05T02:00:00Z",
            ],
        ),
        // Samoa skipped 2011-12-30 (23:59:59 -10 on the 29th → 00:00 +14 on
        // the 31st, 10:00 UTC): noon on the 30th fires at that jump.
        (
            "0 12 * * *",
            "Pacific/Apia",
            "2011-12-29T00:00:00Z",
            [
                "2011-12-29T22:00:00Z",
                "2011-12-30T10:00:00Z",
                "2011-12-30T22:00:00Z",
            ],
        ),
        // Midnight JST (+09:00) on 1 January.
        (
            "@yearly",
            "Asia/Tokyo",
            "2026-06-01T00:00:00Z",
            [
                "2026-12-31T15:00:00Z",
                "2027-12-31T15:00:00Z",
                "2028-12-31T15:00:00Z",
            ],
        ),
    ];

    #[test]
    fn next_fire_times_match_the_hand_checked_table() {
        for (text, zone_name, start, expected) in NEXT_FIRES {
            let fires = next_n(&schedule(text), utc(start), zone(zone_name), 3);
            let expected: Vec<_> = expected.iter().map(|e| utc(e)).collect();
            assert_eq!(fires, expected, "{text:?} in {zone_name} after {start}");
        }
    }

    // Expression, zone, instant, the latest slot at or before it.
    const PREVIOUS_SLOTS: &[(&str, &str, &str, &str)] = &[
        // Inside the repeated hour (02:10 CET): today's 02:30 already fired,
        // at 02:30 CEST.
        (
            "30 2 * * *",
            "Europe/Berlin",
            "2026-10-25T01:10:00Z",
            "2026-10-25T00:30:00Z",
        ),
        // At or before: a slot itself.
        (
            "30 2 * * *",
            "Europe/Berlin",
            "2026-10-25T00:30:00Z",
            "2026-10-25T00:30:00Z",
        ),
        (
            "30 2 * * *",
            "Europe/Berlin",
            "2026-10-25T00:29:59Z",
            "2026-10-24T00:30:00Z",
        ),
        // The skipped 02:30 fell due at the end of the gap.
        (
            "30 2 * * *",
            "Europe/Berlin",
            "2026-03-29T01:00:00Z",
            "2026-03-29T01:00:00Z",
        ),
        (
            "30 2 * * *",
            "Europe/Berlin",
            "2026-03-29T00:59:59Z",
            "2026-03-28T01:30:00Z",
        ),
        // 02:59 CET, end of the repeated hour: the last slot is 02:30 CEST.
        (
            "*/30 * * * *",
            "Europe/Berlin",
            "2026-10-25T01:59:00Z",
            "2026-10-25T00:30:00Z",
        ),
        (
            "0 0 29 2 *",
            "UTC",
            "2026-06-01T00:00:00Z",
            "2024-02-29T00:00:00Z",
        ),
        // OR rule: Monday 26 January, not a 1st.
        (
            "0 12 1 * mon",
            "UTC",
            "2026-02-01T11:59:00Z",
            "2026-01-26T12:00:00Z",
        ),
    ];

    #[test]
    fn previous_slots_match_the_hand_checked_table() {
        for (text, zone_name, at, expected) in PREVIOUS_SLOTS {
            let slot = schedule(text).previous_slot_at_or_before(utc(at), zone(zone_name));
            assert_eq!(slot, Some(utc(expected)), "{text:?} in {zone_name} at {at}");
        }
    }

    const PARSE_ERRORS: &[(&str, &str)] = &[
        ("", "the schedule is empty"),
        (" \t ", "the schedule is empty"),
        (
            "* * * *",
            "expected 5 fields (minute hour day-of-month month day-of-week), found 4",
        ),
        (
            "0 30 2 * * *",
            "expected 5 fields (minute hour day-of-month month day-of-week), found 6; \
             a seconds field is not supported",
        ),
        (
            "0 0 1 1 * 2027 x",
            "expected 5 fields (minute hour day-of-month month day-of-week), found 7",
        ),
        ("60 * * * *", "field 1 (minute): 60 is out of range 0-59"),
        (
            "99999999999 * * * *",
            "field 1 (minute): 99999999999 is out of range 0-59",
        ),
        ("* 24 * * *", "field 2 (hour): 24 is out of range 0-23"),
        (
            "* * 0 * *",
            "field 3 (day of month): 0 is out of range 1-31",
        ),
        (
            "* * 32 * *",
            "field 3 (day of month): 32 is out of range 1-31",
        ),
        ("* * * 0 *", "field 4 (month): 0 is out of range 1-12"),
        ("* * * 13 *", "field 4 (month): 13 is out of range 1-12"),
        ("* * * * 8", "field 5 (day of week): 8 is out of range 0-7"),
        ("1,,2 * * * *", "field 1 (minute): empty list item"),
        ("* 1, * * *", "field 2 (hour): empty list item"),
        ("* * ,1 * *", "field 3 (day of month): empty list item"),
        (
            "*/0 * * * *",
            "field 1 (minute): step 0 is out of range 1-59",
        ),
        (
            "* */24 * * *",
            "field 2 (hour): step 24 is out of range 1-23",
        ),
        (
            "* * * * 1-5/8",
            "field 5 (day of week): step 8 is out of range 1-7",
        ),
        ("30-10 * * * *", "field 1 (minute): range 30-10 is reversed"),
        (
            "* * * dec-jan *",
            "field 4 (month): range dec-jan is reversed",
        ),
        (
            "* * * * sat-mon/2",
            "field 5 (day of week): range sat-mon is reversed",
        ),
        ("mon * * * *", "field 1 (minute): \"mon\" is not a number"),
        ("* * L * *", "field 3 (day of month): \"L\" is not a number"),
        ("* * ? * *", "field 3 (day of month): \"?\" is not a number"),
        (
            "* * * foo *",
            "field 4 (month): \"foo\" is not a number or a month name (jan-dec)",
        ),
        (
            "* * * * monday",
            "field 5 (day of week): \"monday\" is not a number or a day name (sun-sat)",
        ),
        (
            "* * * * jan",
            "field 5 (day of week): \"jan\" is not a number or a day name (sun-sat)",
        ),
        (
            "* * * * 5#2",
            "field 5 (day of week): \"5#2\" is not a number or a day name (sun-sat)",
        ),
        (
            "* * * * 1-2-3",
            "field 5 (day of week): malformed item \"1-2-3\"",
        ),
        (
            "*/5/2 * * * *",
            "field 1 (minute): malformed item \"*/5/2\"",
        ),
        ("5- * * * *", "field 1 (minute): malformed item \"5-\""),
        ("-5 * * * *", "field 1 (minute): malformed item \"-5\""),
        ("*/ * * * *", "field 1 (minute): malformed item \"*/\""),
        ("/5 * * * *", "field 1 (minute): malformed item \"/5\""),
        (
            "1-5/x * * * *",
            "field 1 (minute): malformed item \"1-5/x\"",
        ),
        ("*-5 * * * *", "field 1 (minute): malformed item \"*-5\""),
        (
            "@reboot",
            "unknown macro \"@reboot\" (expected @yearly, @annually, @monthly, @weekly, \
             @daily, @midnight or @hourly)",
        ),
        (
            "@daily 5",
            "unknown macro \"@daily 5\" (expected @yearly, @annually, @monthly, @weekly, \
             @daily, @midnight or @hourly)",
        ),
        (
            "0 0 30 2 *",
            "the schedule never fires: day of month 30 does not occur in month 2",
        ),
        (
            "0 0 31 apr,jun,sep,nov *",
            "the schedule never fires: day of month 31 does not occur in month 4,6,9,11",
        ),
        // AND rule (day of week starts with `*`): still never.
        (
            "0 0 30,31 feb */2",
            "the schedule never fires: day of month 30,31 does not occur in month 2",
        ),
    ];

    #[test]
    fn parse_errors_name_the_problem_and_the_field() {
        for (text, expected) in PARSE_ERRORS {
            match Schedule::parse(text) {
                Ok(schedule) => panic!("{text:?} parsed as {schedule}"),
                Err(error) => assert_eq!(error.to_string(), *expected, "{text:?}"),
            }
        }
    }

    #[test]
    fn field_errors_are_typed() {
        assert_eq!(
            Schedule::parse("* 24 * * *"),
            Err(CronError::Field {
                field: Field::Hour,
                problem: FieldProblem::OutOfRange {
                    value: "24".to_owned(),
                    min: 0,
                    max: 23
                },
            })
        );
        assert_eq!(
            "1 2 3".parse::<Schedule>(),
            Err(CronError::FieldCount { found: 3 })
        );
    }

    // Input, canonical form.
    const CANONICAL: &[(&str, &str)] = &[
        ("*/15 * * * *", "*/15 * * * *"),
        ("0-59 * * * *", "* * * * *"),
        ("*/1 * * * *", "* * * * *"),
        ("0,15,30,45 * * * *", "*/15 * * * *"),
        ("0-30/15 * * * *", "0-30/15 * * * *"),
        ("1,2,3,5 * * * *", "1-3,5 * * * *"),
        ("1,2 * * * *", "1,2 * * * *"),
        ("0 9-17/2 * * mon-fri", "0 9-17/2 * * 1-5"),
        ("0 0 * * 7", "0 0 * * 0"),
        ("0 0 * * fri-sun", "0 0 * * 0,5,6"),
        ("0 0 * JAN,Feb,mar *", "0 0 * 1-3 *"),
        ("0 12 1 * mon", "0 12 1 * 1"),
        ("  0\t0  * * *  ", "0 0 * * *"),
        ("@hourly", "0 * * * *"),
        ("@daily", "0 0 * * *"),
        ("@MIDNIGHT", "0 0 * * *"),
        ("@weekly", "0 0 * * 0"),
        ("@monthly", "0 0 1 * *"),
        ("@yearly", "0 0 1 1 *"),
        ("@annually", "0 0 1 1 *"),
        // OR with a day field matching every day: every day.
        ("0 0 1-31 * mon", "0 0 * * *"),
        ("0 0 15 * 0-6", "0 0 * * *"),
        // AND kept: a day field still starts with `*`.
        ("0 0 */2 * mon", "0 0 */2 * 1"),
        ("0 0 */2,10 * mon", "0 0 */2,10 * 1"),
        ("0 0 */31 * mon", "0 0 */31 * 1"),
        ("0 0 5 * */7", "0 0 5 * */7"),
        ("0 0 * * */2", "0 0 * * */2"),
        // OR kept: neither starts with `*`.
        ("0 0 1-31/2 * mon", "0 0 1-31/2 * 1"),
        ("0 0 1 * 0-7/7", "0 0 1 * 0"),
    ];

    #[test]
    fn display_writes_the_canonical_form() {
        for (text, expected) in CANONICAL {
            let parsed = schedule(text);
            assert_eq!(parsed.to_string(), *expected, "{text:?}");
            assert_eq!(schedule(expected), parsed, "{expected:?} reparsed");
        }
    }

    #[test]
    fn names_and_macros_are_case_insensitive_and_sunday_is_0_or_7() {
        assert_eq!(schedule("0 0 * JAN-mar Mon-FRI"), schedule("0 0 * 1-3 1-5"));
        assert_eq!(schedule("@Daily"), schedule("0 0 * * *"));
        assert_eq!(schedule("0 0 * * 7"), schedule("0 0 * * sun"));
        assert_eq!(schedule("0 0 * * 5-7"), schedule("0 0 * * fri-sun"));
        assert_eq!(schedule("0 0 * * sun/2"), schedule("0 0 * * 0,2,4,6"));
        assert_eq!(schedule("0 0 * * 1/2"), schedule("0 0 * * 0,1,3,5"));
        assert_eq!(schedule("5/20 * * * *"), schedule("5,25,45 * * * *"));
    }

    #[test]
    fn time_zones_are_iana_names() {
        assert_eq!(parse_time_zone("Europe/Berlin"), Ok(Tz::Europe__Berlin));
        assert_eq!(parse_time_zone("UTC"), Ok(Tz::UTC));
        assert_eq!(
            parse_time_zone("Europe/Berln").unwrap_err().to_string(),
            "unknown time zone \"Europe/Berln\" (expected an IANA name such as Europe/Berlin or UTC)"
        );
        assert!(parse_time_zone("").is_err());
        assert!(parse_time_zone("europe/berlin").is_err());
    }

    #[test]
    fn searches_stay_short_for_rare_schedules() {
        // 29 February on a Sunday, searched both ways across 2100; a
        // minute-by-minute search would take ~40 million steps.
        let rare = schedule("0 0 29 2 */7");
        let start = utc("2089-01-01T00:00:00Z");
        assert_eq!(
            rare.next_after(start, Tz::UTC),
            Some(utc("2128-02-29T00:00:00Z"))
        );
        assert_eq!(
            rare.previous_slot_at_or_before(utc("2128-02-28T00:00:00Z"), Tz::UTC),
            Some(utc("2088-02-29T00:00:00Z"))
        );
    }

    // Generated expressions: each field a list of one to three items built
    // from the components the grammar has.

    fn random_case(name: &str, case: u8) -> String {
        match case % 3 {
            0 => name.to_owned(),
            1 => name.to_ascii_uppercase(),
            _ => name[..1].to_ascii_uppercase() + &name[1..],
        }
    }

    /// A value as a number or, where the field has names, sometimes a name.
    fn value_text(field: Field, value: u32, ends_range: bool, name: bool, case: u8) -> String {
        let named = match field {
            Field::Month if name => Some(MONTH_NAMES[value as usize - 1]),
            // `sun` is 0, or 7 ending a range.
            Field::DayOfWeek if name && value == 7 && ends_range => Some("sun"),
            Field::DayOfWeek if name && value < 7 && !(value == 0 && ends_range) => {
                Some(DAY_NAMES[value as usize])
            }
            _ => None,
        };
        named.map_or_else(|| value.to_string(), |n| random_case(n, case))
    }

    fn item(field: Field) -> impl Strategy<Value = String> {
        let (min, max) = (field.min(), field.max());
        let value = move || min..=max;
        let range = move || (value(), value()).prop_map(|(a, b)| (a.min(b), a.max(b)));
        let style = || (any::<bool>(), any::<u8>());
        prop_oneof![
            3 => Just("*".to_owned()),
            2 => (1..=max).prop_map(|step| format!("*/{step}")),
            3 => (value(), style())
                .prop_map(move |(v, (name, case))| value_text(field, v, false, name, case)),
            2 => (range(), style()).prop_map(move |((a, b), (name, case))| format!(
                "{}-{}",
                value_text(field, a, false, name, case),
                value_text(field, b, true, name, case)
            )),
            1 => (range(), 1..=max, style()).prop_map(move |((a, b), step, (name, case))| {
                format!(
                    "{}-{}/{step}",
                    value_text(field, a, false, name, case),
                    value_text(field, b, true, name, case)
                )
            }),
            1 => (value(), 1..=max, style()).prop_map(move |(a, step, (name, case))| {
                format!("{}/{step}", value_text(field, a, false, name, case))
            }),
        ]
    }

    fn field_text(field: Field, star_weight: u32) -> impl Strategy<Value = String> {
        prop_oneof![
            star_weight => Just("*".to_owned()),
            4 => prop::collection::vec(item(field), 1..=3).prop_map(|items| items.join(",")),
        ]
    }

    /// Expressions that parse and fire (a few generated ones never fire).
    fn expression() -> impl Strategy<Value = String> {
        (
            field_text(Field::Minute, 1),
            field_text(Field::Hour, 2),
            field_text(Field::DayOfMonth, 6),
            field_text(Field::Month, 6),
            field_text(Field::DayOfWeek, 6),
        )
            .prop_map(|(minute, hour, dom, month, dow)| {
                format!("{minute} {hour} {dom} {month} {dow}")
            })
            .prop_filter("never fires", |text| Schedule::parse(text).is_ok())
    }

    /// Expressions dense around the night hours, where daylight saving moves
    /// the clock, so that a two-day window sees them fire.
    fn night_expression() -> impl Strategy<Value = String> {
        let hour = prop_oneof![
            Just("*".to_owned()),
            (1..=6u32).prop_map(|step| format!("*/{step}")),
            (0..=4u32).prop_map(|h| h.to_string()),
            (0..=3u32, 1..=4u32).prop_map(|(a, len)| format!("{a}-{}", a + len)),
            prop::collection::vec(0..=23u32, 1..=3).prop_map(|hours| {
                hours
                    .iter()
                    .map(u32::to_string)
                    .collect::<Vec<_>>()
                    .join(",")
            }),
        ];
        (
            field_text(Field::Minute, 2),
            hour,
            field_text(Field::DayOfMonth, 12),
            field_text(Field::DayOfWeek, 8),
        )
            .prop_map(|(minute, hour, dom, dow)| format!("{minute} {hour} {dom} * {dow}"))
            .prop_filter("never fires", |text| Schedule::parse(text).is_ok())
    }

    /// The same expression for croner, which takes day of month and day of
    /// week together (AND) only when one is exactly `*` or day of week starts
    /// with `+` (Vixie cron's rule: when one starts with `*`), and reads `*`
    /// alone only as a whole field.
    fn croner_pattern(text: &str) -> String {
        let fields: Vec<String> = text
            .split_whitespace()
            .map(|field| {
                if field == "*" {
                    return field.to_owned();
                }
                let items: Vec<&str> = field
                    .split(',')
                    .map(|item| if item == "*" { "*/1" } else { item })
                    .collect();
                items.join(",")
            })
            .collect();
        let both = fields[2].starts_with('*') || fields[4].starts_with('*');
        let plus = if both { "+" } else { "" };
        format!(
            "{} {} {} {} {plus}{}",
            fields[0], fields[1], fields[2], fields[3], fields[4]
        )
    }

    // Zones with daylight saving or odd offsets; each has transitions in
    // 2000-2040 (São Paulo and Tehran until they stopped, Apia's skipped day
    // in 2011).
    const DST_ZONES: [Tz; 10] = [
        Tz::Europe__Berlin,
        Tz::America__New_York,
        Tz::Australia__Lord_Howe,
        Tz::America__Sao_Paulo,
        Tz::America__Santiago,
        Tz::America__St_Johns,
        Tz::Pacific__Chatham,
        Tz::Asia__Tehran,
        Tz::Pacific__Apia,
        Tz::Europe__London,
    ];

    fn offset_seconds(tz: Tz, instant: i64) -> i32 {
        let instant = DateTime::from_timestamp(instant, 0).unwrap();
        tz.offset_from_utc_datetime(&instant.naive_utc())
            .fix()
            .local_minus_utc()
    }

    /// The instants in `year` at which `tz` changes its offset.
    fn offset_changes(tz: Tz, year: i32) -> Vec<i64> {
        let start = utc(&format!("{year}-01-01T00:00:00Z")).timestamp();
        let end = utc(&format!("{}-01-01T00:00:00Z", year + 1)).timestamp();
        let mut changes = Vec::new();
        let step = 3 * 3600;
        let mut at = start;
        while at < end {
            if offset_seconds(tz, at) != offset_seconds(tz, at + step) {
                let (mut before, mut after) = (at, at + step);
                while after - before > 1 {
                    let middle = before + (after - before) / 2;
                    if offset_seconds(tz, middle) == offset_seconds(tz, before) {
                        before = middle;
                    } else {
                        after = middle;
                    }
                }
                changes.push(after);
            }
            at += step;
        }
        changes
    }

    /// The fire instants in (`from`, `to`] by the rule itself: walk UTC
    /// minute by minute and fire when the wall clock first reaches or passes
    /// a wall minute of the schedule. Needs whole-minute offsets (every zone
    /// here since 1970).
    fn fires_by_walking(
        schedule: &Schedule,
        tz: Tz,
        from: DateTime<Utc>,
        to: DateTime<Utc>,
    ) -> Vec<DateTime<Utc>> {
        let mut instant = DateTime::from_timestamp(from.timestamp().div_euclid(60) * 60, 0)
            .unwrap()
            - TimeDelta::days(1);
        let mut highest_shown = local(instant, tz);
        let mut fires = Vec::new();
        while instant <= to {
            instant += TimeDelta::minutes(1);
            let shown = local(instant, tz);
            if shown > highest_shown {
                let mut wall = highest_shown + TimeDelta::minutes(1);
                let mut fired = false;
                while wall <= shown {
                    fired |= matches(schedule, wall);
                    wall += TimeDelta::minutes(1);
                }
                highest_shown = shown;
                if fired && instant > from && instant <= to {
                    fires.push(instant);
                }
            }
        }
        fires
    }

    fn instant_near_a_change(tz: Tz, year: i32, pick: usize, offset: i64) -> DateTime<Utc> {
        let changes = offset_changes(tz, year);
        let base = if changes.is_empty() {
            utc(&format!("{year}-06-01T00:00:00Z")).timestamp()
        } else {
            changes[pick % changes.len()]
        };
        DateTime::from_timestamp(base + offset, 0).unwrap()
    }

    fn config(default_cases: u32) -> ProptestConfig {
        ProptestConfig {
            cases: std::env::var("PROPTEST_CASES")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(default_cases),
            ..ProptestConfig::default()
        }
    }

    proptest! {
        #![proptest_config(config(256))]

        // Zones without daylight saving, where croner's rules and these
        // agree: the next five fire times are the same.
        #[test]
        fn next_fires_agree_with_croner(
            text in expression(),
            // 1971 to 2100.
            seconds in 31_536_000i64..4_102_444_800,
            nanos in prop_oneof![Just(0u32), 0u32..1_000_000_000],
            tz in prop::sample::select(vec![Tz::UTC, Tz::Asia__Tokyo, Tz::Asia__Kolkata]),
        ) {
            let ours = schedule(&text);
            let theirs = croner::parser::CronParser::new()
                .parse(&croner_pattern(&text))
                .unwrap_or_else(|e| panic!("croner refused {text:?}: {e}"));
            let mut after = DateTime::from_timestamp(seconds, nanos).unwrap();
            for _ in 0..5 {
                // croner keeps a start's fraction of a second in its result;
                // fires are whole seconds, so the truncated start has the
                // same next fire.
                let whole_second = DateTime::from_timestamp(after.timestamp(), 0).unwrap();
                let expected = theirs
                    .find_next_occurrence(&whole_second.with_timezone(&tz), false)
                    .unwrap()
                    .with_timezone(&Utc);
                let next = ours.next_after(after, tz);
                prop_assert_eq!(next, Some(expected), "{:?} in {} after {}", text, tz, after);
                after = expected;
            }
        }

        #[test]
        fn the_canonical_form_parses_back_to_the_same_schedule(text in expression()) {
            let parsed = schedule(&text);
            let canonical = parsed.to_string();
            prop_assert_eq!(schedule(&canonical), parsed, "{:?} → {:?}", text, canonical);
            prop_assert_eq!(schedule(&canonical).to_string(), canonical);
        }

        // In any zone, fire times increase, and each one is when the clock
        // reached or jumped over a wall minute of the schedule.
        #[test]
        fn fires_increase_and_match_in_local_time(
            text in expression(),
            tz in prop::sample::select(DST_ZONES.to_vec()),
            year in 2000i32..2040,
            pick in 0usize..4,
            offset in -3 * 86_400i64..3 * 86_400,
            nanos in prop_oneof![Just(0u32), 0u32..1_000_000_000],
        ) {
            let ours = schedule(&text);
            let start = instant_near_a_change(tz, year, pick, offset)
                + TimeDelta::nanoseconds(i64::from(nanos));
            let mut after = start;
            for _ in 0..5 {
                let next = ours.next_after(after, tz).unwrap();
                prop_assert!(next > after);
                let shown = local(next, tz);
                let shown_before = local(next - TimeDelta::seconds(1), tz);
                let mut wall = start_of_minute(shown_before) + TimeDelta::minutes(1);
                let mut reached = false;
                while wall <= shown {
                    reached |= matches(&ours, wall);
                    wall += TimeDelta::minutes(1);
                }
                prop_assert!(reached, "{:?} in {}: {} ({}) matches nothing", text, tz, next, shown);
                after = next;
            }
        }

        #[test]
        fn previous_slot_is_consistent_with_next_after(
            text in expression(),
            tz in prop::sample::select(
                DST_ZONES.iter().copied().chain([Tz::UTC, Tz::Asia__Tokyo]).collect::<Vec<_>>()
            ),
            year in 2000i32..2040,
            pick in 0usize..4,
            offset in -3 * 86_400i64..3 * 86_400,
            nanos in prop_oneof![Just(0u32), 0u32..1_000_000_000],
        ) {
            let ours = schedule(&text);
            let at = instant_near_a_change(tz, year, pick, offset)
                + TimeDelta::nanoseconds(i64::from(nanos));
            let slot = ours.previous_slot_at_or_before(at, tz).unwrap();
            let next = ours.next_after(at, tz).unwrap();
            let one = TimeDelta::nanoseconds(1);
            prop_assert!(slot <= at);
            prop_assert_eq!(ours.next_after(slot - one, tz), Some(slot));
            prop_assert_eq!(ours.next_after(slot, tz), Some(next));
            prop_assert_eq!(ours.previous_slot_at_or_before(next, tz), Some(next));
            prop_assert_eq!(ours.previous_slot_at_or_before(next - one, tz), Some(slot));
        }

        // Around daylight-saving changes the fire times are exactly those of
        // the rule applied minute by minute, and the previous slot is the
        // latest of them.
        #[test]
        fn fires_around_offset_changes_follow_the_rule(
            text in night_expression(),
            tz in prop::sample::select(DST_ZONES.to_vec()),
            year in 2000i32..2040,
            pick in 0usize..4,
            offset in -86_400i64..86_400,
            probe in 0i64..2 * 86_400,
        ) {
            let ours = schedule(&text);
            let from = instant_near_a_change(tz, year, pick, offset);
            let to = from + TimeDelta::days(2);
            let expected = fires_by_walking(&ours, tz, from, to);
            let mut fires = Vec::new();
            let mut after = from;
            while let Some(next) = ours.next_after(after, tz).filter(|&next| next <= to) {
                fires.push(next);
                after = next;
            }
            prop_assert_eq!(&fires, &expected, "{:?} in {} from {}", text, tz, from);

            let probe = from + TimeDelta::seconds(probe);
            let slot = ours.previous_slot_at_or_before(probe, tz).unwrap();
            match expected.iter().rev().find(|&&fire| fire <= probe) {
                Some(&latest) => prop_assert_eq!(slot, latest),
                None => prop_assert!(slot <= from),
            }
        }
    }
}
