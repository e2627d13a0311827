//! `GET /v1/openapi.json`: the OpenAPI 3.1 document of this API.
//!
//! The object schemas are derived from the hearth-api types themselves
//! (`hearth_api::openapi`); the small request and answer envelopes are typed
//! here. Each operation is declared below with `#[utoipa::path]` on a
//! function that only carries it (the handlers live in `mod.rs`); a test
//! reads the routes the real router answers and fails when one is missing
//! here or declared here but not served. The end-to-end tests check real
//! answers against these schemas.

use std::sync::OnceLock;

use axum::http::header;
use axum::response::{IntoResponse, Response};
// `Object` alone is utoipa's name for any JSON object: say which one.
use hearth_api::Object as AnyObject;
use hearth_api::{Event, Kind};
use utoipa::OpenApi;
use utoipa::openapi::OpenApi as Document;

/// The document, built once.
pub fn document() -> &'static Document {
    static DOC: OnceLock<Document> = OnceLock::new();
    DOC.get_or_init(ApiDoc::openapi)
}

pub async fn serve() -> Response {
    // Serialising a derived document cannot fail; say so if it ever does.
    match serde_json::to_vec(document()) {
        Ok(body) => ([(header::CONTENT_TYPE, "application/json")], body).into_response(),
        Err(e) => (
            axum::http::StatusCode::INTERNAL_SERVER_ERROR,
            axum::Json(
                serde_json::json!({"error": format!("cannot serialise the OpenAPI document: {e}")}),
            ),
        )
            .into_response(),
    }
}

#[derive(OpenApi)]
#[openapi(
    info(
        title = "hearth HTTP API",
        description = "The API hearthd serves on its unix socket (mode 0600: the file mode is the access control). Every change goes through `POST /v1/apply`, `DELETE` and the VM actions; everything else reads. Errors are a non-2xx status with `{\"error\": message}` naming the object and the field.",
        license(name = "Apache-2.0", identifier = "Apache-2.0")
    ),
    paths(
        health,
        apply,
        events,
        sources,
        source_refresh,
        openapi_json,
        metrics,
        list,
        get_one,
        patch_labels,
        delete,
        console,
        console_attach,
        agent_ping,
        agent_exec,
        agent_exec_start,
        agent_exec_status,
        agent_file_put,
        agent_file_get,
        watch,
        agent_freeze_status,
        restore,
        restore_group,
        snapshot_export,
        backup_verify,
        vm_action
    ),
    components(schemas(
        AnyObject,
        Kind,
        Event,
        Plural,
        VmActionName,
        ErrorAnswer,
        Health,
        ObjectList,
        ApplyRequest,
        LabelPatch,
        LabelPatchMeta,
        ApplyResults,
        ApplyResult,
        ApplyAction,
        Deleted,
        Message,
        EventList,
        AgentPing,
        ExecRequest,
        ExecResult,
        FreezeStatus,
        FreezeState,
        RestoreRequest
    )),
    tags(
        (name = "objects", description = "Create, read and delete objects of every kind."),
        (name = "virtualmachines", description = "VM actions, console and guest agent."),
        (name = "snapshots", description = "Disk snapshots as standalone images."),
        (name = "backups", description = "Backup targets: checking one against its manifest."),
        (name = "daemon", description = "The daemon itself: health, manifest sources, events, this document, metrics.")
    )
)]
struct ApiDoc;

// ---------------------------------------------------------------- envelopes

pub use envelopes::*;

/// The requests and answers around the objects. The handlers write the same
/// JSON with `json!` (so these are never built); the end-to-end tests check
/// real answers against the schemas made from them.
#[allow(dead_code)]
mod envelopes {
    use hearth_api::{Event, Kind};
    use serde::Serialize;
    use utoipa::ToSchema;
    use utoipa::openapi::RefOr;
    use utoipa::openapi::schema::{ObjectBuilder, Schema, SchemaType, Type};

    use super::AnyObject;

    /// An error: every non-2xx answer.
    #[derive(Serialize, ToSchema)]
    pub struct ErrorAnswer {
        /// Names the object and the field, e.g. `VirtualMachine "demo": spec.memory: ...`.
        pub error: String,
    }

    /// The plural of a kind, as it appears in paths: from `Kind::plural`,
    /// which is what the router looks the kind up by.
    pub struct Plural;

    impl utoipa::PartialSchema for Plural {
        fn schema() -> RefOr<Schema> {
            ObjectBuilder::new()
                .schema_type(SchemaType::new(Type::String))
                .enum_values(Some(Kind::ALL.map(Kind::plural)))
                .description(Some("The plural of a kind, as it appears in paths."))
                .into()
        }
    }

    impl ToSchema for Plural {}

    /// A VM action.
    #[derive(Serialize, ToSchema)]
    #[serde(rename_all = "lowercase")]
    pub enum VmActionName {
        Start,
        Stop,
        Restart,
    }

    #[derive(Serialize, ToSchema)]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
    pub struct Health {
        /// hearthd's version.
        pub version: String,
        /// The accelerator VMs run under.
        pub accelerator: Accelerator,
        /// Why that accelerator was chosen.
        pub accelerator_reason: String,
    }

    #[derive(Serialize, ToSchema)]
    #[serde(rename_all = "lowercase")]
    pub enum Accelerator {
        Kvm,
        Tcg,
    }

    /// A merge patch of an object's labels, and nothing else.
    #[derive(Serialize, ToSchema)]
    #[serde(deny_unknown_fields)]
    pub struct LabelPatch {
        pub metadata: LabelPatchMeta,
    }

    #[derive(Serialize, ToSchema)]
    #[serde(deny_unknown_fields)]
    pub struct LabelPatchMeta {
        /// A value sets the label; `null` removes it.
        pub labels: std::collections::BTreeMap<String, Option<String>>,
    }

    /// A list of objects of one kind, with their status.
    #[derive(Serialize, ToSchema)]
    #[serde(deny_unknown_fields)]
    pub struct ObjectList {
        pub items: Vec<AnyObject>,
    }

    /// Objects to create or update, all or nothing.
    #[derive(Serialize, ToSchema)]
    #[serde(deny_unknown_fields)]
    pub struct ApplyRequest {
        pub items: Vec<AnyObject>,
    }

    #[derive(Serialize, ToSchema)]
    #[serde(deny_unknown_fields)]
    pub struct ApplyResults {
        pub results: Vec<ApplyResult>,
    }

    /// What an apply did to one object.
    #[derive(Serialize, ToSchema)]
    #[serde(deny_unknown_fields)]
    pub struct ApplyResult {
        pub kind: Kind,
        pub name: String,
        pub action: ApplyAction,
    }

    #[derive(Serialize, ToSchema)]
    #[serde(rename_all = "lowercase")]
    pub enum ApplyAction {
        Created,
        Configured,
        Unchanged,
    }

    /// A delete was accepted: the object's reconcile tears it down.
    #[derive(Serialize, ToSchema)]
    #[serde(deny_unknown_fields)]
    pub struct Deleted {
        pub kind: Kind,
        pub name: String,
        /// Always `deleted`.
        pub action: String,
    }

    #[derive(Serialize, ToSchema)]
    #[serde(deny_unknown_fields)]
    pub struct Message {
        /// What happened, for a person.
        pub message: String,
    }

    /// Events, oldest first.
    #[derive(Serialize, ToSchema)]
    #[serde(deny_unknown_fields)]
    pub struct EventList {
        pub items: Vec<Event>,
    }

    #[derive(Serialize, ToSchema)]
    #[serde(deny_unknown_fields)]
    pub struct AgentPing {
        pub ok: bool,
        /// Round trip, milliseconds.
        pub ms: u64,
    }

    /// A program to run in the guest (`guest-exec`), waited for.
    #[derive(Serialize, ToSchema)]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
    pub struct ExecRequest {
        /// The program's path in the guest.
        pub path: String,
        #[serde(default)]
        pub args: Vec<String>,
        /// 1..600, default 60.
        #[serde(default)]
        #[schema(minimum = 1, maximum = 600)]
        pub timeout_seconds: Option<u64>,
    }

    #[derive(Serialize, ToSchema)]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
    pub struct ExecResult {
        /// Unset when the program was killed by a signal.
        pub exit_code: Option<i64>,
        pub signal: Option<i64>,
        /// Captured output, as UTF-8 (invalid bytes replaced).
        pub stdout: String,
        pub stderr: String,
        /// The agent cut the captured output short.
        pub truncated: bool,
    }

    #[derive(Serialize, ToSchema)]
    #[serde(deny_unknown_fields)]
    pub struct FreezeStatus {
        pub status: FreezeState,
    }

    #[derive(Serialize, ToSchema)]
    #[serde(rename_all = "lowercase")]
    pub enum FreezeState {
        Frozen,
        Thawed,
    }

    #[derive(Serialize, ToSchema)]
    #[serde(deny_unknown_fields)]
    pub struct RestoreRequest {
        /// A Ready VirtualMachineSnapshot of this VM.
        pub from: String,
    }
}

// ---------------------------------------------------------------- operations
//
// Functions that only carry an operation's description; the handlers are in
// mod.rs, console.rs and sources.rs.

#[utoipa::path(get, path = "/v1/health", tag = "daemon",
    summary = "The daemon's version and accelerator",
    responses((status = 200, description = "The daemon answers", body = Health)))]
#[allow(dead_code)]
fn health() {}

#[utoipa::path(post, path = "/v1/apply", tag = "objects",
    summary = "Create or update objects, all or nothing",
    description = "Every object is validated (syntax, fields, host paths inside the image roots, a disk used by at most one VM, immutable specs, network clashes, ownership) before any is written; the batch is written in one store transaction. Host paths must be absolute.",
    params(
        ("create" = Option<bool>, Query, description = "true: only create; an object that already exists is a 409 and nothing is written"),
    ),
    request_body = ApplyRequest,
    responses(
        (status = 200, description = "Every object written (or unchanged), in order", body = ApplyResults),
        (status = 400, description = "An invalid object, a body that is not JSON, a key twice in one object, or a field other than items: nothing changed", body = ErrorAnswer),
        (status = 409, description = "A conflict (a disk used by two VMs, an object owned by a manifest file, with create=true an object that exists): nothing changed", body = ErrorAnswer),
        (status = 413, description = "A body over 8 MiB: nothing changed", body = ErrorAnswer),
        (status = 415, description = "A Content-Type that is not JSON: nothing changed", body = ErrorAnswer),
    ))]
#[allow(dead_code)]
fn apply() {}

#[utoipa::path(get, path = "/v1/events", tag = "daemon",
    summary = "Events, oldest first",
    params(
        ("kind" = Option<String>, Query, description = "A kind, as the CLI accepts it (`vm`, `VirtualMachine`, ...)"),
        ("name" = Option<String>, Query, description = "An object name"),
        ("limit" = Option<u32>, Query, description = "At most this many (default 100, at most 10000)"),
    ),
    responses(
        (status = 200, description = "The events (with a name, of that object's current life)", body = EventList),
        (status = 400, description = "Unknown kind, or a limit that is not a number or over 10000", body = ErrorAnswer),
    ))]
#[allow(dead_code)]
fn events() {}

#[utoipa::path(get, path = "/v1/sources", tag = "daemon",
    summary = "The sources of desired state as hearthd sees them",
    description = "The manifest directory's view at the top level: every file, what it declares and in what state, parse errors with line and column, conflicts, pending deletes, re-list counts and timings (docs/manifest-directory.md). `sources`: every source (the directory, each git repository) with its kind and state (Pending, Ready, Stale, Conflict); a git source also with its URL, ref, fetched and applied commit, why it is Stale, its files and recent events (docs/sources.md).",
    responses((status = 200, description = "The sources' view", body = serde_json::Value)))]
#[allow(dead_code)]
fn sources() {}

#[utoipa::path(post, path = "/v1/sources/{name}/refresh", tag = "daemon",
    summary = "Fetch a git source now",
    description = "Fetches the git source now (for a webhook relay or a CI job) and answers once that fetch and its apply are done (at most 120 s), with the source's view.",
    params(("name" = String, Path, description = "The git source's name")),
    responses(
        (status = 200, description = "The source after the fetch", body = serde_json::Value),
        (status = 404, description = "No git source of that name", body = ErrorAnswer),
    ))]
#[allow(dead_code)]
fn source_refresh() {}

#[utoipa::path(get, path = "/v1/openapi.json", tag = "daemon",
    summary = "This document",
    responses((status = 200, description = "OpenAPI 3.1", body = serde_json::Value)))]
#[allow(dead_code)]
fn openapi_json() {}

#[utoipa::path(get, path = "/metrics", tag = "daemon",
    summary = "Prometheus metrics",
    description = "The Prometheus text format (0.0.4), or OpenMetrics 1.0 when the Accept header asks for `application/openmetrics-text`. Every metric is described in docs/metrics.md.",
    responses((status = 200, description = "Metrics", body = String, content_type = "text/plain")))]
#[allow(dead_code)]
fn metrics() {}

#[utoipa::path(get, path = "/v1/{plural}", tag = "objects",
    summary = "All objects of one kind, or (watch=true) a stream of their changes",
    description = "With `watch=true` the answer is the change stream of `GET /v1/watch` for this kind (JSON lines, `application/x-ndjson`); see docs/http-api.md.",
    params(
        ("plural" = Plural, Path),
        ("watch" = Option<bool>, Query, description = "Stream changes instead of listing"),
        ("since" = Option<u64>, Query, description = "With watch: go on after this sequence number"),
        ("name" = Option<String>, Query, description = "With watch: only this object"),
        ("heartbeat" = Option<u64>, Query, description = "With watch: seconds between bookmarks while idle (1 to 300)"),
    ),
    responses(
        (status = 200, description = "The objects, sorted by name; with watch=true, JSON lines", body = ObjectList),
        (status = 404, description = "Unknown resource", body = ErrorAnswer),
    ))]
#[allow(dead_code)]
fn list() {}

#[utoipa::path(get, path = "/v1/{plural}/{name}", tag = "objects",
    summary = "One object, with its status",
    params(("plural" = Plural, Path), ("name" = String, Path)),
    responses(
        (status = 200, description = "The object", body = AnyObject),
        (status = 404, description = "No such object", body = ErrorAnswer),
    ))]
#[allow(dead_code)]
fn get_one() {}

#[utoipa::path(patch, path = "/v1/{plural}/{name}", tag = "objects",
    summary = "Set or remove labels",
    description = "Changes only `metadata.labels` (a value sets a label, `null` removes it); the spec, generation and owner stay. How a snapshot a schedule made is pinned: `{\"metadata\": {\"labels\": {\"hearth.dev/keep\": \"true\"}}}`. Refused for an object a manifest file or a git source owns.",
    params(("plural" = Plural, Path), ("name" = String, Path)),
    request_body = LabelPatch,
    responses(
        (status = 200, description = "The object, relabeled", body = AnyObject),
        (status = 400, description = "A label key or value that is not valid", body = ErrorAnswer),
        (status = 404, description = "No such object", body = ErrorAnswer),
        (status = 409, description = "Owned by a source", body = ErrorAnswer),
    ))]
#[allow(dead_code)]
fn patch_labels() {}

#[utoipa::path(delete, path = "/v1/{plural}/{name}", tag = "objects",
    summary = "Delete an object",
    description = "Marks the object for deletion; its reconcile tears down what was started. Refused for a disk in use, a network or image something uses, and an object owned by a manifest file.",
    params(("plural" = Plural, Path), ("name" = String, Path)),
    responses(
        (status = 200, description = "Deletion requested", body = Deleted),
        (status = 404, description = "No such object", body = ErrorAnswer),
        (status = 409, description = "In use, or owned by a manifest file", body = ErrorAnswer),
    ))]
#[allow(dead_code)]
fn delete() {}

#[utoipa::path(get, path = "/v1/virtualmachines/{name}/console", tag = "virtualmachines",
    summary = "The serial console log",
    params(
        ("name" = String, Path),
        ("follow" = Option<bool>, Query, description = "Keep the answer open and stream what the VM writes next, on into its next start"),
        ("previous" = Option<bool>, Query, description = "The log of the VM's previous start instead (not with follow)"),
    ),
    responses(
        (status = 200, description = "The log", body = String, content_type = "text/plain"),
        (status = 400, description = "previous with follow, or an unknown parameter", body = ErrorAnswer),
        (status = 404, description = "No such VM, or (previous) no previous start", body = ErrorAnswer),
    ))]
#[allow(dead_code)]
fn console() {}

#[utoipa::path(get, path = "/v1/virtualmachines/{name}/console/attach", tag = "virtualmachines",
    summary = "Attach to the serial console (HTTP/1.1 upgrade)",
    description = "Send `Connection: upgrade` and `Upgrade: hearth-console`. After the 101 the \
connection carries raw serial bytes both ways until either side closes. One client at a time.",
    params(("name" = String, Path)),
    responses(
        (status = 101, description = "Attached: raw bytes follow"),
        (status = 400, description = "Not an upgrade request", body = ErrorAnswer),
        (status = 404, description = "No such VM", body = ErrorAnswer),
        (status = 409, description = "Another client is attached, or the VM is not running", body = ErrorAnswer),
    ))]
#[allow(dead_code)]
fn console_attach() {}

#[utoipa::path(post, path = "/v1/virtualmachines/{name}/agent/ping", tag = "virtualmachines",
    summary = "Ping the guest agent",
    params(("name" = String, Path)),
    responses(
        (status = 200, description = "The agent answered", body = AgentPing),
        (status = 404, description = "No such VM", body = ErrorAnswer),
        (status = 409, description = "Not running, or the agent is not connected", body = ErrorAnswer),
    ))]
#[allow(dead_code)]
fn agent_ping() {}

#[utoipa::path(post, path = "/v1/virtualmachines/{name}/agent/exec", tag = "virtualmachines",
    summary = "Run a program in the guest and wait for it",
    params(("name" = String, Path)),
    request_body = ExecRequest,
    responses(
        (status = 200, description = "The program ended (or was killed at the timeout)", body = ExecResult),
        (status = 404, description = "No such VM", body = ErrorAnswer),
        (status = 409, description = "Not running, or the agent is not connected", body = ErrorAnswer),
    ))]
#[allow(dead_code)]
fn agent_exec() {}

#[utoipa::path(post, path = "/v1/virtualmachines/{name}/agent/exec/start", tag = "virtualmachines",
    summary = "Start a program in the guest",
    description = "Body: `{path, args?, stdinBase64?}`. Answers at once with hearthd's id of the program and its guest pid; poll `GET .../agent/exec/{id}`. Each agent request takes the channel for that request only, so snapshots are never held up.",
    params(("name" = String, Path)),
    request_body = serde_json::Value,
    responses(
        (status = 200, description = "Started: `{id, pid}`", body = serde_json::Value),
        (status = 400, description = "A bad body", body = ErrorAnswer),
        (status = 404, description = "No such VM", body = ErrorAnswer),
        (status = 409, description = "Not running, no agent, or the agent is not connected", body = ErrorAnswer),
    ))]
#[allow(dead_code)]
fn agent_exec_start() {}

#[utoipa::path(get, path = "/v1/virtualmachines/{name}/agent/exec/{id}", tag = "virtualmachines",
    summary = "A started program's state",
    description = "`{id, pid, exited: false}` while it runs; once it ended `{id, pid, exited: true, exitCode, signal, stdoutBase64, stderrBase64, truncated}`, given once.",
    params(
        ("name" = String, Path),
        ("id" = u64, Path),
        ("waitMs" = Option<u64>, Query, description = "Wait up to this long for the program to end before answering"),
    ),
    responses(
        (status = 200, description = "Running or ended", body = serde_json::Value),
        (status = 404, description = "No such VM or program", body = ErrorAnswer),
        (status = 409, description = "Not running, or the agent is not connected", body = ErrorAnswer),
    ))]
#[allow(dead_code)]
fn agent_exec_status() {}

#[utoipa::path(put, path = "/v1/virtualmachines/{name}/agent/files", tag = "virtualmachines",
    summary = "Write a file in the guest",
    description = "The request body becomes the file at `path`: written to a temporary file next to it in chunks, then given `mode` and renamed into place.",
    params(
        ("name" = String, Path),
        ("path" = String, Query, description = "Absolute path in the guest"),
        ("mode" = Option<String>, Query, description = "Octal permission mode, 0 to 777"),
    ),
    request_body(content = Vec<u8>, content_type = "application/octet-stream"),
    responses(
        (status = 200, description = "Written", body = serde_json::Value),
        (status = 400, description = "A bad path or mode, or the upload broke off", body = ErrorAnswer),
        (status = 404, description = "No such VM", body = ErrorAnswer),
        (status = 409, description = "Not running, or the agent is not connected", body = ErrorAnswer),
    ))]
#[allow(dead_code)]
fn agent_file_put() {}

#[utoipa::path(get, path = "/v1/virtualmachines/{name}/agent/files", tag = "virtualmachines",
    summary = "Read a file from the guest",
    description = "The file's bytes, streamed in chunks; size and mode in headers when the guest can tell them.",
    params(
        ("name" = String, Path),
        ("path" = String, Query, description = "Absolute path in the guest"),
    ),
    responses(
        (status = 200, description = "The file", body = Vec<u8>, content_type = "application/octet-stream"),
        (status = 400, description = "A bad path, or not a regular file", body = ErrorAnswer),
        (status = 404, description = "No such VM, or no such file in the guest", body = ErrorAnswer),
        (status = 409, description = "Not running, or the agent is not connected", body = ErrorAnswer),
    ))]
#[allow(dead_code)]
fn agent_file_get() {}

#[utoipa::path(get, path = "/v1/watch", tag = "objects",
    summary = "The change stream",
    description = "JSON lines (`application/x-ndjson`), one per change: `{seq, type: ADDED|MODIFIED|DELETED|EVENT|BOOKMARK|RELIST, kind, name, object|event}`, resumable with `since`. See docs/http-api.md, Watching.",
    params(
        ("kinds" = Option<String>, Query, description = "Comma-separated kinds (plurals, kind names or short names), and `sources` for the events of sources of manifests (git repositories); every kind and the sources when left out"),
        ("name" = Option<String>, Query, description = "Only this object"),
        ("since" = Option<u64>, Query, description = "Go on after this sequence number"),
        ("objects" = Option<bool>, Query, description = "Object changes (default true)"),
        ("events" = Option<bool>, Query, description = "Events (default false)"),
        ("limit" = Option<usize>, Query, description = "Events in the initial list (default 100, at most 10000)"),
        ("heartbeat" = Option<u64>, Query, description = "Seconds between bookmarks while idle (1 to 300, default 15)"),
    ),
    responses(
        (status = 200, description = "The stream", body = String, content_type = "application/x-ndjson"),
        (status = 400, description = "A bad parameter, named", body = ErrorAnswer),
    ))]
#[allow(dead_code)]
fn watch() {}

#[utoipa::path(post, path = "/v1/virtualmachines/{name}/agent/fsfreeze-status", tag = "virtualmachines",
    summary = "The guest's filesystem freeze state, as its agent says",
    params(("name" = String, Path)),
    responses(
        (status = 200, description = "The agent answered", body = FreezeStatus),
        (status = 404, description = "No such VM", body = ErrorAnswer),
        (status = 409, description = "Not running, or the agent is not connected", body = ErrorAnswer),
    ))]
#[allow(dead_code)]
fn agent_freeze_status() {}

#[utoipa::path(post, path = "/v1/virtualmachines/{name}/restore", tag = "virtualmachines",
    summary = "Rebuild a VM's disks from one of its snapshots",
    description = "Stops the VM, puts a fresh overlay over each snapshot layer as the disk's head, and starts the VM again if it ran. Answers once the disks are rebuilt.",
    params(("name" = String, Path)),
    request_body = RestoreRequest,
    responses(
        (status = 200, description = "The disks are rebuilt", body = Message),
        (status = 404, description = "No such VM or snapshot", body = ErrorAnswer),
        (status = 409, description = "The snapshot is not Ready or not of this VM", body = ErrorAnswer),
    ))]
#[allow(dead_code)]
fn restore() {}

#[utoipa::path(get, path = "/v1/backups/verify", tag = "backups",
    summary = "Check a backup target's files against its manifest",
    description = "Reads DIR/hearth-backup.json and checks each file of each point (up to `at`): there, of the manifest's length and SHA-256, and chained by its qcow2 header to the point before it on its disk. Writes nothing. The answer is one JSON document per line: `{\"plan\": {\"files\", \"bytes\"}}` first, `{\"file\": {\"point\", \"disk\", \"file\", \"size\", \"problem\"?}}` per file as it is checked, `{\"progress\": {\"bytesDone\"}}` about every second while files are hashed, then `{\"summary\": {\"points\", \"files\", \"bytes\", \"damagedFiles\", \"unrestorablePoints\", \"strays\"}}`.",
    params(
        ("dir" = String, Query, description = "The target directory (`spec.to` of its backups), absolute, on hearthd's host"),
        ("at" = Option<u32>, Query, description = "The newest point checked; every point when absent"),
    ),
    responses(
        (status = 200, description = "The checks, one JSON line per file, then the summary", body = String, content_type = "application/x-ndjson"),
        (status = 400, description = "Not an absolute path, or no readable hearth-backup.json there", body = ErrorAnswer),
    ))]
#[allow(dead_code)]
fn backup_verify() {}

#[utoipa::path(post, path = "/v1/virtualmachinesnapshotgroups/{name}/restore", tag = "snapshots",
    summary = "Restore every member VM of a snapshot group",
    description = "Checks that the group and each member VirtualMachineSnapshot are Ready and each member VM exists, then restores every member side by side, as `/v1/virtualmachines/{name}/restore` does for one VM. Answers once every member is rebuilt.",
    params(("name" = String, Path)),
    responses(
        (status = 200, description = "Every member is rebuilt", body = Message),
        (status = 404, description = "No such group, member snapshot or VM", body = ErrorAnswer),
        (status = 409, description = "The group or a member is not Ready, or a member could not be restored", body = ErrorAnswer),
    ))]
#[allow(dead_code)]
fn restore_group() {}

#[utoipa::path(get, path = "/v1/virtualdisksnapshots/{name}/export", tag = "snapshots",
    summary = "A disk snapshot as one standalone image",
    description = "Converts the Ready snapshot's layer chain into one image with no backing file (in a private file of hearthd's, unlinked once open) and streams it. The answer starts once the conversion is done: Content-Length is the file's size, `x-hearth-export-format` its format and `x-hearth-virtual-size` the disk's size. Deleting the snapshot meanwhile waits for the conversion. hearthd writes nothing outside its state directory: the client writes the file.",
    params(
        ("name" = String, Path),
        ("format" = Option<String>, Query, description = "qcow2 (the default) or raw; raw streams the whole virtual size, holes as zeros"),
    ),
    responses(
        (status = 200, description = "The image", body = Vec<u8>, content_type = "application/octet-stream"),
        (status = 400, description = "A format other than qcow2 or raw", body = ErrorAnswer),
        (status = 404, description = "No such disk snapshot", body = ErrorAnswer),
        (status = 409, description = "The snapshot is not Ready, or is being deleted", body = ErrorAnswer),
    ))]
#[allow(dead_code)]
fn snapshot_export() {}

#[utoipa::path(post, path = "/v1/virtualmachines/{name}/{action}", tag = "virtualmachines",
    summary = "Start, stop or restart a VM",
    description = "Sets the VM's run intent (for `Manual` VMs; start is refused for `AlwaysOff`); the reconcile acts on it.",
    params(("name" = String, Path), ("action" = VmActionName, Path)),
    responses(
        (status = 200, description = "The run intent is set", body = Message),
        (status = 404, description = "No such VM or action", body = ErrorAnswer),
        (status = 409, description = "Refused by the run policy, or being deleted", body = ErrorAnswer),
    ))]
#[allow(dead_code)]
fn vm_action() {}

#[cfg(test)]
mod tests;
