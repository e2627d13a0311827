//! Ignite's two ways in, booted for real: `hearth run IMAGE --ssh` from an
//! empty store, and an Ignite manifest (`image.oci` + `kernel.oci`) in the
//! manifest directory. The images are the Debian 12 test guest made into
//! OCI images (common/debian_oci.rs) on a real registry on 127.0.0.1;
//! hearthd and its VMs run in a network namespace of the test's (each VM
//! has a NAT network), reaching the registry through a loopback relay.
//!
//! Ground truth: ssh into the guest with the key `hearth run` made (the
//! guest's own sshd, `/proc/cmdline`, the copied file's bytes), the guest
//! agent for the Ignite VM, the registry's own access log for the reuse of
//! a pulled image, and the process table for stopped and deleted VMs.

mod common;

use std::fs;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::debian::*;
use common::debian_oci::debian_oci;
use common::*;
use hearth_test_support::oci::TestRegistry;

fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

/// Manifest GETs of `repo` in the registry's own log (one line a request
/// at level info).
fn manifest_gets(registry: &TestRegistry, repo: &str) -> usize {
    // Quoted only when the URI has characters that need it.
    let uri = format!("/v2/{repo}/manifests/");
    registry
        .log()
        .lines()
        .filter(|l| {
            l.contains("http.request.method=GET")
                && (l.contains(&format!("http.request.uri={uri}"))
                    || l.contains(&format!("http.request.uri=\"{uri}")))
        })
        .count()
}

fn ignite_manifest(rootfs: &str, kernel: &str, marker: &Path, running: bool) -> String {
    format!(
        "apiVersion: ignite.weave.works/v1alpha4
kind: VM
metadata:
  name: ig
spec:
  image:
    oci: {rootfs}
  kernel:
    oci: {kernel}
    cmdLine: hearth.test=ignite
  cpus: 1
  memory: 768MB
  diskSize: 3GB
  copyFiles:
  - hostPath: {}
    vmPath: /etc/ignite-marker
status:
  running: {running}
",
        s(marker)
    )
}

#[test]
fn hearth_run_and_an_ignite_manifest_boot_debian_from_a_registry() {
    let _serial = serial();
    let t0 = Instant::now();
    let mark = |what: &str| eprintln!("oci_run: {:>6.1} s  {what}", t0.elapsed().as_secs_f64());
    let work = tempfile::Builder::new()
        .prefix("hearth-oci-run-")
        .tempdir()
        .unwrap();
    let w = work.path();
    let images = debian_oci(w, false);
    let registry = TestRegistry::start(false);
    let rootfs = registry.push(&images.layout, "rootfs", "debian/rootfs:12");
    let noboot = registry.push(&images.layout, "noboot", "debian/noboot:12");
    let kernel = registry.push(&images.layout, "kernel", "debian/kernel:12");
    let host = rootfs.split('/').next().expect("host").to_string();
    let port: u16 = host
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .expect("the registry's port");
    mark("images built and pushed");

    let manifests = w.join("manifests");
    fs::create_dir(&manifests).unwrap();
    let files = w.join("files");
    fs::create_dir(&files).unwrap();
    let run_marker = files.join("run-marker");
    fs::write(&run_marker, b"copied by hearth run\n").unwrap();
    let ignite_marker = files.join("ignite-marker");
    fs::write(&ignite_marker, b"copied from an Ignite manifest\n").unwrap();
    let home = w.join("home");
    fs::create_dir(&home).unwrap();
    let d = Daemon::start_in_netns(
        &[&files],
        &[
            "--manifests",
            s(&manifests),
            "--registry-insecure",
            &host,
            "--image-retry-max-seconds",
            "2",
        ],
    );
    d.netns.as_ref().expect("netns").relay_loopback(port);

    // `hearth run` from an empty store, and the Ignite manifest beside it:
    // both guests boot at once.
    let (_, listed) = d.request("GET", "/v1/virtualimages", None);
    assert_eq!(listed["items"], serde_json::json!([]), "an empty store");
    let copy = format!("{}:/etc/hearth-run-marker", s(&run_marker));
    let run = d
        .cli_command(
            &[
                "run",
                &rootfs,
                "--name",
                "web",
                "--memory",
                "768MB",
                "--size",
                "3GB",
                "--ssh",
                "--copy-file",
                &copy,
                "--timeout",
                "15m",
            ],
            Stdio::null(),
        )
        .env("HOME", &home)
        .env_remove("XDG_DATA_HOME")
        .spawn()
        .expect("hearth run");
    let file = manifests.join("ig.yaml");
    fs::write(
        &file,
        ignite_manifest(&noboot, &kernel, &ignite_marker, true),
    )
    .unwrap();
    let out = run.wait_with_output().expect("hearth run");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "hearth run: {}\n{stdout}\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr),
        d.log()
    );
    mark("hearth run: the agent answers");
    // The pull was drawn as it ran, then the way in was printed.
    assert!(
        stdout
            .lines()
            .any(|l| l.starts_with("image/web-image: ") && l.contains("Ready")),
        "{stdout}"
    );
    let key = home.join(".local/share/hearth/ssh/id_web");
    assert!(
        stdout.contains(&format!(
            "Log in:  hearth ssh web -l root -i {}",
            key.display()
        )),
        "{stdout}"
    );
    assert!(key.is_file() && key.with_extension("pub").is_file());

    // The guest's own sshd lets the key in as root (the disk's
    // authorized_keys), its kernel is the image's, the copied file is there.
    wait_guest(
        &d,
        "web",
        "sshd listening",
        "ss -Htln | grep -q ':22 '",
        Duration::from_secs(180),
    );
    let key_arg = key.display().to_string();
    let ssh = |cmd: &[&str]| {
        let mut args = vec!["ssh", "web", "-l", "root", "-i", &key_arg];
        args.extend(SSH_OPTS);
        args.push("--");
        args.extend(cmd);
        let out = d.hearth_in_netns(&args, Some(&home));
        assert!(
            out.status.success(),
            "hearth ssh web {cmd:?}: {}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    assert_eq!(
        ssh(&["cat", "/etc/hearth-run-marker"]),
        "copied by hearth run\n"
    );
    assert!(
        ssh(&["cat", "/proc/cmdline"]).starts_with("root=/dev/vda rw console=ttyS0"),
        "the image's kernel, booted by hearth"
    );
    assert_eq!(ssh(&["uname", "-r"]).trim(), images.version);
    mark("ssh into web");

    // A second run of the same reference reuses the Ready image: the
    // registry is not asked for the manifest again.
    let asked = manifest_gets(&registry, "debian/rootfs");
    assert!(
        asked >= 1,
        "the registry logged no manifest GET:\n{}",
        registry.log()
    );
    let again = d
        .cli_command(
            &["run", &rootfs, "--name", "again", "--timeout", "1s"],
            Stdio::null(),
        )
        .env("HOME", &home)
        .output()
        .expect("hearth run");
    let again_out = String::from_utf8_lossy(&again.stdout).into_owned();
    assert!(
        again_out.contains("reusing VirtualImage \"web-image\" (Ready)"),
        "{again_out}\n{}",
        String::from_utf8_lossy(&again.stderr)
    );
    assert!(d.get("virtualimages", "again-image").is_none());
    for path in [
        "virtualmachines/again",
        "virtualdisks/again-root",
        "virtualnetworks/again-net",
    ] {
        d.request("DELETE", &format!("/v1/{path}"), None);
    }
    assert_eq!(manifest_gets(&registry, "debian/rootfs"), asked);

    // The Ignite VM: the kernel image's kernel with the manifest's cmdLine,
    // the copied file, from the guest's agent.
    d.wait_vm("ig", "agent connected", DEBIAN_BOOT_TIMEOUT, |v| {
        assert_ne!(v["status"]["phase"], "Failed", "ig: {v:#}");
        v["status"]["phase"] == "Running" && v["status"]["agentConnected"] == true
    });
    mark("ig: the agent answers");
    let cmdline = d.agent_sh_ok("ig", "cat /proc/cmdline");
    assert!(
        cmdline.starts_with("root=/dev/vda rw console=ttyS0")
            && cmdline.contains("hearth.test=ignite"),
        "{cmdline}"
    );
    assert_eq!(d.agent_sh_ok("ig", "uname -r").trim(), images.version);
    assert_eq!(
        d.agent_sh_ok("ig", "cat /etc/ignite-marker"),
        "copied from an Ignite manifest\n"
    );
    // The kernel image's modules, copied into the root disk as Ignite does.
    let got = d.agent_sh_ok(
        "ig",
        &format!("sha256sum /lib/modules/$(uname -r)/{}", images.module),
    );
    assert!(got.starts_with(&images.module_sha), "{got}");
    d.agent_sh_ok("ig", "modprobe dummy && grep -q '^dummy ' /proc/modules");

    // status.running: false stops it (no QEMU of it is left), and removing
    // the file deletes everything it made.
    assert!(!d.qemu_pids_of("ig").is_empty());
    fs::write(
        &file,
        ignite_manifest(&noboot, &kernel, &ignite_marker, false),
    )
    .unwrap();
    wait_until("ig's QEMU is gone", Duration::from_secs(180), || {
        d.qemu_pids_of("ig").is_empty()
    });
    assert!(
        d.get("virtualmachines", "ig").is_some(),
        "stopped, not deleted"
    );
    fs::remove_file(&file).unwrap();
    let gone = [
        ("virtualmachines", "ig"),
        ("virtualdisks", "ig-root"),
        ("virtualnetworks", "ig-net"),
        ("virtualimages", "ig-image"),
        ("virtualimages", "ig-kernel"),
    ];
    wait_until(
        "the Ignite objects are gone",
        Duration::from_secs(120),
        || gone.iter().all(|(p, n)| d.get(p, n).is_none()),
    );
    // hearth run's VM is untouched by it.
    assert!(!d.qemu_pids_of("web").is_empty());
    wait_until(
        "the second run's VM is gone",
        Duration::from_secs(180),
        || d.get_vm("again").is_none(),
    );
    assert_eq!(d.qemu_pids_of("again"), Vec::<u32>::new());
    mark("stopped and deleted");
}
