//! Following hearthd's change stream (`GET /v1/watch`, docs/http-api.md
//! "Watching"): a pure [`Informer`] turns the stream's lines into what
//! changed, and a [`Follower`] reads the lines and, when the connection
//! drops (hearthd restarting), reconnects from the last `seq` it saw, so
//! nothing is missed and nothing is shown twice.
//!
//! Lines are read leniently, as the tables read objects: fields this CLI
//! does not know are ignored, a line type it does not know is skipped.

use std::collections::{BTreeMap, VecDeque};
use std::io::Write;
use std::time::Duration;

use anyhow::bail;
use hearth_api::WatchType;
use serde::Deserialize;
use serde_json::Value;

use crate::client::{ApiClient, ApiError, LineStream};

/// How long `get -w` and `events -w` keep trying to reconnect.
pub const RECONNECT_FOR: Duration = Duration::from_secs(60);

/// (kind, name)
pub type Key = (String, String);

/// One line of the stream, as far as this CLI reads it.
#[derive(Clone, Debug, Deserialize)]
pub struct Line {
    pub seq: u64,
    #[serde(rename = "type")]
    pub type_: WatchType,
    #[serde(default)]
    pub kind: Option<String>,
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub object: Option<Value>,
    #[serde(default)]
    pub event: Option<Value>,
    #[serde(default)]
    pub message: Option<String>,
}

/// What the stream told, for the commands that follow it.
#[derive(Clone, Debug, PartialEq)]
pub enum Update {
    /// The objects held are complete and current as of `seq`: after the
    /// first list (`first`), and again after a reconnect has caught up.
    Synced { first: bool, seq: u64 },
    /// An object changed (after a re-list: differs from what was held).
    Object {
        seq: u64,
        type_: WatchType,
        kind: String,
        name: String,
        object: Value,
    },
    /// An event, each one once.
    Event { seq: u64, event: Value },
    /// hearthd could not go on from our seq; the changes up to the next
    /// `Synced` are the differences from what we held.
    Relisted(String),
    /// The connection dropped; the follower reconnects on the next call.
    Lost(String),
}

/// The objects a stream has shown, and where to go on from.
#[derive(Debug)]
pub struct Informer {
    objects: BTreeMap<Key, Value>,
    /// While a list (the first one, or a re-list) is read: what it holds.
    listing: Option<BTreeMap<Key, Value>>,
    synced_once: bool,
    /// Reconnected: the next bookmark means caught up.
    replaying: bool,
    /// The last seq outside a list: the resume point.
    resume: Option<u64>,
    /// Events up to here were shown.
    events_upto: Option<u64>,
    /// The newest event seq of the list being read.
    list_events: Option<u64>,
}

impl Default for Informer {
    fn default() -> Self {
        Informer::new()
    }
}

impl Informer {
    /// For a stream opened without `since`: it starts with a list.
    pub fn new() -> Informer {
        Informer {
            objects: BTreeMap::new(),
            listing: Some(BTreeMap::new()),
            synced_once: false,
            replaying: false,
            resume: None,
            events_upto: None,
            list_events: None,
        }
    }

    /// The objects held, by kind and name.
    pub fn objects(&self) -> impl Iterator<Item = (&Key, &Value)> {
        self.objects.iter()
    }

    pub fn get(&self, kind: &str, name: &str) -> Option<&Value> {
        self.objects.get(&(kind.to_string(), name.to_string()))
    }

    /// The connection dropped: the seq to go on from, or None when a new
    /// list is needed (none was complete yet, or it broke in the middle).
    pub fn reconnecting(&mut self) -> Option<u64> {
        self.replaying = true;
        match (&self.listing, self.resume) {
            (None, Some(seq)) => Some(seq),
            _ => {
                self.listing = Some(BTreeMap::new());
                self.list_events = None;
                None
            }
        }
    }

    fn new_event(&mut self, seq: u64) -> bool {
        let new = self.events_upto.is_none_or(|upto| seq > upto);
        if self.listing.is_some() {
            self.list_events = self.list_events.max(Some(seq));
        } else {
            self.events_upto = self.events_upto.max(Some(seq));
        }
        new
    }

    /// One line in, what changed out.
    pub fn apply(&mut self, line: Line) -> Vec<Update> {
        let mut out = Vec::new();
        match line.type_ {
            WatchType::Added | WatchType::Modified | WatchType::Deleted => {
                let (Some(kind), Some(name), Some(object)) = (line.kind, line.name, line.object)
                else {
                    return out;
                };
                let key = (kind.clone(), name.clone());
                let deleted = line.type_ == WatchType::Deleted;
                if let Some(list) = &mut self.listing {
                    if deleted {
                        list.remove(&key);
                    } else {
                        list.insert(key, object);
                    }
                    return out;
                }
                self.resume = Some(line.seq);
                if deleted {
                    self.objects.remove(&key);
                } else {
                    self.objects.insert(key, object.clone());
                }
                out.push(Update::Object {
                    seq: line.seq,
                    type_: line.type_,
                    kind,
                    name,
                    object,
                });
            }
            WatchType::Event => {
                if self.listing.is_none() {
                    self.resume = Some(line.seq);
                }
                if let Some(event) = line.event
                    && self.new_event(line.seq)
                {
                    out.push(Update::Event {
                        seq: line.seq,
                        event,
                    });
                }
            }
            WatchType::Relist => {
                self.listing = Some(BTreeMap::new());
                self.list_events = None;
                out.push(Update::Relisted(line.message.unwrap_or_default()));
            }
            WatchType::Bookmark => {
                self.resume = Some(line.seq);
                let was_replaying = std::mem::take(&mut self.replaying);
                if let Some(list) = self.listing.take() {
                    self.events_upto = self.events_upto.max(self.list_events.take());
                    if self.synced_once {
                        out.extend(differences(&self.objects, &list, line.seq));
                    }
                    self.objects = list;
                    let first = !self.synced_once;
                    self.synced_once = true;
                    out.push(Update::Synced {
                        first,
                        seq: line.seq,
                    });
                } else if was_replaying {
                    out.push(Update::Synced {
                        first: false,
                        seq: line.seq,
                    });
                }
            }
            WatchType::Unknown => {}
        }
        out
    }
}

/// What a re-list changed: ADDED and MODIFIED for what it holds anew or
/// differently, DELETED (with the last state held) for what it lacks.
fn differences(old: &BTreeMap<Key, Value>, new: &BTreeMap<Key, Value>, seq: u64) -> Vec<Update> {
    let update = |type_, (kind, name): &Key, object: &Value| Update::Object {
        seq,
        type_,
        kind: kind.clone(),
        name: name.clone(),
        object: object.clone(),
    };
    let mut out = Vec::new();
    for (key, object) in new {
        match old.get(key) {
            None => out.push(update(WatchType::Added, key, object)),
            Some(before) if before != object => out.push(update(WatchType::Modified, key, object)),
            Some(_) => {}
        }
    }
    for (key, object) in old {
        if !new.contains_key(key) {
            out.push(update(WatchType::Deleted, key, object));
        }
    }
    out
}

/// Errors worth another connection attempt: hearthd is away or restarting.
fn retryable(e: &ApiError) -> bool {
    match e {
        ApiError::Unreachable { .. } | ApiError::Protocol { .. } | ApiError::Timeout { .. } => true,
        ApiError::Server { status, .. } => status.is_server_error(),
    }
}

/// A stream being followed, reconnected when it drops.
pub struct Follower {
    client: ApiClient,
    /// The path without `since` (it has a query already).
    base: String,
    informer: Informer,
    stream: Option<LineStream>,
    pending: VecDeque<Update>,
    lost: Option<String>,
    give_up_after: Duration,
    notes: Box<dyn Write + Send>,
}

impl Follower {
    /// Opens `base` (a `/v1/watch?...` or `/v1/{plural}?watch=true...`
    /// path). A failure here is returned as it is: a 404 means a hearthd
    /// from before the stream. Reconnection notes go to `notes` (stderr).
    pub async fn open(
        client: &ApiClient,
        base: String,
        give_up_after: Duration,
        notes: Box<dyn Write + Send>,
    ) -> Result<Follower, ApiError> {
        let stream = client.lines(&base).await?;
        Ok(Follower {
            client: client.clone(),
            base,
            informer: Informer::new(),
            stream: Some(stream),
            pending: VecDeque::new(),
            lost: None,
            give_up_after,
            notes,
        })
    }

    pub fn informer(&self) -> &Informer {
        &self.informer
    }

    /// The next update; reconnects first when the last one was `Lost`.
    /// Fails when hearthd cannot be reached again within the bound.
    pub async fn next(&mut self) -> anyhow::Result<Update> {
        loop {
            if let Some(update) = self.pending.pop_front() {
                return Ok(update);
            }
            let Some(stream) = &mut self.stream else {
                self.reconnect().await?;
                continue;
            };
            let why = match stream.next_line().await {
                Ok(Some(bytes)) if bytes.iter().all(u8::is_ascii_whitespace) => continue,
                Ok(Some(bytes)) => {
                    match serde_json::from_slice::<Line>(&bytes) {
                        Ok(line) => self.pending.extend(self.informer.apply(line)),
                        Err(e) => {
                            let _ = writeln!(
                                self.notes,
                                "hearth: skipping a line of the stream this version cannot read: {e}"
                            );
                        }
                    }
                    continue;
                }
                Ok(None) => "hearthd ended the stream".to_string(),
                Err(e) => e.to_string(),
            };
            self.stream = None;
            self.lost = Some(why.clone());
            return Ok(Update::Lost(why));
        }
    }

    async fn reconnect(&mut self) -> anyhow::Result<()> {
        let why = self.lost.take().unwrap_or_else(|| "no stream".to_string());
        let path = match self.informer.reconnecting() {
            Some(seq) => {
                let _ = writeln!(
                    self.notes,
                    "hearth: lost the stream from hearthd ({why}); reconnecting from seq {seq}"
                );
                format!("{}&since={seq}", self.base)
            }
            None => {
                let _ = writeln!(
                    self.notes,
                    "hearth: lost the stream from hearthd ({why}); reconnecting for a new list"
                );
                self.base.clone()
            }
        };
        let deadline = tokio::time::Instant::now() + self.give_up_after;
        let mut pause = Duration::from_millis(100);
        loop {
            match self.client.lines(&path).await {
                Ok(stream) => {
                    let _ = writeln!(self.notes, "hearth: reconnected to hearthd");
                    self.stream = Some(stream);
                    return Ok(());
                }
                Err(e) if retryable(&e) && tokio::time::Instant::now() < deadline => {
                    let left = deadline - tokio::time::Instant::now();
                    tokio::time::sleep(pause.min(left)).await;
                    pause = (pause * 2).min(Duration::from_secs(2));
                }
                Err(e) => bail!(
                    "lost the stream from hearthd and could not reconnect within {:?}: {e}",
                    self.give_up_after
                ),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn line(v: Value) -> Line {
        serde_json::from_value(v).expect("a line")
    }

    fn obj(seq: u64, type_: &str, name: &str, phase: &str) -> Line {
        line(
            json!({"seq": seq, "type": type_, "kind": "VirtualDisk", "name": name,
                    "object": {"metadata": {"name": name}, "status": {"phase": phase}}}),
        )
    }

    fn bookmark(seq: u64) -> Line {
        line(json!({"seq": seq, "type": "BOOKMARK"}))
    }

    fn event(seq: u64, message: &str) -> Line {
        line(
            json!({"seq": seq, "type": "EVENT", "kind": "VirtualDisk", "name": "a",
                    "event": {"reason": "R", "message": message}}),
        )
    }

    /// Updates as short strings.
    fn said(updates: Vec<Update>) -> Vec<String> {
        updates
            .into_iter()
            .map(|u| match u {
                Update::Synced { first, seq } => format!("synced {first} {seq}"),
                Update::Object {
                    seq,
                    type_,
                    name,
                    object,
                    ..
                } => format!("{type_:?} {name} {} {seq}", object["status"]["phase"]),
                Update::Event { seq, event } => format!("event {} {seq}", event["message"]),
                Update::Relisted(why) => format!("relisted {why}"),
                Update::Lost(why) => format!("lost {why}"),
            })
            .collect()
    }

    #[test]
    fn the_first_list_is_held_until_its_bookmark_then_changes_flow() {
        let mut i = Informer::new();
        assert!(i.apply(obj(5, "ADDED", "a", "Pending")).is_empty());
        assert_eq!(said(i.apply(event(4, "made"))), ["event \"made\" 4"]);
        assert_eq!(said(i.apply(bookmark(5))), ["synced true 5"]);
        assert_eq!(i.objects().count(), 1);
        assert_eq!(
            said(i.apply(obj(6, "MODIFIED", "a", "Ready"))),
            ["Modified a \"Ready\" 6"]
        );
        assert_eq!(
            i.get("VirtualDisk", "a").unwrap()["status"]["phase"],
            "Ready"
        );
        assert_eq!(
            said(i.apply(obj(7, "DELETED", "a", "Ready"))),
            ["Deleted a \"Ready\" 7"]
        );
        assert!(i.get("VirtualDisk", "a").is_none());
        // Heartbeats say nothing, but move the resume point.
        assert!(i.apply(bookmark(9)).is_empty());
        assert_eq!(i.reconnecting(), Some(9));
        // A line type from a newer hearthd is skipped.
        assert!(
            i.apply(line(json!({"seq": 10, "type": "SOMETHING"})))
                .is_empty()
        );
    }

    #[test]
    fn a_reconnect_goes_on_from_the_last_seq_and_says_when_it_caught_up() {
        let mut i = Informer::new();
        i.apply(obj(3, "ADDED", "a", "Pending"));
        i.apply(bookmark(3));
        i.apply(obj(4, "MODIFIED", "a", "Ready"));
        assert_eq!(i.reconnecting(), Some(4));
        assert_eq!(
            said(i.apply(obj(5, "ADDED", "b", "Pending"))),
            ["Added b \"Pending\" 5"]
        );
        assert_eq!(said(i.apply(bookmark(5))), ["synced false 5"]);
        assert!(i.apply(bookmark(5)).is_empty(), "only the first bookmark");
    }

    #[test]
    fn a_list_cut_short_is_asked_for_again() {
        let mut i = Informer::new();
        i.apply(obj(3, "ADDED", "a", "Pending"));
        assert_eq!(i.reconnecting(), None, "the list never completed");
        i.apply(obj(4, "ADDED", "a", "Ready"));
        i.apply(obj(4, "ADDED", "b", "Ready"));
        assert_eq!(said(i.apply(bookmark(4))), ["synced true 4"]);
        assert_eq!(i.objects().count(), 2);
    }

    #[test]
    fn a_relist_turns_into_the_differences_from_what_was_held() {
        let mut i = Informer::new();
        for (n, phase) in [("a", "Ready"), ("b", "Pending"), ("c", "Ready")] {
            i.apply(obj(3, "ADDED", n, phase));
        }
        i.apply(bookmark(3));
        assert_eq!(i.reconnecting(), Some(3));
        assert_eq!(
            said(i.apply(line(
                json!({"seq": 90, "type": "RELIST", "message": "seq 3 is older than the kept history"})
            ))),
            ["relisted seq 3 is older than the kept history"]
        );
        // a unchanged, b now Ready, c gone, d new.
        i.apply(obj(90, "ADDED", "a", "Ready"));
        i.apply(obj(90, "ADDED", "b", "Ready"));
        i.apply(obj(90, "ADDED", "d", "Pending"));
        assert_eq!(
            said(i.apply(bookmark(90))),
            [
                "Modified b \"Ready\" 90",
                "Added d \"Pending\" 90",
                "Deleted c \"Ready\" 90",
                "synced false 90"
            ]
        );
        assert_eq!(i.objects().count(), 3);
    }

    #[test]
    fn events_are_shown_once_across_lists() {
        let mut i = Informer::new();
        assert_eq!(said(i.apply(event(1, "one"))), ["event \"one\" 1"]);
        assert_eq!(said(i.apply(event(2, "two"))), ["event \"two\" 2"]);
        i.apply(bookmark(2));
        assert_eq!(said(i.apply(event(3, "three"))), ["event \"three\" 3"]);
        // A new list after a cut (or a relist) repeats recent events: only
        // the newer one is shown.
        i.apply(line(json!({"seq": 4, "type": "RELIST", "message": "x"})));
        assert!(i.apply(event(2, "two")).is_empty());
        assert!(i.apply(event(3, "three")).is_empty());
        assert_eq!(said(i.apply(event(4, "four"))), ["event \"four\" 4"]);
        i.apply(bookmark(4));
        assert!(i.apply(event(4, "four")).is_empty());
        assert_eq!(said(i.apply(event(5, "five"))), ["event \"five\" 5"]);
    }
}
