//! `GET /metrics` and `GET /v1/openapi.json` end to end: a real hearthd, the
//! real test guest under QEMU, scraped and parsed as Prometheus does
//! (`prometheus-parse`), with every value checked against what the test did
//! or read from the host itself; and real API answers checked against the
//! OpenAPI document's schemas (`jsonschema`).

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use common::*;
use prometheus_parse::{Scrape, Value as PromValue};
use serde_json::{Value, json};

const SNAP_TIMEOUT: Duration = Duration::from_secs(90);

// ---------------------------------------------------------------- scraping

fn parse(text: &str) -> Scrape {
    let lines = text.lines().map(|l| Ok(l.to_string()));
    Scrape::parse(lines).unwrap_or_else(|e| panic!("not Prometheus text: {e}\n{text}"))
}

/// `GET /metrics` over the API socket; the text, checked to be the
/// Prometheus text format.
fn scrape_socket(d: &Daemon) -> (String, Scrape) {
    let (status, body) = raw_request(&d.socket(), "GET", "/metrics", None)
        .unwrap_or_else(|e| panic!("GET /metrics: {e}\n{}", d.log()));
    let text = String::from_utf8(body).expect("metrics are UTF-8");
    assert_eq!(status, 200, "{text}");
    let scrape = parse(&text);
    (text, scrape)
}

/// A plain HTTP/1.1 GET over TCP; the status and the body.
fn tcp_get(addr: SocketAddr, path: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap_or_else(|e| panic!("connect {addr}: {e}"));
    s.set_read_timeout(Some(Duration::from_secs(30)))
        .expect("timeout");
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .expect("write");
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).expect("read");
    let text = String::from_utf8_lossy(&buf).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").expect("HTTP answer");
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("status");
    // axum answers small bodies with a length, not chunked.
    assert!(
        !head
            .to_ascii_lowercase()
            .contains("transfer-encoding: chunked"),
        "{head}"
    );
    (status, body.to_string())
}

fn labels_match(sample: &prometheus_parse::Sample, labels: &[(&str, &str)]) -> bool {
    labels.iter().all(|(k, v)| sample.labels.get(k) == Some(*v))
}

/// The value of the one series `name{labels..}` (a counter, gauge or an
/// untyped `_count`/`_sum`); panics when there is none or more than one.
fn value(s: &Scrape, name: &str, labels: &[(&str, &str)]) -> f64 {
    let found: Vec<f64> = s
        .samples
        .iter()
        .filter(|x| x.metric == name && labels_match(x, labels))
        .filter_map(|x| match x.value {
            PromValue::Counter(v) | PromValue::Gauge(v) | PromValue::Untyped(v) => Some(v),
            _ => None,
        })
        .collect();
    assert_eq!(
        found.len(),
        1,
        "{name}{labels:?}: {} series, not one; metrics seen: {:?}",
        found.len(),
        s.samples
            .iter()
            .map(|x| format!("{}{}", x.metric, x.labels))
            .collect::<Vec<_>>()
    );
    found[0]
}

fn series_type(s: &Scrape, name: &str, labels: &[(&str, &str)]) -> &'static str {
    let x = s
        .samples
        .iter()
        .find(|x| x.metric == name && labels_match(x, labels))
        .unwrap_or_else(|| panic!("no {name}{labels:?}"));
    match x.value {
        PromValue::Counter(_) => "counter",
        PromValue::Gauge(_) => "gauge",
        PromValue::Histogram(_) => "histogram",
        PromValue::Summary(_) => "summary",
        PromValue::Untyped(_) => "untyped",
    }
}

/// The `+Inf` bucket of a histogram: its count, as the parser reads it.
fn histogram_inf(s: &Scrape, name: &str, labels: &[(&str, &str)]) -> f64 {
    s.samples
        .iter()
        .find(|x| x.metric == name && labels_match(x, labels))
        .and_then(|x| match &x.value {
            PromValue::Histogram(buckets) => buckets
                .iter()
                .find(|b| b.less_than.is_infinite())
                .map(|b| b.count),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no histogram {name}{labels:?}"))
}

/// Re-lists of the manifest directory, whatever triggered them.
fn relists(s: &Scrape) -> f64 {
    s.samples
        .iter()
        .filter(|x| x.metric == "hearth_manifest_relists_total")
        .map(|x| match x.value {
            PromValue::Counter(v) => v,
            _ => panic!("hearth_manifest_relists_total is not a counter"),
        })
        .sum()
}

/// `/proc/PID/status` VmRSS, in bytes, as the test reads it itself.
fn vm_rss(pid: u64) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .expect("VmRSS");
    kib * 1024.0
}

fn objects(yaml: &str) -> Vec<Value> {
    hearth_api::raw_documents(yaml, "test")
        .expect("test manifest")
        .into_iter()
        .map(|d| d.value)
        .collect()
}

// ---------------------------------------------------------------- OpenAPI

fn openapi(d: &Daemon) -> Value {
    let (status, doc) = d.request("GET", "/v1/openapi.json", None);
    assert_eq!(status, 200, "{doc}");
    assert_eq!(doc["openapi"], "3.1.0", "{doc}");
    doc
}

/// Checks a real answer against `#/components/schemas/NAME`.
fn assert_matches(doc: &Value, schema_name: &str, answer: &Value) {
    let schema = json!({
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$ref": format!("#/components/schemas/{schema_name}"),
        "components": doc["components"],
    });
    let v = jsonschema::validator_for(&schema).unwrap_or_else(|e| panic!("{schema_name}: {e}"));
    let errors: Vec<String> = v
        .iter_errors(answer)
        .map(|e| format!("{}: {e}", e.instance_path()))
        .collect();
    assert!(
        errors.is_empty(),
        "the answer does not match {schema_name}: {errors:#?}\n{answer:#}"
    );
}

/// The schema of the 200 answer of `METHOD PATH` in the document.
fn answer_schema(doc: &Value, method: &str, path: &str) -> String {
    let r = &doc["paths"][path][method]["responses"]["200"]["content"]["application/json"]["schema"]
        ["$ref"];
    r.as_str()
        .and_then(|r| r.strip_prefix("#/components/schemas/"))
        .unwrap_or_else(|| panic!("{method} {path}: no 200 JSON schema in the document"))
        .to_string()
}

#[test]
fn the_served_openapi_document_describes_the_real_answers() {
    let _g = serial();
    let images = tempfile::tempdir().expect("tmp");
    let d = Daemon::start_without_guest(&[images.path()], &[]);
    let doc = openapi(&d);

    let (status, health) = d.request("GET", "/v1/health", None);
    assert_eq!(status, 200);
    assert_matches(&doc, &answer_schema(&doc, "get", "/v1/health"), &health);

    let disk = Disk::blank("blank", "16Mi").json();
    let net = json!({"apiVersion": "hearth.dev/v1alpha1", "kind": "VirtualNetwork",
                     "metadata": {"name": "iso"}, "spec": {"mode": "Isolated", "dhcp": false}});
    assert_matches(&doc, "ApplyRequest", &json!({"items": [disk, net]}));
    let results = d.apply(vec![disk.clone()]);
    assert_matches(&doc, &answer_schema(&doc, "post", "/v1/apply"), &results);

    // The disk as the API shows it once Ready: with its status and the
    // server-set metadata.
    let shown = d.wait_object(
        "virtualdisks",
        "blank",
        "Ready",
        Duration::from_secs(60),
        |v| v["status"]["phase"] == "Ready",
    );
    assert_matches(&doc, "Object", &shown);
    let (_, list) = d.request("GET", "/v1/virtualdisks", None);
    assert_matches(&doc, &answer_schema(&doc, "get", "/v1/{plural}"), &list);
    let (_, events) = d.request("GET", "/v1/events?kind=VirtualDisk&name=blank", None);
    assert!(!events["items"].as_array().expect("items").is_empty());
    assert_matches(&doc, &answer_schema(&doc, "get", "/v1/events"), &events);

    // An error answer, and a delete.
    let (status, err) = d.request("GET", "/v1/virtualdisks/nope", None);
    assert_eq!(status, 404);
    assert_matches(&doc, "ErrorAnswer", &err);
    let (status, deleted) = d.request("DELETE", "/v1/virtualdisks/blank", None);
    assert_eq!(status, 200, "{deleted}");
    assert_matches(
        &doc,
        &answer_schema(&doc, "delete", "/v1/{plural}/{name}"),
        &deleted,
    );

    // What the schema refuses, the API refuses too.
    let bad = json!({"apiVersion": "hearth.dev/v1alpha1", "kind": "VirtualDisk",
                     "metadata": {"name": "bad"}, "spec": {"size": "16Mi", "source": {"blank": {}}, "colour": 1}});
    let (status, _) = d.apply_json(vec![bad]);
    assert_eq!(status, 400);
}

#[test]
fn a_metrics_listener_on_a_non_loopback_address_is_refused() {
    let dir = tempfile::tempdir().expect("tmp");
    let out = std::process::Command::new(hearthd_bin())
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .arg("--run-dir")
        .arg(dir.path().join("run"))
        .args(["--accel", "tcg", "--metrics-listen", "0.0.0.0:9464"])
        .arg("--manifests")
        .arg(dir.path().join("manifests"))
        .output()
        .expect("run hearthd");
    assert!(!out.status.success(), "hearthd started");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--metrics-listen 0.0.0.0:9464") && err.contains("loopback"),
        "{err}"
    );
    assert!(
        !dir.path().join("state").exists(),
        "refused before touching anything"
    );
}

// ---------------------------------------------------------------- metrics

#[test]
fn metrics_scraped_as_prometheus_does_match_what_the_vm_did() {
    let _g = serial();
    let mut d = Daemon::start_with(&["--metrics-listen", "127.0.0.1:0"]);
    let tcp = d.metrics_addr(Duration::from_secs(30));
    assert!(tcp.ip().is_loopback(), "{tcp}");
    let doc = openapi(&d);

    // Before any VM: the daemon's own series exist, at zero where nothing
    // happened yet.
    let (text, s) = scrape_socket(&d);
    assert!(!text.contains("# EOF"), "Prometheus text, not OpenMetrics");
    assert!(value(&s, "hearth_manifest_relists_total", &[("reason", "start")]) >= 1.0);
    assert_eq!(value(&s, "hearth_manifest_parse_errors_total", &[]), 0.0);
    assert_eq!(
        series_type(&s, "hearth_manifest_parse_errors_total", &[]),
        "counter"
    );
    assert_eq!(
        value(
            &s,
            "hearth_snapshots",
            &[("kind", "VirtualDiskSnapshot"), ("phase", "Ready")]
        ),
        0.0
    );

    let vm = "metrics";
    let disk = "metrics-data";
    let mut items = objects(&overlay_disk_yaml(disk));
    items.extend(objects(&vm_yaml(vm, "AlwaysOn", &[disk], "")));
    d.apply(items);
    let shown = d.wait_agent(vm);
    assert_matches(&doc, "Object", &shown);
    let pid = shown["status"]["pid"].as_u64().expect("pid");

    // Phase and agent.
    let (_, s) = scrape_socket(&d);
    assert_eq!(
        value(&s, "hearth_vm_phase", &[("vm", vm), ("phase", "Running")]),
        1.0
    );
    for other in ["Pending", "Starting", "Stopping", "Stopped", "Failed"] {
        assert_eq!(
            value(&s, "hearth_vm_phase", &[("vm", vm), ("phase", other)]),
            0.0,
            "{other}"
        );
    }
    assert_eq!(value(&s, "hearth_vm_agent_connected", &[("vm", vm)]), 1.0);

    // QEMU's resident memory, as the test reads it from /proc itself.
    let rss = value(&s, "hearth_vm_memory_rss_bytes", &[("vm", vm)]);
    let seen = vm_rss(pid);
    assert!(
        (rss - seen).abs() <= seen * 0.10,
        "RSS metric {rss} vs VmRSS {seen} of pid {pid}"
    );
    assert!(
        rss > 32.0 * 1024.0 * 1024.0,
        "a booted guest uses memory: {rss}"
    );

    // CPU: the whole process, and the vCPU thread within it.
    let cpu = value(&s, "hearth_vm_cpu_seconds_total", &[("vm", vm)]);
    let vcpu0 = value(
        &s,
        "hearth_vm_vcpu_seconds_total",
        &[("vm", vm), ("vcpu", "0")],
    );
    assert!(vcpu0 > 0.0, "the guest booted on vCPU 0: {vcpu0}");
    assert!(cpu >= vcpu0, "process {cpu} s < its vCPU thread {vcpu0} s");
    assert_eq!(
        series_type(&s, "hearth_vm_cpu_seconds_total", &[("vm", vm)]),
        "counter"
    );

    // Disk writes: 4 MiB written and synced in the guest show up.
    let dl = [("vm", vm), ("disk", disk), ("device", "vdisk0")];
    let bytes0 = value(&s, "hearth_vm_disk_write_bytes_total", &dl);
    let ops0 = value(&s, "hearth_vm_disk_write_ops_total", &dl);
    let flush0 = value(&s, "hearth_vm_disk_flush_ops_total", &dl);
    assert!(
        value(&s, "hearth_vm_disk_read_bytes_total", &dl) > 0.0,
        "the guest mounted it"
    );
    d.agent_sh_ok(
        vm,
        "dd if=/dev/urandom of=/data/metrics.bin bs=1M count=4 conv=fsync 2>&1",
    );
    let (_, s) = scrape_socket(&d);
    let bytes1 = value(&s, "hearth_vm_disk_write_bytes_total", &dl);
    assert!(
        bytes1 - bytes0 >= 4.0 * 1024.0 * 1024.0,
        "wrote 4 MiB, the counter grew by {}",
        bytes1 - bytes0
    );
    assert!(value(&s, "hearth_vm_disk_write_ops_total", &dl) > ops0);
    assert!(
        value(&s, "hearth_vm_disk_flush_ops_total", &dl) > flush0,
        "fsync flushes"
    );

    // The same figures on the TCP listener, which serves nothing else.
    let (status, body) = tcp_get(tcp, "/metrics");
    assert_eq!(status, 200, "{body}");
    let t = parse(&body);
    assert_eq!(
        value(&t, "hearth_vm_phase", &[("vm", vm), ("phase", "Running")]),
        1.0
    );
    assert!(value(&t, "hearth_vm_disk_write_bytes_total", &dl) >= bytes1);
    let (status, _) = tcp_get(tcp, "/v1/health");
    assert_eq!(status, 404, "the metrics listener is not the API");

    // Two snapshots, one after the other: two cuts, two freeze windows.
    let mut windows_ms = 0u64;
    for name in ["metrics-snap-1", "metrics-snap-2"] {
        d.apply(vec![DiskSnapshot::of(name, disk).json()]);
        let snap = snapshot_final(&d, name, SNAP_TIMEOUT);
        assert_eq!(snap["status"]["phase"], "Ready", "{snap:#}");
        assert_eq!(snap["status"]["consistent"], true, "{snap:#}");
        windows_ms += snap["status"]["freezeWindowMs"]
            .as_u64()
            .expect("a frozen window");
        assert_matches(&doc, "Object", &snap);
    }
    let (_, s) = scrape_socket(&d);
    let kind = [("kind", "VirtualDiskSnapshot")];
    assert_eq!(
        value(
            &s,
            "hearth_snapshots",
            &[("kind", "VirtualDiskSnapshot"), ("phase", "Ready")]
        ),
        2.0
    );
    assert_eq!(
        value(
            &s,
            "hearth_snapshots",
            &[("kind", "VirtualDiskSnapshot"), ("phase", "Failed")]
        ),
        0.0
    );
    assert_eq!(
        value(&s, "hearth_snapshot_freeze_window_seconds_count", &kind),
        2.0
    );
    assert_eq!(
        histogram_inf(&s, "hearth_snapshot_freeze_window_seconds", &kind),
        2.0
    );
    let sum = value(&s, "hearth_snapshot_freeze_window_seconds_sum", &kind);
    assert!(
        (sum - windows_ms as f64 / 1000.0).abs() < 1e-6,
        "freeze windows sum {sum} s, the snapshots say {windows_ms} ms"
    );
    assert_eq!(value(&s, "hearth_snapshot_ready_seconds_count", &kind), 2.0);
    // The device's counters go on across the cuts (new nodes under the same
    // device).
    assert!(value(&s, "hearth_vm_disk_write_bytes_total", &dl) >= bytes1);
    assert!(value(&s, "hearth_snapshot_ready_seconds_sum", &kind) > 0.0);

    // Reconciles ran for each kind the test used.
    for k in ["VirtualMachine", "VirtualDisk", "VirtualDiskSnapshot"] {
        assert!(
            value(
                &s,
                "hearth_reconcile_duration_seconds_count",
                &[("kind", k)]
            ) > 0.0,
            "{k}"
        );
        // The series exists (zero or more errors).
        assert!(value(&s, "hearth_reconcile_errors_total", &[("kind", k)]) >= 0.0);
    }

    // A manifest that does not parse raises the parse-error counter.
    let relists_before = relists(&s);
    let manifests = d.dir.path().join("manifests");
    std::fs::create_dir_all(&manifests).expect("mkdir");
    let bad = manifests.join("broken.yaml");
    std::fs::write(&bad, "kind: VirtualMachine\nmetadata: {name: [unclosed\n").expect("write");
    wait_until(
        "the manifest directory reports the file",
        SNAP_TIMEOUT,
        || {
            let (_, v) = d.request("GET", "/v1/sources", None);
            v["files"].as_array().is_some_and(|files| {
                files
                    .iter()
                    .any(|f| f["path"].as_str() == bad.to_str() && f["valid"] == false)
            })
        },
    );
    let (_, s) = scrape_socket(&d);
    assert_eq!(value(&s, "hearth_manifest_parse_errors_total", &[]), 1.0);
    assert!(
        relists(&s) > relists_before,
        "a re-list read the new file: {} -> {}",
        relists_before,
        relists(&s)
    );

    // Once QEMU is gone, its process series go too; the phase stays.
    let (status, v) = d.request("POST", &format!("/v1/virtualmachines/{vm}/stop"), None);
    assert_eq!(status, 200, "{v}");
    d.wait_phase(vm, "Stopped", BOOT_TIMEOUT);
    let (_, s) = scrape_socket(&d);
    assert_eq!(
        value(&s, "hearth_vm_phase", &[("vm", vm), ("phase", "Stopped")]),
        1.0
    );
    assert_eq!(value(&s, "hearth_vm_agent_connected", &[("vm", vm)]), 0.0);
    assert!(
        !s.samples
            .iter()
            .any(|x| x.metric == "hearth_vm_memory_rss_bytes" && labels_match(x, &[("vm", vm)])),
        "no RSS for a stopped VM"
    );
    d.kill();
}

/// A cut wakes the VM snapshots of its own disk snapshots, not every VM
/// snapshot there is: the reconciles of that kind a new VM snapshot costs,
/// counted by hearthd's own histogram, do not grow with the VM snapshots
/// taken before it. (No resync in between: it wakes every object.)
#[test]
fn a_vm_snapshot_costs_the_same_reconciles_however_many_came_before() {
    let _g = serial();
    let d = Daemon::start_with(&["--resync-seconds", "3600"]);
    let (vm, disk) = ("many", "many-data");
    let mut items = objects(&overlay_disk_yaml(disk));
    items.extend(objects(&vm_yaml(vm, "AlwaysOn", &[disk], "")));
    d.apply(items);
    d.wait_agent(vm);
    let kind = [("kind", "VirtualMachineSnapshot")];
    let reconciles = || {
        let (_, s) = scrape_socket(&d);
        value(&s, "hearth_reconcile_duration_seconds_count", &kind)
    };
    let mut costs = Vec::new();
    for i in 0..8 {
        let name = format!("many-{i}");
        let before = reconciles();
        d.apply(vec![VmSnapshot::of(&name, vm).json()]);
        let snap = d.wait_final("virtualmachinesnapshots", &name, SNAP_TIMEOUT);
        assert_eq!(snap["status"]["phase"], "Ready", "{snap:#}");
        // The reconciles a final phase starts are over within this.
        std::thread::sleep(Duration::from_millis(500));
        costs.push(reconciles() - before);
    }
    let (first, last) = (costs[0], costs[costs.len() - 1]);
    assert!(first >= 1.0, "{costs:?}");
    // Waking all seven VM snapshots before it would cost the eighth seven
    // more; a wake that lands while a reconcile runs may cost one or two.
    assert!(
        last <= first + 2.0,
        "the 8th VM snapshot cost {last} VirtualMachineSnapshot reconciles, the first {first}: {costs:?}"
    );
}
