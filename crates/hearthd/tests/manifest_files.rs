//! Files coming and going (`cp`, `mv`, renames), files that cannot be used,
//! the same object in two files, `git checkout` and a ConfigMap-style
//! `..data` symlink swap. No guest boots: `AlwaysOff` VMs and blank disks.

mod common;
mod manifest_support;

use std::process::Command;
use std::time::Duration;

use common::*;
use manifest_support::*;

fn run(dir: &std::path::Path, program: &str, args: &[&str]) {
    let out = Command::new(program)
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap_or_else(|e| panic!("{program}: {e}"));
    assert!(
        out.status.success(),
        "{program} {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Issue #3, required behaviour 5, and the API/CLI refusing to change what a
/// file owns.
#[test]
fn cp_mv_and_renames_in_and_out_of_the_directory() {
    let _serial = serial();
    let env = Env::start();
    let out = &env.outside;
    let dir = &env.dir;

    // cp a new file in: a VM and its disk.
    let a = format!(
        "{}---\n{}",
        disk_text("a-data"),
        vm_text("a", "AlwaysOff", "256Mi")
    );
    std::fs::write(out.join("a.yaml"), &a).expect("w");
    run(out, "cp", &["a.yaml", dir.to_str().expect("utf8")]);
    env.wait_generation("a", 1);
    env.until("disk created", Duration::from_secs(20), || {
        env.d
            .get_disk("a-data")
            .is_some_and(|d| d["status"]["phase"] == "Ready")
    });

    // cp over the existing file (in place: truncate and write).
    std::fs::write(
        out.join("a.yaml"),
        a.replace("memory: 256Mi", "memory: 320Mi"),
    )
    .expect("w");
    run(out, "cp", &["a.yaml", dir.to_str().expect("utf8")]);
    env.wait_generation("a", 2);

    // The API and the CLI refuse to change or delete it, naming the file.
    let err = env.d.cli_err(&["delete", "vm", "a"]);
    assert!(
        err.contains("owned by the manifest file") && err.contains("/manifests/a.yaml"),
        "{err}"
    );
    let err = env.d.cli_err(&["delete", "disk", "a-data"]);
    assert!(err.contains("/manifests/a.yaml"), "{err}");
    std::fs::write(out.join("api.yaml"), vm_text("a", "AlwaysOff", "512Mi")).expect("w");
    let err = env
        .d
        .cli_err(&["apply", "-f", out.join("api.yaml").to_str().expect("utf8")]);
    assert!(
        err.contains("owned by the manifest file") && err.contains("/manifests/a.yaml"),
        "{err}"
    );
    assert_eq!(env.generation("a"), 2);
    let described = env.d.cli_ok(&["describe", "vm", "a"]);
    assert!(
        described.contains("file:") && described.contains("/manifests/a.yaml"),
        "{described}"
    );
    let wide = env.d.cli_ok(&["get", "vm", "-o", "wide"]);
    assert!(wide.contains("/manifests/a.yaml"), "{wide}");

    // mv in from outside.
    std::fs::write(out.join("b.yaml"), vm_text("b", "AlwaysOff", "256Mi")).expect("w");
    run(out, "mv", &["b.yaml", dir.to_str().expect("utf8")]);
    env.wait_generation("b", 1);

    // Rename within the directory: nothing changes but the owner.
    run(dir, "mv", &["b.yaml", "b-renamed.yaml"]);
    env.until("owner follows the file", Duration::from_secs(5), || {
        env.owner("b")
            .is_some_and(|o| o.ends_with("/b-renamed.yaml"))
    });
    env.assert_settled();
    assert_eq!(env.generation("b"), 1, "a rename is not an update");
    assert_eq!(env.count("b", "Deleting"), 0);
    assert_eq!(env.count("b", "SourceChanged"), 1);

    // Rename to a name that is not a manifest: deleted (after the grace period).
    run(dir, "mv", &["b-renamed.yaml", "b-renamed.yaml.disabled"]);
    env.wait_gone("b", Duration::from_secs(20));

    // mv out: deleted, the VM first, then its disk.
    run(dir, "mv", &["a.yaml", out.to_str().expect("utf8")]);
    env.wait_gone("a", Duration::from_secs(20));
    env.until("disk deleted", Duration::from_secs(30), || {
        env.d.get_disk("a-data").is_none()
    });
    let deleting = env
        .d
        .events("VirtualMachine", "a")
        .into_iter()
        .find(|e| e["reason"] == "Deleting")
        .expect("a Deleting event");
    assert!(
        deleting["message"]
            .as_str()
            .unwrap_or_default()
            .contains("/manifests/a.yaml"),
        "{deleting}"
    );
    assert!(
        env.path("b-renamed.yaml.disabled").exists(),
        "hearthd deletes no file"
    );
}

/// Issue #3, required behaviour 8.
#[test]
fn unusable_files_keep_the_last_good_state_and_report_the_error() {
    let _serial = serial();
    let env = Env::start();
    let good = vm_text("keep", "AlwaysOff", "256Mi");
    env.write("keep.yaml", &good);
    env.write("other.yaml", &vm_text("other", "AlwaysOff", "256Mi"));
    env.wait_generation("keep", 1);
    env.wait_generation("other", 1);

    let mut garbage: Vec<u8> = (0..4096u32).map(|i| (i * 7919 % 251) as u8).collect();
    garbage[0] = 0xff;
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        (
            "invalid YAML",
            good.replace("  boot:\n", "  boot: [\n").into_bytes(),
            "line ",
        ),
        (
            "unknown field",
            good.replace("  memory: 256Mi\n", "  memory: 256Mi\n  gpus: 2\n")
                .into_bytes(),
            "spec.gpus",
        ),
        (
            "missing name",
            good.replace("  name: keep\n", "").into_bytes(),
            "metadata.name",
        ),
        ("binary garbage", garbage, "not UTF-8"),
    ];
    for (what, bytes, expected) in cases {
        // Once a re-list has read the file: the error, and nothing else.
        env.relisted_after(what, || {
            std::fs::write(env.path("keep.yaml"), &bytes).expect("w")
        });
        let file = env.source_file("keep.yaml").expect("file");
        assert_eq!(file["valid"], false, "{what}: {file}");
        let error = file["error"].as_str().unwrap_or_default();
        assert!(error.contains(expected), "{what}: {file}");
        assert!(error.contains("line "), "{what}: {file}");
        let c = env.condition("keep").expect("condition");
        assert_eq!(c["status"], "False", "{what}: {c}");
        assert!(
            c["message"].as_str().unwrap_or_default().contains(expected),
            "{what}: {c}"
        );
        assert_eq!(env.generation("keep"), 1, "{what}: nothing changed");
    }

    // A 100 MB file is not even read. Written in many steps, it may be
    // re-listed while it grows: wait for the re-list of the whole of it.
    env.relisted_after("the 100 MB file", || {
        let f = std::fs::File::create(env.path("keep.yaml")).expect("create");
        let mut w = std::io::BufWriter::new(f);
        let line = b"padding: 0123456789012345678901234567890123456789012345678901234567890\n";
        for _ in 0..(100 << 20) / line.len() {
            std::io::Write::write_all(&mut w, line).expect("write");
        }
    });
    let file = env.source_file("keep.yaml").expect("file");
    assert!(
        file["error"]
            .as_str()
            .is_some_and(|e| e.contains("bytes") && e.contains("not read")),
        "{file}"
    );

    // The daemon keeps working: another file still applies.
    env.write("other.yaml", &vm_text("other", "AlwaysOff", "320Mi"));
    env.wait_generation("other", 2);
    let (status, _) = env.d.request("GET", "/v1/health", None);
    assert_eq!(status, 200);
    env.assert_settled();
    assert!(
        env.vm("keep").is_some(),
        "an unusable file is never a delete"
    );
    assert_eq!(env.generation("keep"), 1);
    assert_eq!(env.count("keep", "Deleting"), 0);
    assert!(env.count("keep", "ManifestInvalid") >= 5);

    // Fixed: applied.
    env.write("keep.yaml", &good.replace("256Mi", "384Mi"));
    env.wait_generation("keep", 2);
    env.until("the condition is resolved", Duration::from_secs(5), || {
        env.condition("keep").is_some_and(|c| c["status"] == "True")
    });
    assert_eq!(env.count("keep", "ManifestValid"), 1);
}

/// Issue #3, required behaviour 9.
#[test]
fn the_same_object_in_two_files_is_a_conflict_until_one_goes() {
    let _serial = serial();
    let env = Env::start();
    env.write("one.yaml", &vm_text("dup", "AlwaysOff", "256Mi"));
    env.wait_generation("dup", 1);

    env.write("two.yaml", &vm_text("dup", "AlwaysOff", "512Mi"));
    env.until("conflict reported", Duration::from_secs(5), || {
        env.count("dup", "ManifestConflict") == 1
    });
    let event = env
        .d
        .events("VirtualMachine", "dup")
        .into_iter()
        .find(|e| e["reason"] == "ManifestConflict")
        .expect("event");
    let message = event["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("/one.yaml") && message.contains("/two.yaml"),
        "{message}"
    );
    let problems = env.sources()["problems"].clone();
    assert!(
        problems.to_string().contains("ManifestConflict"),
        "{problems}"
    );
    assert_eq!(
        env.condition("dup").expect("condition")["reason"],
        "ManifestConflict"
    );
    env.assert_settled();
    assert_eq!(env.generation("dup"), 1, "the VM is untouched");
    assert_eq!(env.memory("dup").as_deref(), Some("256Mi"));

    // Deleting one copy leaves the other in force.
    std::fs::remove_file(env.path("one.yaml")).expect("rm");
    env.wait_generation("dup", 2);
    assert_eq!(env.memory("dup").as_deref(), Some("512Mi"));
    assert!(env.owner("dup").is_some_and(|o| o.ends_with("/two.yaml")));
    env.assert_settled();
    assert!(env.vm("dup").is_some());
    assert_eq!(env.count("dup", "Deleting"), 0);
    assert_eq!(env.condition("dup").expect("condition")["status"], "True");
}

/// The VMs hearthd holds, as name -> memory.
fn vms(env: &Env) -> Vec<(String, String)> {
    let (_, v) = env.d.request("GET", "/v1/virtualmachines", None);
    v["items"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|vm| {
            (
                vm["metadata"]["name"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
                vm["spec"]["memory"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
            )
        })
        .collect()
}

fn wants(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect()
}

/// Issue #3, required behaviour 10.
#[test]
fn git_checkout_and_a_configmap_symlink_swap_end_in_the_checked_out_content() {
    let _serial = serial();
    let env = Env::start();
    let dir = &env.dir;
    let git = |args: &[&str]| {
        let mut all = vec!["-c", "user.name=t", "-c", "user.email=t@example.invalid"];
        all.extend_from_slice(args);
        run(dir, "git", &all);
    };
    git(&["init", "-q", "-b", "main"]);
    std::fs::write(dir.join("a.yaml"), vm_text("ga", "AlwaysOff", "256Mi")).expect("w");
    std::fs::write(dir.join("b.yaml"), vm_text("gb", "AlwaysOff", "256Mi")).expect("w");
    git(&["add", "."]);
    git(&["commit", "-q", "-m", "main"]);
    env.until("branch main applied", Duration::from_secs(20), || {
        vms(&env) == wants(&[("ga", "256Mi"), ("gb", "256Mi")])
    });
    git(&["checkout", "-q", "-b", "other"]);
    std::fs::write(dir.join("a.yaml"), vm_text("ga", "AlwaysOff", "384Mi")).expect("w");
    std::fs::remove_file(dir.join("b.yaml")).expect("rm");
    std::fs::write(dir.join("c.yaml"), vm_text("gc", "AlwaysOff", "256Mi")).expect("w");
    git(&["add", "-A"]);
    git(&["commit", "-q", "-m", "other"]);
    env.until("branch other applied", Duration::from_secs(20), || {
        vms(&env) == wants(&[("ga", "384Mi"), ("gc", "256Mi")])
    });

    git(&["checkout", "-q", "main"]);
    env.until("main checked out", Duration::from_secs(20), || {
        vms(&env) == wants(&[("ga", "256Mi"), ("gb", "256Mi")])
    });
    git(&["checkout", "-q", "other"]);
    env.until("other checked out", Duration::from_secs(20), || {
        vms(&env) == wants(&[("ga", "384Mi"), ("gc", "256Mi")])
    });
    env.assert_settled();
    assert_eq!(vms(&env), wants(&[("ga", "384Mi"), ("gc", "256Mi")]));
    let files: Vec<String> = env.sources()["files"]
        .as_array()
        .expect("files")
        .iter()
        .map(|f| {
            f["path"]
                .as_str()
                .unwrap_or_default()
                .rsplit('/')
                .next()
                .unwrap_or_default()
                .to_string()
        })
        .collect();
    assert_eq!(
        files,
        vec!["a.yaml", "c.yaml"],
        "nothing under .git/ is read"
    );
    // Each checkout is one change per object: no delete of anything kept.
    assert_eq!(env.count("ga", "Deleting"), 0);
    assert_eq!(env.count("ga", "Updated"), 3);

    // ConfigMap volume, as the kubelet's atomic writer lays it out:
    // FILE -> ..data/FILE, ..data -> ..TIMESTAMP/
    for f in ["a.yaml", "c.yaml"] {
        std::fs::remove_file(dir.join(f)).expect("rm");
    }
    std::fs::remove_dir_all(dir.join(".git")).expect("rm .git");
    env.wait_gone("ga", Duration::from_secs(20));
    let ts1 = dir.join("..2026_01_01_00_00_00.000000001");
    std::fs::create_dir(&ts1).expect("mkdir");
    std::fs::write(ts1.join("cm.yaml"), vm_text("cm", "AlwaysOff", "256Mi")).expect("w");
    std::os::unix::fs::symlink("..2026_01_01_00_00_00.000000001", dir.join("..data")).expect("ln");
    std::os::unix::fs::symlink("..data/cm.yaml", dir.join("cm.yaml")).expect("ln");
    env.until("ConfigMap v1", Duration::from_secs(20), || {
        vms(&env) == wants(&[("cm", "256Mi"), ("gc", "256Mi")])
            || vms(&env) == wants(&[("cm", "256Mi")])
    });
    env.wait_gone("gc", Duration::from_secs(20));

    // Update: new timestamped dir, `..data_tmp` link renamed over `..data`
    // (the atomic swap), then the new key's link, then the old dir removed.
    env.relisted_after("the ConfigMap update", || {
        let ts2 = dir.join("..2026_01_01_00_01_00.000000002");
        std::fs::create_dir(&ts2).expect("mkdir");
        std::fs::write(ts2.join("cm.yaml"), vm_text("cm", "AlwaysOff", "512Mi")).expect("w");
        std::fs::write(ts2.join("cm2.yaml"), vm_text("cm2", "AlwaysOff", "256Mi")).expect("w");
        std::os::unix::fs::symlink("..2026_01_01_00_01_00.000000002", dir.join("..data_tmp"))
            .expect("ln");
        std::fs::rename(dir.join("..data_tmp"), dir.join("..data")).expect("swap");
        std::os::unix::fs::symlink("..data/cm2.yaml", dir.join("cm2.yaml")).expect("ln");
        std::fs::remove_dir_all(&ts1).expect("rm old");
    });
    env.until("ConfigMap v2", Duration::from_secs(20), || {
        vms(&env) == wants(&[("cm", "512Mi"), ("cm2", "256Mi")])
    });
    env.assert_settled();
    assert_eq!(vms(&env), wants(&[("cm", "512Mi"), ("cm2", "256Mi")]));
    assert_eq!(env.count("cm", "Deleting"), 0);
    assert!(
        env.owner("cm")
            .is_some_and(|o| o.ends_with("/manifests/cm.yaml"))
    );
}
