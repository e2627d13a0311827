//! Limits on the YAML and JSON texts hearth reads from outside: manifest
//! files, `hearth apply -f` and the YAML inside a spec (cloud-init). They are
//! checked before the YAML parser builds anything. docs/limits.md lists them
//! with every other limit.
//!
//! Why before: libyaml's scanner (which serde_yaml_ng runs) keeps one
//! possible simple key per open `[` or `{` and checks all of them on every
//! token, so nesting alone makes a parse quadratic: 400 KB of `{a: {a: ...`
//! takes a minute. serde_yaml_ng's own recursion limit (128) only applies
//! once a whole document has been scanned, which is too late. The walk here
//! runs the same libyaml parser event by event and stops at the first
//! collection nested too deep, so the scanner never gets far; texts within
//! the limits then parse in time linear in their size.

use std::fmt;
use std::mem::MaybeUninit;

/// Lists and mappings nested deeper than this are refused. hearth's
/// objects nest about 6 deep (`items[0].spec.disks[0].source.blank`).
pub const MAX_NESTING: usize = 32;

/// Documents (`---`) in one text.
pub const MAX_DOCUMENTS: usize = 1000;

/// The most objects one apply may carry, and one text once `{"items":
/// [...]}` lists are expanded (a text is applied as one apply): an apply is
/// checked and written as one transaction while other applies wait, and
/// each object it creates is then reconciled (docs/limits.md).
pub const MAX_APPLY_OBJECTS: usize = 10_000;

/// Values (scalars, aliases, lists, mappings) in one text. The parser holds
/// every event of a document in memory, roughly 200 bytes each: 200,000
/// values are about 40 MB. A manifest has a few hundred; a text of
/// [`MAX_APPLY_OBJECTS`] small disks (about 13 values each) fits.
pub const MAX_VALUES: usize = 200_000;

/// Bytes of one manifest: a file in the manifest directory, or a file or
/// stdin given to `hearth apply -f`.
pub const MAX_MANIFEST_BYTES: usize = 4 << 20;

/// A text over one of the limits, with where it went over (1-based line and
/// column, as the parser counts them) when that is known.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LimitError {
    pub location: Option<(usize, usize)>,
    pub message: String,
}

impl fmt::Display for LimitError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.location {
            Some((line, column)) => write!(f, "line {line}, column {column}: {}", self.message),
            None => f.write_str(&self.message),
        }
    }
}

impl std::error::Error for LimitError {}

/// The size limit of a manifest.
pub fn check_manifest_size(len: usize) -> Result<(), LimitError> {
    if len > MAX_MANIFEST_BYTES {
        return Err(LimitError {
            location: None,
            message: format!(
                "{len} bytes, larger than the {MAX_MANIFEST_BYTES} bytes a manifest may have; not parsed"
            ),
        });
    }
    Ok(())
}

/// Checks nesting, documents and values of a YAML (or JSON) text without
/// building it. A syntax error is not this check's business: it returns Ok
/// and leaves the error to the parser, which reaches it having scanned no
/// more than this walk did.
pub fn check_yaml(text: &str) -> Result<(), LimitError> {
    let mut parser = EventParser::new(text);
    if !parser.initialised {
        return Err(LimitError {
            location: None,
            message: "out of memory before parsing".into(),
        });
    }
    let mut depth = 0usize;
    let mut documents = 0usize;
    let mut values = 0usize;
    loop {
        let Some((kind, (line, column))) = parser.next() else {
            return Ok(());
        };
        let over = |message: String| LimitError {
            location: Some((line + 1, column + 1)),
            message,
        };
        match kind {
            unsafe_libyaml::YAML_DOCUMENT_START_EVENT => {
                documents += 1;
                if documents > MAX_DOCUMENTS {
                    return Err(over(format!(
                        "more than {MAX_DOCUMENTS} documents; not parsed"
                    )));
                }
            }
            unsafe_libyaml::YAML_SEQUENCE_START_EVENT
            | unsafe_libyaml::YAML_MAPPING_START_EVENT => {
                depth += 1;
                values += 1;
                if depth > MAX_NESTING {
                    return Err(over(format!(
                        "lists and mappings nested more than {MAX_NESTING} levels deep; not parsed"
                    )));
                }
            }
            unsafe_libyaml::YAML_SEQUENCE_END_EVENT | unsafe_libyaml::YAML_MAPPING_END_EVENT => {
                depth = depth.saturating_sub(1);
            }
            unsafe_libyaml::YAML_SCALAR_EVENT | unsafe_libyaml::YAML_ALIAS_EVENT => values += 1,
            unsafe_libyaml::YAML_STREAM_END_EVENT => return Ok(()),
            _ => {}
        }
        if values > MAX_VALUES {
            return Err(over(format!(
                "more than {MAX_VALUES} values (scalars, lists and mappings); not parsed"
            )));
        }
    }
}

/// libyaml's event parser over a borrowed text, one event at a time.
struct EventParser<'text> {
    /// Initialised in `new` if `initialised`; freed in `drop`.
    sys: Box<MaybeUninit<unsafe_libyaml::yaml_parser_t>>,
    initialised: bool,
    /// The end of the stream or a syntax error was reached.
    done: bool,
    /// The parser reads `text` through a raw pointer: it must outlive it.
    _text: &'text str,
}

impl<'text> EventParser<'text> {
    fn new(text: &'text str) -> EventParser<'text> {
        let mut sys = Box::new(MaybeUninit::<unsafe_libyaml::yaml_parser_t>::uninit());
        let ptr = sys.as_mut_ptr();
        // SAFETY: `ptr` points to writable memory the size of a parser;
        // `yaml_parser_initialize` zeroes and initialises it (it fails only
        // when out of memory, leaving nothing to free). The input is `text`,
        // which the parser only reads, up to `text.len()` bytes, and which
        // outlives it (`'text`).
        let initialised = unsafe {
            if unsafe_libyaml::yaml_parser_initialize(ptr).fail {
                false
            } else {
                unsafe_libyaml::yaml_parser_set_encoding(ptr, unsafe_libyaml::YAML_UTF8_ENCODING);
                unsafe_libyaml::yaml_parser_set_input_string(ptr, text.as_ptr(), text.len() as u64);
                true
            }
        };
        EventParser {
            sys,
            initialised,
            done: false,
            _text: text,
        }
    }

    /// The next event's type and 0-based start line and column; None at
    /// the end of the stream or at a syntax error.
    fn next(&mut self) -> Option<(unsafe_libyaml::yaml_event_type_t, (usize, usize))> {
        if !self.initialised || self.done {
            return None;
        }
        let mut event = MaybeUninit::<unsafe_libyaml::yaml_event_t>::uninit();
        // SAFETY: the parser is initialised and its input outlives it;
        // `yaml_parser_parse` fills `event` (zeroed on failure), whose
        // allocations `yaml_event_delete` then frees, once.
        unsafe {
            if unsafe_libyaml::yaml_parser_parse(self.sys.as_mut_ptr(), event.as_mut_ptr()).fail {
                self.done = true;
                return None;
            }
            let e = event.as_mut_ptr();
            let kind = (*e).type_;
            let mark = (*e).start_mark;
            unsafe_libyaml::yaml_event_delete(e);
            if kind == unsafe_libyaml::YAML_NO_EVENT
                || kind == unsafe_libyaml::YAML_STREAM_END_EVENT
            {
                self.done = true;
            }
            Some((kind, (mark.line as usize, mark.column as usize)))
        }
    }
}

impl Drop for EventParser<'_> {
    fn drop(&mut self) {
        if self.initialised {
            // SAFETY: frees what `yaml_parser_initialize` allocated, once.
            unsafe { unsafe_libyaml::yaml_parser_delete(self.sys.as_mut_ptr()) }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(text: &str) -> LimitError {
        check_yaml(text).expect_err("over a limit")
    }

    /// `levels` lists nested in flow style: `[[[1]]]`.
    fn flow(levels: usize) -> String {
        format!("{}1{}", "[".repeat(levels), "]".repeat(levels))
    }

    /// `levels` mappings nested in block style, two spaces a level.
    fn block(levels: usize) -> String {
        (0..levels)
            .map(|i| format!("{}k{i}:\n", "  ".repeat(i)))
            .collect::<String>()
            + &format!("{}v: 1\n", "  ".repeat(levels))
    }

    #[test]
    fn nesting_up_to_the_limit_is_accepted_and_one_more_is_refused_where_it_starts() {
        check_yaml(&flow(MAX_NESTING)).expect("flow at the limit");
        let e = err(&flow(MAX_NESTING + 1));
        assert_eq!(e.location, Some((1, MAX_NESTING + 1)), "{e}");
        assert!(e.message.contains("nested more than 32 levels"), "{e}");

        // `block(n)` is n + 1 mappings deep (the innermost holds `v`).
        check_yaml(&block(MAX_NESTING - 1)).expect("block at the limit");
        let e = err(&block(MAX_NESTING));
        assert_eq!(
            e.location,
            Some((MAX_NESTING + 1, 2 * MAX_NESTING + 1)),
            "{e}"
        );

        // Compact block sequences: `- - - x`, two columns a level.
        check_yaml(&format!("{}x\n", "- ".repeat(MAX_NESTING))).expect("at the limit");
        let e = err(&format!("{}x\n", "- ".repeat(MAX_NESTING + 1)));
        assert_eq!(e.location, Some((1, 2 * MAX_NESTING + 1)), "{e}");

        // JSON is YAML: the same count.
        let json = format!("{}1{}", "{\"a\": ".repeat(33), "}".repeat(33));
        assert_eq!(err(&json).location, Some((1, 6 * 32 + 1)));
    }

    #[test]
    fn nesting_is_measured_not_counted_so_siblings_do_not_add_up() {
        let wide = format!("[{}]", vec![flow(MAX_NESTING - 1); 2000].join(", "));
        check_yaml(&wide).expect("many shallow lists");
    }

    #[test]
    fn a_huge_nested_text_is_refused_at_its_33rd_level() {
        // 4 MiB of nested mappings, unclosed: the parse would take hours.
        let e = err(&"{a: ".repeat(MAX_MANIFEST_BYTES / 4));
        assert_eq!(e.location, Some((1, 4 * MAX_NESTING + 1)), "{e}");
        let e = err(&"[\n".repeat(MAX_MANIFEST_BYTES / 2));
        assert_eq!(e.location, Some((MAX_NESTING + 1, 1)), "{e}");
    }

    #[test]
    fn documents_and_values_have_limits_too() {
        check_yaml(&"---\na: 1\n".repeat(MAX_DOCUMENTS)).expect("at the limit");
        let e = err(&"---\na: 1\n".repeat(MAX_DOCUMENTS + 1));
        assert_eq!(e.location, Some((2 * MAX_DOCUMENTS + 1, 1)), "{e}");
        assert!(e.message.contains("more than 1000 documents"), "{e}");

        // A list of n scalars is n + 1 values.
        let list = |n: usize| format!("[{}]", vec!["1"; n].join(","));
        check_yaml(&list(MAX_VALUES - 1)).expect("at the limit");
        let e = err(&list(MAX_VALUES));
        assert!(
            e.message
                .contains(&format!("more than {MAX_VALUES} values")),
            "{e}"
        );
        assert_eq!(e.location.map(|l| l.0), Some(1));
    }

    #[test]
    fn syntax_errors_and_odd_input_are_left_to_the_parser() {
        for text in [
            "",
            "a: [1, 2",
            "a: b: c",
            "\t- x",
            "*undefined",
            "%YAML 9.9\n---\na",
            "\u{feff}a: 1",
            "a: \"\\uD800\"",
        ] {
            check_yaml(text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        }
    }

    #[test]
    fn aliases_count_as_values_not_as_their_expansion() {
        // A small billion laughs: serde_yaml_ng refuses the expansion.
        let mut text = String::from("a: &a [x, x, x, x, x, x, x, x, x, x]\n");
        for i in 0..8 {
            let prev = if i == 0 {
                "a".to_string()
            } else {
                format!("b{}", i - 1)
            };
            text += &format!(
                "b{i}: &b{i} [{}]\n",
                vec![format!("*{prev}"); 10].join(", ")
            );
        }
        check_yaml(&text).expect("few values");
    }

    #[test]
    fn the_size_limit() {
        check_manifest_size(MAX_MANIFEST_BYTES).expect("at the limit");
        let e = check_manifest_size(MAX_MANIFEST_BYTES + 1).expect_err("over");
        assert_eq!(e.location, None);
        assert!(
            e.to_string()
                .starts_with("4194305 bytes, larger than the 4194304"),
            "{e}"
        );
    }
}
