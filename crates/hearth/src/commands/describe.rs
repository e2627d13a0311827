//! `hearth describe KIND NAME`: one object for people, with its conditions
//! and recent events.

use std::io::Write;

use chrono::{DateTime, Utc};
use hearth_api::Kind;
use serde_json::Value;

use crate::client::ApiClient;
use crate::output::{Table, age_of, at, cell, human_age, human_bytes, str_at, time_at};

/// How many recent events describe shows.
const EVENT_LIMIT: usize = 20;

#[derive(Debug, clap::Args)]
#[command(
    about = "Show one object in detail: spec, status, conditions and recent events",
    after_help = "\
For a VM the header says its firmware (BIOS, UEFI, or kernel for a direct
kernel boot) and what its cloud-init seed carries; the spec shows the
cloud-init user data in full. For an image: its source, how the import goes
(bytes, rate, attempts), the full digest, format, sizes, where it is stored,
the disks made from it, and why an import failed.

Examples:
  hearth describe vm demo
  hearth describe image debian-12
  hearth describe disk data
  hearth describe snapshot data-20250101-120000
  hearth describe vmsnapshot before-upgrade"
)]
pub struct Args {
    #[arg(value_name = "KIND", value_parser = super::parse_kind, help = super::KIND_HELP)]
    pub kind: Kind,
    /// The object's name.
    #[arg(value_name = "NAME", value_parser = super::parse_name)]
    pub name: String,
}

pub async fn run(client: &ApiClient, args: &Args) -> anyhow::Result<()> {
    let text = describe(client, args, Utc::now()).await?;
    std::io::stdout().lock().write_all(text.as_bytes())?;
    Ok(())
}

/// Fetches the object and its events and renders them.
pub async fn describe(
    client: &ApiClient,
    args: &Args,
    now: DateTime<Utc>,
) -> anyhow::Result<String> {
    let object = client
        .get(&super::object_path(args.kind, &args.name))
        .await?;
    let events_path = format!(
        "/v1/events?kind={}&name={}&limit={EVENT_LIMIT}",
        args.kind.as_str(),
        args.name
    );
    // The object is the point; a failed events request only loses that part.
    let events = match client.get(&events_path).await {
        Ok(answer) => match answer.get("items").and_then(Value::as_array) {
            Some(items) => Ok(items.clone()),
            None => Err("hearthd's events answer has no \"items\" list".to_string()),
        },
        Err(e) => Err(e.to_string()),
    };
    Ok(render(
        args.kind,
        &object,
        events.as_deref().map_err(String::as_str),
        now,
    ))
}

pub fn render(
    kind: Kind,
    obj: &Value,
    events: Result<&[Value], &str>,
    now: DateTime<Utc>,
) -> String {
    let mut out = String::new();
    let line = |out: &mut String, label: &str, value: String| {
        out.push_str(&format!("{:<12}{value}\n", format!("{label}:")));
    };
    line(&mut out, "Name", cell(at(obj, &["metadata", "name"])));
    line(&mut out, "Kind", kind.as_str().to_string());
    line(
        &mut out,
        "Source",
        cell(at(obj, &["metadata", "managedBy"])),
    );
    let created = match str_at(obj, &["metadata", "creationTimestamp"]) {
        Some(ts) => format!("{ts} ({} ago)", age_of(obj, now)),
        None => "-".to_string(),
    };
    line(&mut out, "Created", created);
    line(
        &mut out,
        "Generation",
        cell(at(obj, &["metadata", "generation"])),
    );
    // Notes such as which field of an Ignite manifest made which field
    // here, and what it could not honour (docs/ignite.md).
    if let Some(Value::Object(notes)) = at(obj, &["metadata", "annotations"])
        && !notes.is_empty()
    {
        out.push_str("Annotations:\n");
        for (k, v) in notes {
            out.push_str(&format!(
                "  {k}: {}\n",
                v.as_str().map_or_else(|| v.to_string(), str::to_string)
            ));
        }
    }
    if kind == Kind::VirtualMachine {
        line(&mut out, "Firmware", super::get::firmware_of(obj));
        line(&mut out, "Cloud-init", cloud_init_summary(obj));
    }

    let fields = Fields {
        order: match kind {
            Kind::VirtualMachine | Kind::VirtualDisk => FIELD_ORDER,
            Kind::VirtualImage => IMAGE_FIELD_ORDER,
            Kind::VirtualNetwork => NETWORK_FIELD_ORDER,
            Kind::VirtualDiskSnapshot
            | Kind::VirtualMachineSnapshot
            | Kind::VirtualMachineSnapshotGroup => SNAPSHOT_FIELD_ORDER,
            Kind::VirtualMachineSnapshotSchedule => SCHEDULE_FIELD_ORDER,
            Kind::VirtualMachineBackup => BACKUP_FIELD_ORDER,
        },
        now,
    };
    out.push_str("Spec:\n");
    match at(obj, &["spec"]) {
        Some(spec @ Value::Object(_)) => fields.render(&mut out, spec, 2),
        _ => out.push_str("  <none>\n"),
    }

    out.push_str("Status:\n");
    let mut status = at(obj, &["status"]).cloned().unwrap_or(Value::Null);
    if let Some(map) = status.as_object_mut()
        && let Some(spec) = map.get("virtualMachineSpec")
    {
        // A whole VM spec would drown the rest: say it is there.
        let disks = spec["disks"].as_array().map_or(0, Vec::len);
        let summary =
            format!("recorded, {disks} disk(s) (`hearth get vmsnapshot NAME -o yaml` shows it)");
        map.insert("virtualMachineSpec".into(), Value::String(summary));
    }
    let conditions = match status.as_object_mut() {
        Some(map) => map.remove("conditions"),
        None => None,
    };
    match &status {
        Value::Object(map) if !map.is_empty() => fields.render(&mut out, &status, 2),
        _ => out.push_str("  <none yet: hearthd has not reconciled this object>\n"),
    }

    let conditions = conditions
        .as_ref()
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default();
    if conditions.is_empty() {
        out.push_str("Conditions:  <none>\n");
    } else {
        out.push_str("Conditions:\n");
        let mut table = Table::new(&["TYPE", "STATUS", "REASON", "MESSAGE", "AGE"]);
        for c in conditions {
            table.push(vec![
                cell(at(c, &["type"])),
                cell(at(c, &["status"])),
                cell(at(c, &["reason"])),
                cell(at(c, &["message"])),
                time_at(c, &["lastTransitionTime"])
                    .map(|t| human_age(t, now))
                    .unwrap_or_else(|| "-".to_string()),
            ]);
        }
        out.push_str(&table.render_indented(2));
    }

    match events {
        Err(why) => out.push_str(&format!("Events:      <unavailable: {why}>\n")),
        Ok([]) => out.push_str("Events:      <none>\n"),
        Ok(events) => {
            out.push_str("Events:\n");
            let mut table = Table::new(&["AGE", "TYPE", "REASON", "MESSAGE"]);
            let skip = events.len().saturating_sub(EVENT_LIMIT);
            for e in &events[skip..] {
                table.push(vec![
                    time_at(e, &["time"])
                        .map(|t| human_age(t, now))
                        .unwrap_or_else(|| "-".to_string()),
                    cell(at(e, &["type"])),
                    cell(at(e, &["reason"])),
                    cell(at(e, &["message"])),
                ]);
            }
            out.push_str(&table.render_indented(2));
        }
    }
    out
}

/// How `key: value` blocks are laid out for one kind.
struct Fields {
    /// Known fields in manifest order; the rest follow by name.
    order: &'static [&'static str],
    /// For `(3m ago)` after times.
    now: DateTime<Utc>,
}

impl Fields {
    /// `key: value` lines for a JSON object, values aligned per level; nested
    /// objects indent, lists of scalars join with `, `, lists of objects get `- `.
    fn render(&self, out: &mut String, v: &Value, indent: usize) {
        let Some(map) = v.as_object() else {
            out.push_str(&format!("{}{}\n", " ".repeat(indent), scalar(v)));
            return;
        };
        let width = map
            .iter()
            .filter(|(_, v)| is_inline(v))
            .map(|(k, _)| k.chars().count() + 1)
            .max()
            .unwrap_or(0);
        let pad = " ".repeat(indent);
        let mut entries: Vec<_> = map.iter().collect();
        entries.sort_by_key(|(k, _)| field_rank(self.order, k));
        for (key, value) in entries {
            if let Value::String(text) = value
                && is_multi_line(text)
            {
                // YAML's block style: the text as written, one line per line.
                out.push_str(&format!("{pad}{key}: |\n"));
                for text_line in text.lines() {
                    if text_line.is_empty() {
                        out.push('\n');
                    } else {
                        out.push_str(&format!("{pad}  {}\n", printable(text_line)));
                    }
                }
                continue;
            }
            if is_inline(value) {
                let label = format!("{key}:");
                let text = self.humanised(key, value);
                out.push_str(&format!("{pad}{label:<width$}  {text}\n"));
                continue;
            }
            out.push_str(&format!("{pad}{key}:\n"));
            match value {
                Value::Array(items) => {
                    for item in items {
                        let mut block = String::new();
                        self.render(&mut block, item, indent + 4);
                        // Turn the first line's indent into a list bullet.
                        let bullet_at = indent + 2;
                        if block.len() >= bullet_at + 2 {
                            block.replace_range(bullet_at..bullet_at + 2, "- ");
                        }
                        out.push_str(&block);
                    }
                }
                _ => self.render(out, value, indent + 2),
            }
        }
    }

    /// The value, with byte counts in binary units and times with their age.
    fn humanised(&self, key: &str, value: &Value) -> String {
        let text = inline(value);
        match (key, value) {
            // `size` in a disk's spec is a quantity string like `1Gi`: left as is.
            (
                "capacity" | "allocated" | "size" | "virtualSize" | "bytesDone" | "bytesTotal",
                Value::Number(n),
            ) => match n.as_u64() {
                Some(bytes) => format!("{text} ({})", human_bytes(bytes)),
                None => text,
            },
            ("bytesPerSecond", Value::Number(n)) => match n.as_u64() {
                Some(rate) => format!("{text} ({}/s)", human_bytes(rate)),
                None => text,
            },
            ("cutTime" | "startTime", Value::String(s)) => match DateTime::parse_from_rfc3339(s) {
                Ok(t) => format!(
                    "{text} ({} ago)",
                    human_age(t.with_timezone(&Utc), self.now)
                ),
                Err(_) => text,
            },
            // Guest paths: a newline or ", " in one must not fake another
            // line or another entry, so such a path is shown quoted.
            ("frozenMountPoints", Value::Array(items)) if !items.is_empty() => items
                .iter()
                .map(|item| match item {
                    Value::String(path)
                        if path.is_empty()
                            || path.contains(", ")
                            || path.starts_with('"')
                            || path.chars().any(char::is_control) =>
                    {
                        format!("{path:?}")
                    }
                    other => scalar(other),
                })
                .collect::<Vec<_>>()
                .join(", "),
            _ => text,
        }
    }
}

/// The order fields are shown in: as in a manifest, whatever order the JSON
/// map iterates in; fields this CLI does not know come last, by name.
const FIELD_ORDER: &[&str] = &[
    "runPolicy",
    "cpus",
    "memory",
    "size",
    "source",
    "boot",
    "kernel",
    "initrd",
    "cmdline",
    "firmware",
    "disks",
    "networks",
    "virtualNetworkName",
    "macAddress",
    "ipAddress",
    "ports",
    "hostPort",
    "guestPort",
    "protocol",
    "hostAddress",
    "cloudInit",
    "hostname",
    "sshAuthorizedKeys",
    "userData",
    "networkConfig",
    "guestAgent",
    "stopTimeoutSeconds",
    "freezeDeadlineSeconds",
    "expediteFreeze",
    "phase",
    "accelerator",
    "acceleratorReason",
    "pid",
    "agentConnected",
    "startTime",
    "interfaces",
    "network",
    "mac",
    "hostInterface",
    "guestIpAddresses",
    "confirmed",
    "path",
    "capacity",
    "allocated",
    "attachedTo",
    "chainLength",
    "compaction",
    "id",
    "layers",
    "bytesDone",
    "bytesTotal",
    "lastError",
    "observedGeneration",
];

/// A VirtualImage: where it comes from, how the import goes, what it is,
/// where it is stored, who uses it, and why it failed.
const IMAGE_FIELD_ORDER: &[&str] = &[
    "source",
    "file",
    "http",
    "url",
    "sha256",
    "oci",
    "reference",
    "layout",
    "archive",
    "tag",
    "shape",
    "phase",
    "progress",
    "bytesDone",
    "bytesTotal",
    "bytesPerSecond",
    "digest",
    "layers",
    "format",
    "size",
    "virtualSize",
    "path",
    "usedBy",
    "attempts",
    "reason",
    "message",
    "observedGeneration",
];

/// A VirtualNetwork: what was asked, then what the host has, then why.
/// One list for both: the spec shows mode, subnet, bridge, dhcp; the status
/// phase, subnet, bridge, gateway, leases.
const NETWORK_FIELD_ORDER: &[&str] = &[
    "mode",
    "phase",
    "subnet",
    "bridge",
    "gateway",
    "dhcp",
    "leases",
    "message",
    "observedGeneration",
];

/// The same for both snapshot kinds: what was asked, then what happened,
/// then why.
const SCHEDULE_FIELD_ORDER: &[&str] = &[
    "schedule",
    "timeZone",
    "virtualMachineNames",
    "selector",
    "virtualMachineSnapshotGroupTemplate",
    "requiredConsistency",
    "retention",
    "startingDeadlineSeconds",
    "suspend",
    "lastRunTime",
    "lastResult",
    "nextRunTime",
    "nextRetentionTime",
    "lastScheduleTime",
    "snapshots",
    "active",
    "message",
];

const BACKUP_FIELD_ORDER: &[&str] = &[
    "virtualMachineName",
    "to",
    "mode",
    "requiredConsistency",
    "phase",
    "kind",
    "point",
    "base",
    "reasonFull",
    "checkpoint",
    "cutTime",
    "bytesRead",
    "bytesWritten",
    "durationMs",
    "files",
    "reason",
    "message",
];

const SNAPSHOT_FIELD_ORDER: &[&str] = &[
    "virtualDiskName",
    "virtualMachineName",
    "requiredConsistency",
    "phase",
    "consistent",
    "frozenMountPoints",
    "cutTime",
    "freezeWindowMs",
    "cutId",
    "size",
    "capacity",
    "virtualDiskSnapshotNames",
    "virtualMachineSpec",
    "virtualMachineSnapshotName",
    "reason",
    "message",
    "observedGeneration",
];

fn field_rank(order: &[&str], key: &str) -> (usize, String) {
    let known = order.iter().position(|k| *k == key);
    (known.unwrap_or(order.len()), key.to_string())
}

/// `yes (userData, 1 SSH key, hostname web)` or `no`: what the VM's
/// cloud-init seed carries, without the contents.
fn cloud_init_summary(vm: &Value) -> String {
    let Some(ci) = at(vm, &["spec", "cloudInit"]).and_then(Value::as_object) else {
        return "no".to_string();
    };
    let mut parts = Vec::new();
    for field in ["userData", "networkConfig"] {
        if ci.get(field).is_some_and(Value::is_string) {
            parts.push(field.to_string());
        }
    }
    match ci
        .get("sshAuthorizedKeys")
        .and_then(Value::as_array)
        .map(Vec::len)
    {
        Some(1) => parts.push("1 SSH key".to_string()),
        Some(n) if n > 1 => parts.push(format!("{n} SSH keys")),
        _ => {}
    }
    if let Some(h) = ci.get("hostname").and_then(Value::as_str) {
        parts.push(format!("hostname {}", printable(h)));
    }
    if parts.is_empty() {
        "yes".to_string()
    } else {
        format!("yes ({})", parts.join(", "))
    }
}

fn is_multi_line(text: &str) -> bool {
    text.contains('\n')
}

/// A line of user text safe to print: control characters other than tabs
/// (terminal escapes, carriage returns) are shown escaped.
fn printable(text: &str) -> String {
    text.chars()
        .map(|c| {
            if c.is_control() && c != '\t' {
                c.escape_default().to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}

/// Fits on the key's line: scalars, `{}`, and lists without objects in them.
fn is_inline(v: &Value) -> bool {
    match v {
        Value::String(text) => !is_multi_line(text),
        Value::Object(map) => map.is_empty(),
        Value::Array(items) => items.iter().all(|i| !i.is_object() && !i.is_array()),
        _ => true,
    }
}

fn inline(v: &Value) -> String {
    match v {
        Value::Object(_) => "{}".to_string(),
        Value::Array(items) if items.is_empty() => "<none>".to_string(),
        Value::Array(items) => items.iter().map(scalar).collect::<Vec<_>>().join(", "),
        other => scalar(other),
    }
}

fn scalar(v: &Value) -> String {
    match v {
        Value::Null => "-".to_string(),
        Value::String(s) if s.is_empty() => "\"\"".to_string(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn now() -> DateTime<Utc> {
        DateTime::parse_from_rfc3339("2025-01-01T12:00:00Z")
            .expect("time")
            .with_timezone(&Utc)
    }

    fn demo_vm() -> Value {
        json!({
            "apiVersion": "hearth.dev/v1alpha1",
            "kind": "VirtualMachine",
            "metadata": {"name": "demo", "creationTimestamp": "2025-01-01T11:55:00Z",
                         "generation": 2, "managedBy": "file:/etc/hearth/manifests/demo.yaml"},
            "spec": {"runPolicy": "AlwaysOn", "cpus": 1, "memory": "256Mi",
                     "boot": {"kernel": "/k/vmlinuz", "cmdline": "console=ttyS0"},
                     "disks": [{"virtualDiskName": "data"}], "guestAgent": true},
            "status": {"phase": "Running", "pid": 99, "agentConnected": false,
                       "conditions": [{"type": "Ready", "status": "False", "reason": "AgentNotConnected",
                                       "message": "waiting for\nqemu-ga", "lastTransitionTime": "2025-01-01T11:59:00Z"}]}
        })
    }

    #[test]
    fn describe_shows_source_spec_status_conditions_and_events() {
        let events = [
            json!({"time": "2025-01-01T11:58:00Z", "kind": "VirtualMachine", "name": "demo",
                             "type": "Normal", "reason": "Started", "message": "qemu pid 99"}),
        ];
        let text = render(Kind::VirtualMachine, &demo_vm(), Ok(&events), now());
        let expected = "\
Name:       demo
Kind:       VirtualMachine
Source:     file:/etc/hearth/manifests/demo.yaml
Created:    2025-01-01T11:55:00Z (5m ago)
Generation: 2
Firmware:   kernel
Cloud-init: no
Spec:
  runPolicy:   AlwaysOn
  cpus:        1
  memory:      256Mi
  boot:
    kernel:   /k/vmlinuz
    cmdline:  console=ttyS0
  disks:
    - virtualDiskName:  data
  guestAgent:  true
Status:
  phase:           Running
  pid:             99
  agentConnected:  false
Conditions:
  TYPE    STATUS   REASON              MESSAGE               AGE
  Ready   False    AgentNotConnected   waiting for qemu-ga   1m
Events:
  AGE   TYPE     REASON    MESSAGE
  2m    Normal   Started   qemu pid 99
";
        assert_eq!(text, expected);
    }

    #[test]
    fn describe_without_status_or_events_says_so() {
        let mut vm = demo_vm();
        if let Some(map) = vm.as_object_mut() {
            map.remove("status");
        }
        let text = render(Kind::VirtualMachine, &vm, Err("connection reset"), now());
        assert!(text.contains("Status:\n  <none yet"), "{text}");
        assert!(text.contains("Conditions:  <none>\n"), "{text}");
        assert!(
            text.contains("Events:      <unavailable: connection reset>\n"),
            "{text}"
        );
        let text = render(Kind::VirtualMachine, &vm, Ok(&[]), now());
        assert!(text.ends_with("Events:      <none>\n"), "{text}");
    }

    #[test]
    fn describe_disk_humanises_capacity_and_shows_the_source() {
        let disk = json!({
            "metadata": {"name": "data"},
            "spec": {"source": {"blank": {}}, "size": "1Gi"},
            "status": {"phase": "Ready", "capacity": 1073741824u64, "allocated": 200704,
                       "attachedTo": "demo", "chainLength": 3, "lastError": "",
                       "compaction": {"id": 4, "layers": 2, "bytesDone": 1048576, "bytesTotal": 4194304}}
        });
        let text = render(Kind::VirtualDisk, &disk, Ok(&[]), now());
        let expected = "\
Spec:
  size:  1Gi
  source:
    blank:  {}
Status:
  phase:        Ready
  capacity:     1073741824 (1.0Gi)
  allocated:    200704 (196.0Ki)
  attachedTo:   demo
  chainLength:  3
  compaction:
    id:          4
    layers:      2
    bytesDone:   1048576 (1.0Mi)
    bytesTotal:  4194304 (4.0Mi)
  lastError:    \"\"
";
        assert!(text.contains(expected), "{text}");
        assert!(text.contains("Source:     -\n"), "{text}");
    }

    #[test]
    fn only_the_last_twenty_events_are_shown() {
        let events: Vec<Value> = (0..25)
            .map(|i| json!({"time": "2025-01-01T11:00:00Z", "type": "Normal", "reason": format!("R{i}"), "message": ""}))
            .collect();
        let text = render(Kind::VirtualMachine, &demo_vm(), Ok(&events), now());
        assert!(!text.contains("   R4\n"), "{text}");
        assert!(text.contains("   R5\n"), "{text}");
        assert!(text.contains("   R24\n"), "{text}");
    }

    fn disk_snapshot() -> Value {
        json!({
            "apiVersion": "hearth.dev/v1alpha1",
            "kind": "VirtualDiskSnapshot",
            "metadata": {"name": "pre-data", "creationTimestamp": "2025-01-01T11:58:00Z",
                         "generation": 1, "managedBy": "api"},
            "spec": {"requiredConsistency": true, "virtualDiskName": "data"},
            "status": {"message": "cut with 2 other snapshots", "reason": "Taken",
                       "virtualMachineSnapshotName": "pre", "capacity": 1073741824u64,
                       "size": 1258291, "cutId": 3, "freezeWindowMs": 84,
                       "cutTime": "2025-01-01T11:58:01.5Z", "consistent": true, "phase": "Ready",
                       "frozenMountPoints": ["/data", "/mnt/vdb"], "futureField": "kept",
                       "conditions": [{"type": "Ready", "status": "True", "reason": "Taken",
                                       "message": "in cut 3", "lastTransitionTime": "2025-01-01T11:58:02Z"}]}
        })
    }

    #[test]
    fn describe_snapshot_shows_every_status_field_in_order_and_humanised() {
        let events = [
            json!({"time": "2025-01-01T11:58:01Z", "type": "Normal", "reason": "Cut",
                             "message": "cut 3: 3 snapshots, frozen 84 ms"}),
        ];
        let text = render(
            Kind::VirtualDiskSnapshot,
            &disk_snapshot(),
            Ok(&events),
            now(),
        );
        let expected = "\
Name:       pre-data
Kind:       VirtualDiskSnapshot
Source:     api
Created:    2025-01-01T11:58:00Z (2m ago)
Generation: 1
Spec:
  virtualDiskName:      data
  requiredConsistency:  true
Status:
  phase:                       Ready
  consistent:                  true
  frozenMountPoints:           /data, /mnt/vdb
  cutTime:                     2025-01-01T11:58:01.5Z (1m ago)
  freezeWindowMs:              84
  cutId:                       3
  size:                        1258291 (1.2Mi)
  capacity:                    1073741824 (1.0Gi)
  virtualMachineSnapshotName:  pre
  reason:                      Taken
  message:                     cut with 2 other snapshots
  futureField:                 kept
Conditions:
  TYPE    STATUS   REASON   MESSAGE    AGE
  Ready   True     Taken    in cut 3   1m
Events:
  AGE   TYPE     REASON   MESSAGE
  1m    Normal   Cut      cut 3: 3 snapshots, frozen 84 ms
";
        assert_eq!(text, expected);
    }

    #[test]
    fn frozen_mount_points_show_none_for_an_empty_list_and_quote_odd_paths() {
        let mut snap = disk_snapshot();
        snap["status"]["frozenMountPoints"] = json!([]);
        let text = render(Kind::VirtualDiskSnapshot, &snap, Ok(&[]), now());
        assert!(
            text.contains("\n  frozenMountPoints:           <none>\n"),
            "{text}"
        );
        snap["status"]["frozenMountPoints"] = json!(["/", "/a, /b", "/x\nphase: Fake", ""]);
        let text = render(Kind::VirtualDiskSnapshot, &snap, Ok(&[]), now());
        assert!(
            text.contains(
                "\n  frozenMountPoints:           /, \"/a, /b\", \"/x\\nphase: Fake\", \"\"\n"
            ),
            "{text}"
        );
        let phase_lines = text
            .lines()
            .filter(|l| l.trim_start().starts_with("phase:"))
            .count();
        assert_eq!(phase_lines, 1, "a mount point added a line: {text}");
        // Not frozen (offline cut): no line at all.
        snap["status"]
            .as_object_mut()
            .expect("status")
            .remove("frozenMountPoints");
        let text = render(Kind::VirtualDiskSnapshot, &snap, Ok(&[]), now());
        assert!(!text.contains("frozenMountPoints"), "{text}");
    }

    #[test]
    fn describe_vm_snapshot_lists_its_disk_snapshots_and_failure() {
        let snap = json!({
            "metadata": {"name": "pre"},
            "spec": {"virtualMachineName": "demo", "requiredConsistency": true},
            "status": {"phase": "Failed", "virtualDiskSnapshotNames": ["pre-root", "pre-data"],
                       "virtualMachineSpec": {"memory": "256Mi",
                           "disks": [{"virtualDiskName": "root"}, {"virtualDiskName": "data"}]},
                       "reason": "FreezeTimeout", "message": "the guest did not freeze within 10 s"}
        });
        let text = render(Kind::VirtualMachineSnapshot, &snap, Ok(&[]), now());
        let expected = "\
Spec:
  virtualMachineName:   demo
  requiredConsistency:  true
Status:
  phase:                     Failed
  virtualDiskSnapshotNames:  pre-root, pre-data
  virtualMachineSpec:        recorded, 2 disk(s) (`hearth get vmsnapshot NAME -o yaml` shows it)
  reason:                    FreezeTimeout
  message:                   the guest did not freeze within 10 s
Conditions:  <none>
Events:      <none>
";
        assert!(text.ends_with(expected), "{text}");
    }

    #[tokio::test]
    async fn describe_asks_for_the_snapshot_and_its_events() {
        use crate::test_server::{ScriptedServer, ok};
        let dir = tempfile::tempdir().expect("tempdir");
        let server = ScriptedServer::start(
            dir.path(),
            vec![ok(&disk_snapshot().to_string()), ok(r#"{"items": []}"#)],
        );
        let client = ApiClient::new(&server.socket);
        let args = Args {
            kind: Kind::VirtualDiskSnapshot,
            name: "pre-data".into(),
        };
        let text = describe(&client, &args, now()).await.expect("described");
        assert!(text.starts_with("Name:       pre-data\n"), "{text}");
        let seen = server.seen();
        assert_eq!(seen.len(), 2);
        assert_eq!(seen[0].path, "/v1/virtualdisksnapshots/pre-data");
        assert_eq!(
            seen[1].path,
            "/v1/events?kind=VirtualDiskSnapshot&name=pre-data&limit=20"
        );
    }

    fn debian_image() -> Value {
        let sha = "0f3a5b7c9d1e".to_string() + &"ab".repeat(26);
        json!({
            "apiVersion": "hearth.dev/v1alpha1",
            "kind": "VirtualImage",
            "metadata": {"name": "debian-12", "creationTimestamp": "2025-01-01T11:00:00Z",
                         "generation": 1, "managedBy": "api"},
            "spec": {"source": {"http": {"sha256": sha, "url": "http://127.0.0.1:8080/debian-12.qcow2"}}},
            "status": {"usedBy": ["web-root"], "path": "/var/lib/hearth/images/sha256-0f3a.qcow2",
                       "virtualSize": 2147483648u64, "size": 356515840u64, "format": "qcow2",
                       "digest": format!("sha256:{sha}"), "message": "", "attempts": 2,
                       "bytesTotal": 356515840u64, "bytesDone": 356515840u64, "progress": "100%",
                       "phase": "Ready", "observedGeneration": 1,
                       "conditions": [{"type": "Ready", "status": "True", "reason": "Imported",
                                       "message": "verified sha256", "lastTransitionTime": "2025-01-01T11:02:00Z"}]}
        })
    }

    #[test]
    fn describe_image_shows_source_import_digest_sizes_path_and_users_in_order() {
        let events = [
            json!({"time": "2025-01-01T11:01:00Z", "type": "Warning", "reason": "ImportFailed",
                   "message": "attempt 1: HttpError: 503 Service Unavailable"}),
            json!({"time": "2025-01-01T11:02:00Z", "type": "Normal", "reason": "Imported",
                   "message": "qcow2, 340.0Mi"}),
        ];
        let text = render(Kind::VirtualImage, &debian_image(), Ok(&events), now());
        let sha = "0f3a5b7c9d1e".to_string() + &"ab".repeat(26);
        let expected = format!(
            "\
Name:       debian-12
Kind:       VirtualImage
Source:     api
Created:    2025-01-01T11:00:00Z (1h ago)
Generation: 1
Spec:
  source:
    http:
      url:     http://127.0.0.1:8080/debian-12.qcow2
      sha256:  {sha}
Status:
  phase:               Ready
  progress:            100%
  bytesDone:           356515840 (340.0Mi)
  bytesTotal:          356515840 (340.0Mi)
  digest:              sha256:{sha}
  format:              qcow2
  size:                356515840 (340.0Mi)
  virtualSize:         2147483648 (2.0Gi)
  path:                /var/lib/hearth/images/sha256-0f3a.qcow2
  usedBy:              web-root
  attempts:            2
  message:             \"\"
  observedGeneration:  1
Conditions:
  TYPE    STATUS   REASON     MESSAGE           AGE
  Ready   True     Imported   verified sha256   58m
Events:
  AGE   TYPE      REASON         MESSAGE
  59m   Warning   ImportFailed   attempt 1: HttpError: 503 Service Unavailable
  58m   Normal    Imported       qcow2, 340.0Mi
"
        );
        assert_eq!(text, expected);
    }

    #[test]
    fn describe_network_shows_the_spec_then_what_the_host_has_in_order() {
        // JSON maps iterate by key; the order below is the field order.
        let net = json!({
            "metadata": {"name": "lan", "managedBy": "api", "generation": 1},
            "spec": {"subnet": "10.77.0.0/24", "mode": "NAT", "dhcp": true},
            "status": {"message": "host networking is not wired yet", "leases": 2,
                       "subnet": "10.77.0.0/24", "phase": "Pending", "observedGeneration": 1}
        });
        let text = render(Kind::VirtualNetwork, &net, Ok(&[]), now());
        let order = [
            "mode:",
            "subnet:",
            "dhcp:",
            "phase:",
            "subnet:",
            "leases:",
            "message:",
            "observedGeneration:",
        ];
        let mut at = 0;
        for key in order {
            let found = text[at..]
                .find(key)
                .unwrap_or_else(|| panic!("{key} after byte {at}:\n{text}"));
            at += found + key.len();
        }
        assert!(text.contains("Kind:       VirtualNetwork"), "{text}");
    }

    #[test]
    fn describe_a_failing_import_shows_the_rate_and_why() {
        let image = json!({
            "metadata": {"name": "alpine"},
            "spec": {"source": {"file": "/var/lib/hearth/images/alpine.raw"}},
            "status": {"phase": "Importing", "bytesPerSecond": 3145728, "bytesDone": 1048576,
                       "reason": "HttpError", "message": "attempt 1: connection reset", "attempts": 2}
        });
        let text = render(Kind::VirtualImage, &image, Ok(&[]), now());
        assert!(
            text.contains(
                "\
Spec:
  source:
    file:  /var/lib/hearth/images/alpine.raw
Status:
  phase:           Importing
  bytesDone:       1048576 (1.0Mi)
  bytesPerSecond:  3145728 (3.0Mi/s)
  attempts:        2
  reason:          HttpError
  message:         attempt 1: connection reset
"
            ),
            "{text}"
        );
    }

    #[test]
    fn describe_vm_says_firmware_and_cloud_init_and_shows_the_user_data_as_written() {
        let vm = json!({
            "metadata": {"name": "web"},
            "spec": {"firmware": "UEFI", "cpus": 2, "disks": [{"virtualDiskName": "web-root"}],
                     "cloudInit": {"userData": "#cloud-config\nruncmd:\n  - [touch, /etc/x]\n\n# \u{1b}[31mred\n",
                                   "sshAuthorizedKeys": ["ssh-ed25519 AAAA me@laptop"],
                                   "hostname": "web"}},
            "status": {"phase": "Running"}
        });
        let text = render(Kind::VirtualMachine, &vm, Ok(&[]), now());
        assert!(
            text.contains(
                "Firmware:   UEFI\nCloud-init: yes (userData, 1 SSH key, hostname web)\n"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "\
Spec:
  cpus:      2
  firmware:  UEFI
  disks:
    - virtualDiskName:  web-root
  cloudInit:
    hostname:           web
    sshAuthorizedKeys:  ssh-ed25519 AAAA me@laptop
    userData: |
      #cloud-config
      runcmd:
        - [touch, /etc/x]

      # \\u{1b}[31mred
Status:
"
            ),
            "{text}"
        );
        assert!(
            !text.contains('\u{1b}'),
            "a terminal escape got through: {text}"
        );
        let none = json!({"metadata": {"name": "a"}, "spec": {"cloudInit": {}}});
        assert!(render(Kind::VirtualMachine, &none, Ok(&[]), now()).contains("Cloud-init: yes\n"));
    }

    #[tokio::test]
    async fn describe_image_asks_for_the_image_and_its_events() {
        use crate::test_server::{ScriptedServer, ok};
        let dir = tempfile::tempdir().expect("tempdir");
        let server = ScriptedServer::start(
            dir.path(),
            vec![ok(&debian_image().to_string()), ok(r#"{"items": []}"#)],
        );
        let client = ApiClient::new(&server.socket);
        let args = Args {
            kind: Kind::VirtualImage,
            name: "debian-12".into(),
        };
        let text = describe(&client, &args, now()).await.expect("described");
        assert!(
            text.starts_with("Name:       debian-12\nKind:       VirtualImage\n"),
            "{text}"
        );
        let paths: Vec<String> = server.seen().into_iter().map(|s| s.path).collect();
        assert_eq!(
            paths,
            [
                "/v1/virtualimages/debian-12",
                "/v1/events?kind=VirtualImage&name=debian-12&limit=20"
            ]
        );
    }
}
