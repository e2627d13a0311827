//! Metadata, conditions and events shared by every kind.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

pub const API_VERSION: &str = "hearth.dev/v1alpha1";

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ObjectMeta {
    pub name: String,
    /// Set by hearthd; ignored when a user supplies it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub creation_timestamp: Option<DateTime<Utc>>,
    /// Bumped by hearthd each time the spec changes; ignored on input.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub generation: u64,
    /// Where the object came from: `api` or `file:/path/to/manifest.yaml`.
    /// Set by hearthd; ignored on input.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub managed_by: Option<String>,
    /// Short facts to select objects by (`tier: prod`), and the labels
    /// hearth reads (`hearth.dev/keep: "true"` pins a snapshot).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// Free-form notes kept with the object and shown by `hearth describe`;
    /// an object translated from another tool's manifest (docs/ignite.md)
    /// records here which field made it and what could not be honoured.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
}

/// At most this many labels on an object.
pub const MAX_LABELS: usize = 64;

/// A label key: an optional DNS-subdomain prefix and `/`, then a name of
/// at most 63 letters, digits, `-`, `_` and `.`, starting and ending with
/// a letter or digit (Kubernetes' rule, so labels carry over).
pub fn check_label_key(key: &str) -> Result<(), String> {
    let (prefix, name) = match key.rsplit_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, key),
    };
    if let Some(p) = prefix {
        let ok = !p.is_empty()
            && p.len() <= 253
            && p.split('.').all(|part| {
                !part.is_empty()
                    && part
                        .bytes()
                        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                    && !part.starts_with('-')
                    && !part.ends_with('-')
            });
        if !ok {
            return Err(format!(
                "{key:?}: the prefix before '/' must be a DNS subdomain (example.com)"
            ));
        }
    }
    check_label_text(name).map_err(|why| format!("{key:?}: the name {why}"))
}

/// A label value: empty, or like a key's name.
pub fn check_label_value(value: &str) -> Result<(), String> {
    if value.is_empty() {
        return Ok(());
    }
    check_label_text(value).map_err(|why| format!("{value:?} {why}"))
}

fn check_label_text(t: &str) -> Result<(), String> {
    let alnum = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric());
    if t.is_empty() || t.len() > 63 {
        return Err("must be 1 to 63 characters".into());
    }
    if !t
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        || !alnum(t.chars().next())
        || !alnum(t.chars().last())
    {
        return Err(
            "may hold only letters, digits, '-', '_' and '.', and must start and end with a letter or digit"
                .into(),
        );
    }
    Ok(())
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Condition {
    #[serde(rename = "type")]
    pub type_: String,
    pub status: ConditionStatus,
    #[serde(default)]
    pub reason: String,
    #[serde(default)]
    pub message: String,
    pub last_transition_time: DateTime<Utc>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub enum ConditionStatus {
    True,
    False,
    Unknown,
}

/// Sets a condition, keeping its transition time when only the message changes.
pub fn set_condition(
    conditions: &mut Vec<Condition>,
    type_: &str,
    status: ConditionStatus,
    reason: &str,
    message: &str,
    now: DateTime<Utc>,
) {
    if let Some(c) = conditions.iter_mut().find(|c| c.type_ == type_) {
        if c.status != status {
            c.last_transition_time = now;
        }
        c.status = status;
        c.reason = reason.to_string();
        c.message = message.to_string();
    } else {
        conditions.push(Condition {
            type_: type_.to_string(),
            status,
            reason: reason.to_string(),
            message: message.to_string(),
            last_transition_time: now,
        });
    }
}

pub fn remove_condition(conditions: &mut Vec<Condition>, type_: &str) {
    conditions.retain(|c| c.type_ != type_);
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub enum EventType {
    Normal,
    Warning,
}

/// The `kind` of an event about a source of manifests (a git
/// repository), named by the source's name: sources are not objects.
pub const SOURCE_EVENT_KIND: &str = "Source";

/// Something that happened to an object, kept in the store for `describe`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct Event {
    pub time: DateTime<Utc>,
    pub kind: String,
    pub name: String,
    #[serde(rename = "type")]
    pub type_: EventType,
    pub reason: String,
    pub message: String,
}
