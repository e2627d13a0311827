//! The one error of the engine's command surface: why a request was
//! refused. The HTTP API maps each variant to one status.

use hearth_api::FieldError;

use crate::store::StoreError;

/// Why a request was refused. Each maps to one HTTP status.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    #[error("{0}")]
    Invalid(#[from] FieldError),
    #[error("{0}")]
    BadRequest(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Conflict(String),
    #[error("store: {0}")]
    Store(#[from] StoreError),
}
