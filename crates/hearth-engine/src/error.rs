//! The one error of the engine's command surface: why a request was
//! refused. Each case names the object (and the field) it is about; the
//! HTTP API maps [`RequestError::refusal`] to one status.

use hearth_api::{FieldError, Kind};

use crate::store::StoreError;

pub use hearth_api::limits::MAX_APPLY_OBJECTS;

/// Why a request was refused.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    /// A field of an object is wrong (syntax, range, a host path outside
    /// the roots, an immutable spec changed).
    #[error("{0}")]
    Invalid(#[from] FieldError),
    #[error(
        "{count} objects in one apply, more than the limit of {max} objects per apply; split them over several applies",
        max = MAX_APPLY_OBJECTS
    )]
    TooManyObjects { count: usize },
    /// The same kind and name twice in one apply.
    #[error("{object} appears twice in one apply")]
    Twice { object: String },
    /// What a guest program or copy was given is wrong, or the guest
    /// refused it.
    #[error("VirtualMachine {vm:?}: {message}")]
    Guest { vm: String, message: String },
    #[error("{kind} {name:?} not found")]
    NotFound { kind: Kind, name: String },
    /// Something inside a VM or hearthd's sessions that is not there.
    #[error("VirtualMachine {vm:?}: {what}")]
    NotInGuest { vm: String, what: String },
    /// An apply that only creates met an object that exists.
    #[error("{kind} {name:?} already exists; an apply with create=true only creates")]
    Exists { kind: Kind, name: String },
    /// `then` says what did not happen because of it (`; nothing was
    /// restored`), or is empty.
    #[error("{kind} {name:?} is being deleted{then}")]
    Deleting {
        kind: Kind,
        name: String,
        then: &'static str,
    },
    #[error("{object} is owned by the manifest file {file}; edit or remove that file instead")]
    OwnedByFile { object: String, file: String },
    #[error("VirtualMachine {vm:?} is not running")]
    NotRunning { vm: String },
    /// The state of things refuses the request; the text names what.
    #[error("{0}")]
    Conflict(String),
    #[error("store: {0}")]
    Store(#[from] StoreError),
}

/// The classes of refusal, each one HTTP status.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The request itself is wrong (400).
    BadRequest,
    /// What it names does not exist (404).
    NotFound,
    /// It cannot be done in the present state (409).
    Conflict,
    /// hearthd failed (500).
    Internal,
}

impl RequestError {
    pub fn refusal(&self) -> Refusal {
        match self {
            RequestError::Invalid(_)
            | RequestError::TooManyObjects { .. }
            | RequestError::Twice { .. }
            | RequestError::Guest { .. } => Refusal::BadRequest,
            RequestError::NotFound { .. } | RequestError::NotInGuest { .. } => Refusal::NotFound,
            RequestError::Exists { .. }
            | RequestError::Deleting { .. }
            | RequestError::OwnedByFile { .. }
            | RequestError::NotRunning { .. }
            | RequestError::Conflict(_) => Refusal::Conflict,
            RequestError::Store(_) => Refusal::Internal,
        }
    }

    pub(crate) fn not_found(kind: Kind, name: &str) -> RequestError {
        RequestError::NotFound {
            kind,
            name: name.to_string(),
        }
    }

    pub(crate) fn deleting(kind: Kind, name: &str, then: &'static str) -> RequestError {
        RequestError::Deleting {
            kind,
            name: name.to_string(),
            then,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The texts clients and tests read stay what they were.
    #[test]
    fn typed_cases_read_as_before() {
        let cases = [
            (
                RequestError::not_found(Kind::VirtualMachine, "a"),
                r#"VirtualMachine "a" not found"#,
            ),
            (
                RequestError::deleting(Kind::VirtualDiskSnapshot, "s", "; nothing was exported"),
                r#"VirtualDiskSnapshot "s" is being deleted; nothing was exported"#,
            ),
            (
                RequestError::NotRunning { vm: "a".into() },
                r#"VirtualMachine "a" is not running"#,
            ),
            (
                RequestError::Guest {
                    vm: "a".into(),
                    message: "no program to run (path is empty)".into(),
                },
                r#"VirtualMachine "a": no program to run (path is empty)"#,
            ),
            (
                RequestError::Twice {
                    object: r#"VirtualDisk "d""#.into(),
                },
                r#"VirtualDisk "d" appears twice in one apply"#,
            ),
        ];
        for (e, text) in cases {
            assert_eq!(e.to_string(), text);
        }
        assert_eq!(
            RequestError::TooManyObjects { count: 10_001 }.to_string(),
            format!(
                "10001 objects in one apply, more than the limit of {MAX_APPLY_OBJECTS} objects per apply; split them over several applies"
            )
        );
    }
}
