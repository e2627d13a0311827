//! `hearth exec` and `hearth cp` end to end: the real CLI, a real hearthd,
//! real QEMU and the real qemu-ga in the test guest. One boot serves every
//! check (boots are slow under TCG).

mod common;

use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Child, Output, Stdio};
use std::time::{Duration, Instant};

use common::*;

/// The real CLI with `stdin` written to it, then closed.
fn cli_with_stdin(d: &Daemon, args: &[&str], stdin: &[u8]) -> Output {
    let mut child = d
        .cli_command(args, Stdio::piped())
        .spawn()
        .expect("run hearth");
    let mut pipe = child.stdin.take().expect("stdin");
    let data = stdin.to_vec();
    let writer = std::thread::spawn(move || {
        pipe.write_all(&data).expect("write stdin");
    });
    let out = child.wait_with_output().expect("hearth");
    writer.join().expect("stdin writer");
    out
}

/// The real CLI started in the background (for a copy that runs while
/// something else happens).
fn cli_spawn(d: &Daemon, args: &[&str]) -> Child {
    d.cli_command(args, Stdio::null())
        .spawn()
        .expect("run hearth")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn random_file(path: &Path, len: usize, mode: u32) {
    let mut data = vec![0u8; len];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut data))
        .expect("read /dev/urandom");
    std::fs::write(path, &data).expect("write");
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
}

/// The SHA-256 the guest computes of one of its files.
fn guest_sha256(d: &Daemon, vm: &str, path: &str) -> String {
    let out = d.agent_sh_ok(vm, &format!("sha256sum {path}"));
    out.split_whitespace().next().expect("digest").to_string()
}

/// Applies a snapshot of the data disk and waits (on the change stream)
/// until it is Ready; returns it and the time from the request to Ready.
fn timed_snapshot(d: &Daemon, name: &str) -> (serde_json::Value, Duration) {
    let started = Instant::now();
    let (status, v) = d.apply_json(vec![DiskSnapshot::of(name, "data").json()]);
    assert_eq!(status, 200, "apply snapshot {name}: {v}");
    let s = d.wait_final("virtualdisksnapshots", name, Duration::from_secs(60));
    if s["status"]["phase"] == "Failed" {
        panic!("snapshot {name} failed: {s:#}\n{}", d.log());
    }
    (s, started.elapsed())
}

#[test]
fn exec_and_cp_through_the_guest_agent() {
    let _serial = serial();
    let d = Daemon::start();
    apply_manifest(
        &d,
        "vm.yaml",
        &format!(
            "{}---\n{}",
            overlay_disk_yaml("data"),
            vm_yaml("box", "AlwaysOn", &["data"], "")
        ),
    );
    d.wait_agent("box");
    let local = tempfile::tempdir().expect("tempdir");

    // --- exec: stdout, stderr and the exit status.
    let out = d.cli(&[
        "exec",
        "box",
        "--",
        "sh",
        "-c",
        "echo out; echo err >&2; exit 3",
    ]);
    assert_eq!(text(&out.stdout), "out\n");
    assert_eq!(text(&out.stderr), "err\n");
    assert_eq!(out.status.code(), Some(3), "{out:?}");
    let out = d.cli(&["exec", "box", "--", "sh", "-c", "kill -9 $$"]);
    assert_eq!(out.status.code(), Some(128 + 9), "{out:?}");

    // --- exec: stdin from a pipe reaches the program, byte for byte.
    let mut input = vec![0u8; 64 << 10];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut input))
        .expect("urandom");
    let out = cli_with_stdin(&d, &["exec", "box", "--", "cat"], &input);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(
        out.stdout == input,
        "cat gave back {} bytes",
        out.stdout.len()
    );
    // -n: no stdin even from a pipe.
    let out = cli_with_stdin(&d, &["exec", "-n", "box", "--", "wc", "-c"], b"ignored");
    assert_eq!(text(&out.stdout).trim(), "0", "{}", text(&out.stderr));

    // --- exec --timeout: 124 within bounds, and the program is named.
    let started = Instant::now();
    let out = d.cli(&["exec", "box", "--timeout", "3s", "--", "sleep", "30"]);
    let took = started.elapsed();
    assert_eq!(out.status.code(), Some(124), "{out:?}");
    assert!(
        took >= Duration::from_secs(3) && took < Duration::from_secs(10),
        "--timeout 3s took {took:?}"
    );
    let err = text(&out.stderr);
    assert!(
        err.contains("\"sleep 30\"") && err.contains("pid "),
        "{err}"
    );

    // --- output too big for one agent reply fails saying so, and the
    // channel is fine afterwards.
    let started = Instant::now();
    let out = d.cli(&["exec", "box", "--", "head", "-c", "14000000", "/dev/zero"]);
    assert_eq!(out.status.code(), Some(125), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("hearth cp"),
        "{}",
        text(&out.stderr)
    );
    eprintln!("14 MB of output refused after {:?}", started.elapsed());
    let out = d.cli(&["exec", "box", "--", "echo", "still here"]);
    assert_eq!(text(&out.stdout), "still here\n", "{out:?}");

    // --- exec errors name what is wrong, with hearth's own status.
    let out = d.cli(&["exec", "box", "--", "no-such-program"]);
    assert_eq!(out.status.code(), Some(125), "{out:?}");
    assert!(text(&out.stderr).contains("no-such-program"), "{out:?}");
    let out = d.cli(&["exec", "ghost", "--", "true"]);
    assert_eq!(out.status.code(), Some(125), "{out:?}");
    assert!(text(&out.stderr).contains("\"ghost\""), "{out:?}");
    apply_manifest(
        &d,
        "idle.yaml",
        &format!(
            "{}---\n{}  guestAgent: false\n",
            vm_yaml("idle", "Manual", &[], ""),
            vm_yaml("mute", "Manual", &[], "")
        ),
    );
    let out = d.cli(&["exec", "idle", "--", "true"]);
    assert_eq!(out.status.code(), Some(125), "{out:?}");
    assert!(
        text(&out.stderr).contains("VirtualMachine \"idle\" is not running"),
        "{out:?}"
    );
    let err = d.cli_err(&["cp", "idle:/etc/hostname", "-"]);
    assert!(
        err.contains("VirtualMachine \"idle\" is not running"),
        "{err}"
    );
    let out = d.cli(&["exec", "mute", "--", "true"]);
    assert!(
        text(&out.stderr).contains("VirtualMachine \"mute\" has no guest agent"),
        "{out:?}"
    );

    // --- cp into the guest and back: same bytes, same mode.
    let blob = local.path().join("blob.bin");
    random_file(&blob, 1 << 20, 0o750);
    let digest = sha256_file(&blob);
    let started = Instant::now();
    d.cli_ok(&["cp", blob.to_str().expect("utf8"), "box:/data/blob.bin"]);
    let copy_in = started.elapsed();
    assert_eq!(guest_sha256(&d, "box", "/data/blob.bin"), digest);
    assert_eq!(
        d.agent_sh_ok("box", "stat -c %a /data/blob.bin").trim(),
        "750"
    );
    let back = local.path().join("back.bin");
    let started = Instant::now();
    d.cli_ok(&["cp", "box:/data/blob.bin", back.to_str().expect("utf8")]);
    let copy_out = started.elapsed();
    assert_eq!(sha256_file(&back), digest);
    let mode = std::fs::metadata(&back).expect("back").permissions().mode();
    assert_eq!(mode & 0o777, 0o750, "mode {mode:o}");
    eprintln!("1 MiB: into the guest {copy_in:?}, out of it {copy_out:?}");
    // Nothing left over on either side.
    let listing = d.agent_sh_ok("box", "ls -a /data");
    assert!(!listing.contains(".hearth-"), "{listing}");
    let names: Vec<String> = std::fs::read_dir(local.path())
        .expect("list")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    assert!(names.iter().all(|n| !n.contains(".hearth-")), "{names:?}");
    // To stdout, and into a guest directory under the source's name.
    let out = d.cli(&["cp", "box:/data/hello.txt", "-"]);
    assert_eq!(text(&out.stdout), "hello from hearth\n", "{out:?}");
    d.cli_ok(&["cp", blob.to_str().expect("utf8"), "box:/tmp/"]);
    assert_eq!(guest_sha256(&d, "box", "/tmp/blob.bin"), digest);
    // A name that needs escaping in the URL arrives as it is.
    d.cli_ok(&["cp", blob.to_str().expect("utf8"), "box:/tmp/a b&c+d.bin"]);
    assert_eq!(guest_sha256(&d, "box", "'/tmp/a b&c+d.bin'"), digest);

    // --- cp errors name the path.
    let missing = local.path().join("missing");
    let err = d.cli_err(&[
        "cp",
        "box:/data/no-such-file",
        missing.to_str().expect("utf8"),
    ]);
    assert!(err.contains("/data/no-such-file"), "{err}");
    assert!(err.contains("no such file"), "{err}");
    assert!(!missing.exists(), "a failed copy leaves no local file");
    let err = d.cli_err(&["cp", "box:/data", missing.to_str().expect("utf8")]);
    assert!(err.contains("/data is a directory"), "{err}");
    let err = d.cli_err(&["cp", blob.to_str().expect("utf8"), "box:/data"]);
    assert!(err.contains("/data is a directory"), "{err}");
    let err = d.cli_err(&["cp", blob.to_str().expect("utf8"), "box:/no-dir/x"]);
    assert!(err.contains("/no-dir does not exist"), "{err}");
    let err = d.cli_err(&["cp", local.path().to_str().expect("utf8"), "box:/data/x"]);
    assert!(err.contains("is a directory"), "{err}");

    // --- a long copy does not hold the channel: the agent answers a ping
    // at once meanwhile, and a snapshot cut of the disk being written is as
    // quick and consistent as one taken while nothing is copied.
    let (base, base_ready) = timed_snapshot(&d, "before-copy");
    assert_eq!(base["status"]["consistent"], true, "{base:#}");
    let base_window = base["status"]["freezeWindowMs"].as_u64().expect("window");
    let big = local.path().join("big.bin");
    random_file(&big, 16 << 20, 0o640);
    let big_digest = sha256_file(&big);
    let started = Instant::now();
    let mut copy = cli_spawn(
        &d,
        &["cp", big.to_str().expect("utf8"), "box:/data/big.bin"],
    );
    // The copy is under way once its temporary file has grown in the guest.
    wait_until(
        "the copy's temporary file in the guest",
        Duration::from_secs(30),
        || {
            let out = d.agent_sh_ok("box", "find /data -name '.big.bin.hearth-*' -size +64k");
            !out.trim().is_empty()
        },
    );
    let mut pings = Vec::new();
    for _ in 0..5 {
        let (status, v) = d.request("POST", "/v1/virtualmachines/box/agent/ping", None);
        assert_eq!(status, 200, "{v}");
        pings.push(v["ms"].as_u64().expect("ms"));
    }
    let (during, during_ready) = timed_snapshot(&d, "during-copy");
    assert!(
        copy.try_wait().expect("try_wait").is_none(),
        "the copy had already ended: the snapshot was not taken during it"
    );
    let status = copy.wait().expect("copy");
    let copy_took = started.elapsed();
    let mut err = String::new();
    copy.stderr
        .take()
        .expect("stderr")
        .read_to_string(&mut err)
        .expect("read");
    assert!(status.success(), "cp of 16 MiB: {err}");
    assert_eq!(during["status"]["consistent"], true, "{during:#}");
    let window = during["status"]["freezeWindowMs"].as_u64().expect("window");
    eprintln!(
        "16 MiB into the guest in {copy_took:?}; agent pings during it {pings:?} ms; \
         snapshot before: window {base_window} ms, Ready after {base_ready:?}; \
         during: window {window} ms, Ready after {during_ready:?}"
    );
    assert!(
        pings.iter().all(|ms| *ms < 1000),
        "the agent waited behind the copy: {pings:?} ms"
    );
    assert!(
        window < base_window + 1000,
        "freeze window {window} ms during the copy, {base_window} ms without"
    );
    assert!(
        during_ready < base_ready + Duration::from_secs(3),
        "Ready after {during_ready:?} during the copy, {base_ready:?} without"
    );
    assert_eq!(guest_sha256(&d, "box", "/data/big.bin"), big_digest);
    assert_eq!(
        d.agent_sh_ok("box", "stat -c %a /data/big.bin").trim(),
        "640"
    );
    let listing = d.agent_sh_ok("box", "ls -a /data");
    assert!(!listing.contains(".hearth-"), "{listing}");
}
