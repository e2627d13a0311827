//! An in-memory QEMU for tests: a block graph behind a [`Monitor`] and a
//! guest's freeze state behind a [`GuestAgent`]. It answers the QMP and
//! qemu-ga commands hearth sends, as QEMU does in the cases hearth relies on
//! (a transaction runs whole or not at all; `blockdev-del` refuses a node in
//! use and fails for one it does not know), records every call, and lets a
//! test make any one call fail, hang, or lose its reply.

use std::collections::{BTreeMap, HashMap};
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use serde_json::{Value, json};

use super::{GuestAgent, Monitor};
use crate::agent::{AgentError, ExecOutput, FreezeStatus};
use crate::fsmap::FsInfo;
use crate::qmp::QmpError;

/// What an injected fault does to one call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fault {
    /// The command is refused (`{"error": {"class", "desc"}}`) and has no effect.
    Fail { class: String, desc: String },
    /// No reply: the call waits out its timeout; the command never ran.
    Hang,
    /// The command runs, but its reply never comes (the call times out).
    LoseReply,
    /// The reply comes after this long (a timeout if that is too long); the
    /// command runs when the reply is sent.
    Late(Duration),
    /// The connection closes before the command is sent.
    Disconnect,
}

impl Fault {
    /// A refusal with QEMU's usual class.
    pub fn fail(desc: &str) -> Fault {
        Fault::Fail {
            class: "GenericError".into(),
            desc: desc.into(),
        }
    }
}

/// One recorded call.
#[derive(Clone, Debug, PartialEq)]
pub struct Call {
    pub command: String,
    pub arguments: Option<Value>,
}

/// The faults waiting for their call, and the calls so far.
#[derive(Default)]
struct Script {
    calls: Vec<Call>,
    counts: HashMap<String, usize>,
    /// (command, the call number it hits, what it does).
    faults: Vec<(String, usize, Fault)>,
}

impl Script {
    fn inject(&mut self, command: &str, nth: usize, fault: Fault) {
        let at = self.counts.get(command).copied().unwrap_or(0) + nth.max(1);
        self.faults.push((command.to_string(), at, fault));
    }

    /// Records a call; the fault it hits, if any.
    fn call(&mut self, command: &str, arguments: Option<Value>) -> Option<Fault> {
        self.calls.push(Call {
            command: command.to_string(),
            arguments,
        });
        let n = self.counts.entry(command.to_string()).or_default();
        *n += 1;
        let n = *n;
        let i = self
            .faults
            .iter()
            .position(|(c, at, _)| c == command && *at == n)?;
        Some(self.faults.remove(i).2)
    }
}

/// One node of the fake block graph.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Node {
    pub driver: String,
    /// The file it reads (what `query-named-block-nodes` reports).
    pub filename: String,
    /// Its `file` child, for a format node.
    pub file: Option<String>,
    pub backing: Option<String>,
    pub size: Option<u64>,
    pub read_only: bool,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Job {
    pub id: String,
    pub kind: String,
    pub status: String,
    pub error: Option<String>,
}

#[derive(Default)]
struct Graph {
    nodes: BTreeMap<String, Node>,
    /// Device id (`qdev`) and the node it writes to.
    devices: Vec<(String, String)>,
    fdsets: BTreeMap<u64, Vec<(i64, String)>>,
    next_fd: i64,
    /// Sizes `blockdev-create` formatted, by the protocol node it wrote.
    formatted: HashMap<String, u64>,
    jobs: Vec<Job>,
    /// The error the next `blockdev-create` job concludes with.
    job_error: Option<String>,
    status: String,
    anonymous: u64,
}

struct QemuState {
    graph: Graph,
    script: Script,
}

/// A fake QEMU monitor. Clones share one QEMU.
#[derive(Clone)]
pub struct FakeQemu {
    state: Arc<Mutex<QemuState>>,
}

impl Default for FakeQemu {
    fn default() -> Self {
        FakeQemu::new()
    }
}

fn command_error(command: &str, desc: String) -> QmpError {
    QmpError::Command {
        command: command.to_string(),
        class: "GenericError".into(),
        desc,
    }
}

impl FakeQemu {
    /// A running QEMU with no devices.
    pub fn new() -> FakeQemu {
        FakeQemu {
            state: Arc::new(Mutex::new(QemuState {
                graph: Graph {
                    status: "running".into(),
                    next_fd: 10,
                    ..Graph::default()
                },
                script: Script::default(),
            })),
        }
    }

    fn lock(&self) -> MutexGuard<'_, QemuState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Adds device `device` (a `qdev` id) writing to a qcow2 node `node` of
    /// `size` bytes over `file` (its file node is `{node}-file`), as a launch
    /// makes it.
    pub fn attach(&self, device: &str, node: &str, file: &str, size: u64) {
        let mut s = self.lock();
        let g = &mut s.graph;
        let file_node = format!("{node}-file");
        g.nodes.insert(
            file_node.clone(),
            Node {
                driver: "file".into(),
                filename: file.into(),
                file: None,
                backing: None,
                size: Some(size),
                read_only: false,
            },
        );
        g.nodes.insert(
            node.into(),
            Node {
                driver: "qcow2".into(),
                filename: file.into(),
                file: Some(file_node),
                backing: None,
                size: Some(size),
                read_only: false,
            },
        );
        g.devices.push((device.into(), node.into()));
    }

    /// Makes call number `nth` (1 = the next one) of `command` do `fault`.
    pub fn inject(&self, command: &str, nth: usize, fault: Fault) {
        self.lock().script.inject(command, nth, fault);
    }

    /// The run state `query-status` reports.
    pub fn set_status(&self, status: &str) {
        self.lock().graph.status = status.into();
    }

    /// The next `blockdev-create` job concludes with this error.
    pub fn fail_next_job(&self, error: &str) {
        self.lock().graph.job_error = Some(error.into());
    }

    pub fn calls(&self) -> Vec<Call> {
        self.lock().script.calls.clone()
    }

    /// The commands called, in order.
    pub fn commands(&self) -> Vec<String> {
        self.calls().into_iter().map(|c| c.command).collect()
    }

    pub fn node(&self, name: &str) -> Option<Node> {
        self.lock().graph.nodes.get(name).cloned()
    }

    /// Every named node.
    pub fn node_names(&self) -> Vec<String> {
        self.lock()
            .graph
            .nodes
            .keys()
            .filter(|n| !n.starts_with('#'))
            .cloned()
            .collect()
    }

    /// The node `device` writes to.
    pub fn top(&self, device: &str) -> Option<String> {
        let s = self.lock();
        s.graph
            .devices
            .iter()
            .find(|(d, _)| d == device)
            .map(|(_, n)| n.clone())
    }

    /// The label of every fd set.
    pub fn fdset_labels(&self) -> Vec<String> {
        let s = self.lock();
        s.graph
            .fdsets
            .values()
            .filter_map(|fds| fds.first().map(|(_, l)| l.clone()))
            .collect()
    }

    pub fn jobs(&self) -> Vec<Job> {
        self.lock().graph.jobs.clone()
    }

    async fn call(
        &self,
        command: &str,
        arguments: Option<Value>,
        timeout: Duration,
    ) -> Result<Value, QmpError> {
        let fault = self.lock().script.call(command, arguments.clone());
        let timed_out = || QmpError::Timeout {
            command: command.to_string(),
            timeout,
        };
        match fault {
            None => self.lock().graph.run(command, arguments),
            Some(Fault::Fail { class, desc }) => Err(QmpError::Command {
                command: command.to_string(),
                class,
                desc,
            }),
            Some(Fault::Hang) => {
                tokio::time::sleep(timeout).await;
                Err(timed_out())
            }
            Some(Fault::LoseReply) => {
                let _ = self.lock().graph.run(command, arguments);
                tokio::time::sleep(timeout).await;
                Err(timed_out())
            }
            Some(Fault::Late(after)) => {
                if after >= timeout {
                    tokio::time::sleep(timeout).await;
                    // QEMU runs it all the same, later.
                    let _ = self.lock().graph.run(command, arguments);
                    return Err(timed_out());
                }
                tokio::time::sleep(after).await;
                self.lock().graph.run(command, arguments)
            }
            Some(Fault::Disconnect) => Err(QmpError::Disconnected),
        }
    }
}

impl Monitor for FakeQemu {
    async fn execute(
        &self,
        command: &str,
        arguments: Option<Value>,
        timeout: Duration,
    ) -> Result<Value, QmpError> {
        self.call(command, arguments, timeout).await
    }

    async fn execute_with_fd(
        &self,
        command: &str,
        arguments: Option<Value>,
        fd: OwnedFd,
        timeout: Duration,
    ) -> Result<Value, QmpError> {
        // QEMU would keep the descriptor; the fake needs only its label.
        drop(fd);
        self.call(command, arguments, timeout).await
    }
}

fn str_arg<'a>(command: &str, args: &'a Value, key: &str) -> Result<&'a str, QmpError> {
    args.get(key)
        .and_then(Value::as_str)
        .ok_or_else(|| command_error(command, format!("Parameter '{key}' is missing")))
}

impl Graph {
    /// Who uses `node`: a device, a node's backing or file.
    fn user_of(&self, node: &str) -> Option<String> {
        if let Some((d, _)) = self.devices.iter().find(|(_, n)| n == node) {
            return Some(format!("device {d}"));
        }
        self.nodes
            .iter()
            .find(|(_, n)| n.backing.as_deref() == Some(node) || n.file.as_deref() == Some(node))
            .map(|(name, _)| format!("node {name}"))
    }

    fn run(&mut self, command: &str, arguments: Option<Value>) -> Result<Value, QmpError> {
        let args = arguments.unwrap_or_else(|| json!({}));
        match command {
            "query-status" => Ok(json!({
                "status": self.status,
                "running": self.status == "running",
            })),
            "query-block" => Ok(Value::Array(
                self.devices
                    .iter()
                    .map(|(d, n)| {
                        let node = &self.nodes[n];
                        json!({
                            "device": "",
                            "qdev": d,
                            "inserted": {
                                "node-name": n,
                                "file": node.filename,
                                "image": {"virtual-size": node.size},
                            },
                        })
                    })
                    .collect(),
            )),
            "query-named-block-nodes" => Ok(Value::Array(
                self.nodes
                    .iter()
                    .filter(|(name, _)| !name.starts_with('#'))
                    .map(|(name, n)| {
                        json!({
                            "node-name": name,
                            "drv": n.driver,
                            "file": n.filename,
                            "ro": n.read_only,
                            "image": {"virtual-size": n.size},
                        })
                    })
                    .collect(),
            )),
            "query-fdsets" => Ok(Value::Array(
                self.fdsets
                    .iter()
                    .map(|(id, fds)| {
                        json!({
                            "fdset-id": id,
                            "fds": fds.iter().map(|(fd, l)| json!({"fd": fd, "opaque": l})).collect::<Vec<_>>(),
                        })
                    })
                    .collect(),
            )),
            "query-pci" => Ok(json!([])),
            "add-fd" => {
                let label = args
                    .get("opaque")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_string();
                let set = match args.get("fdset-id").and_then(Value::as_u64) {
                    Some(s) => s,
                    None => self.fdsets.keys().max().map_or(0, |m| m + 1),
                };
                let fd = self.next_fd;
                self.next_fd += 1;
                self.fdsets.entry(set).or_default().push((fd, label));
                Ok(json!({"fdset-id": set, "fd": fd}))
            }
            "remove-fd" => {
                let set = args.get("fdset-id").and_then(Value::as_u64).unwrap_or(0);
                let Some(fds) = self.fdsets.get_mut(&set) else {
                    return Err(command_error(
                        command,
                        format!("File descriptor named 'fdset-id:{set}' not found"),
                    ));
                };
                match args.get("fd").and_then(Value::as_i64) {
                    Some(fd) => fds.retain(|(f, _)| *f != fd),
                    None => fds.clear(),
                }
                if fds.is_empty() {
                    self.fdsets.remove(&set);
                }
                Ok(json!({}))
            }
            "blockdev-add" => self.blockdev_add(&args),
            "blockdev-del" => {
                let name = str_arg(command, &args, "node-name")?;
                if !self.nodes.contains_key(name) {
                    return Err(command_error(
                        command,
                        format!("Failed to find node with node-name='{name}'"),
                    ));
                }
                if let Some(user) = self.user_of(name) {
                    return Err(command_error(
                        command,
                        format!("Node '{name}' is busy: used by {user}"),
                    ));
                }
                let gone = self.nodes.remove(name);
                // A child added with the node goes with it.
                if let Some(child) = gone.and_then(|n| n.file).filter(|c| c.starts_with('#')) {
                    self.nodes.remove(&child);
                }
                Ok(json!({}))
            }
            "blockdev-create" => {
                let job = str_arg(command, &args, "job-id")?.to_string();
                if self.jobs.iter().any(|j| j.id == job) {
                    return Err(command_error(
                        command,
                        format!("Job ID '{job}' already in use"),
                    ));
                }
                let options = args.get("options").cloned().unwrap_or_default();
                let file = str_arg(command, &options, "file")?;
                if !self.nodes.contains_key(file) {
                    return Err(command_error(
                        command,
                        format!("Cannot find device='' nor node-name='{file}'"),
                    ));
                }
                let size = options.get("size").and_then(Value::as_u64).unwrap_or(0);
                let error = self.job_error.take();
                if error.is_none() {
                    self.formatted.insert(file.to_string(), size);
                }
                self.jobs.push(Job {
                    id: job,
                    kind: "create".into(),
                    status: "concluded".into(),
                    error,
                });
                Ok(json!({}))
            }
            "block-stream" => {
                let job = args
                    .get("job-id")
                    .and_then(Value::as_str)
                    .unwrap_or("stream")
                    .to_string();
                self.jobs.push(Job {
                    id: job,
                    kind: "stream".into(),
                    status: "concluded".into(),
                    error: None,
                });
                Ok(json!({}))
            }
            "query-jobs" => Ok(Value::Array(
                self.jobs
                    .iter()
                    .map(|j| {
                        let mut v = json!({"id": j.id, "type": j.kind, "status": j.status});
                        if let Some(e) = &j.error {
                            v["error"] = json!(e);
                        }
                        v
                    })
                    .collect(),
            )),
            "job-dismiss" => {
                let id = str_arg(command, &args, "id")?;
                match self.jobs.iter().position(|j| j.id == id) {
                    Some(i) if self.jobs[i].status == "concluded" => {
                        self.jobs.remove(i);
                        Ok(json!({}))
                    }
                    Some(_) => Err(command_error(
                        command,
                        format!("Job '{id}' in state 'running' cannot accept command verb 'dismiss'"),
                    )),
                    None => Err(command_error(command, format!("Job not found: {id}"))),
                }
            }
            "blockdev-reopen" => Ok(json!({})),
            "transaction" => self.transaction(&args),
            other => Err(QmpError::Command {
                command: other.to_string(),
                class: "CommandNotFound".into(),
                desc: format!("The command {other} has not been found"),
            }),
        }
    }

    fn blockdev_add(&mut self, args: &Value) -> Result<Value, QmpError> {
        let command = "blockdev-add";
        let name = str_arg(command, args, "node-name")?.to_string();
        if self.nodes.contains_key(&name) {
            return Err(command_error(
                command,
                format!("Duplicate nodes with node-name='{name}'"),
            ));
        }
        let driver = str_arg(command, args, "driver")?.to_string();
        let read_only = args
            .get("read-only")
            .and_then(Value::as_bool)
            .unwrap_or(false);
        let open = |g: &Graph, filename: &str| -> Result<(), QmpError> {
            match filename.strip_prefix("/dev/fdset/") {
                Some(set) if !g.fdsets.contains_key(&set.parse().unwrap_or(u64::MAX)) => {
                    Err(command_error(
                        command,
                        format!("Could not open '{filename}': No such file or directory"),
                    ))
                }
                _ => Ok(()),
            }
        };
        let node = match driver.as_str() {
            "file" => {
                let filename = str_arg(command, args, "filename")?;
                open(self, filename)?;
                Node {
                    driver,
                    filename: self.label(filename),
                    file: None,
                    backing: None,
                    size: None,
                    read_only,
                }
            }
            "qcow2" => {
                let (file, filename, size) = match args.get("file") {
                    Some(Value::String(child)) => {
                        let Some(c) = self.nodes.get(child) else {
                            return Err(command_error(
                                command,
                                format!("Cannot find device='' nor node-name='{child}'"),
                            ));
                        };
                        let Some(size) = self.formatted.get(child).copied() else {
                            return Err(command_error(
                                command,
                                format!("Image is not in qcow2 format ({child})"),
                            ));
                        };
                        (child.clone(), c.filename.clone(), Some(size))
                    }
                    Some(f @ Value::Object(_)) => {
                        let filename = str_arg(command, f, "filename")?;
                        open(self, filename)?;
                        self.anonymous += 1;
                        let child = format!("#block{}", self.anonymous);
                        let label = self.label(filename);
                        self.nodes.insert(
                            child.clone(),
                            Node {
                                driver: "file".into(),
                                filename: label.clone(),
                                file: None,
                                backing: None,
                                size: None,
                                read_only,
                            },
                        );
                        (child, label, None)
                    }
                    _ => return Err(command_error(command, "Parameter 'file' is missing".into())),
                };
                let backing = match args.get("backing") {
                    Some(Value::String(b)) => Some(b.clone()),
                    _ => None,
                };
                Node {
                    driver,
                    filename,
                    file: Some(file),
                    backing,
                    size,
                    read_only,
                }
            }
            other => {
                return Err(command_error(command, format!("Unknown driver '{other}'")));
            }
        };
        self.nodes.insert(name, node);
        Ok(json!({}))
    }

    /// An fd set's path stands for the file it was labelled with.
    fn label(&self, filename: &str) -> String {
        filename
            .strip_prefix("/dev/fdset/")
            .and_then(|s| s.parse::<u64>().ok())
            .and_then(|s| self.fdsets.get(&s)?.first().map(|(_, l)| l.clone()))
            .unwrap_or_else(|| filename.to_string())
    }

    /// All actions are checked before any runs: one refused action refuses
    /// the whole transaction, and the graph stays as it was.
    fn transaction(&mut self, args: &Value) -> Result<Value, QmpError> {
        let command = "transaction";
        let actions = args
            .get("actions")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        let mut switches = Vec::new();
        for a in &actions {
            if a.get("type").and_then(Value::as_str) != Some("blockdev-snapshot") {
                return Err(command_error(command, format!("unsupported action {a}")));
            }
            let data = a.get("data").cloned().unwrap_or_default();
            let node = str_arg(command, &data, "node")?.to_string();
            let overlay = str_arg(command, &data, "overlay")?.to_string();
            if !self.nodes.contains_key(&node) {
                return Err(command_error(
                    command,
                    format!("Cannot find device='{node}' nor node-name='{node}'"),
                ));
            }
            let Some(o) = self.nodes.get(&overlay) else {
                return Err(command_error(
                    command,
                    format!("Cannot find device='' nor node-name='{overlay}'"),
                ));
            };
            if o.backing.is_some() {
                return Err(command_error(
                    command,
                    "The overlay already has a backing image".to_string(),
                ));
            }
            if self.user_of(&overlay).is_some() || switches.iter().any(|(_, o)| *o == overlay) {
                return Err(command_error(
                    command,
                    format!("The overlay '{overlay}' is already in use"),
                ));
            }
            switches.push((node, overlay));
        }
        for (node, overlay) in switches {
            if let Some(o) = self.nodes.get_mut(&overlay) {
                o.backing = Some(node.clone());
            }
            if let Some(n) = self.nodes.get_mut(&node) {
                n.read_only = true;
            }
            for (_, top) in &mut self.devices {
                if *top == node {
                    *top = overlay.clone();
                }
            }
        }
        Ok(json!({}))
    }
}

/// The guest's side of a fake agent.
struct AgentState {
    frozen: bool,
    /// Mount points a full freeze freezes.
    mountpoints: Vec<String>,
    fsinfo: Vec<FsInfo>,
    exec: Option<ExecOutput>,
    next_pid: i64,
    script: Script,
}

/// A fake guest agent. Clones share one guest, so a test keeps one to look
/// at while the code under test holds another.
#[derive(Clone)]
pub struct FakeAgent {
    state: Arc<Mutex<AgentState>>,
}

impl Default for FakeAgent {
    fn default() -> Self {
        FakeAgent::new()
    }
}

impl FakeAgent {
    /// A thawed guest with one filesystem, `/`.
    pub fn new() -> FakeAgent {
        FakeAgent {
            state: Arc::new(Mutex::new(AgentState {
                frozen: false,
                mountpoints: vec!["/".into()],
                fsinfo: Vec::new(),
                exec: None,
                next_pid: 100,
                script: Script::default(),
            })),
        }
    }

    fn lock(&self) -> MutexGuard<'_, AgentState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Makes call number `nth` (1 = the next one) of `command` (its qemu-ga
    /// name, e.g. `guest-fsfreeze-freeze`) do `fault`.
    pub fn inject(&self, command: &str, nth: usize, fault: Fault) {
        self.lock().script.inject(command, nth, fault);
    }

    pub fn set_fsinfo(&self, fsinfo: Vec<FsInfo>) {
        self.lock().fsinfo = fsinfo;
    }

    /// What a program started with `guest-exec` exits with (it exits at once).
    pub fn set_exec_output(&self, out: ExecOutput) {
        self.lock().exec = Some(out);
    }

    pub fn is_frozen(&self) -> bool {
        self.lock().frozen
    }

    pub fn calls(&self) -> Vec<Call> {
        self.lock().script.calls.clone()
    }

    pub fn commands(&self) -> Vec<String> {
        self.calls().into_iter().map(|c| c.command).collect()
    }

    async fn call(
        &self,
        command: &str,
        arguments: Option<Value>,
        timeout: Duration,
    ) -> Result<Value, AgentError> {
        let fault = self.lock().script.call(command, arguments.clone());
        let timed_out = || AgentError::Timeout {
            command: command.to_string(),
            timeout,
        };
        match fault {
            None => self.lock().run(command, arguments),
            Some(Fault::Fail { class, desc }) => Err(AgentError::Command {
                command: command.to_string(),
                class,
                desc,
            }),
            Some(Fault::Hang) => {
                tokio::time::sleep(timeout).await;
                Err(timed_out())
            }
            Some(Fault::LoseReply) => {
                let _ = self.lock().run(command, arguments);
                tokio::time::sleep(timeout).await;
                Err(timed_out())
            }
            Some(Fault::Late(after)) => {
                if after >= timeout {
                    tokio::time::sleep(timeout).await;
                    let _ = self.lock().run(command, arguments);
                    return Err(timed_out());
                }
                tokio::time::sleep(after).await;
                self.lock().run(command, arguments)
            }
            Some(Fault::Disconnect) => Err(AgentError::Disconnected),
        }
    }
}

impl AgentState {
    fn run(&mut self, command: &str, arguments: Option<Value>) -> Result<Value, AgentError> {
        // qemu-ga refuses all but a few commands while frozen.
        let allowed_frozen = ["guest-ping", "guest-fsfreeze-status", "guest-fsfreeze-thaw"];
        if self.frozen && !allowed_frozen.contains(&command) {
            return Err(AgentError::Command {
                command: command.to_string(),
                class: "CommandNotFound".into(),
                desc: format!("Command {command} has been disabled: the agent is in frozen state"),
            });
        }
        let args = arguments.unwrap_or_else(|| json!({}));
        match command {
            "guest-ping" => Ok(json!({})),
            "guest-fsfreeze-freeze" => {
                self.frozen = true;
                Ok(json!(self.mountpoints.len()))
            }
            "guest-fsfreeze-freeze-list" => {
                let n = args
                    .get("mountpoints")
                    .and_then(Value::as_array)
                    .map_or(0, Vec::len);
                self.frozen = true;
                Ok(json!(n))
            }
            "guest-fsfreeze-status" => Ok(json!(if self.frozen { "frozen" } else { "thawed" })),
            "guest-fsfreeze-thaw" => {
                let n = if self.frozen {
                    self.mountpoints.len()
                } else {
                    0
                };
                self.frozen = false;
                Ok(json!(n))
            }
            "guest-get-fsinfo" => Ok(json!(null)),
            "guest-exec" => {
                self.next_pid += 1;
                Ok(json!({"pid": self.next_pid}))
            }
            "guest-exec-status" => Ok(json!({"exited": true})),
            other => Err(AgentError::Command {
                command: other.to_string(),
                class: "CommandNotFound".into(),
                desc: format!("The command {other} has not been found"),
            }),
        }
    }
}

impl GuestAgent for FakeAgent {
    async fn ping(&mut self, timeout: Duration) -> Result<(), AgentError> {
        self.call("guest-ping", None, timeout).await.map(|_| ())
    }

    async fn fsfreeze_freeze(&mut self, timeout: Duration) -> Result<u32, AgentError> {
        let v = self.call("guest-fsfreeze-freeze", None, timeout).await?;
        Ok(v.as_u64().unwrap_or(0) as u32)
    }

    async fn fsfreeze_freeze_list(
        &mut self,
        mountpoints: &[String],
        timeout: Duration,
    ) -> Result<u32, AgentError> {
        let v = self
            .call(
                "guest-fsfreeze-freeze-list",
                Some(json!({"mountpoints": mountpoints})),
                timeout,
            )
            .await?;
        Ok(v.as_u64().unwrap_or(0) as u32)
    }

    async fn fsfreeze_status(&mut self, timeout: Duration) -> Result<FreezeStatus, AgentError> {
        let v = self.call("guest-fsfreeze-status", None, timeout).await?;
        Ok(if v == "frozen" {
            FreezeStatus::Frozen
        } else {
            FreezeStatus::Thawed
        })
    }

    async fn fsfreeze_thaw(&mut self, timeout: Duration) -> Result<u32, AgentError> {
        let v = self.call("guest-fsfreeze-thaw", None, timeout).await?;
        Ok(v.as_u64().unwrap_or(0) as u32)
    }

    async fn get_fsinfo(&mut self, timeout: Duration) -> Result<Vec<FsInfo>, AgentError> {
        self.call("guest-get-fsinfo", None, timeout).await?;
        Ok(self.lock().fsinfo.clone())
    }

    async fn exec_start(
        &mut self,
        path: &str,
        args: &[&str],
        timeout: Duration,
    ) -> Result<i64, AgentError> {
        let v = self
            .call(
                "guest-exec",
                Some(json!({"path": path, "arg": args, "capture-output": true})),
                timeout,
            )
            .await?;
        v.get("pid")
            .and_then(Value::as_i64)
            .ok_or_else(|| AgentError::Protocol("guest-exec reply has no pid".into()))
    }

    async fn exec_status(
        &mut self,
        pid: i64,
        timeout: Duration,
    ) -> Result<Option<ExecOutput>, AgentError> {
        self.call("guest-exec-status", Some(json!({"pid": pid})), timeout)
            .await?;
        Ok(Some(self.lock().exec.clone().unwrap_or(ExecOutput {
            exit_code: Some(0),
            signal: None,
            stdout: Vec::new(),
            stderr: Vec::new(),
            truncated: false,
        })))
    }
}

#[cfg(test)]
mod tests;
