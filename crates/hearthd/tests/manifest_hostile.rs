//! Hostile input from a local user who can write manifests: nesting that
//! would keep the YAML parser busy for minutes (in a manifest file, through
//! `hearth apply -f`, and inside an API apply body's cloud-init YAML), and a
//! manifest replaced by something that is not a regular file. The daemon
//! keeps answering, nothing declared is lost, and each error names the file
//! or object and the line or field.

mod common;
mod manifest_support;

use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::*;
use manifest_support::*;
use serde_json::{Value, json};

/// `{a: {a: {a: ...`: libyaml's scanner keeps a possible simple key per flow
/// level and checks each of them on every token, so each level costs time
/// proportional to the depth so far (a quadratic parse).
fn nested_mappings(bytes: usize) -> String {
    "{a: ".repeat(bytes / 4)
}

/// `[[[[...`: the same with flow sequences.
fn nested_lists(bytes: usize) -> String {
    "[".repeat(bytes)
}

/// Longest an answer may take while hostile input is being dealt with.
const ANSWER: Duration = Duration::from_secs(1);

/// `hearth get vm` and `GET /v1/sources`, each timed: both answer within
/// [`ANSWER`].
#[track_caller]
fn assert_answers(env: &Env, when: &str) {
    let started = Instant::now();
    let out = env.d.cli(&["get", "vm"]);
    let took = started.elapsed();
    assert!(
        out.status.success(),
        "{when}: hearth get vm: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(took < ANSWER, "{when}: hearth get vm took {took:?}");
    let started = Instant::now();
    let (status, v) = env.d.request("GET", "/v1/sources", None);
    let took = started.elapsed();
    assert_eq!(status, 200, "{when}: {v}");
    assert!(took < ANSWER, "{when}: GET /v1/sources took {took:?}");
}

/// Runs a command, killed after `deadline`: its output, or None if it had to
/// be killed.
fn run_with_deadline(mut command: Command, deadline: Duration) -> (Option<Output>, Duration) {
    let started = Instant::now();
    let mut child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    if eventually_every(Duration::from_millis(20), deadline, || {
        child.try_wait().expect("wait").is_some()
    }) {
        let out = child.wait_with_output().expect("output");
        return (Some(out), started.elapsed());
    }
    let _ = child.kill();
    let _ = child.wait();
    (None, started.elapsed())
}

/// A manifest that nests deeper than any object needs is refused at once,
/// before the YAML parser sees it: the pipeline applies other files at once,
/// `GET /v1/sources` and `hearth get vm` answer, and the file's objects are
/// held with an error naming the line and column.
#[test]
fn deeply_nested_manifests_are_refused_at_once_and_block_nothing() {
    let _serial = serial();
    let env = Env::start();
    env.write("keep.yaml", &vm_text("keep", "AlwaysOff", "256Mi"));
    env.wait_generation("keep", 1);
    assert_answers(&env, "before");

    // 400 KB each: a valid manifest replaced by nested mappings, a new
    // file of nested lists, and right after them an ordinary new file.
    let written = Instant::now();
    env.write("keep.yaml", &nested_mappings(400_000));
    env.write("lists.yaml", &nested_lists(400_000));
    env.write("after.yaml", &vm_text("after", "AlwaysOff", "256Mi"));
    env.until(
        "the file written after the nested ones is applied",
        Duration::from_secs(15),
        || env.generation("after") == 1,
    );
    eprintln!(
        "after.yaml applied {:?} after the writes",
        written.elapsed()
    );
    // The nested files are still there: the daemon keeps answering.
    for i in 0..5 {
        assert_answers(&env, &format!("with the nested files there ({i})"));
        // Deliberate: the daemon answers over a second, not only once.
        std::thread::sleep(Duration::from_millis(200));
    }

    let keep = env.source_file("keep.yaml").expect("keep.yaml listed");
    assert_eq!(keep["valid"], false, "{keep}");
    let error = keep["error"].as_str().unwrap_or_default();
    assert!(
        error.starts_with("line 1, column 129: ") && error.contains("nested more than 32"),
        "{keep}"
    );
    assert_eq!(keep["objects"][0]["state"], "Held", "{keep}");
    let lists = env.source_file("lists.yaml").expect("lists.yaml listed");
    let error = lists["error"].as_str().unwrap_or_default();
    assert!(
        error.starts_with("line 1, column 33: ") && error.contains("nested more than 32"),
        "{lists}"
    );

    // Nothing lost: the VM keeps its last good state; the event names the file.
    assert_eq!(env.generation("keep"), 1);
    assert_eq!(env.memory("keep").as_deref(), Some("256Mi"));
    let condition = env.condition("keep").expect("condition");
    assert_eq!(condition["status"], "False", "{condition}");
    let event = env
        .d
        .events("VirtualMachine", "keep")
        .into_iter()
        .find(|e| e["reason"] == "ManifestInvalid")
        .expect("a ManifestInvalid event");
    let message = event["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("/manifests/keep.yaml") && message.contains("line 1, column 129"),
        "{message}"
    );

    // Fixed: applied again.
    env.write("keep.yaml", &vm_text("keep", "AlwaysOff", "320Mi"));
    env.wait_generation("keep", 2);
    env.assert_settled();
    assert_answers(&env, "at the end");
}

/// A manifest within the limits but slow to parse: about 4 MiB of 100,000
/// quoted strings (under a field no VM has, so it is refused once parsed).
fn slow_manifest(name: &str) -> String {
    let value = format!("\"{}\", ", "0123456789".repeat(3));
    format!(
        "apiVersion: hearth.dev/v1alpha1\nkind: VirtualMachine\nmetadata:\n  name: {name}\nspec:\n  padding: [{}1]\n",
        value.repeat(99_000)
    )
}

/// Large files are parsed on threads of their own, two at a time: a file
/// written with them is applied at once, `GET /v1/sources` and `hearth get
/// vm` answer while they parse, and each is listed with its error once done.
#[test]
fn large_manifests_parse_in_the_background_and_hold_up_nothing() {
    let _serial = serial();
    let env = Env::start();
    let big: Vec<String> = (0..4).map(|i| format!("big{i}.yaml")).collect();
    let written = Instant::now();
    for (i, name) in big.iter().enumerate() {
        env.write(name, &slow_manifest(&format!("big{i}")));
    }
    env.write("after.yaml", &vm_text("after", "AlwaysOff", "256Mi"));
    env.until(
        "the small file written after the large ones is applied",
        Duration::from_secs(5),
        || env.generation("after") == 1,
    );
    eprintln!(
        "after.yaml applied {:?} after the writes",
        written.elapsed()
    );
    let mut saw_parsing = false;
    let mut files: Vec<Value> = Vec::new();
    let all_parsed = eventually_every(Duration::from_millis(200), Duration::from_secs(120), || {
        assert_answers(&env, "while the large files parse");
        files = big.iter().filter_map(|n| env.source_file(n)).collect();
        saw_parsing |= files.iter().any(|f| f["parsing"] == true);
        files.len() == big.len()
            && files.iter().all(|f| {
                f["error"]
                    .as_str()
                    .is_some_and(|e| e.contains("spec.padding: unknown field"))
            })
    });
    assert!(all_parsed, "not all parsed: {files:#?}");
    eprintln!("all four parsed {:?} after the writes", written.elapsed());
    let sources = env.sources();
    assert!(saw_parsing, "no file was seen parsing: {sources:#}");
    assert!(
        sources["relists"]["parsed"].as_u64().unwrap_or(0) >= 1,
        "no re-list picked up a background parse: {sources:#}"
    );
    assert_eq!(env.generation("after"), 1);
}

/// `hearth apply -f` of a nested file (and of one larger than a manifest may
/// be) fails at once, naming the file and the line.
#[test]
fn hearth_apply_of_a_deeply_nested_or_oversized_file_fails_at_once() {
    let _serial = serial();
    let d = Daemon::start();
    let nested = manifest(&d, "nested.yaml", &nested_mappings(200_000));
    let lists = manifest(&d, "lists.yaml", &nested_lists(200_000));
    let mut big = vm_yaml("big", "AlwaysOff", &[], "");
    let filler = format!("# {}\n", "x".repeat(1000));
    while big.len() <= 5 << 20 {
        big.push_str(&filler);
    }
    let big = manifest(&d, "big.yaml", &big);

    for (path, expected) in [
        (&nested, "line 1, column 129: "),
        (&lists, "line 1, column 33: "),
    ] {
        let arg = path.to_str().expect("utf8");
        let (out, took) = run_with_deadline(
            d.cli_command(&["apply", "-f", arg], Stdio::null()),
            Duration::from_secs(20),
        );
        let out =
            out.unwrap_or_else(|| panic!("hearth apply -f {arg}: still running after {took:?}"));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{arg}: {stderr}");
        assert!(
            stderr.contains(&format!("{arg}: {expected}"))
                && stderr.contains("nested more than 32"),
            "{stderr}"
        );
        eprintln!("hearth apply -f {arg}: refused in {took:?}");
    }

    // From stdin too.
    let mut command = d.cli_command(&["apply", "-f", "-"], Stdio::piped());
    command.stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = command.spawn().expect("spawn");
    let mut stdin = child.stdin.take().expect("stdin");
    let text = nested_mappings(200_000);
    let writer = std::thread::spawn(move || {
        // The CLI may stop reading early: a broken pipe is fine.
        let _ = std::io::Write::write_all(&mut stdin, text.as_bytes());
    });
    if !eventually_every(Duration::from_millis(20), Duration::from_secs(20), || {
        child.try_wait().expect("wait").is_some()
    }) {
        let _ = child.kill();
        panic!("hearth apply -f - still running after 20 s");
    }
    let out = child.wait_with_output().expect("output");
    writer.join().expect("writer");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("<stdin>: line 1, column 129: ") && stderr.contains("nested more than 32"),
        "{stderr}"
    );

    let arg = big.to_str().expect("utf8");
    let err = d.cli_err(&["apply", "-f", arg]);
    assert!(
        err.contains(arg) && err.contains("larger than") && err.contains("4194304 bytes"),
        "{err}"
    );
    assert!(d.get_vm("big").is_none(), "nothing applied");
}

/// An apply body's cloud-init YAML (`networkConfig`, `#cloud-config`
/// userData) is parsed by validation: nested, it is refused at once with the
/// object and the field, while other requests are answered.
#[test]
fn an_apply_body_with_deeply_nested_cloud_init_yaml_is_refused_at_once() {
    let _serial = serial();
    let env = Env::start();
    let guest = guest_dir();
    let vm = |name: &str, field: &str, text: String| -> Value {
        json!({
            "apiVersion": "hearth.dev/v1alpha1",
            "kind": "VirtualMachine",
            "metadata": {"name": name},
            "spec": {
                "runPolicy": "AlwaysOff",
                "boot": {"kernel": guest.join("vmlinuz"), "initrd": guest.join("initrd.img")},
                "cloudInit": {field: text},
            },
        })
    };
    let bodies = [
        (
            vm("nc", "networkConfig", nested_mappings(240_000)),
            "spec.cloudInit.networkConfig",
        ),
        (
            vm(
                "ud",
                "userData",
                format!("#cloud-config\n{}", nested_mappings(240_000)),
            ),
            "spec.cloudInit.userData",
        ),
    ];
    let socket = env.d.socket();
    let requests: Vec<_> = bodies
        .iter()
        .map(|(item, field)| {
            let body = json!({"items": [item]});
            let socket = socket.clone();
            let field = field.to_string();
            std::thread::spawn(move || {
                let started = Instant::now();
                let answer = raw_request(&socket, "POST", "/v1/apply", Some(&body));
                (field, answer, started.elapsed())
            })
        })
        .collect();
    for i in 0..5 {
        assert_answers(
            &env,
            &format!("while the nested bodies are validated ({i})"),
        );
        // Deliberate: the daemon answers all along the validations.
        std::thread::sleep(Duration::from_millis(200));
    }
    for r in requests {
        let (field, answer, took) = r.join().expect("request thread");
        let (status, body) = answer.unwrap_or_else(|e| panic!("{field}: {e} after {took:?}"));
        let body = String::from_utf8_lossy(&body);
        assert_eq!(status, 400, "{field}: {body}");
        assert!(
            body.contains(&field) && body.contains("line ") && body.contains("nested more than 32"),
            "{field}: {body}"
        );
        assert!(
            took < Duration::from_secs(5),
            "{field}: answered after {took:?}"
        );
    }
    assert!(env.vm("nc").is_none() && env.vm("ud").is_none());

    // The body's own JSON nesting stops at serde_json's recursion limit.
    let deep = format!("{{\"items\": [{}]}}", "[".repeat(100_000));
    let started = Instant::now();
    let (status, body) = raw_request_bytes(&socket, "/v1/apply", deep.as_bytes());
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("recursion limit"), "{body}");
    assert!(started.elapsed() < Duration::from_secs(5));
}

/// A POST of raw bytes (not a JSON value).
fn raw_request_bytes(socket: &Path, path: &str, body: &[u8]) -> (u16, String) {
    use std::io::{Read, Write};
    let mut stream = std::os::unix::net::UnixStream::connect(socket).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(120)))
        .expect("timeout");
    write!(
        stream,
        "POST {path} HTTP/1.1\r\nHost: hearthd\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .expect("write");
    stream.write_all(body).expect("write");
    let mut buf = Vec::new();
    stream.read_to_end(&mut buf).expect("read");
    let text = String::from_utf8_lossy(&buf).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (status, text)
}

/// What a manifest path is replaced by.
#[derive(Clone, Copy, Debug)]
enum Replacement {
    SymlinkToDevZero,
    SymlinkToDirectory,
    Fifo,
    Socket,
    Directory,
    DanglingSymlink,
    SymlinkLoop,
    TooLarge,
}

impl Replacement {
    const ALL: [Replacement; 8] = [
        Replacement::SymlinkToDevZero,
        Replacement::SymlinkToDirectory,
        Replacement::Fifo,
        Replacement::Socket,
        Replacement::Directory,
        Replacement::DanglingSymlink,
        Replacement::SymlinkLoop,
        Replacement::TooLarge,
    ];

    fn name(self) -> String {
        format!("{self:?}").to_lowercase()
    }

    /// What the file's error in `GET /v1/sources` must say.
    fn error(self) -> &'static str {
        match self {
            Replacement::SymlinkToDevZero => "/dev/zero, a character device",
            Replacement::SymlinkToDirectory => "a directory",
            Replacement::Fifo => "a FIFO",
            Replacement::Socket => "a socket",
            Replacement::Directory => "a directory",
            Replacement::DanglingSymlink => "which does not exist",
            Replacement::SymlinkLoop => "symbolic links",
            Replacement::TooLarge => "more than the 4194304 bytes",
        }
    }

    /// `rm path` and put this there instead; what must be kept alive.
    fn replace(self, env: &Env, path: &Path) -> Option<std::os::unix::net::UnixListener> {
        std::fs::remove_file(path).expect("rm");
        match self {
            Replacement::SymlinkToDevZero => symlink("/dev/zero", path).expect("ln"),
            Replacement::SymlinkToDirectory => symlink(&env.outside, path).expect("ln"),
            Replacement::Fifo => rustix::fs::mknodat(
                rustix::fs::CWD,
                path,
                rustix::fs::FileType::Fifo,
                rustix::fs::Mode::from_raw_mode(0o644),
                0,
            )
            .expect("mkfifo"),
            Replacement::Socket => {
                return Some(std::os::unix::net::UnixListener::bind(path).expect("bind"));
            }
            Replacement::Directory => std::fs::create_dir(path).expect("mkdir"),
            Replacement::DanglingSymlink => {
                symlink(env.outside.join("nothing-here.yaml"), path).expect("ln")
            }
            Replacement::SymlinkLoop => symlink(path, path).expect("ln"),
            Replacement::TooLarge => {
                let mut text = disk_text(&self.disk());
                let filler = format!("# {}\n", "x".repeat(1000));
                while text.len() <= 4 << 20 {
                    text.push_str(&filler);
                }
                std::fs::write(path, text).expect("write")
            }
        }
        None
    }

    fn disk(self) -> String {
        format!("d-{}", self.name())
    }

    fn file(self) -> String {
        format!("{}.yaml", self.name())
    }
}

fn qemu_io(image: &Path, command: &str, read_only: bool) -> String {
    let mut args = vec!["-f", "qcow2"];
    if read_only {
        args.push("-r");
    }
    let out = Command::new("qemu-io")
        .args(&args)
        .arg("-c")
        .arg(command)
        .arg(image)
        .output()
        .expect("qemu-io (apt-get install qemu-utils)");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "qemu-io {command}: {text}");
    text
}

/// Each way a manifest path can exist without being a usable file keeps
/// what the file declared: after the grace period and a periodic re-list the
/// disk, its image file and the data in it are still there, and the file is
/// listed with its error. The daemon opens none of them for reading and
/// keeps answering.
#[test]
fn a_manifest_replaced_by_something_not_a_regular_file_keeps_its_disk_and_data() {
    let _serial = serial();
    let env = Env::start_with(&["--manifests-resync-seconds", "3"]);
    let grace = Duration::from_millis(
        env.sources()["settings"]["deleteGraceMs"]
            .as_u64()
            .expect("deleteGraceMs"),
    );
    for r in Replacement::ALL {
        env.write(&r.file(), &disk_text(&r.disk()));
    }
    let mut images: Vec<(Replacement, PathBuf)> = Vec::new();
    for r in Replacement::ALL {
        let disk = env.d.wait_object(
            "virtualdisks",
            &r.disk(),
            "Ready",
            Duration::from_secs(30),
            |d| d["status"]["phase"] == "Ready",
        );
        let image = PathBuf::from(disk["status"]["path"].as_str().expect("path"));
        qemu_io(&image, "write -P 0x5a 0 64k", false);
        images.push((r, image));
    }

    let mut keep_alive = Vec::new();
    env.relisted_after("the replacements", || {
        for r in Replacement::ALL {
            keep_alive.push(r.replace(&env, &env.path(&r.file())));
        }
    });
    let replaced = Instant::now();
    assert_answers(&env, "right after the replacements");

    // Past the grace period, then a periodic re-list after that.
    std::thread::sleep((grace + Duration::from_millis(500)).saturating_sub(replaced.elapsed()));
    let periodic = |env: &Env| env.sources()["relists"]["periodic"].as_u64().unwrap_or(0);
    let before = periodic(&env);
    env.until("a periodic re-list", Duration::from_secs(15), || {
        periodic(&env) > before
    });
    assert_answers(&env, "after the grace period");

    let mut lost = Vec::new();
    for (r, image) in &images {
        if env.d.get_disk(&r.disk()).is_none() || !image.exists() {
            lost.push(format!("{r:?}"));
        }
    }
    assert!(
        lost.is_empty(),
        "deleted after its file was replaced: {lost:?}"
    );
    env.assert_settled();
    for (r, image) in &images {
        let read = qemu_io(image, "read -P 0x5a 0 64k", true);
        assert!(!read.contains("verification failed"), "{r:?}: {read}");
        let file = env
            .source_file(&r.file())
            .unwrap_or_else(|| panic!("{r:?}: not listed"));
        assert_eq!(file["valid"], false, "{r:?}: {file}");
        assert!(
            file["error"]
                .as_str()
                .unwrap_or_default()
                .contains(r.error()),
            "{r:?}: {file}"
        );
        assert_eq!(file["objects"][0]["state"], "Held", "{r:?}: {file}");
        let events = env.d.event_reasons("VirtualDisk", &r.disk());
        assert!(
            events.iter().any(|e| e == "ManifestInvalid"),
            "{r:?}: {events:?}"
        );
        assert!(!events.iter().any(|e| e == "Deleting"), "{r:?}: {events:?}");
    }

    // hearthd holds none of them open (the FIFO, /dev/zero, the socket).
    let pid = env.d.child.as_ref().expect("hearthd").id();
    let open: Vec<PathBuf> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("fd dir")
        .flatten()
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .collect();
    for p in &open {
        assert!(
            !p.starts_with(&env.dir) && p != Path::new("/dev/zero"),
            "hearthd holds {} open",
            p.display()
        );
    }
    drop(keep_alive);

    // Put back: the same disks, unchanged; the problem is resolved.
    env.relisted_after("the files put back", || {
        for r in Replacement::ALL {
            let p = env.path(&r.file());
            if p.is_dir() && !p.is_symlink() {
                std::fs::remove_dir(&p).expect("rmdir");
            } else {
                std::fs::remove_file(&p).expect("rm");
            }
            env.write(&r.file(), &disk_text(&r.disk()));
        }
    });
    for r in Replacement::ALL {
        env.d.wait_object(
            "virtualdisks",
            &r.disk(),
            "ManifestValid again",
            Duration::from_secs(10),
            |d| {
                d["metadata"]["generation"] == 1
                    && d["status"]["conditions"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .any(|c| c["type"] == "ManifestValid" && c["status"] == "True")
            },
        );
    }

    // A file really removed still deletes its disk and the image.
    let (r, image) = &images[0];
    std::fs::remove_file(env.path(&r.file())).expect("rm");
    env.until(
        "the disk of a removed file is deleted",
        Duration::from_secs(30),
        || env.d.get_disk(&r.disk()).is_none(),
    );
    wait_until("its image is removed", Duration::from_secs(10), || {
        !image.exists()
    });
}
