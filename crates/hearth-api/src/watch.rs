//! The change stream's wire format: one JSON object per line
//! (`GET /v1/watch`, docs/http-api.md "Watching").
//!
//! Every change hearthd stores (an object added, modified or deleted, an
//! event recorded) gets a sequence number, `seq`, that never repeats and
//! only grows. A client that remembers the last `seq` it saw and reconnects
//! with `since=SEQ` gets every change after it, none twice.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::meta::Event;

/// What one line says.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum WatchType {
    /// An object was created (or, in an initial list, exists).
    Added,
    /// An object's spec, status or deletion mark changed.
    Modified,
    /// An object is gone; `object` is its last state.
    Deleted,
    /// An event was recorded about an object; it is in `event`.
    Event,
    /// Nothing to report: everything up to `seq` has been delivered
    /// (for this stream's filter). The first one of a connection ends its
    /// initial list or replay; later ones are heartbeats.
    Bookmark,
    /// The `since` asked for is no longer in the kept history (or is not
    /// one of this store's): what follows up to the next bookmark is the
    /// whole current state, and anything the client holds that is not in
    /// it is gone. `message` says why.
    Relist,
    /// A type this client does not know (a newer hearthd); skip the line.
    #[serde(other)]
    Unknown,
}

/// One line of the stream.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WatchLine {
    /// The change's sequence number. Lines of an initial list (or of a
    /// relist) carry the list's own `seq`: the last change it includes.
    pub seq: u64,
    #[serde(rename = "type")]
    pub type_: WatchType,
    /// The object's kind (`VirtualMachine`); absent on bookmarks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// ADDED, MODIFIED, DELETED: the object with its status, as
    /// `GET /v1/{plural}/{name}` shows it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub object: Option<Value>,
    /// True when the object is being deleted (hearthd is tearing it down).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub deleting: bool,
    /// EVENT: the event.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub event: Option<Event>,
    /// RELIST: why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

impl WatchLine {
    pub fn bookmark(seq: u64) -> WatchLine {
        WatchLine {
            seq,
            type_: WatchType::Bookmark,
            kind: None,
            name: None,
            object: None,
            deleting: false,
            event: None,
            message: None,
        }
    }

    pub fn relist(seq: u64, message: String) -> WatchLine {
        WatchLine {
            message: Some(message),
            type_: WatchType::Relist,
            ..WatchLine::bookmark(seq)
        }
    }

    pub fn object(
        seq: u64,
        type_: WatchType,
        kind: &str,
        name: &str,
        object: Value,
        deleting: bool,
    ) -> WatchLine {
        WatchLine {
            kind: Some(kind.to_string()),
            name: Some(name.to_string()),
            object: Some(object),
            deleting,
            type_,
            ..WatchLine::bookmark(seq)
        }
    }

    pub fn event(seq: u64, event: Event) -> WatchLine {
        WatchLine {
            kind: Some(event.kind.clone()),
            name: Some(event.name.clone()),
            event: Some(event),
            type_: WatchType::Event,
            ..WatchLine::bookmark(seq)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn lines_read_back_and_carry_only_what_they_say() {
        let bookmark = WatchLine::bookmark(7);
        assert_eq!(
            serde_json::to_value(&bookmark).unwrap(),
            json!({"seq": 7, "type": "BOOKMARK"})
        );
        let added = WatchLine::object(
            8,
            WatchType::Added,
            "VirtualDisk",
            "data",
            json!({"kind": "VirtualDisk", "metadata": {"name": "data"}}),
            false,
        );
        let text = serde_json::to_string(&added).unwrap();
        assert_eq!(
            text,
            r#"{"seq":8,"type":"ADDED","kind":"VirtualDisk","name":"data","object":{"kind":"VirtualDisk","metadata":{"name":"data"}}}"#
        );
        assert_eq!(serde_json::from_str::<WatchLine>(&text).unwrap(), added);
        let deleting = WatchLine {
            deleting: true,
            ..added.clone()
        };
        assert_eq!(serde_json::to_value(&deleting).unwrap()["deleting"], true);
        let relist = WatchLine::relist(9, "too old".into());
        assert_eq!(
            serde_json::to_value(&relist).unwrap(),
            json!({"seq": 9, "type": "RELIST", "message": "too old"})
        );
    }

    #[test]
    fn a_type_from_a_newer_hearthd_reads_as_unknown() {
        let line: WatchLine = serde_json::from_str(r#"{"seq": 3, "type": "COMPACTED"}"#).unwrap();
        assert_eq!(line.type_, WatchType::Unknown);
        assert_eq!(line.seq, 3);
    }
}
