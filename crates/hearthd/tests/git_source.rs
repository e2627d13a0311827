//! A git repository as a source of desired state, against real remotes on
//! this machine: `git daemon` on 127.0.0.1 (the git:// transport) with a
//! booted VM, and a `file://` repository with disks only. Every state is
//! read from hearthd's objects and from the process table (the VM's QEMU
//! pid), every commit made and pushed with the `git` program.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::follow::Cli;
use common::git::{PgpKey, Remote, git, git_wrapper};
use common::*;
use serde_json::Value;

const SETTLE: Duration = Duration::from_secs(60);

/// `git daemon` serving `root` on 127.0.0.1; killed when dropped.
struct GitDaemon {
    child: Child,
    port: u16,
}

impl GitDaemon {
    fn start(root: &Path) -> GitDaemon {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        // The daemon itself, not `git daemon`: that one runs git-daemon as a
        // child of its own, which a kill of the parent would leave behind.
        let exec_path = git(root, &["--exec-path"]);
        let child = Command::new(Path::new(&exec_path).join("git-daemon"))
            .args([
                "--reuseaddr",
                "--listen=127.0.0.1",
                &format!("--port={port}"),
                &format!("--base-path={}", root.display()),
                "--export-all",
                root.to_str().unwrap(),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("git daemon (apt-get install git)");
        wait_until("git daemon listens", Duration::from_secs(20), || {
            std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
        });
        GitDaemon { child, port }
    }
}

impl Drop for GitDaemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn source(d: &Daemon, name: &str) -> Value {
    let (status, v) = d.request("GET", "/v1/sources", None);
    assert_eq!(status, 200, "{v:#}");
    v["sources"]
        .as_array()
        .and_then(|a| a.iter().find(|s| s["name"] == name).cloned())
        .unwrap_or_else(|| panic!("no source {name} in {v:#}"))
}

fn wait_source(d: &Daemon, name: &str, what: &str, f: impl Fn(&Value) -> bool) -> Value {
    let mut last = Value::Null;
    let ok = hearth_test_support::eventually(SETTLE, || {
        last = source(d, name);
        f(&last)
    });
    assert!(ok, "source {name}: {what}: {last:#}");
    last
}

fn vm_text(name: &str, cpus: u32) -> String {
    vm_yaml(name, "AlwaysOn", &[], "").replace(
        "  memory: 256Mi\n",
        &format!("  cpus: {cpus}\n  memory: 256Mi\n"),
    )
}

/// The VM's spec.cpus and its QEMU pid once it runs that spec.
fn running_with(d: &Daemon, vm: &str, cpus: u64) -> u32 {
    d.wait_vm(vm, &format!("Running with {cpus} cpus"), SETTLE, |v| {
        v["spec"]["cpus"] == cpus && v["status"]["phase"] == "Running"
    });
    let pids = d.qemu_pids_of(vm);
    assert_eq!(pids.len(), 1, "one QEMU of {vm}: {pids:?}");
    pids[0]
}

/// Holds for `for_` that the VM exists, runs the same QEMU, with `cpus`.
fn unchanged_for(d: &Daemon, vm: &str, pid: u32, cpus: u64, for_: Duration) {
    let end = std::time::Instant::now() + for_;
    while std::time::Instant::now() < end {
        let v = d.get_vm(vm).unwrap_or_else(|| panic!("{vm} was deleted"));
        assert_eq!(v["spec"]["cpus"], cpus, "{v:#}");
        assert_eq!(d.qemu_pids_of(vm), vec![pid], "{vm}'s QEMU changed");
        std::thread::sleep(Duration::from_millis(300));
    }
}

#[test]
fn a_vm_follows_its_branch_over_git_daemon_and_a_broken_remote_deletes_nothing() {
    let _serial = serial();
    let remote = Remote::new();
    let first = remote.commit(&[("vms/ga.yaml", Some(&vm_text("ga", 1)))], "ga with 1 cpu");
    let server = GitDaemon::start(&remote.root);
    let url = format!("git://127.0.0.1:{}/remote.git", server.port);
    let d = Daemon::start_with(&[
        "--git",
        &url,
        "--git-ref",
        "main",
        "--git-path",
        "vms",
        "--git-interval-seconds",
        "2",
        "--git-name",
        "lab",
    ]);

    // Applied by the first commit; its owner names the source and the file.
    let pid = running_with(&d, "ga", 1);
    let vm = d.get_vm("ga").unwrap();
    assert_eq!(vm["metadata"]["managedBy"], "git:lab:vms/ga.yaml", "{vm:#}");
    let s = wait_source(&d, "lab", "Ready at the first commit", |s| {
        s["state"] == "Ready" && s["appliedCommit"]["id"] == first.as_str()
    });
    assert_eq!(s["kind"], "git");
    assert_eq!(s["url"], url.as_str());
    // The API and the CLI refuse to change what the source declares.
    let err = d.cli_err(&["delete", "vm", "ga"]);
    assert!(err.contains("git:lab:vms/ga.yaml"), "{err}");

    // A spec edit is applied (the VM restarts with 2 CPUs); a refresh
    // fetches at once and answers after the apply.
    let second = remote.commit(
        &[("vms/ga.yaml", Some(&vm_text("ga", 2)))],
        "ga with 2 cpus",
    );
    let out = d.cli_ok(&["sources", "refresh", "lab"]);
    assert!(
        out.contains("Ready") && out.contains(&second[..12]),
        "{out}"
    );
    assert_eq!(d.get_vm("ga").unwrap()["spec"]["cpus"], 2);
    let pid = {
        let p = running_with(&d, "ga", 2);
        assert_ne!(p, pid, "a spec change restarts the VM");
        p
    };
    let listed = d.cli_ok(&["get", "sources"]);
    assert!(
        listed.contains("lab") && listed.contains("git") && listed.contains(&second[..12]),
        "{listed}"
    );

    // The remote goes away: Stale, the last good commit stands, the VM
    // runs on with the same QEMU.
    std::fs::rename(&remote.bare, remote.root.join("gone.git")).unwrap();
    let s = wait_source(&d, "lab", "Stale while the repository is gone", |s| {
        s["state"] == "Stale"
    });
    assert!(
        s["reason"].as_str().unwrap().contains("fetching main"),
        "{s:#}"
    );
    assert_eq!(s["appliedCommit"]["id"], second.as_str());
    unchanged_for(&d, "ga", pid, 2, Duration::from_secs(5));
    std::fs::rename(remote.root.join("gone.git"), &remote.bare).unwrap();
    wait_source(&d, "lab", "Ready again", |s| s["state"] == "Ready");

    // A commit without the folder, then one with no manifest in it: Stale,
    // nothing deleted.
    std::fs::rename(remote.work.join("vms"), remote.root.join("vms.away")).unwrap();
    let no_folder = remote.commit(&[("README.md", Some("no vms here\n"))], "no vms folder");
    let s = wait_source(&d, "lab", "Stale without the folder", |s| {
        s["state"] == "Stale" && s["fetchedCommit"]["id"] == no_folder.as_str()
    });
    assert!(
        s["reason"].as_str().unwrap().contains("has no folder"),
        "{s:#}"
    );
    remote.commit(
        &[("vms/notes.txt", Some("not a manifest\n"))],
        "no manifest",
    );
    let s = wait_source(&d, "lab", "Stale without a manifest", |s| {
        s["reason"]
            .as_str()
            .is_some_and(|r| r.contains("has no manifest"))
    });
    assert_eq!(s["appliedCommit"]["id"], second.as_str(), "{s:#}");
    unchanged_for(&d, "ga", pid, 2, Duration::from_secs(3));

    // A force push back to the first commit: followed, and said, also to
    // whoever follows the source's events.
    let mut follower = Cli::spawn(&d, &["events", "-w", "-o", "json", "--for", "source/lab"]);
    remote.force_push(&first);
    let s = wait_source(&d, "lab", "the first commit again", |s| {
        s["appliedCommit"]["id"] == first.as_str() && s["state"] == "Ready"
    });
    let events = s["events"].to_string();
    assert!(events.contains("HistoryRewritten"), "{s:#}");
    let pid = running_with(&d, "ga", 1);
    // The source's events are in the daemon's event log too, apart from
    // any object's: each reason of this test so far, in order.
    let logged: Vec<Value> = d
        .cli_ok(&["events", "--for", "source/lab", "-o", "json"])
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let reasons: Vec<&str> = logged
        .iter()
        .map(|e| e["reason"].as_str().unwrap())
        .collect();
    assert!(
        logged
            .iter()
            .all(|e| e["kind"] == "Source" && e["name"] == "lab"),
        "{logged:?}"
    );
    let at = |r: &str| reasons.iter().position(|x| *x == r);
    assert!(
        at("Stale").is_some() && at("Stale") < at("HistoryRewritten"),
        "{reasons:?}"
    );
    let table = d.cli_ok(&["events"]);
    assert!(
        table.contains("source/lab") && table.contains("HistoryRewritten"),
        "{table}"
    );
    let line = follower.line_with("the HistoryRewritten event", |l| {
        l.contains("HistoryRewritten")
    });
    let e: Value = serde_json::from_str(&line).expect("a JSON line");
    assert_eq!(
        (e["kind"].as_str(), e["name"].as_str()),
        (Some("Source"), Some("lab"))
    );
    follower.stop();

    // A file moved to another folder: the same object, not restarted.
    std::fs::create_dir_all(remote.work.join("vms/team")).unwrap();
    git(&remote.work, &["mv", "vms/ga.yaml", "vms/team/ga.yaml"]);
    let moved = remote.commit(&[], "move ga");
    wait_source(&d, "lab", "the move applied", |s| {
        s["appliedCommit"]["id"] == moved.as_str()
    });
    d.wait_vm("ga", "owned by its new path", SETTLE, |v| {
        v["metadata"]["managedBy"] == "git:lab:vms/team/ga.yaml"
    });
    unchanged_for(&d, "ga", pid, 1, Duration::from_secs(2));

    // A commit that removes the file deletes the VM and stops its QEMU.
    remote.commit(
        &[
            ("vms/team/ga.yaml", None),
            ("vms/keep.yaml", Some(&disk_text("git-keep"))),
        ],
        "ga removed",
    );
    wait_until("ga is deleted", SETTLE, || d.get_vm("ga").is_none());
    wait_until("ga's QEMU is gone", SETTLE, || {
        d.qemu_pids_of("ga").is_empty()
    });
    drop(server);
}

/// A daemon without guests following `url`'s main every second, with
/// `extra` flags.
fn following(url: &str, extra: &[&str]) -> Daemon {
    let mut args = vec![
        "--git",
        url,
        "--git-ref",
        "main",
        "--git-interval-seconds",
        "1",
    ];
    args.extend_from_slice(extra);
    Daemon::start_without_guest(&[], &args)
}

fn disk_exists(d: &Daemon, name: &str) -> bool {
    d.request("GET", &format!("/v1/virtualdisks/{name}"), None)
        .0
        == 200
}

/// A blank disk manifest.
fn disk_text(name: &str) -> String {
    format!(
        "apiVersion: hearth.dev/v1alpha1\nkind: VirtualDisk\nmetadata:\n  name: {name}\nspec:\n  source:\n    blank: {{}}\n  size: 16Mi\n"
    )
}

#[test]
fn a_burst_of_commits_over_file_settles_to_the_last_and_leaves_no_git_process() {
    let _serial = serial();
    let remote = Remote::new();
    remote.commit(&[("d0.yaml", Some(&disk_text("burst-0")))], "start");
    let d = following(&remote.url(), &[]);
    wait_until("burst-0 exists", SETTLE, || {
        d.request("GET", "/v1/virtualdisks/burst-0", None).0 == 200
    });
    // 50 commits, each adding a disk and removing the one before.
    let mut last = String::new();
    for i in 1..=50 {
        last = remote.commit(
            &[
                (
                    &format!("d{i}.yaml"),
                    Some(&disk_text(&format!("burst-{i}"))),
                ),
                (&format!("d{}.yaml", i - 1), None),
            ],
            &format!("burst {i}"),
        );
    }
    wait_source(&d, "git", "the last commit applied", |s| {
        s["appliedCommit"]["id"] == last.as_str()
    });
    wait_until("only burst-50 is left", SETTLE, || {
        let (_, v) = d.request("GET", "/v1/virtualdisks", None);
        let names: Vec<String> = v["items"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|o| o["status"]["phase"] != "Terminating")
            .map(|o| o["metadata"]["name"].as_str().unwrap_or("").to_string())
            .collect();
        names == ["burst-50"]
    });
    // An unknown source: the refresh says which exist.
    let (status, v) = d.request("POST", "/v1/sources/nope/refresh", None);
    assert_eq!(status, 404, "{v}");
    assert!(v["error"].as_str().unwrap().contains("git"), "{v}");
    // The source reads its cache through two `git cat-file` kept running,
    // not one per commit; no git process of this daemon outlives it.
    let state = d.dir.path().display().to_string();
    let gits = || -> Vec<String> {
        std::fs::read_dir("/proc")
            .unwrap()
            .filter_map(|e| {
                let cmd = std::fs::read(e.ok()?.path().join("cmdline")).ok()?;
                let text = String::from_utf8_lossy(&cmd).replace('\0', " ");
                (text.starts_with("git ") || text.contains("/git "))
                    .then_some(text)
                    .filter(|t| t.contains(&state))
            })
            .collect()
    };
    let readers: Vec<String> = gits()
        .into_iter()
        .filter(|t| t.contains("cat-file"))
        .collect();
    assert!(
        (1..=2).contains(&readers.len()),
        "the source's cat-file readers: {readers:?}"
    );
    drop(d);
    wait_until(
        "no git process of the daemon left",
        Duration::from_secs(10),
        || gits().is_empty(),
    );
}

/// An ed25519 key made by ssh-keygen in `dir`: its private key's path and
/// its public key's line.
fn ssh_key(dir: &Path, name: &str) -> (PathBuf, String) {
    let key = dir.join(name);
    let out = Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "", "-C", name, "-f"])
        .arg(&key)
        .output()
        .expect("ssh-keygen (apt-get install openssh-client)");
    assert!(out.status.success(), "{out:?}");
    let public = std::fs::read_to_string(key.with_extension("pub")).unwrap();
    (key, public.trim().to_string())
}

#[test]
fn only_commits_signed_by_an_allowed_key_are_applied() {
    let _serial = serial();
    let remote = Remote::new();
    let keys = remote.root.join("keys");
    std::fs::create_dir_all(&keys).unwrap();
    let (good, good_pub) = ssh_key(&keys, "good");
    let (other, _) = ssh_key(&keys, "other");
    let signers = keys.join("allowed_signers");
    std::fs::write(&signers, format!("test@hearth.invalid {good_pub}\n")).unwrap();
    let first = remote.commit_signed(
        &[("a.yaml", Some(&disk_text("signed-a")))],
        "signed a",
        Some(&good),
    );
    let d = following(
        &remote.url(),
        &["--git-allowed-signers", signers.to_str().unwrap()],
    );
    wait_source(&d, "git", "the signed commit applied", |s| {
        s["state"] == "Ready" && s["appliedCommit"]["id"] == first.as_str()
    });
    let exists = |name: &str| disk_exists(&d, name);
    assert!(exists("signed-a"));

    // Unsigned, then signed by a key not allowed: neither is applied.
    let unsigned = remote.commit(&[("b.yaml", Some(&disk_text("unsigned-b")))], "unsigned b");
    let s = wait_source(&d, "git", "Unverified (unsigned)", |s| {
        s["state"] == "Unverified" && s["fetchedCommit"]["id"] == unsigned.as_str()
    });
    assert_eq!(s["appliedCommit"]["id"], first.as_str(), "{s:#}");
    let stranger = remote.commit_signed(
        &[("c.yaml", Some(&disk_text("stranger-c")))],
        "other key",
        Some(&other),
    );
    let s = wait_source(&d, "git", "Unverified (unknown signer)", |s| {
        s["state"] == "Unverified" && s["fetchedCommit"]["id"] == stranger.as_str()
    });
    assert!(
        s["reason"]
            .as_str()
            .unwrap()
            .contains("not signed by a key of"),
        "{s:#}"
    );
    std::thread::sleep(Duration::from_secs(2));
    assert!(!exists("unsigned-b") && !exists("stranger-c"));

    // A good signature again: that commit (with everything before it) applies.
    let last = remote.commit_signed(
        &[("d.yaml", Some(&disk_text("signed-d")))],
        "signed d",
        Some(&good),
    );
    wait_source(&d, "git", "the signed tip applied", |s| {
        s["state"] == "Ready" && s["appliedCommit"]["id"] == last.as_str()
    });
    assert!(exists("signed-d") && exists("unsigned-b") && exists("stranger-c"));
}

#[test]
fn openpgp_signatures_by_an_allowed_key_apply_and_a_new_key_file_needs_no_restart() {
    let _serial = serial();
    let remote = Remote::new();
    let keys = remote.root.join("keys");
    std::fs::create_dir_all(&keys).unwrap();
    let good = PgpKey::new(&keys, "good");
    let other = PgpKey::new(&keys, "other");
    let (ssh, _) = ssh_key(&keys, "ssh");
    let allowed = keys.join("allowed.asc");
    std::fs::write(&allowed, &good.public).unwrap();
    let first = remote.commit_as(
        &[("a.yaml", Some(&disk_text("pgp-a")))],
        "signed a",
        Some(good.signing()),
    );
    let d = following(
        &remote.url(),
        &["--git-allowed-keys", allowed.to_str().unwrap()],
    );
    wait_source(&d, "git", "the signed commit applied", |s| {
        s["state"] == "Ready" && s["appliedCommit"]["id"] == first.as_str()
    });
    assert!(disk_exists(&d, "pgp-a"));

    // A key not in the file, then an ssh signature (no ssh key is allowed).
    let stranger = remote.commit_as(
        &[("b.yaml", Some(&disk_text("pgp-b")))],
        "other key",
        Some(other.signing()),
    );
    let s = wait_source(&d, "git", "Unverified (unknown key)", |s| {
        s["state"] == "Unverified" && s["fetchedCommit"]["id"] == stranger.as_str()
    });
    assert_eq!(s["appliedCommit"]["id"], first.as_str(), "{s:#}");
    assert!(
        s["reason"].as_str().unwrap().contains("allowed.asc"),
        "{s:#}"
    );
    let by_ssh = remote.commit_signed(
        &[("c.yaml", Some(&disk_text("pgp-c")))],
        "ssh signed",
        Some(&ssh),
    );
    let s = wait_source(&d, "git", "Unverified (ssh signature)", |s| {
        s["state"] == "Unverified" && s["fetchedCommit"]["id"] == by_ssh.as_str()
    });
    assert_eq!(s["appliedCommit"]["id"], first.as_str(), "{s:#}");
    assert!(!disk_exists(&d, "pgp-b") && !disk_exists(&d, "pgp-c"));

    // The other key allowed too, in the same file: read again at the next
    // fetch, no restart; its commit applies with everything before it.
    std::fs::write(&allowed, format!("{}{}", good.public, other.public)).unwrap();
    let last = remote.commit_as(
        &[("d.yaml", Some(&disk_text("pgp-d")))],
        "other key, now allowed",
        Some(other.signing()),
    );
    wait_source(&d, "git", "the newly allowed key's commit applied", |s| {
        s["state"] == "Ready" && s["appliedCommit"]["id"] == last.as_str()
    });
    for name in ["pgp-b", "pgp-c", "pgp-d"] {
        assert!(disk_exists(&d, name), "{name}");
    }
    // hearthd's gpg runs start no agent: nothing runs with its keyring
    // (the cache's `NAME.gnupg`).
    let keyring = d
        .state_dir()
        .join("git")
        .join("git.gnupg")
        .display()
        .to_string();
    let agents: Vec<String> = hearth_test_support::process::command_lines()
        .into_iter()
        .map(|(_, argv)| argv.join(" "))
        .filter(|l| l.contains(&keyring))
        .collect();
    assert!(agents.is_empty(), "{agents:?}");
}

/// sshd inside a network namespace, on 127.0.0.1:2222 there, letting in
/// root with the keys of `authorized_keys` only; killed when dropped (and
/// whatever it left dies with the namespace).
struct Sshd {
    child: Child,
    dir: PathBuf,
    /// The host's public key line, for a known_hosts file.
    host_public: String,
}

const SSHD_PORT: u16 = 2222;

impl Sshd {
    fn start(ns: &str, dir: &Path) -> Sshd {
        const INSTALL: &str = "apt-get install openssh-server";
        assert!(
            Path::new("/usr/sbin/sshd").exists(),
            "/usr/sbin/sshd is missing: {INSTALL}"
        );
        // sshd's privilege-separation directory (the package's service
        // makes it at boot; here nothing did).
        std::fs::create_dir_all("/run/sshd").unwrap();
        let (host_key, host_public) = ssh_key(dir, "host");
        let config = dir.join("sshd_config");
        std::fs::write(
            &config,
            format!(
                "Port {SSHD_PORT}\nListenAddress 127.0.0.1\nHostKey {}\nPidFile {}\n\
                 AuthorizedKeysFile {}\nStrictModes no\nUsePAM no\n\
                 PasswordAuthentication no\nKbdInteractiveAuthentication no\n\
                 PermitRootLogin prohibit-password\nAllowUsers root\n",
                host_key.display(),
                dir.join("sshd.pid").display(),
                dir.join("authorized_keys").display(),
            ),
        )
        .unwrap();
        std::fs::write(dir.join("authorized_keys"), "").unwrap();
        let child = Command::new("ip")
            .args(["netns", "exec", ns, "/usr/sbin/sshd", "-D", "-e", "-f"])
            .arg(&config)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("sshd.log")).unwrap())
            .spawn()
            .unwrap_or_else(|e| panic!("sshd: {e} ({INSTALL})"));
        let sshd = Sshd {
            child,
            dir: dir.to_path_buf(),
            host_public,
        };
        wait_until("sshd listens", Duration::from_secs(10), || {
            std::fs::read_to_string(dir.join("sshd.log"))
                .is_ok_and(|l| l.contains("Server listening"))
        });
        sshd
    }

    /// Lets in exactly the holder of `public`.
    fn authorize(&self, public: &str) {
        std::fs::write(self.dir.join("authorized_keys"), format!("{public}\n")).unwrap();
    }
}

impl Drop for Sshd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn a_repository_over_ssh_with_a_key_and_known_hosts_and_a_refused_host_or_key_deletes_nothing() {
    let _serial = serial();
    let remote = Remote::new();
    let keys = remote.root.join("ssh");
    std::fs::create_dir_all(&keys).unwrap();
    let (client, client_public) = ssh_key(&keys, "client");
    let (_, stranger_public) = ssh_key(&keys, "stranger");
    let (_, other_host_public) = ssh_key(&keys, "other-host");
    let known_hosts = keys.join("known_hosts");
    let first = remote.commit(&[("a.yaml", Some(&disk_text("ssh-a")))], "a");

    let d = Daemon::start_in_netns(
        &[],
        &[
            "--accel",
            "tcg",
            "--git",
            &format!("ssh://root@127.0.0.1:{SSHD_PORT}{}", remote.bare.display()),
            "--git-ref",
            "main",
            "--git-interval-seconds",
            "1",
            "--git-ssh-key-file",
            client.to_str().unwrap(),
            "--git-known-hosts-file",
            known_hosts.to_str().unwrap(),
        ],
    );
    let ns = d.netns.as_ref().unwrap().name.clone();
    let sshd = Sshd::start(&ns, &keys);
    let host_line = |public: &str| {
        // known_hosts names a host on another port as [HOST]:PORT; the
        // key line without its comment.
        let key: Vec<&str> = public.split_whitespace().take(2).collect();
        format!("[127.0.0.1]:{SSHD_PORT} {}\n", key.join(" "))
    };
    sshd.authorize(&client_public);
    std::fs::write(&known_hosts, host_line(&sshd.host_public)).unwrap();
    wait_source(&d, "git", "the first commit applied over ssh", |s| {
        s["state"] == "Ready" && s["appliedCommit"]["id"] == first.as_str()
    });
    assert!(disk_exists(&d, "ssh-a"));
    let log = std::fs::read_to_string(keys.join("sshd.log")).unwrap();
    assert!(log.contains("Accepted publickey for root"), "{log}");

    // The host presents a key known_hosts does not hold: refused (no host
    // is trusted on first use), the source Stale, nothing deleted.
    std::fs::write(&known_hosts, host_line(&other_host_public)).unwrap();
    let second = remote.commit(
        &[("a.yaml", None), ("b.yaml", Some(&disk_text("ssh-b")))],
        "a out, b in",
    );
    let s = wait_source(&d, "git", "Stale (unknown host key)", |s| {
        s["state"] == "Stale"
    });
    assert!(
        s["reason"]
            .as_str()
            .unwrap()
            .contains("Host key verification failed"),
        "{s:#}"
    );
    assert_eq!(s["appliedCommit"]["id"], first.as_str(), "{s:#}");
    std::thread::sleep(Duration::from_secs(2));
    assert!(disk_exists(&d, "ssh-a") && !disk_exists(&d, "ssh-b"));

    // The right host, but sshd no longer lets our key in.
    std::fs::write(&known_hosts, host_line(&sshd.host_public)).unwrap();
    sshd.authorize(&stranger_public);
    let s = wait_source(&d, "git", "Stale (key refused)", |s| {
        s["state"] == "Stale"
            && s["reason"]
                .as_str()
                .is_some_and(|r| r.contains("Permission denied"))
    });
    assert_eq!(s["appliedCommit"]["id"], first.as_str(), "{s:#}");
    assert!(disk_exists(&d, "ssh-a") && !disk_exists(&d, "ssh-b"));

    // Let in again: the commit waiting since then applies.
    sshd.authorize(&client_public);
    wait_source(&d, "git", "the second commit applied", |s| {
        s["state"] == "Ready" && s["appliedCommit"]["id"] == second.as_str()
    });
    wait_until("b in, a out", SETTLE, || {
        disk_exists(&d, "ssh-b") && !disk_exists(&d, "ssh-a")
    });
    drop(sshd);
}

/// `git http-backend` behind a plain HTTP server on 127.0.0.1 that wants
/// Basic auth with one user and token; each request is served by a thread
/// of its own and answered with `Connection: close`. Records whether each
/// request carried the right credentials.
struct HttpGit {
    port: u16,
    seen: std::sync::Arc<std::sync::Mutex<Vec<(String, bool)>>>,
}

fn base64_of(text: &str) -> String {
    let mut child = Command::new("base64")
        .args(["-w", "0"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("base64 (coreutils)");
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

impl HttpGit {
    fn start(root: &Path, user: &str, token: &str) -> HttpGit {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let want = format!("Basic {}", base64_of(&format!("{user}:{token}")));
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let (root, log) = (root.to_path_buf(), seen.clone());
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let (root, want, log) = (root.clone(), want.clone(), log.clone());
                std::thread::spawn(move || {
                    let _ = serve_cgi(stream, &root, &want, &log);
                });
            }
        });
        HttpGit { port, seen }
    }
}

fn serve_cgi(
    mut stream: std::net::TcpStream,
    root: &Path,
    want_auth: &str,
    log: &std::sync::Mutex<Vec<(String, bool)>>,
) -> std::io::Result<()> {
    use std::io::{BufRead, BufReader, Read, Write};
    stream.set_read_timeout(Some(Duration::from_secs(30)))?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let mut parts = line.split_whitespace();
    let method = parts.next().unwrap_or("").to_string();
    let target = parts.next().unwrap_or("").to_string();
    let mut headers = Vec::new();
    loop {
        let mut h = String::new();
        reader.read_line(&mut h)?;
        let h = h.trim_end().to_string();
        if h.is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            headers.push((k.trim().to_ascii_lowercase(), v.trim().to_string()));
        }
    }
    let header = |k: &str| headers.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
    let mut body = Vec::new();
    if let Some(n) = header("content-length").and_then(|n| n.parse::<usize>().ok()) {
        body.resize(n, 0);
        reader.read_exact(&mut body)?;
    } else if header("transfer-encoding").is_some_and(|t| t.contains("chunked")) {
        loop {
            let mut size = String::new();
            reader.read_line(&mut size)?;
            let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
            let mut chunk = vec![0; n + 2];
            reader.read_exact(&mut chunk)?;
            if n == 0 {
                break;
            }
            body.extend_from_slice(&chunk[..n]);
        }
    }
    let authorized = header("authorization").as_deref() == Some(want_auth);
    log.lock().unwrap().push((target.clone(), authorized));
    if !authorized {
        stream.write_all(
            b"HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: Basic realm=\"git\"\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
        )?;
        return Ok(());
    }
    let (path, query) = target.split_once('?').unwrap_or((&target, ""));
    let mut cgi = Command::new("git");
    cgi.arg("http-backend")
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .env("GIT_PROJECT_ROOT", root)
        .env("GIT_HTTP_EXPORT_ALL", "1")
        .env("REQUEST_METHOD", &method)
        .env("PATH_INFO", path)
        .env("QUERY_STRING", query)
        .env("REMOTE_USER", "deploy")
        .env("REMOTE_ADDR", "127.0.0.1")
        .env("CONTENT_LENGTH", body.len().to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    if let Some(t) = header("content-type") {
        cgi.env("CONTENT_TYPE", t);
    }
    if let Some(p) = header("git-protocol") {
        cgi.env("GIT_PROTOCOL", p);
    }
    if let Some(e) = header("content-encoding") {
        cgi.env("HTTP_CONTENT_ENCODING", e);
    }
    let mut child = cgi.spawn()?;
    let mut stdin = child.stdin.take().unwrap();
    let writer = std::thread::spawn(move || stdin.write_all(&body));
    let out = child.wait_with_output()?;
    let _ = writer.join();
    let split = out
        .stdout
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|i| (i, 4))
        .or_else(|| {
            out.stdout
                .windows(2)
                .position(|w| w == b"\n\n")
                .map(|i| (i, 2))
        })
        .unwrap_or((0, 0));
    let cgi_headers = String::from_utf8_lossy(&out.stdout[..split.0]).to_string();
    let cgi_body = &out.stdout[split.0 + split.1..];
    let mut status = "200 OK".to_string();
    let mut response = String::new();
    for h in cgi_headers.lines().filter(|l| !l.trim().is_empty()) {
        match h.split_once(':') {
            Some((k, v)) if k.eq_ignore_ascii_case("status") => status = v.trim().to_string(),
            _ => response.push_str(&format!("{}\r\n", h.trim_end())),
        }
    }
    stream.write_all(
        format!(
            "HTTP/1.1 {status}\r\n{response}Content-Length: {}\r\nConnection: close\r\n\r\n",
            cgi_body.len()
        )
        .as_bytes(),
    )?;
    stream.write_all(cgi_body)?;
    Ok(())
}

/// A TLS terminator on 127.0.0.1 (`socat`, OpenSSL) in front of a plain
/// server, with a certificate of a test CA; killed with its per-connection
/// children when dropped.
struct TlsFront {
    child: Child,
    port: u16,
}

impl TlsFront {
    fn start(ca: &hearth_test_support::tls::TestCa, to_port: u16) -> TlsFront {
        use std::os::unix::process::CommandExt;
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = Command::new("socat")
            .arg(format!(
                "OPENSSL-LISTEN:{port},bind=127.0.0.1,reuseaddr,fork,cert={},key={},verify=0",
                ca.certificate().display(),
                ca.key().display()
            ))
            .arg(format!("TCP:127.0.0.1:{to_port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .expect("socat (apt-get install socat; .ci/install-deps.sh does)");
        wait_until("socat listens", Duration::from_secs(20), || {
            std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
        });
        TlsFront { child, port }
    }
}

impl Drop for TlsFront {
    fn drop(&mut self) {
        if let Some(group) = rustix::process::Pid::from_raw(self.child.id() as i32) {
            let _ = rustix::process::kill_process_group(group, rustix::process::Signal::KILL);
        }
        let _ = self.child.wait();
    }
}

#[test]
fn a_token_over_https_is_sent_only_to_a_server_of_the_trusted_ca_and_a_wrong_one_leaves_the_source_stale()
 {
    let _serial = serial();
    let remote = Remote::new();
    let first = remote.commit(&[("a.yaml", Some(&disk_text("http-a")))], "a");
    let server = HttpGit::start(&remote.root, "deploy", "s3cret-token");
    let ca = hearth_test_support::tls::TestCa::new(&remote.root.join("ca"), "hearth git CA");
    let other = hearth_test_support::tls::TestCa::new(&remote.root.join("other"), "other CA");
    let front = TlsFront::start(&ca, server.port);
    let trusted = remote.root.join("trusted.pem");
    std::fs::copy(ca.ca(), &trusted).unwrap();
    let token = remote.root.join("token");
    std::fs::write(&token, "s3cret-token\n").unwrap();
    let url = format!("https://127.0.0.1:{}/remote.git", front.port);
    let d = following(
        &url,
        &[
            "--git-username",
            "deploy",
            "--git-token-file",
            token.to_str().unwrap(),
            "--git-ca-file",
            trusted.to_str().unwrap(),
        ],
    );
    wait_source(&d, "git", "applied over https with the token", |s| {
        s["state"] == "Ready" && s["appliedCommit"]["id"] == first.as_str()
    });
    let exists = |name: &str| disk_exists(&d, name);
    assert!(exists("http-a"));
    // Requests, not connections: socat connects to the server for a
    // client whose handshake then fails, which sends nothing.
    let served = || {
        let seen = server.seen.lock().unwrap();
        seen.iter().filter(|(target, _)| !target.is_empty()).count()
    };
    // The plain server is reached only through the TLS front.
    assert!(served() > 0);
    {
        let seen = server.seen.lock().unwrap();
        assert!(seen.iter().all(|(t, ok)| *ok || t.is_empty()), "{seen:?}");
    }
    // A rotated token, wrong: Stale, nothing changes; read again at each
    // fetch, so the right one brings the source back without a restart.
    std::fs::write(&token, "wrong\n").unwrap();
    let second = remote.commit(&[("b.yaml", Some(&disk_text("http-b")))], "b");
    let s = wait_source(&d, "git", "Stale with a wrong token", |s| {
        s["state"] == "Stale"
    });
    let reason = s["reason"].as_str().unwrap();
    assert!(
        !reason.contains("wrong") && !reason.contains("s3cret"),
        "{reason}"
    );
    assert!(exists("http-a") && !exists("http-b"));
    std::fs::write(&token, "s3cret-token").unwrap();
    wait_source(&d, "git", "the second commit applied", |s| {
        s["state"] == "Ready" && s["appliedCommit"]["id"] == second.as_str()
    });
    assert!(exists("http-a") && exists("http-b"));

    // The server's certificate no longer chains to the trusted CA (the
    // file now holds another one): no request reaches the server, so the
    // token is not sent; Stale, nothing changes. The CA back, the commit
    // that waited applies, without a restart.
    std::fs::copy(other.ca(), &trusted).unwrap();
    let third = remote.commit(&[("c.yaml", Some(&disk_text("http-c")))], "c");
    let s = wait_source(&d, "git", "Stale with an untrusted certificate", |s| {
        s["state"] == "Stale"
    });
    let reason = s["reason"].as_str().unwrap();
    assert!(reason.contains("certificate"), "{reason}");
    assert_eq!(s["appliedCommit"]["id"], second.as_str(), "{s:#}");
    // Fetches run one at a time: every one begun since this Stale reads
    // the new file, and two intervals give at least one more.
    let syncs = |s: Value| s["syncs"].as_u64().unwrap();
    let (before, fetches) = (served(), syncs(source(&d, "git")));
    std::thread::sleep(Duration::from_secs(3));
    assert!(syncs(source(&d, "git")) > fetches, "no fetch ran meanwhile");
    assert_eq!(
        served(),
        before,
        "a request passed an untrusted certificate"
    );
    assert!(exists("http-b") && !exists("http-c"));
    std::fs::copy(ca.ca(), &trusted).unwrap();
    wait_source(&d, "git", "the third commit applied", |s| {
        s["state"] == "Ready" && s["appliedCommit"]["id"] == third.as_str()
    });
    assert!(exists("http-c"));
    drop(front);
}

#[test]
fn a_daemon_killed_between_fetch_and_apply_applies_that_commit_once_after_a_restart() {
    let _serial = serial();
    let remote = Remote::new();
    let first = remote.commit(&[("a.yaml", Some(&disk_text("crash-a")))], "a");
    // A `git` ahead in hearthd's PATH: the real one, then, once the trigger
    // file exists, a SIGKILL to hearthd right after a fetch has landed.
    let trigger = remote.root.join("kill-after-fetch");
    let path = git_wrapper(
        &remote.root,
        &format!(
            "$REAL \"$@\"\nrc=$?\ncase \" $* \" in *\" fetch \"*)\n  if [ -e {t} ]; then rm -f {t}; kill -9 $PPID; fi;;\nesac\nexit $rc\n",
            t = trigger.display()
        ),
    );
    let env = [("PATH", path.as_str())];
    let mut d = Daemon::start_without_guest_env(
        &[],
        &[
            "--git",
            &remote.url(),
            "--git-ref",
            "main",
            "--git-interval-seconds",
            "1",
        ],
        &env,
    );
    wait_source(&d, "git", "the first commit applied", |s| {
        s["appliedCommit"]["id"] == first.as_str()
    });

    std::fs::write(&trigger, "").unwrap();
    let second = remote.commit(&[("b.yaml", Some(&disk_text("crash-b")))], "b");
    let died = hearth_test_support::eventually(SETTLE, || {
        d.child
            .as_mut()
            .is_some_and(|c| c.try_wait().ok().flatten().is_some())
    });
    assert!(died, "hearthd was not killed after a fetch:\n{}", d.log());
    assert!(!trigger.exists(), "the kill came from the wrapper");
    d.kill();
    // What the fetch left in the cache: the second commit, not applied.
    let cache = d.dir.path().join("state/git/git.git");
    let fetched = git(
        &cache,
        &["--git-dir", ".", "rev-parse", "refs/hearth/fetched"],
    );
    assert_eq!(fetched, second);
    let applied = git(
        &cache,
        &["--git-dir", ".", "rev-parse", "refs/hearth/applied"],
    );
    assert_eq!(applied, first);

    d.spawn_env(&env);
    wait_source(
        &d,
        "git",
        "the second commit applied after the restart",
        |s| s["state"] == "Ready" && s["appliedCommit"]["id"] == second.as_str(),
    );
    let (status, b) = d.request("GET", "/v1/virtualdisks/crash-b", None);
    assert_eq!(status, 200, "{b}");
    assert_eq!(b["metadata"]["generation"], 1, "applied once: {b:#}");
    let (_, a) = d.request("GET", "/v1/virtualdisks/crash-a", None);
    assert_eq!(a["metadata"]["generation"], 1, "not applied again: {a:#}");
}

#[test]
fn the_same_object_in_the_directory_and_a_repository_is_a_conflict_that_changes_nothing() {
    let _serial = serial();
    let remote = Remote::new();
    let disk = |size: &str| disk_text("shared").replace("16Mi", size);
    remote.commit(&[("own.yaml", Some(&disk_text("git-own")))], "own");
    let dir = tempfile::Builder::new()
        .prefix("hearth-e2e-")
        .tempdir()
        .unwrap();
    let manifests = dir.path().join("manifests");
    std::fs::create_dir_all(&manifests).unwrap();
    std::fs::write(manifests.join("shared.yaml"), disk("16Mi")).unwrap();
    let d = Daemon::start_without_guest_in(
        dir,
        &[],
        &[
            "--git",
            &remote.url(),
            "--git-ref",
            "main",
            "--git-interval-seconds",
            "1",
        ],
    );
    wait_until(
        "the directory's disk and the repository's exist",
        SETTLE,
        || {
            d.request("GET", "/v1/virtualdisks/shared", None).0 == 200
                && d.request("GET", "/v1/virtualdisks/git-own", None).0 == 200
        },
    );
    // The repository declares the directory's object too.
    let both = remote.commit(&[("shared.yaml", Some(&disk("32Mi")))], "shared too");
    let s = wait_source(&d, "git", "a conflict reported", |s| {
        s["state"] == "Conflict" && s["appliedCommit"]["id"] == both.as_str()
    });
    let problems = s["problems"].to_string();
    assert!(
        problems.contains("shared") && problems.contains("owned by the manifest file"),
        "{s:#}"
    );
    // The directory's declaration stands.
    std::thread::sleep(Duration::from_secs(2));
    let (_, shared) = d.request("GET", "/v1/virtualdisks/shared", None);
    assert_eq!(shared["spec"]["size"], "16Mi", "{shared:#}");
    assert!(
        shared["metadata"]["managedBy"]
            .as_str()
            .unwrap()
            .starts_with("file:"),
        "{shared:#}"
    );
}

#[test]
fn a_fetch_that_hangs_dies_with_a_killed_daemon() {
    let _serial = serial();
    let remote = Remote::new();
    remote.commit(&[("a.yaml", Some(&disk_text("hang-a")))], "a");
    // A `git` whose fetch hangs (it becomes a sleep of an odd length, to be
    // found in the process table) once the trigger file exists.
    let trigger = remote.root.join("hang");
    let path = git_wrapper(
        &remote.root,
        &format!(
            "case \" $* \" in *\" fetch \"*)\n  if [ -e {t} ]; then exec sleep 313.37; fi;;\nesac\nexec $REAL \"$@\"\n",
            t = trigger.display()
        ),
    );
    let mut d = Daemon::start_without_guest_env(
        &[],
        &[
            "--git",
            &remote.url(),
            "--git-ref",
            "main",
            "--git-interval-seconds",
            "1",
        ],
        &[("PATH", path.as_str())],
    );
    wait_until("hang-a exists", SETTLE, || {
        d.request("GET", "/v1/virtualdisks/hang-a", None).0 == 200
    });
    std::fs::write(&trigger, "").unwrap();
    let sleeping = || -> Vec<u32> {
        std::fs::read_dir("/proc")
            .unwrap()
            .filter_map(|e| {
                let e = e.ok()?;
                let pid: u32 = e.file_name().to_str()?.parse().ok()?;
                let cmd = std::fs::read(e.path().join("cmdline")).ok()?;
                (cmd == b"sleep\x00313.37\x00").then_some(pid)
            })
            .collect()
    };
    wait_until("a fetch hangs", SETTLE, || !sleeping().is_empty());
    d.kill();
    wait_until(
        "the hanging fetch died with hearthd",
        Duration::from_secs(10),
        || sleeping().is_empty(),
    );
}
