//! VirtualImage reconcile: import an image into the content-addressed image
//! store, verify it, and report it.

use std::sync::Arc;

use crate::context::{Context, ReconcileError};

pub async fn reconcile(_ctx: &Arc<Context>, _name: &str) -> Result<(), ReconcileError> {
    Ok(())
}
