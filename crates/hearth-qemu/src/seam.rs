//! The operations hearth's engine runs on a QEMU, as two traits: [`Monitor`]
//! (QMP) and [`GuestAgent`] (qemu-ga). The real clients implement them;
//! [`fake`] (feature `test-support`) is an in-memory QEMU for tests of the
//! code that drives them, so that code can be tested without a process.
//!
//! A [`Monitor`] needs only the two primitives a QMP connection has (a
//! command, a command with a descriptor); the typed operations are written
//! once over them, so the real client and the fake answer the very same
//! commands.

use std::future::Future;
use std::os::fd::OwnedFd;
use std::path::Path;
use std::time::Duration;

use serde_json::{Value, json};

use crate::agent::{AgentClient, AgentError, ExecOutput, FreezeStatus};
use crate::fsmap::FsInfo;
use crate::qmp::{self, FileNode, QmpClient, QmpError};

#[cfg(any(test, feature = "test-support"))]
pub mod fake;

/// A QEMU monitor (QMP) connection.
pub trait Monitor: Send + Sync {
    /// Runs one command and returns its `return` value.
    fn execute(
        &self,
        command: &str,
        arguments: Option<Value>,
        timeout: Duration,
    ) -> impl Future<Output = Result<Value, QmpError>> + Send;

    /// [`execute`](Self::execute), sending `fd` along (`add-fd`).
    fn execute_with_fd(
        &self,
        command: &str,
        arguments: Option<Value>,
        fd: OwnedFd,
        timeout: Duration,
    ) -> impl Future<Output = Result<Value, QmpError>> + Send;

    /// `query-status`: the run state (`running`, `paused`, ...).
    fn query_status(
        &self,
        timeout: Duration,
    ) -> impl Future<Output = Result<String, QmpError>> + Send {
        async move {
            let v = self.execute("query-status", None, timeout).await?;
            Ok(v.get("status")
                .and_then(Value::as_str)
                .unwrap_or("unknown")
                .to_string())
        }
    }

    /// `query-block`: every block device and the node it writes to.
    fn query_block(
        &self,
        timeout: Duration,
    ) -> impl Future<Output = Result<Value, QmpError>> + Send {
        self.execute("query-block", None, timeout)
    }

    /// `query-named-block-nodes` (flat): every named node.
    fn query_named_block_nodes(
        &self,
        timeout: Duration,
    ) -> impl Future<Output = Result<Value, QmpError>> + Send {
        self.execute(
            "query-named-block-nodes",
            Some(json!({"flat": true})),
            timeout,
        )
    }

    /// Every fd set with the label of its first descriptor.
    fn fdsets(
        &self,
        timeout: Duration,
    ) -> impl Future<Output = Result<Vec<(u64, String)>, QmpError>> + Send {
        qmp::fdsets(self, timeout)
    }

    /// One atomic `transaction` of `actions`: all of them run or none.
    fn transaction(
        &self,
        actions: Vec<Value>,
        timeout: Duration,
    ) -> impl Future<Output = Result<Value, QmpError>> + Send {
        self.execute("transaction", Some(json!({"actions": actions})), timeout)
    }

    /// `blockdev-add` with `options`.
    fn blockdev_add(
        &self,
        options: Value,
        timeout: Duration,
    ) -> impl Future<Output = Result<Value, QmpError>> + Send {
        self.execute("blockdev-add", Some(options), timeout)
    }

    /// Starts `blockdev-create` job `job` with `options`.
    fn blockdev_create(
        &self,
        job: &str,
        options: Value,
        timeout: Duration,
    ) -> impl Future<Output = Result<Value, QmpError>> + Send {
        self.execute(
            "blockdev-create",
            Some(json!({"job-id": job, "options": options})),
            timeout,
        )
    }

    /// Starts a `block-stream` job with `arguments`.
    fn block_stream(
        &self,
        arguments: Value,
        timeout: Duration,
    ) -> impl Future<Output = Result<Value, QmpError>> + Send {
        self.execute("block-stream", Some(arguments), timeout)
    }

    /// `query-jobs`: every job QEMU lists.
    fn query_jobs(
        &self,
        timeout: Duration,
    ) -> impl Future<Output = Result<Value, QmpError>> + Send {
        self.execute("query-jobs", None, timeout)
    }

    /// `job-dismiss` of concluded job `id`.
    fn job_dismiss(
        &self,
        id: &str,
        timeout: Duration,
    ) -> impl Future<Output = Result<Value, QmpError>> + Send {
        self.execute("job-dismiss", Some(json!({"id": id})), timeout)
    }

    /// Adds a protocol (`file`) node over `path`, handed over by descriptor
    /// ([`qmp::add_protocol_node`]).
    fn add_protocol_node(
        &self,
        node: &str,
        path: &Path,
        read_only: bool,
        timeout: Duration,
    ) -> impl Future<Output = Result<FileNode, QmpError>> + Send {
        qmp::add_protocol_node(self, node, path, read_only, timeout)
    }

    /// Deletes `node` ([`qmp::remove_node`]), and the fd sets labelled
    /// `file` when it is given.
    fn remove_node(
        &self,
        node: &str,
        file: Option<&Path>,
        timeout: Duration,
    ) -> impl Future<Output = Result<(), QmpError>> + Send {
        qmp::remove_node(self, node, file, timeout)
    }
}

impl Monitor for QmpClient {
    fn execute(
        &self,
        command: &str,
        arguments: Option<Value>,
        timeout: Duration,
    ) -> impl Future<Output = Result<Value, QmpError>> + Send {
        QmpClient::execute(self, command, arguments, timeout)
    }

    fn execute_with_fd(
        &self,
        command: &str,
        arguments: Option<Value>,
        fd: OwnedFd,
        timeout: Duration,
    ) -> impl Future<Output = Result<Value, QmpError>> + Send {
        QmpClient::execute_with_fd(self, command, arguments, fd, timeout)
    }
}

/// A guest agent (qemu-ga) connection: one command at a time, hence `&mut`.
pub trait GuestAgent: Send {
    fn ping(&mut self, timeout: Duration) -> impl Future<Output = Result<(), AgentError>> + Send;

    /// Freezes every filesystem; the number frozen.
    fn fsfreeze_freeze(
        &mut self,
        timeout: Duration,
    ) -> impl Future<Output = Result<u32, AgentError>> + Send;

    /// Freezes the filesystems mounted at `mountpoints`; the number frozen.
    fn fsfreeze_freeze_list(
        &mut self,
        mountpoints: &[String],
        timeout: Duration,
    ) -> impl Future<Output = Result<u32, AgentError>> + Send;

    fn fsfreeze_status(
        &mut self,
        timeout: Duration,
    ) -> impl Future<Output = Result<FreezeStatus, AgentError>> + Send;

    /// Thaws every frozen filesystem; the number thawed.
    fn fsfreeze_thaw(
        &mut self,
        timeout: Duration,
    ) -> impl Future<Output = Result<u32, AgentError>> + Send;

    fn get_fsinfo(
        &mut self,
        timeout: Duration,
    ) -> impl Future<Output = Result<Vec<FsInfo>, AgentError>> + Send;

    /// Starts a program; its guest pid.
    fn exec_start(
        &mut self,
        path: &str,
        args: &[&str],
        timeout: Duration,
    ) -> impl Future<Output = Result<i64, AgentError>> + Send;

    /// `None` while the program runs, its output once it has exited.
    fn exec_status(
        &mut self,
        pid: i64,
        timeout: Duration,
    ) -> impl Future<Output = Result<Option<ExecOutput>, AgentError>> + Send;
}

impl GuestAgent for AgentClient {
    fn ping(&mut self, timeout: Duration) -> impl Future<Output = Result<(), AgentError>> + Send {
        AgentClient::ping(self, timeout)
    }

    fn fsfreeze_freeze(
        &mut self,
        timeout: Duration,
    ) -> impl Future<Output = Result<u32, AgentError>> + Send {
        AgentClient::fsfreeze_freeze(self, timeout)
    }

    fn fsfreeze_freeze_list(
        &mut self,
        mountpoints: &[String],
        timeout: Duration,
    ) -> impl Future<Output = Result<u32, AgentError>> + Send {
        AgentClient::fsfreeze_freeze_list(self, mountpoints, timeout)
    }

    fn fsfreeze_status(
        &mut self,
        timeout: Duration,
    ) -> impl Future<Output = Result<FreezeStatus, AgentError>> + Send {
        AgentClient::fsfreeze_status(self, timeout)
    }

    fn fsfreeze_thaw(
        &mut self,
        timeout: Duration,
    ) -> impl Future<Output = Result<u32, AgentError>> + Send {
        AgentClient::fsfreeze_thaw(self, timeout)
    }

    fn get_fsinfo(
        &mut self,
        timeout: Duration,
    ) -> impl Future<Output = Result<Vec<FsInfo>, AgentError>> + Send {
        AgentClient::get_fsinfo(self, timeout)
    }

    fn exec_start(
        &mut self,
        path: &str,
        args: &[&str],
        timeout: Duration,
    ) -> impl Future<Output = Result<i64, AgentError>> + Send {
        AgentClient::exec_start(self, path, args, timeout)
    }

    fn exec_status(
        &mut self,
        pid: i64,
        timeout: Duration,
    ) -> impl Future<Output = Result<Option<ExecOutput>, AgentError>> + Send {
        AgentClient::exec_status(self, pid, timeout)
    }
}
