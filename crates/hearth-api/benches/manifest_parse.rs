//! Benchmark (not a test): how long a manifest within the limits takes to
//! check and to parse, by shape, and how long a text over them takes to be
//! refused. The numbers behind docs/limits.md and the manifest directory's
//! inline parse threshold (`INLINE_PARSE_BYTES`, docs/manifest-directory.md).
//!
//! Run: `cargo bench -p hearth-api --bench manifest_parse` (release), and
//! with `--profile dev` for the debug build the end-to-end tests run.
//! Prints markdown.

use std::path::Path;
use std::time::{Duration, Instant};

use hearth_api::limits::{MAX_MANIFEST_BYTES, MAX_VALUES, check_yaml};
use hearth_api::manifest::parse_manifest;

/// Median of `runs` timings of `f`.
fn median(runs: usize, mut f: impl FnMut()) -> Duration {
    let mut times: Vec<Duration> = (0..runs)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed()
        })
        .collect();
    times.sort();
    times[runs / 2]
}

/// One VM document with about `user_data` bytes of cloud-init.
fn vm_doc(i: usize, user_data: usize) -> String {
    let line = "        - echo a line of a cloud-config script, as long as most\n";
    format!(
        "---\napiVersion: hearth.dev/v1alpha1\nkind: VirtualMachine\nmetadata:\n  name: vm-{i}\nspec:\n  memory: 512Mi\n  boot: {{kernel: /boot/vmlinuz, initrd: /boot/initrd.img}}\n  disks:\n    - virtualDiskName: root-{i}\n  cloudInit:\n    userData: |\n      #cloud-config\n      runcmd:\n{}",
        line.repeat(user_data / line.len())
    )
}

/// Shapes of about `target` bytes and at most `values` values.
fn shapes(target: usize, values: usize) -> Vec<(&'static str, String)> {
    // `unit` repeated as often as both limits allow (it holds `per` values).
    let fill = |unit: &str, per: usize, head: &str, tail: &str| {
        let n = ((target - head.len() - tail.len()) / unit.len()).min(values / per);
        format!("{head}{}{tail}", unit.repeat(n))
    };
    let docs = (target / 4096).clamp(1, 1000);
    vec![
        (
            "ordinary: VMs with cloud-init, one document each",
            (0..docs).map(|i| vm_doc(i, target / docs - 400)).collect(),
        ),
        (
            "quoted strings in a flow list",
            fill(
                "\"0123456789012345678901234567890123\", ",
                1,
                "x: [",
                "1]\n",
            ),
        ),
        (
            "short scalars in a flow list",
            fill("1,", 1, "x: [", "1]\n"),
        ),
        (
            "a flow mapping of short keys",
            fill("k: 1, ", 2, "x: {", "z: 1}\n"),
        ),
        ("a block list of short scalars", fill("- 1\n", 1, "", "")),
        (
            "lists nested 31 deep, one a line",
            fill(
                &format!("- {}1{}\n", "[".repeat(31), "]".repeat(31)),
                32,
                "",
                "",
            ),
        ),
    ]
}

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        eprintln!(
            "manifest_parse: a benchmark; run it with `cargo bench -p hearth-api --bench manifest_parse`"
        );
        return;
    }
    let base = Path::new("/srv/manifests");
    println!("| shape | bytes | limits check | parse_manifest | outcome |");
    println!("|---|---|---|---|---|");
    // The inline parse threshold, then the largest texts within the limits.
    for target in [16 << 10, 64 << 10, MAX_MANIFEST_BYTES] {
        for (shape, text) in shapes(target, MAX_VALUES - 1000) {
            let runs = if target > 1 << 20 { 5 } else { 21 };
            let check = median(runs, || {
                let _ = check_yaml(&text);
            });
            let parse = median(runs, || {
                let _ = parse_manifest(text.as_bytes(), base);
            });
            let outcome = match parse_manifest(text.as_bytes(), base) {
                Ok(objs) => format!("{} objects", objs.len()),
                Err(e) => e.to_string().chars().take(60).collect(),
            };
            println!(
                "| {shape} | {} | {:.1} ms | {:.1} ms | {outcome} |",
                text.len(),
                check.as_secs_f64() * 1e3,
                parse.as_secs_f64() * 1e3
            );
        }
    }
    for (shape, text) in [
        (
            "`{a: ` nested, 4 MiB",
            "{a: ".repeat(MAX_MANIFEST_BYTES / 4),
        ),
        ("`[` nested, 4 MiB", "[".repeat(MAX_MANIFEST_BYTES)),
        (
            "empty documents, 4 MiB",
            "---\n".repeat(MAX_MANIFEST_BYTES / 4),
        ),
    ] {
        let parse = median(5, || {
            let _ = parse_manifest(text.as_bytes(), base);
        });
        let outcome: String = parse_manifest(text.as_bytes(), base)
            .err()
            .map(|e| e.to_string().chars().take(60).collect())
            .unwrap_or_default();
        println!(
            "| {shape} (refused) | {} | | {:.3} ms | {outcome} |",
            text.len(),
            parse.as_secs_f64() * 1e3
        );
    }
}
