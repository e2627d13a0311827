//! `hearth get KIND [NAME]`: list objects or show one.

use std::io::Write;

use anyhow::Context;
use chrono::{DateTime, Utc};
use hearth_api::{Kind, WatchType};
use serde_json::{Value, json};

use crate::client::ApiClient;
use crate::follow::{Follower, RECONNECT_FOR, Update};
use crate::output::{Table, age_of, at, cell, human_bytes, str_at, time_at, u64_at};

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// Columns for people.
    #[default]
    Table,
    /// More columns.
    Wide,
    /// The server's JSON: a list as {"items": [...]}, one object as itself.
    Json,
    /// The same as YAML; can be applied again.
    Yaml,
}

#[derive(Debug, clap::Args)]
#[command(
    about = "List objects of a kind, or show one",
    after_help = "\
For images, PROGRESS is how far an import has come (100% when Ready), SIZE
the stored file and VIRTUAL-SIZE the disk size it describes; -o wide adds
the source, the digest (sha256 and its first 12 hex digits; all of it in
`hearth describe image`), the disks made from it and why an import failed.
For VMs, -o wide adds FIRMWARE (BIOS, UEFI, or kernel for a direct kernel
boot) and CLOUD-INIT (yes when spec.cloudInit is set; the user data itself
is shown only by `hearth describe vm`).

For snapshots, CONSISTENT says whether the guest was frozen (or stopped) at
the cut, CUT-TIME is when it was taken (UTC) and FREEZE-MS how long the guest
was frozen for it; -o wide adds the cut's id (snapshots of one VM taken
together share it) and, for a Failed snapshot, the reason and message.

With -w (--watch), the table is printed once, then one row per change as it
happens (kubectl style), until interrupted; --output-watch-events adds an
EVENT column (ADDED, MODIFIED, DELETED). -o json then prints one object per
line ({type, object} with --output-watch-events), -o yaml one document
per change. When hearthd restarts, the watch reconnects and goes on from the
last change it showed (a note on stderr says so); it gives up after a minute
without hearthd.

Examples:
  hearth get vms
  hearth get vms -w
  hearth get vm demo -w --output-watch-events
  hearth get vm demo -o yaml
  hearth get disks -o wide
  hearth get images
  hearth get image debian-12 -o yaml
  hearth get vms -o wide
  hearth get snapshots
  hearth get vmsnapshots -o wide"
)]
pub struct Args {
    #[arg(value_name = "KIND", value_parser = super::parse_kind, help = super::KIND_HELP)]
    pub kind: Kind,
    /// Only this object; 404 if it does not exist.
    #[arg(value_name = "NAME", value_parser = super::parse_name)]
    pub name: Option<String>,
    /// Output format.
    #[arg(short = 'o', long = "output", value_enum, default_value_t = Format::Table)]
    pub output: Format,
    /// After printing, follow the changes and print each one.
    #[arg(short = 'w', long)]
    pub watch: bool,
    /// With --watch: say what each change was (ADDED, MODIFIED, DELETED).
    #[arg(long, requires = "watch")]
    pub output_watch_events: bool,
}

pub async fn run(client: &ApiClient, args: &Args) -> anyhow::Result<()> {
    if args.watch {
        return watch(
            client,
            args,
            &mut std::io::stdout(),
            Box::new(std::io::stderr()),
        )
        .await;
    }
    get(client, args, Utc::now(), &mut std::io::stdout().lock()).await
}

/// `get -w`: what exists now, then each change, until interrupted or
/// hearthd stays away longer than [`RECONNECT_FOR`].
pub async fn watch(
    client: &ApiClient,
    args: &Args,
    out: &mut impl Write,
    notes: Box<dyn Write + Send>,
) -> anyhow::Result<()> {
    let mut path = format!("/v1/{}?watch=true", args.kind.plural());
    if let Some(name) = &args.name {
        path.push_str(&format!("&name={name}"));
    }
    let mut follower = Follower::open(client, path, RECONNECT_FOR, notes).await?;
    // The header's column widths, once a table has been printed.
    let mut widths: Option<Vec<usize>> = None;
    loop {
        let changes: Vec<(WatchType, Value)> = match follower.next().await? {
            Update::Synced { first: true, .. } => {
                let now: Vec<(WatchType, Value)> = follower
                    .informer()
                    .objects()
                    .map(|(_, o)| (WatchType::Added, o.clone()))
                    .collect();
                if now.is_empty() {
                    match &args.name {
                        Some(name) => {
                            eprintln!("{} {name:?} not found; waiting for it.", args.kind)
                        }
                        None => eprintln!("No {}s found; waiting for changes.", args.kind),
                    }
                }
                now
            }
            Update::Object { type_, object, .. } => vec![(type_, object)],
            Update::Synced { .. }
            | Update::Event { .. }
            | Update::Relisted(_)
            | Update::Lost(_) => {
                continue;
            }
        };
        if changes.is_empty() {
            continue;
        }
        write_changes(args, &changes, Utc::now(), &mut widths, out)?;
        out.flush()?;
    }
}

/// Prints changes in the chosen format; a table's header only once.
fn write_changes(
    args: &Args,
    changes: &[(WatchType, Value)],
    now: DateTime<Utc>,
    widths: &mut Option<Vec<usize>>,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    let type_name = |t: &WatchType| match t {
        WatchType::Added => "ADDED",
        WatchType::Modified => "MODIFIED",
        WatchType::Deleted => "DELETED",
        _ => "-",
    };
    let shown = |(t, o): &(WatchType, Value)| {
        if args.output_watch_events {
            json!({"type": type_name(t), "object": o})
        } else {
            o.clone()
        }
    };
    match args.output {
        Format::Json => {
            for c in changes {
                writeln!(out, "{}", serde_json::to_string(&shown(c))?)?;
            }
        }
        Format::Yaml => {
            for c in changes {
                out.write_all(b"---\n")?;
                out.write_all(serde_yaml_ng::to_string(&shown(c))?.as_bytes())?;
            }
        }
        Format::Table | Format::Wide => {
            let objects: Vec<Value> = changes.iter().map(|(_, o)| o.clone()).collect();
            let mut table = table_for(args.kind, &objects, now, args.output == Format::Wide);
            if args.output_watch_events {
                let types = changes
                    .iter()
                    .map(|(t, _)| type_name(t).to_string())
                    .collect();
                table.insert_column(0, "EVENT", types);
            }
            match widths {
                Some(w) => out.write_all(table.render_rows(w).as_bytes())?,
                None => {
                    let mut w = table.widths();
                    if args.output_watch_events {
                        // Room for the longest type, so later rows line up.
                        w[0] = w[0].max("MODIFIED".len());
                    }
                    out.write_all(table.render_with(&w).as_bytes())?;
                    *widths = Some(w);
                }
            }
        }
    }
    Ok(())
}

pub async fn get(
    client: &ApiClient,
    args: &Args,
    now: DateTime<Utc>,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    let answer = match &args.name {
        Some(name) => client.get(&super::object_path(args.kind, name)).await?,
        None => client.get(&format!("/v1/{}", args.kind.plural())).await?,
    };
    match args.output {
        Format::Json => {
            writeln!(out, "{}", serde_json::to_string_pretty(&answer)?)?;
        }
        Format::Yaml => {
            out.write_all(serde_yaml_ng::to_string(&answer)?.as_bytes())?;
        }
        Format::Table | Format::Wide => {
            let items: Vec<Value> = if args.name.is_some() {
                vec![answer]
            } else {
                answer
                    .get("items")
                    .and_then(Value::as_array)
                    .cloned()
                    .context("hearthd's list answer has no \"items\" list")?
            };
            if items.is_empty() {
                eprintln!("No {}s found.", args.kind);
                return Ok(());
            }
            let wide = args.output == Format::Wide;
            let table = table_for(args.kind, &items, now, wide);
            out.write_all(table.render().as_bytes())?;
        }
    }
    Ok(())
}

pub fn table_for(kind: Kind, items: &[Value], now: DateTime<Utc>, wide: bool) -> Table {
    match kind {
        Kind::VirtualMachine => vm_table(items, now, wide),
        Kind::VirtualDisk => disk_table(items, now, wide),
        Kind::VirtualImage => image_table(items, now, wide),
        Kind::VirtualNetwork => network_table(items, now, wide),
        Kind::VirtualDiskSnapshot
        | Kind::VirtualMachineSnapshot
        | Kind::VirtualMachineSnapshotGroup => snapshot_table(kind, items, now, wide),
        Kind::VirtualMachineSnapshotSchedule => schedule_table(items, now, wide),
        Kind::VirtualMachineBackup => backup_table(items, now, wide),
    }
}

/// `NAME VM PHASE KIND POINT WRITTEN DURATION TO AGE`; wide adds BASE
/// CHECKPOINT REASON-FULL MESSAGE.
pub fn backup_table(items: &[Value], now: DateTime<Utc>, wide: bool) -> Table {
    let mut header = vec![
        "NAME", "VM", "PHASE", "KIND", "POINT", "WRITTEN", "DURATION", "TO",
    ];
    if wide {
        header.extend(["BASE", "CHECKPOINT", "REASON-FULL", "MESSAGE"]);
    }
    header.push("AGE");
    let mut table = Table::new(&header);
    for b in items {
        let written = u64_at(b, &["status", "bytesWritten"])
            .map(human_bytes)
            .unwrap_or_else(|| "-".to_string());
        let took = u64_at(b, &["status", "durationMs"])
            .map(|ms| format!("{:.1}s", ms as f64 / 1000.0))
            .unwrap_or_else(|| "-".to_string());
        let mut row = vec![
            cell(at(b, &["metadata", "name"])),
            cell(at(b, &["spec", "virtualMachineName"])),
            cell(at(b, &["status", "phase"])),
            cell(at(b, &["status", "kind"])),
            cell(at(b, &["status", "point"])),
            written,
            took,
            cell(at(b, &["spec", "to"])),
        ];
        if wide {
            row.extend([
                cell(at(b, &["status", "base"])),
                cell(at(b, &["status", "checkpoint"])),
                cell(at(b, &["status", "reasonFull"])),
                cell(at(b, &["status", "message"])),
            ]);
        }
        row.push(age_of(b, now));
        table.push(row);
    }
    table
}

/// `NAME SCHEDULE VMS LAST-RUN RESULT NEXT-RUN SNAPSHOTS AGE`; wide adds
/// KEEP MAX-AGE SUSPEND MESSAGE.
pub fn schedule_table(items: &[Value], now: DateTime<Utc>, wide: bool) -> Table {
    let mut header = vec![
        "NAME",
        "SCHEDULE",
        "VMS",
        "LAST-RUN",
        "RESULT",
        "NEXT-RUN",
        "SNAPSHOTS",
    ];
    if wide {
        header.extend(["KEEP", "MAX-AGE", "SUSPEND", "MESSAGE"]);
    }
    header.push("AGE");
    let mut table = Table::new(&header);
    for s in items {
        let mut schedule = cell(at(s, &["spec", "schedule"]));
        if let Some(tz) = at(s, &["spec", "timeZone"]).and_then(Value::as_str) {
            schedule = format!("{schedule} ({tz})");
        }
        let vms = match at(s, &["spec", "selector", "matchLabels"]).and_then(Value::as_object) {
            Some(m) => m
                .iter()
                .map(|(k, v)| format!("{k}={}", v.as_str().unwrap_or("")))
                .collect::<Vec<_>>()
                .join(","),
            None => at(s, &["spec", "virtualMachineNames"])
                .and_then(Value::as_array)
                .map(|a| {
                    a.iter()
                        .filter_map(Value::as_str)
                        .collect::<Vec<_>>()
                        .join(",")
                })
                .unwrap_or_else(|| "-".into()),
        };
        let group = at(s, &["spec", "virtualMachineSnapshotGroupTemplate"]).is_some();
        let mut row = vec![
            cell(at(s, &["metadata", "name"])),
            schedule,
            if group { format!("{vms} (group)") } else { vms },
            cell(at(s, &["status", "lastRunTime"])),
            cell(at(s, &["status", "lastResult"])),
            cell(at(s, &["status", "nextRunTime"])),
            cell(at(s, &["status", "snapshots"])),
        ];
        if wide {
            row.extend([
                cell(at(s, &["spec", "retention", "keep"])),
                cell(at(s, &["spec", "retention", "maxAge"])),
                cell(at(s, &["spec", "suspend"])),
                cell(at(s, &["status", "message"])),
            ]);
        }
        row.push(age_of(s, now));
        table.push(row);
    }
    table
}

/// `NAME PHASE IP ACCEL AGENT PID AGE`; wide adds CPUS MEMORY POLICY FIRMWARE
/// CLOUD-INIT MANAGED-BY.
pub fn vm_table(items: &[Value], now: DateTime<Utc>, wide: bool) -> Table {
    let mut header = vec!["NAME", "PHASE", "IP", "ACCEL", "AGENT", "PID"];
    if wide {
        header.extend([
            "CPUS",
            "MEMORY",
            "POLICY",
            "FIRMWARE",
            "CLOUD-INIT",
            "MANAGED-BY",
        ]);
    }
    header.push("AGE");
    let mut table = Table::new(&header);
    for vm in items {
        let agent = at(vm, &["status", "agentConnected"]).and_then(Value::as_bool);
        let mut row = vec![
            cell(at(vm, &["metadata", "name"])),
            cell(at(vm, &["status", "phase"])),
            first_ip(vm).map_or_else(|| "-".to_string(), |(_, ip)| ip.to_string()),
            cell(at(vm, &["status", "accelerator"])),
            if agent == Some(true) { "yes" } else { "no" }.to_string(),
            cell(at(vm, &["status", "pid"])),
        ];
        if wide {
            row.extend([
                cell(at(vm, &["spec", "cpus"])),
                cell(at(vm, &["spec", "memory"])),
                cell(at(vm, &["spec", "runPolicy"])),
                firmware_of(vm),
                cloud_init_of(vm).to_string(),
                cell(at(vm, &["metadata", "managedBy"])),
            ]);
        }
        row.push(age_of(vm, now));
        table.push(row);
    }
    table
}

/// `NAME PHASE SIZE ALLOCATED ATTACHED AGE`; wide adds CHAIN (layers the
/// disk reads through) SOURCE PATH MANAGED-BY.
pub fn disk_table(items: &[Value], now: DateTime<Utc>, wide: bool) -> Table {
    let mut header = vec!["NAME", "PHASE", "SIZE", "ALLOCATED", "ATTACHED"];
    if wide {
        header.extend(["CHAIN", "SOURCE", "PATH", "MANAGED-BY"]);
    }
    header.push("AGE");
    let mut table = Table::new(&header);
    for disk in items {
        // The real capacity once the disk exists; until then what was asked for.
        let size = u64_at(disk, &["status", "capacity"])
            .map(human_bytes)
            .or_else(|| str_at(disk, &["spec", "size"]).map(str::to_string))
            .unwrap_or_else(|| "-".to_string());
        let allocated = u64_at(disk, &["status", "allocated"])
            .map(human_bytes)
            .unwrap_or_else(|| "-".to_string());
        let mut row = vec![
            cell(at(disk, &["metadata", "name"])),
            cell(at(disk, &["status", "phase"])),
            size,
            allocated,
            cell(at(disk, &["status", "attachedTo"])),
        ];
        if wide {
            row.extend([
                u64_at(disk, &["status", "chainLength"])
                    .map(|n| n.to_string())
                    .unwrap_or_else(|| "-".to_string()),
                disk_source(disk),
                cell(at(disk, &["status", "path"])),
                cell(at(disk, &["metadata", "managedBy"])),
            ]);
        }
        row.push(age_of(disk, now));
        table.push(row);
    }
    table
}

/// `NAME PHASE PROGRESS FORMAT SIZE VIRTUAL-SIZE AGE`; wide adds SOURCE DIGEST
/// USED-BY REASON.
pub fn image_table(items: &[Value], now: DateTime<Utc>, wide: bool) -> Table {
    let mut header = vec![
        "NAME",
        "PHASE",
        "PROGRESS",
        "FORMAT",
        "SIZE",
        "VIRTUAL-SIZE",
    ];
    if wide {
        header.extend(["SOURCE", "DIGEST", "USED-BY", "REASON"]);
    }
    header.push("AGE");
    let mut table = Table::new(&header);
    let bytes = |v: &Value, f: &str| {
        u64_at(v, &["status", f])
            .map(human_bytes)
            .unwrap_or_else(|| "-".to_string())
    };
    for image in items {
        let mut row = vec![
            cell(at(image, &["metadata", "name"])),
            cell(at(image, &["status", "phase"])),
            image_progress(image),
            cell(at(image, &["status", "format"])),
            bytes(image, "size"),
            bytes(image, "virtualSize"),
        ];
        if wide {
            let used_by = at(image, &["status", "usedBy"])
                .and_then(Value::as_array)
                .map(|a| {
                    a.iter()
                        .filter_map(Value::as_str)
                        .collect::<Vec<_>>()
                        .join(",")
                })
                .filter(|s| !s.is_empty())
                .unwrap_or_else(|| "-".to_string());
            row.extend([
                image_source(image),
                str_at(image, &["status", "digest"])
                    .map(short_digest)
                    .unwrap_or_else(|| "-".to_string()),
                used_by,
                cell(at(image, &["status", "reason"])),
            ]);
        }
        row.push(age_of(image, now));
        table.push(row);
    }
    table
}

/// `NAME MODE SUBNET GATEWAY BRIDGE LEASES PHASE AGE`; wide adds DHCP
/// MESSAGE MANAGED-BY. SUBNET is the one in use (status), else the one asked
/// for; BRIDGE is the host interface (status), else the one named in spec.
pub fn network_table(items: &[Value], now: DateTime<Utc>, wide: bool) -> Table {
    let mut header = vec![
        "NAME", "MODE", "SUBNET", "GATEWAY", "BRIDGE", "LEASES", "PHASE",
    ];
    if wide {
        header.extend(["DHCP", "MESSAGE", "MANAGED-BY"]);
    }
    header.push("AGE");
    let mut table = Table::new(&header);
    for net in items {
        let either = |status: &str, spec: &str| {
            str_at(net, &["status", status])
                .or_else(|| str_at(net, &["spec", spec]))
                .unwrap_or("-")
                .to_string()
        };
        let mode = str_at(net, &["spec", "mode"]).unwrap_or("NAT").to_string();
        let mut row = vec![
            cell(at(net, &["metadata", "name"])),
            mode.clone(),
            either("subnet", "subnet"),
            cell(at(net, &["status", "gateway"])),
            either("bridge", "bridge"),
            u64_at(net, &["status", "leases"]).unwrap_or(0).to_string(),
            cell(at(net, &["status", "phase"])),
        ];
        if wide {
            let dhcp = mode != "Bridge"
                && at(net, &["spec", "dhcp"]).and_then(Value::as_bool) != Some(false);
            row.extend([
                if dhcp { "yes" } else { "no" }.to_string(),
                cell(at(net, &["status", "message"])),
                cell(at(net, &["metadata", "managedBy"])),
            ]);
        }
        row.push(age_of(net, now));
        table.push(row);
    }
    table
}

/// `status.progress` as hearthd wrote it; while importing without one, the
/// share of `bytesDone` in `bytesTotal`, or the bytes so far.
fn image_progress(image: &Value) -> String {
    if let Some(p) = str_at(image, &["status", "progress"]) {
        return p.to_string();
    }
    if str_at(image, &["status", "phase"]) != Some("Importing") {
        return "-".to_string();
    }
    match (
        u64_at(image, &["status", "bytesDone"]),
        u64_at(image, &["status", "bytesTotal"]).filter(|t| *t > 0),
    ) {
        (Some(done), Some(total)) => {
            format!("{}%", (u128::from(done) * 100 / u128::from(total)).min(100))
        }
        (Some(done), None) => human_bytes(done),
        _ => "-".to_string(),
    }
}

/// The URL of an http source, the path of a file source, the reference,
/// layout or archive of an OCI source.
fn image_source(image: &Value) -> String {
    str_at(image, &["spec", "source", "http", "url"])
        .or_else(|| str_at(image, &["spec", "source", "file"]))
        .or_else(|| str_at(image, &["spec", "source", "oci", "reference"]))
        .or_else(|| str_at(image, &["spec", "source", "oci", "layout"]))
        .or_else(|| str_at(image, &["spec", "source", "oci", "archive"]))
        .map(str::to_string)
        .or_else(|| {
            // A source kind this CLI does not know yet: its name.
            at(image, &["spec", "source"])
                .and_then(Value::as_object)
                .and_then(|m| m.keys().next().cloned())
        })
        .unwrap_or_else(|| "-".to_string())
}

/// `sha256:` and the first 12 hex digits, as `docker images` shows them: enough
/// to tell images apart and to compare with `sha256sum`; describe and
/// `-o yaml` show all 64.
pub fn short_digest(digest: &str) -> String {
    match digest.split_once(':') {
        Some((algo, hex)) if hex.len() > 12 && hex.is_ascii() => format!("{algo}:{}", &hex[..12]),
        _ => digest.to_string(),
    }
}

/// The first address in a VM's `status.interfaces` and its index there: the
/// IP column, and where `hearth ssh` connects. Interfaces without one (not
/// leased or not seen yet) are skipped.
pub fn first_ip(vm: &Value) -> Option<(usize, &str)> {
    at(vm, &["status", "interfaces"])?
        .as_array()?
        .iter()
        .enumerate()
        .find_map(|(i, nic)| {
            str_at(nic, &["ipAddress"])
                .filter(|ip| !ip.is_empty())
                .map(|ip| (i, ip))
        })
}

/// The FIRMWARE cell of a VM: `BIOS`, `UEFI`, or `kernel` for a direct
/// kernel boot (`kernel+UEFI` when OVMF runs it).
pub fn firmware_of(vm: &Value) -> String {
    let firmware = str_at(vm, &["spec", "firmware"]).unwrap_or("BIOS");
    let kernel = at(vm, &["spec", "boot", "kernel"]).is_some_and(|k| !k.is_null());
    match (kernel, firmware) {
        (true, "BIOS") => "kernel".to_string(),
        (true, other) => format!("kernel+{other}"),
        (false, other) => other.to_string(),
    }
}

/// The CLOUD-INIT cell: `yes` when the VM has a cloud-init seed, else `no`.
/// The user data itself never goes in a table (it may hold secrets); see
/// `hearth describe vm`.
pub fn cloud_init_of(vm: &Value) -> &'static str {
    match at(vm, &["spec", "cloudInit"]) {
        Some(Value::Object(_)) => "yes",
        _ => "no",
    }
}

/// `NAME DISK|VM PHASE CONSISTENT CUT-TIME FREEZE-MS SIZE AGE`; wide adds
/// CUT REASON MESSAGE (and VMSNAPSHOT for disk snapshots taken by one).
pub fn snapshot_table(kind: Kind, items: &[Value], now: DateTime<Utc>, wide: bool) -> Table {
    let vm = kind != Kind::VirtualDiskSnapshot;
    let (source_header, source_field) = if kind == Kind::VirtualMachineSnapshotGroup {
        ("VMS", "virtualMachineNames")
    } else if vm {
        ("VM", "virtualMachineName")
    } else {
        ("DISK", "virtualDiskName")
    };
    let mut header = vec![
        "NAME",
        source_header,
        "PHASE",
        "CONSISTENT",
        "CUT-TIME",
        "FREEZE-MS",
        "SIZE",
    ];
    if wide {
        header.push("CUT");
        if !vm {
            header.push("VMSNAPSHOT");
        }
        header.extend(["REASON", "MESSAGE"]);
    }
    header.push("AGE");
    let mut table = Table::new(&header);
    for snap in items {
        let consistent = match at(snap, &["status", "consistent"]).and_then(Value::as_bool) {
            Some(true) => "true",
            Some(false) => "false",
            None => "-",
        };
        let cut_time = time_at(snap, &["status", "cutTime"])
            .map(|t| t.format("%Y-%m-%dT%H:%M:%SZ").to_string())
            .unwrap_or_else(|| "-".to_string());
        let size = u64_at(snap, &["status", "size"])
            .map(human_bytes)
            .unwrap_or_else(|| "-".to_string());
        let source = if kind == Kind::VirtualMachineSnapshotGroup {
            at(snap, &["spec", "virtualMachineNames"])
                .and_then(Value::as_array)
                .map(|vms| {
                    vms.iter()
                        .filter_map(Value::as_str)
                        .collect::<Vec<_>>()
                        .join(",")
                })
                .unwrap_or_else(|| "-".to_string())
        } else {
            cell(at(snap, &["spec", source_field]))
        };
        let mut row = vec![
            cell(at(snap, &["metadata", "name"])),
            source,
            cell(at(snap, &["status", "phase"])),
            consistent.to_string(),
            cut_time,
            cell(at(snap, &["status", "freezeWindowMs"])),
            size,
        ];
        if wide {
            row.push(cell(at(snap, &["status", "cutId"])));
            if !vm {
                row.push(cell(at(snap, &["status", "virtualMachineSnapshotName"])));
            }
            row.extend([
                cell(at(snap, &["status", "reason"])),
                cell(at(snap, &["status", "message"])),
            ]);
        }
        row.push(age_of(snap, now));
        table.push(row);
    }
    table
}

/// `blank`, `image:/path/base.qcow2`, `snapshot:NAME`, ...
fn disk_source(disk: &Value) -> String {
    match at(disk, &["spec", "source"]).and_then(Value::as_object) {
        Some(map) => map
            .iter()
            .map(|(k, v)| match v {
                Value::String(s) => format!("{k}:{s}"),
                _ => k.clone(),
            })
            .collect::<Vec<_>>()
            .join(","),
        None => "-".to_string(),
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

    #[test]
    fn vm_table_shows_phase_ip_accelerator_agent_pid_and_age() {
        let items = [
            json!({"metadata": {"name": "demo", "creationTimestamp": "2025-01-01T11:57:00Z"},
                   "spec": {"cpus": 2, "memory": "512Mi", "runPolicy": "Manual"},
                   "status": {"phase": "Running", "accelerator": "kvm", "agentConnected": true, "pid": 4242,
                              "interfaces": [{"network": "lan", "mac": "52:54:00:00:00:01"},
                                             {"network": "wan", "mac": "52:54:00:00:00:02", "ipAddress": "10.77.0.23"},
                                             {"network": "lab", "mac": "52:54:00:00:00:03", "ipAddress": "10.88.0.5"}]}}),
            json!({"metadata": {"name": "new", "creationTimestamp": "2025-01-01T11:59:55Z"},
                   "spec": {}}),
        ];
        assert_eq!(
            vm_table(&items, now(), false).render(),
            "\
NAME   PHASE     IP           ACCEL   AGENT   PID    AGE
demo   Running   10.77.0.23   kvm     yes     4242   3m
new    -         -            -       no      -      5s
"
        );
        let wide = vm_table(&items, now(), true).render();
        assert!(
            wide.starts_with("NAME   PHASE     IP           ACCEL   AGENT   PID    CPUS   MEMORY   POLICY   FIRMWARE   CLOUD-INIT   MANAGED-BY   AGE\n"),
            "{wide}"
        );
        assert!(
            wide.contains("2      512Mi    Manual   BIOS       no           -            3m"),
            "{wide}"
        );
    }

    #[test]
    fn wide_vm_table_shows_firmware_and_cloud_init_but_never_the_user_data() {
        let vm = |spec: Value| json!({"metadata": {"name": "v"}, "spec": spec});
        let items = [
            vm(
                json!({"firmware": "UEFI", "cloudInit": {"userData": "#cloud-config\npassword: hunter2\n"}}),
            ),
            vm(json!({"firmware": "BIOS", "boot": {"kernel": "/k/vmlinuz"}})),
            vm(json!({"firmware": "UEFI", "boot": {"kernel": "/k/vmlinuz"}, "cloudInit": {}})),
            vm(json!({})),
        ];
        assert_eq!(
            items.iter().map(firmware_of).collect::<Vec<_>>(),
            ["UEFI", "kernel", "kernel+UEFI", "BIOS"]
        );
        assert_eq!(
            items.iter().map(cloud_init_of).collect::<Vec<_>>(),
            ["yes", "no", "yes", "no"]
        );
        let wide = vm_table(&items, now(), true).render();
        assert!(!wide.contains("hunter2"), "{wide}");
        assert!(!wide.contains("cloud-config"), "{wide}");
        assert!(
            wide.lines()
                .nth(1)
                .is_some_and(|l| l.contains("   UEFI          yes          -")),
            "{wide}"
        );
    }

    #[test]
    fn network_table_shows_mode_subnet_gateway_bridge_and_leases() {
        let items = [
            json!({"metadata": {"name": "lan", "creationTimestamp": "2025-01-01T11:00:00Z"},
                   "spec": {"mode": "NAT"},
                   "status": {"phase": "Ready", "subnet": "10.77.0.0/24", "gateway": "10.77.0.1",
                              "bridge": "hth-lan", "leases": 2}}),
            json!({"metadata": {"name": "lab", "creationTimestamp": "2025-01-01T11:59:30Z"},
                   "spec": {"mode": "Bridge", "bridge": "br0"},
                   "status": {"phase": "Pending", "message": "host networking is not wired yet"}}),
            json!({"metadata": {"name": "new"}, "spec": {"subnet": "10.9.0.0/16", "dhcp": false}}),
        ];
        assert_eq!(
            table_for(Kind::VirtualNetwork, &items, now(), false).render(),
            "\
NAME   MODE     SUBNET         GATEWAY     BRIDGE    LEASES   PHASE     AGE
lan    NAT      10.77.0.0/24   10.77.0.1   hth-lan   2        Ready     1h
lab    Bridge   -              -           br0       0        Pending   30s
new    NAT      10.9.0.0/16    -           -         0        -         -
"
        );
        let wide = table_for(Kind::VirtualNetwork, &items, now(), true).render();
        let lines: Vec<&str> = wide.lines().collect();
        assert!(
            lines[0].contains("DHCP") && lines[0].contains("MESSAGE"),
            "{wide}"
        );
        assert!(lines[1].contains(" yes "), "{wide}");
        assert!(
            lines[2].contains(" no ") && lines[2].contains("host networking is not wired yet"),
            "{wide}"
        );
        assert!(lines[3].contains(" no "), "{wide}");
    }

    fn images() -> [Value; 4] {
        let sha = "0f3a5b7c9d1e".to_string() + &"ab".repeat(26);
        [
            json!({"metadata": {"name": "debian-12", "creationTimestamp": "2025-01-01T11:00:00Z"},
                   "spec": {"source": {"http": {"url": "http://127.0.0.1:8080/debian-12.qcow2", "sha256": sha}}},
                   "status": {"phase": "Ready", "progress": "100%", "format": "qcow2",
                              "size": 356515840u64, "virtualSize": 2147483648u64,
                              "digest": format!("sha256:{sha}"), "usedBy": ["web-root", "db-root"]}}),
            json!({"metadata": {"name": "alpine", "creationTimestamp": "2025-01-01T11:59:30Z"},
                   "spec": {"source": {"http": {"url": "http://127.0.0.1:8080/alpine.img", "sha256": sha}}},
                   "status": {"phase": "Importing", "progress": "42%", "bytesDone": 44040192u64,
                              "bytesTotal": 104857600u64}}),
            json!({"metadata": {"name": "local", "creationTimestamp": "2025-01-01T11:59:00Z"},
                   "spec": {"source": {"file": "/var/lib/hearth/images/local.raw"}},
                   "status": {"phase": "Failed", "reason": "NotAnImage", "message": "qemu-img: unknown format",
                              "attempts": 2}}),
            json!({"metadata": {"name": "new"},
                   "spec": {"source": {"http": {"url": "http://127.0.0.1:8080/new.qcow2", "sha256": sha}}},
                   "status": {"phase": "Importing", "bytesDone": 1048576}}),
        ]
    }

    #[test]
    fn image_table_shows_phase_progress_format_and_sizes() {
        assert_eq!(
            table_for(Kind::VirtualImage, &images(), now(), false).render(),
            "\
NAME        PHASE       PROGRESS   FORMAT   SIZE      VIRTUAL-SIZE   AGE
debian-12   Ready       100%       qcow2    340.0Mi   2.0Gi          1h
alpine      Importing   42%        -        -         -              30s
local       Failed      -          -        -         -              1m
new         Importing   1.0Mi      -        -         -              -
"
        );
    }

    #[test]
    fn wide_image_table_adds_source_short_digest_users_and_reason() {
        let wide = image_table(&images(), now(), true).render();
        let lines: Vec<&str> = wide.lines().collect();
        assert!(
            lines[0].ends_with(
                "VIRTUAL-SIZE   SOURCE                                  DIGEST                USED-BY            REASON       AGE"
            ),
            "{wide}"
        );
        assert!(
            lines[1].ends_with(
                "http://127.0.0.1:8080/debian-12.qcow2   sha256:0f3a5b7c9d1e   web-root,db-root   -            1h"
            ),
            "{wide}"
        );
        assert!(
            lines[3].ends_with(
                "/var/lib/hearth/images/local.raw        -                     -                  NotAnImage   1m"
            ),
            "{wide}"
        );
        assert_eq!(short_digest("sha256:abc"), "sha256:abc");
        assert_eq!(short_digest("odd"), "odd");
        assert_eq!(
            image_source(
                &json!({"spec": {"source": {"oci": {"reference": "127.0.0.1:5000/d:12"}}}})
            ),
            "127.0.0.1:5000/d:12"
        );
        assert_eq!(
            image_source(
                &json!({"spec": {"source": {"oci": {"layout": "/srv/oci/d", "tag": "12"}}}})
            ),
            "/srv/oci/d"
        );
        // A source kind this CLI does not know: its name.
        assert_eq!(
            image_source(&json!({"spec": {"source": {"nbd": {"url": "x"}}}})),
            "nbd"
        );
    }

    #[test]
    fn disk_table_humanises_sizes() {
        let items = [
            json!({"metadata": {"name": "data", "creationTimestamp": "2024-12-28T12:00:00Z"},
                   "spec": {"size": "1Gi", "source": {"blank": {}}},
                   "status": {"phase": "Ready", "capacity": 1073741824u64, "allocated": 12897485, "attachedTo": "demo", "chainLength": 3}}),
            json!({"metadata": {"name": "root"},
                   "spec": {"size": "2Gi", "source": {"image": "/img/base.qcow2"}}}),
        ];
        assert_eq!(
            disk_table(&items, now(), false).render(),
            "\
NAME   PHASE   SIZE    ALLOCATED   ATTACHED   AGE
data   Ready   1.0Gi   12.3Mi      demo       4d
root   -       2Gi     -           -          -
"
        );
        let wide = disk_table(&items, now(), true).render();
        assert!(wide.contains("image:/img/base.qcow2"), "{wide}");
        assert!(wide.contains("   blank   "), "{wide}");
        assert!(wide.contains(" CHAIN "), "{wide}");
        assert!(wide.contains("   demo       3     "), "{wide}");
    }

    fn snapshots() -> [Value; 3] {
        [
            json!({"metadata": {"name": "data-20250101-115800", "creationTimestamp": "2025-01-01T11:58:00Z"},
                   "spec": {"virtualDiskName": "data", "requiredConsistency": true},
                   "status": {"phase": "Ready", "consistent": true, "cutTime": "2025-01-01T11:58:01.123456Z",
                              "freezeWindowMs": 84, "cutId": 3, "size": 1258291, "capacity": 1073741824u64,
                              "virtualMachineSnapshotName": "pre"}}),
            json!({"metadata": {"name": "scratch-1", "creationTimestamp": "2025-01-01T11:59:50Z"},
                   "spec": {"virtualDiskName": "scratch", "requiredConsistency": true},
                   "status": {"phase": "Failed", "reason": "AgentUnavailable",
                              "message": "the guest agent is not connected"}}),
            json!({"metadata": {"name": "new"}, "spec": {"virtualDiskName": "data"}}),
        ]
    }

    #[test]
    fn snapshot_table_shows_phase_consistency_cut_time_freeze_window_and_size() {
        assert_eq!(
            snapshot_table(Kind::VirtualDiskSnapshot, &snapshots(), now(), false).render(),
            "\
NAME                   DISK      PHASE    CONSISTENT   CUT-TIME               FREEZE-MS   SIZE    AGE
data-20250101-115800   data      Ready    true         2025-01-01T11:58:01Z   84          1.2Mi   2m
scratch-1              scratch   Failed   -            -                      -           -       10s
new                    data      -        -            -                      -           -       -
"
        );
    }

    #[test]
    fn wide_snapshot_table_adds_the_cut_owner_and_why_it_failed() {
        let wide = snapshot_table(Kind::VirtualDiskSnapshot, &snapshots(), now(), true).render();
        let lines: Vec<&str> = wide.lines().collect();
        assert!(
            lines[0].ends_with("SIZE    CUT   VMSNAPSHOT   REASON             MESSAGE                            AGE"),
            "{wide}"
        );
        assert!(lines[1].ends_with("1.2Mi   3     pre          -                  -                                  2m"), "{wide}");
        assert!(
            lines[2].ends_with("-       -     -            AgentUnavailable   the guest agent is not connected   10s"),
            "{wide}"
        );
    }

    #[test]
    fn group_table_names_its_vms() {
        let items = [json!({
            "metadata": {"name": "pair", "creationTimestamp": "2025-01-01T08:00:00Z"},
            "spec": {"virtualMachineNames": ["app", "db"], "requiredConsistency": true},
            "status": {"phase": "Ready", "consistent": true, "cutTime": "2025-01-01T08:00:02Z",
                       "freezeWindowMs": 268, "size": 2202009,
                       "virtualMachineSnapshotNames": ["pair-app", "pair-db"]}})];
        assert_eq!(
            table_for(Kind::VirtualMachineSnapshotGroup, &items, now(), false).render(),
            "\
NAME   VMS      PHASE   CONSISTENT   CUT-TIME               FREEZE-MS   SIZE    AGE
pair   app,db   Ready   true         2025-01-01T08:00:02Z   268         2.1Mi   4h
"
        );
    }

    #[test]
    fn schedule_table_shows_the_calendar_the_vms_and_the_last_run() {
        let items = [json!({
            "metadata": {"name": "nightly", "creationTimestamp": "2025-01-01T08:00:00Z"},
            "spec": {"schedule": "30 2 * * *", "timeZone": "Europe/Berlin",
                     "virtualMachineNames": ["app", "db"], "retention": {"keep": 7}},
            "status": {"lastRunTime": "2025-01-01T01:30:00Z", "lastResult": "Succeeded",
                       "nextRunTime": "2025-01-02T01:30:00Z", "snapshots": 2}})];
        assert_eq!(
            table_for(Kind::VirtualMachineSnapshotSchedule, &items, now(), false).render(),
            "\
NAME      SCHEDULE                     VMS      LAST-RUN               RESULT      NEXT-RUN               SNAPSHOTS   AGE
nightly   30 2 * * * (Europe/Berlin)   app,db   2025-01-01T01:30:00Z   Succeeded   2025-01-02T01:30:00Z   2           4h
"
        );
    }

    #[test]
    fn vm_snapshot_table_names_the_vm() {
        let items = [json!({
            "metadata": {"name": "pre", "creationTimestamp": "2025-01-01T08:00:00Z"},
            "spec": {"virtualMachineName": "demo", "requiredConsistency": false},
            "status": {"phase": "Ready", "consistent": false, "cutTime": "2025-01-01T08:00:02Z",
                       "cutId": 9, "virtualDiskSnapshotNames": ["pre-root", "pre-data"],
                       "reason": "NoGuestAgent", "message": "spec.guestAgent is false"}})];
        assert_eq!(
            table_for(Kind::VirtualMachineSnapshot, &items, now(), false).render(),
            "\
NAME   VM     PHASE   CONSISTENT   CUT-TIME               FREEZE-MS   SIZE   AGE
pre    demo   Ready   false        2025-01-01T08:00:02Z   -           -      4h
"
        );
        let wide = table_for(Kind::VirtualMachineSnapshot, &items, now(), true).render();
        assert!(
            wide.starts_with("NAME   VM     PHASE   CONSISTENT   CUT-TIME               FREEZE-MS   SIZE   CUT   REASON         MESSAGE                    AGE\n"),
            "{wide}"
        );
        assert!(
            wide.contains("   9     NoGuestAgent   spec.guestAgent is false   4h\n"),
            "{wide}"
        );
    }

    /// What the follower notes on stderr, kept for the test.
    #[derive(Clone, Default)]
    struct Notes(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

    impl Write for Notes {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            if let Ok(mut v) = self.0.lock() {
                v.extend_from_slice(buf);
            }
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl Notes {
        fn text(&self) -> String {
            self.0
                .lock()
                .map(|v| String::from_utf8_lossy(&v).into_owned())
                .unwrap_or_default()
        }
    }

    #[tokio::test]
    async fn get_watch_prints_the_table_then_a_row_per_change_across_a_reconnect() {
        use crate::test_server::{ScriptedServer, ok};
        let dir = tempfile::tempdir().expect("tempdir");
        let vm = |seq: u64, type_: &str, name: &str, phase: &str| {
            json!({"seq": seq, "type": type_, "kind": "VirtualMachine", "name": name,
                   "object": {"metadata": {"name": name}, "spec": {}, "status": {"phase": phase}}})
        };
        let body =
            |lines: Vec<Value>| ok(&lines.iter().map(|l| format!("{l}\n")).collect::<String>());
        let server = ScriptedServer::routes(
            dir.path(),
            vec![
                (
                    "GET",
                    "/v1/virtualmachines?watch=true",
                    vec![body(vec![
                        vm(3, "ADDED", "a", "Pending"),
                        vm(3, "ADDED", "b", "Stopped"),
                        json!({"seq": 3, "type": "BOOKMARK"}),
                        vm(4, "MODIFIED", "a", "Running"),
                    ])],
                ),
                (
                    "GET",
                    "/v1/virtualmachines?watch=true&since=4",
                    vec![body(vec![
                        vm(5, "DELETED", "b", "Stopped"),
                        json!({"seq": 5, "type": "BOOKMARK"}),
                    ])],
                ),
            ],
        );
        let args = Args {
            kind: Kind::VirtualMachine,
            name: None,
            output: Format::Table,
            watch: true,
            output_watch_events: true,
        };
        let notes = Notes::default();
        let mut out = Vec::new();
        let err = watch(
            &ApiClient::new(&server.socket),
            &args,
            &mut out,
            Box::new(notes.clone()),
        )
        .await
        .expect_err("ends when hearthd cannot be reached again");
        assert_eq!(
            String::from_utf8(out).expect("utf-8"),
            "\
EVENT      NAME   PHASE     IP   ACCEL   AGENT   PID   AGE
ADDED      a      Pending   -    -       no      -     -
ADDED      b      Stopped   -    -       no      -     -
MODIFIED   a      Running   -    -       no      -     -
DELETED    b      Stopped   -    -       no      -     -
"
        );
        let notes = notes.text();
        assert!(notes.contains("reconnecting from seq 4"), "{notes}");
        assert!(notes.contains("reconnected to hearthd"), "{notes}");
        assert!(notes.contains("reconnecting from seq 5"), "{notes}");
        // The third connection got a 404: not hearthd any more, no retry.
        assert!(err.to_string().contains("could not reconnect"), "{err}");
        assert_eq!(server.seen().len(), 3);
    }

    #[tokio::test]
    async fn get_image_as_yaml_or_json_is_the_servers_object() {
        use crate::test_server::{ScriptedServer, ok};
        let dir = tempfile::tempdir().expect("tempdir");
        let image = images()[0].clone();
        let server = ScriptedServer::start(dir.path(), vec![ok(&image.to_string())]);
        let client = ApiClient::new(&server.socket);
        let mut args = Args {
            kind: Kind::VirtualImage,
            name: Some("debian-12".into()),
            output: Format::Yaml,
            watch: false,
            output_watch_events: false,
        };
        let mut out = Vec::new();
        get(&client, &args, now(), &mut out).await.expect("yaml");
        let back: Value = serde_yaml_ng::from_slice(&out).expect("the YAML reads back");
        assert_eq!(back, image);
        args.output = Format::Json;
        let mut out = Vec::new();
        get(&client, &args, now(), &mut out).await.expect("json");
        let back: Value = serde_json::from_slice(&out).expect("the JSON reads back");
        assert_eq!(back, image);
        assert!(
            server
                .seen()
                .iter()
                .all(|s| s.path == "/v1/virtualimages/debian-12")
        );
        // The full digest is there, not the table's short one.
        assert!(String::from_utf8_lossy(&out).contains(&"ab".repeat(26)));
    }
}
