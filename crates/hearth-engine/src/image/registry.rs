//! The running VirtualImage imports, one per image at most, and when each
//! image's last attempt failed. Plain data; the imports are in `image`.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Instant;

/// The running import tasks and when each image's last attempt failed.
#[derive(Default)]
pub struct Imports {
    state: Mutex<ImportsState>,
}

#[derive(Default)]
pub(super) struct ImportsState {
    pub(super) running: HashMap<String, tokio::task::JoinHandle<()>>,
    failed_at: HashMap<String, Instant>,
    /// Images whose last attempt ran out of free space: the room above the
    /// reserve the next attempt needs (it waits until there is that much).
    needs_room: HashMap<String, u64>,
}

impl Imports {
    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, ImportsState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn is_running(&self, name: &str) -> bool {
        self.lock()
            .running
            .get(name)
            .is_some_and(|h| !h.is_finished())
    }

    pub(super) fn failed_at(&self, name: &str) -> Option<Instant> {
        self.lock().failed_at.get(name).copied()
    }

    pub(super) fn needs_room(&self, name: &str) -> Option<u64> {
        self.lock().needs_room.get(name).copied()
    }

    /// Called by the task itself as its last step: `None` if the attempt
    /// succeeded, else the room it ran out of, if that is why it failed.
    pub(super) fn finished(&self, name: &str, failure: Option<Option<u64>>) {
        let mut st = self.lock();
        st.running.remove(name);
        match failure {
            Some(needs_room) => {
                st.failed_at.insert(name.to_string(), Instant::now());
                match needs_room {
                    Some(n) => st.needs_room.insert(name.to_string(), n),
                    None => st.needs_room.remove(name),
                };
            }
            None => {
                st.failed_at.remove(name);
                st.needs_room.remove(name);
            }
        }
    }

    /// Stops the image's import, if one runs, and waits until it has ended
    /// (its temporary file is removed as the task's future is dropped).
    pub async fn cancel(&self, name: &str) -> bool {
        let handle = {
            let mut st = self.lock();
            st.failed_at.remove(name);
            st.needs_room.remove(name);
            st.running.remove(name)
        };
        match handle {
            Some(h) => {
                h.abort();
                let _ = h.await;
                true
            }
            None => false,
        }
    }
}
