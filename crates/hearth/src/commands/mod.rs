//! One module per command group. Each turns its arguments into API requests
//! and the answers into text; none knows how the requests travel.

pub mod action;
pub mod apply;
pub mod backup;
pub mod completion;
pub mod console;
pub mod convert;
pub mod cp;
pub mod delete;
pub mod describe;
pub mod events;
pub mod exec;
pub mod export;
pub mod get;
pub mod label;
pub mod logs;
pub mod manpages;
pub mod restore;
pub mod run;
pub mod snapshot;
pub mod sources;
pub mod ssh;
pub mod wait;
pub mod watch;

use hearth_api::{Kind, check_dns_label};
use hyper::StatusCode;

use crate::client::{ApiClient, ApiError};
use crate::output::str_at;

/// The help of every KIND argument: each kind by its short name (a test
/// holds it to `Kind::ALL`).
pub const KIND_HELP: &str = "vm, disk, image, network, snapshot (a disk snapshot), vmsnapshot, \
     vmsnapshotgroup, schedule or backup; plurals and the full kind names \
     (VirtualMachine, VirtualDisk...) work too";

/// clap value parser for KIND arguments: `vm`, `vms`, `disk`, `snapshot`,
/// `vmsnapshot`, `VirtualMachine`, ...
pub fn parse_kind(s: &str) -> Result<Kind, String> {
    Kind::from_user(s).ok_or_else(|| {
        format!(
            "unknown kind {s:?} (use vm, disk, image, network, snapshot, vmsnapshot, \
             vmsnapshotgroup, schedule or backup; VirtualMachine, VirtualDisk, VirtualImage, \
             VirtualNetwork, VirtualDiskSnapshot, VirtualMachineSnapshot, \
             VirtualMachineSnapshotGroup, VirtualMachineSnapshotSchedule and \
             VirtualMachineBackup work too)"
        )
    })
}

/// clap value parser for object names. Checked here so a typo never turns
/// into a strange URL, and the message says what a name may contain.
pub fn parse_name(s: &str) -> Result<String, String> {
    check_dns_label(s).map(|()| s.to_string())
}

/// `virtualmachine/demo`: how results of apply and delete name an object.
pub fn resource_ref(kind: &str, name: &str) -> String {
    format!("{}/{name}", kind.to_ascii_lowercase())
}

/// `vm/demo`: the short form wait uses in its progress lines.
pub fn short_ref(kind: Kind, name: &str) -> String {
    let short = match kind {
        Kind::VirtualMachine => "vm",
        Kind::VirtualDisk => "disk",
        Kind::VirtualDiskSnapshot => "snapshot",
        Kind::VirtualMachineSnapshot => "vmsnapshot",
        Kind::VirtualMachineSnapshotGroup => "vmsnapshotgroup",
        Kind::VirtualMachineSnapshotSchedule => "schedule",
        Kind::VirtualMachineBackup => "backup",
        Kind::VirtualImage => "image",
        Kind::VirtualNetwork => "network",
    };
    format!("{short}/{name}")
}

/// `/v1/virtualmachines/demo`
pub fn object_path(kind: Kind, name: &str) -> String {
    format!("/v1/{}/{name}", kind.plural())
}

/// An object a command makes new, never one it re-applies over.
pub struct New<'a> {
    pub kind: Kind,
    pub name: &'a str,
    /// The name was made up from the clock, not given with --name.
    pub made_up_name: bool,
    /// What the user asked for, in the refusal: "snapshot", "backup".
    pub noun: &'a str,
}

/// Sends `object` in one apply that only creates (`?create=true`) and prints
/// `KIND/NAME created`. hearthd refuses a taken name with a 409; then nothing
/// was written, and the error says what holds the name and what to do.
pub async fn create_only(
    client: &ApiClient,
    new: &New<'_>,
    object: serde_json::Value,
    out: &mut impl std::io::Write,
) -> anyhow::Result<()> {
    let who = short_ref(new.kind, new.name);
    let noun = new.noun;
    let taken = |detail: String| {
        let hint = if new.made_up_name {
            format!("another {noun} was started in the same second; pass --name")
        } else {
            "pick another --name, or delete it first".to_string()
        };
        anyhow::anyhow!("{who} already exists{detail}; no new {noun} was taken ({hint})")
    };
    let answer = match client
        .post(
            "/v1/apply?create=true",
            Some(&serde_json::json!({ "items": [object] })),
        )
        .await
    {
        Ok(answer) => answer,
        Err(ApiError::Server { status, .. }) if status == StatusCode::CONFLICT => {
            // Say what holds the name, when it still does.
            let detail = match client.get(&object_path(new.kind, new.name)).await {
                Ok(existing) => str_at(&existing, &["status", "phase"])
                    .map(|p| format!(" (it is {p})"))
                    .unwrap_or_default(),
                Err(_) => String::new(),
            };
            return Err(taken(detail));
        }
        Err(e) => return Err(e.into()),
    };
    out.write_all(apply::render_results(&answer)?.as_bytes())?;
    let action = answer
        .get("results")
        .and_then(serde_json::Value::as_array)
        .and_then(|r| r.first())
        .and_then(|r| str_at(r, &["action"]));
    if action != Some("created") {
        return Err(taken(String::new()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_and_names_from_the_command_line() {
        assert_eq!(parse_kind("vm"), Ok(Kind::VirtualMachine));
        assert_eq!(parse_kind("Disks"), Ok(Kind::VirtualDisk));
        assert_eq!(parse_kind("snapshots"), Ok(Kind::VirtualDiskSnapshot));
        assert_eq!(parse_kind("vmsnapshot"), Ok(Kind::VirtualMachineSnapshot));
        for image in ["image", "images", "vi", "VirtualImage"] {
            assert_eq!(parse_kind(image), Ok(Kind::VirtualImage), "{image}");
        }
        assert_eq!(
            short_ref(Kind::VirtualImage, "debian-12"),
            "image/debian-12"
        );
        assert_eq!(
            object_path(Kind::VirtualImage, "debian-12"),
            "/v1/virtualimages/debian-12"
        );
        let err = parse_kind("pod").expect_err("unknown");
        assert!(err.contains("\"pod\""), "{err}");
        // Every kind is named, by a name that parses, in the help and in
        // the refusal.
        let named = |text: &str| -> Vec<Kind> {
            text.split(|c: char| !c.is_ascii_alphanumeric())
                .filter_map(Kind::from_user)
                .collect()
        };
        for kind in Kind::ALL {
            assert!(
                named(KIND_HELP).contains(&kind),
                "{kind:?} not in KIND_HELP"
            );
            assert!(named(&err).contains(&kind), "{kind:?} not in: {err}");
        }
        assert_eq!(parse_name("demo-1"), Ok("demo-1".to_string()));
        assert!(parse_name("../etc").is_err());
        assert!(parse_name("Demo").is_err());
        assert_eq!(
            object_path(Kind::VirtualDisk, "data"),
            "/v1/virtualdisks/data"
        );
        assert_eq!(resource_ref("VirtualDisk", "data"), "virtualdisk/data");
        assert_eq!(short_ref(Kind::VirtualMachine, "demo"), "vm/demo");
        assert_eq!(short_ref(Kind::VirtualDiskSnapshot, "s"), "snapshot/s");
        assert_eq!(
            object_path(Kind::VirtualMachineSnapshot, "pre"),
            "/v1/virtualmachinesnapshots/pre"
        );
    }
}
