//! `hearth get KIND [NAME]`: list objects or show one.

use std::io::Write;

use anyhow::Context;
use chrono::{DateTime, Utc};
use hearth_api::Kind;
use serde_json::Value;

use crate::client::ApiClient;
use crate::output::{Table, age_of, at, cell, human_bytes, str_at, u64_at};

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
Examples:
  hearth get vms
  hearth get vm demo -o yaml
  hearth get disks -o wide"
)]
pub struct Args {
    /// vm or disk (vms, disks, virtualmachine, VirtualDisk... also work).
    #[arg(value_name = "KIND", value_parser = super::parse_kind)]
    pub kind: Kind,
    /// Only this object; 404 if it does not exist.
    #[arg(value_name = "NAME", value_parser = super::parse_name)]
    pub name: Option<String>,
    /// Output format.
    #[arg(short = 'o', long = "output", value_enum, default_value_t = Format::Table)]
    pub output: Format,
}

pub async fn run(client: &ApiClient, args: &Args) -> anyhow::Result<()> {
    let answer = match &args.name {
        Some(name) => client.get(&super::object_path(args.kind, name)).await?,
        None => client.get(&format!("/v1/{}", args.kind.plural())).await?,
    };
    let mut out = std::io::stdout().lock();
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
            let table = table_for(args.kind, &items, Utc::now(), wide);
            out.write_all(table.render().as_bytes())?;
        }
    }
    Ok(())
}

pub fn table_for(kind: Kind, items: &[Value], now: DateTime<Utc>, wide: bool) -> Table {
    match kind {
        Kind::VirtualMachine => vm_table(items, now, wide),
        Kind::VirtualDisk => disk_table(items, now, wide),
        Kind::VirtualDiskSnapshot | Kind::VirtualMachineSnapshot => {
            snapshot_table(kind, items, now, wide)
        }
    }
}

/// `NAME PHASE ACCEL AGENT PID AGE`; wide adds CPUS MEMORY POLICY MANAGED-BY.
pub fn vm_table(items: &[Value], now: DateTime<Utc>, wide: bool) -> Table {
    let mut header = vec!["NAME", "PHASE", "ACCEL", "AGENT", "PID"];
    if wide {
        header.extend(["CPUS", "MEMORY", "POLICY", "MANAGED-BY"]);
    }
    header.push("AGE");
    let mut table = Table::new(&header);
    for vm in items {
        let agent = at(vm, &["status", "agentConnected"]).and_then(Value::as_bool);
        let mut row = vec![
            cell(at(vm, &["metadata", "name"])),
            cell(at(vm, &["status", "phase"])),
            cell(at(vm, &["status", "accelerator"])),
            if agent == Some(true) { "yes" } else { "no" }.to_string(),
            cell(at(vm, &["status", "pid"])),
        ];
        if wide {
            row.extend([
                cell(at(vm, &["spec", "cpus"])),
                cell(at(vm, &["spec", "memory"])),
                cell(at(vm, &["spec", "runPolicy"])),
                cell(at(vm, &["metadata", "managedBy"])),
            ]);
        }
        row.push(age_of(vm, now));
        table.push(row);
    }
    table
}

/// `NAME PHASE SIZE ALLOCATED ATTACHED AGE`; wide adds SOURCE PATH MANAGED-BY.
pub fn disk_table(items: &[Value], now: DateTime<Utc>, wide: bool) -> Table {
    let mut header = vec!["NAME", "PHASE", "SIZE", "ALLOCATED", "ATTACHED"];
    if wide {
        header.extend(["SOURCE", "PATH", "MANAGED-BY"]);
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
    fn vm_table_shows_phase_accelerator_agent_pid_and_age() {
        let items = [
            json!({"metadata": {"name": "demo", "creationTimestamp": "2025-01-01T11:57:00Z"},
                   "spec": {"cpus": 2, "memory": "512Mi", "runPolicy": "Manual"},
                   "status": {"phase": "Running", "accelerator": "kvm", "agentConnected": true, "pid": 4242}}),
            json!({"metadata": {"name": "new", "creationTimestamp": "2025-01-01T11:59:55Z"},
                   "spec": {}}),
        ];
        assert_eq!(
            vm_table(&items, now(), false).render(),
            "\
NAME   PHASE     ACCEL   AGENT   PID    AGE
demo   Running   kvm     yes     4242   3m
new    -         -       no      -      5s
"
        );
        let wide = vm_table(&items, now(), true).render();
        assert!(
            wide.starts_with("NAME   PHASE     ACCEL   AGENT   PID    CPUS   MEMORY   POLICY   MANAGED-BY   AGE\n"),
            "{wide}"
        );
        assert!(wide.contains("2      512Mi    Manual"), "{wide}");
    }

    #[test]
    fn disk_table_humanises_sizes() {
        let items = [
            json!({"metadata": {"name": "data", "creationTimestamp": "2024-12-28T12:00:00Z"},
                   "spec": {"size": "1Gi", "source": {"blank": {}}},
                   "status": {"phase": "Ready", "capacity": 1073741824u64, "allocated": 12897485, "attachedTo": "demo"}}),
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
    }
}

/// `NAME SOURCE PHASE CONSISTENT CUT-TIME FREEZE-MS SIZE AGE`.
pub fn snapshot_table(kind: Kind, items: &[Value], now: DateTime<Utc>, _wide: bool) -> Table {
    let source_field = if kind == Kind::VirtualDiskSnapshot {
        "virtualDiskName"
    } else {
        "virtualMachineName"
    };
    let header = vec![
        "NAME",
        if kind == Kind::VirtualDiskSnapshot {
            "DISK"
        } else {
            "VM"
        },
        "PHASE",
        "CONSISTENT",
        "CUT-TIME",
        "FREEZE-MS",
        "SIZE",
        "AGE",
    ];
    let mut table = Table::new(&header);
    for item in items {
        let st = &item["status"];
        let text = |v: &Value| v.as_str().unwrap_or("-").to_string();
        let consistent = match st["consistent"].as_bool() {
            Some(true) => "true".to_string(),
            Some(false) => "false".to_string(),
            None => "-".to_string(),
        };
        let freeze = st["freezeWindowMs"]
            .as_u64()
            .map(|v| v.to_string())
            .unwrap_or_else(|| "-".into());
        let size = st["size"]
            .as_u64()
            .map(crate::output::human_bytes)
            .unwrap_or_else(|| "-".into());
        let cut_time = st["cutTime"]
            .as_str()
            .map(|t| t.chars().take(19).collect::<String>())
            .unwrap_or_else(|| "-".into());
        let age = crate::output::age_of(item, now);
        table.push(vec![
            text(&item["metadata"]["name"]),
            text(&item["spec"][source_field]),
            text(&st["phase"]),
            consistent,
            cut_time,
            freeze,
            size,
            age,
        ]);
    }
    table
}
