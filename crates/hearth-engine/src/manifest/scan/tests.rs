use super::*;

fn vm(name: &str, mem: u32) -> String {
    format!(
        "apiVersion: hearth.dev/v1alpha1\nkind: VirtualMachine\nmetadata: {{name: {name}}}\nspec: {{memory: {mem}Mi, boot: {{kernel: /k}}}}\n"
    )
}

fn files(l: &Listing) -> &BTreeMap<PathBuf, FileScan> {
    match l {
        Listing::Files(f) => f,
        Listing::Missing(why) => panic!("missing: {why}"),
    }
}

fn scanner(dir: PathBuf, max_size: u64) -> Scanner {
    Scanner::new(dir, max_size, Box::new(|| {}))
}

/// Makes every cached entry old enough to be trusted.
fn age(s: &mut Scanner) {
    for c in s.cache.values_mut() {
        c.racy = false;
    }
}

#[test]
fn candidates_only_and_symlinks_followed_through_dot_dirs() {
    let d = tempfile::tempdir().expect("tmp");
    let dir = d.path();
    std::fs::write(dir.join("a.yaml"), vm("a", 256)).expect("w");
    std::fs::write(dir.join("a.yaml~"), vm("old", 256)).expect("w");
    std::fs::write(dir.join(".a.yaml.swp"), b"\x00swap").expect("w");
    std::fs::create_dir(dir.join("sub.yaml")).expect("mkdir");
    // ConfigMap layout: b.yaml -> ..data/b.yaml, ..data -> ..2024_01
    std::fs::create_dir(dir.join("..2024_01")).expect("mkdir");
    std::fs::write(dir.join("..2024_01/b.yaml"), vm("b", 256)).expect("w");
    std::os::unix::fs::symlink("..2024_01", dir.join("..data")).expect("ln");
    std::os::unix::fs::symlink("..data/b.yaml", dir.join("b.yaml")).expect("ln");
    std::os::unix::fs::symlink("..data/none.yaml", dir.join("dangling.yaml")).expect("ln");
    let mut s = scanner(dir.to_path_buf(), 1 << 20);
    let (l, stats) = s.scan();
    let f = files(&l);
    let names: Vec<_> = f
        .keys()
        .map(|p| p.file_name().unwrap().to_owned())
        .collect();
    // The directory and the dangling link are there, and unusable.
    assert_eq!(names, vec!["a.yaml", "b.yaml", "dangling.yaml", "sub.yaml"]);
    for name in ["a.yaml", "b.yaml"] {
        assert!(matches!(f[&dir.join(name)].content, Content::Valid(_)));
    }
    for name in ["dangling.yaml", "sub.yaml"] {
        assert!(matches!(f[&dir.join(name)].content, Content::Invalid(_)));
    }
    assert_eq!(stats.files, 4);
}

#[test]
fn unchanged_files_are_not_read_again_and_changed_ones_are() {
    let d = tempfile::tempdir().expect("tmp");
    for i in 0..20 {
        std::fs::write(
            d.path().join(format!("f{i}.yaml")),
            vm(&format!("v{i}"), 256),
        )
        .expect("w");
    }
    let mut s = scanner(d.path().to_path_buf(), 1 << 20);
    let (_, stats) = s.scan();
    assert_eq!((stats.files, stats.read, stats.parsed), (20, 20, 20));
    age(&mut s);
    let (_, stats) = s.scan();
    assert_eq!((stats.read, stats.parsed), (0, 0));
    std::fs::write(d.path().join("f3.yaml"), vm("v3", 512)).expect("w");
    let (l, stats) = s.scan();
    assert_eq!((stats.read, stats.parsed), (1, 1));
    let Content::Valid(d3) = &files(&l)[&d.path().join("f3.yaml")].content else {
        panic!("invalid")
    };
    assert!(d3[0].spec.contains("512"), "{}", d3[0].spec);
}

#[test]
fn each_bad_version_of_a_file_is_one_parse_error() {
    let d = tempfile::tempdir().expect("tmp");
    let f = d.path().join("a.yaml");
    std::fs::write(&f, "kind: [unclosed").expect("w");
    std::fs::write(d.path().join("ok.yaml"), vm("ok", 256)).expect("w");
    let mut s = scanner(d.path().to_path_buf(), 1 << 20);
    let (_, stats) = s.scan();
    assert_eq!((stats.parsed, stats.parse_errors), (2, 1));
    // The same bad bytes read again are not parsed again.
    age(&mut s);
    std::fs::write(&f, "kind: [unclosed").expect("w");
    let (_, stats) = s.scan();
    assert_eq!(stats.parse_errors, 0);
    std::fs::write(&f, "kind: {still bad").expect("w");
    let (_, stats) = s.scan();
    assert_eq!(stats.parse_errors, 1);
    std::fs::write(&f, vm("a", 256)).expect("w");
    let (_, stats) = s.scan();
    assert_eq!((stats.parsed, stats.parse_errors), (1, 0));
}

#[test]
fn a_racily_clean_file_is_read_again_and_same_bytes_keep_their_parse() {
    let d = tempfile::tempdir().expect("tmp");
    std::fs::write(d.path().join("a.yaml"), vm("a", 256)).expect("w");
    let mut s = scanner(d.path().to_path_buf(), 1 << 20);
    s.scan();
    // Just written: racy, so read again, but the bytes are the same.
    let (_, stats) = s.scan();
    assert_eq!((stats.read, stats.parsed), (1, 0));
}

#[test]
fn too_large_empty_and_garbage_files_are_invalid_not_absent() {
    let d = tempfile::tempdir().expect("tmp");
    std::fs::write(d.path().join("big.yaml"), vec![b'a'; 2000]).expect("w");
    std::fs::write(d.path().join("empty.yaml"), b"").expect("w");
    std::fs::write(d.path().join("bin.yaml"), [0xffu8, 0, 1, 2]).expect("w");
    let mut s = scanner(d.path().to_path_buf(), 1000);
    let (l, _) = s.scan();
    let f = files(&l);
    assert_eq!(f.len(), 3);
    for (p, scan) in f {
        assert!(
            matches!(scan.content, Content::Invalid(_)),
            "{}",
            p.display()
        );
    }
    let Content::Invalid(e) = &f[&d.path().join("big.yaml")].content else {
        unreachable!()
    };
    assert!(e.message.contains("2000 bytes"), "{e}");
}

fn error_of<'a>(l: &'a Listing, path: &Path) -> &'a FileError {
    match &files(l)[path].content {
        Content::Invalid(e) => e,
        other => panic!("{}: {other:?}", path.display()),
    }
}

#[test]
fn what_is_not_a_regular_file_is_listed_invalid_and_never_read() {
    let d = tempfile::tempdir().expect("tmp");
    let dir = d.path();
    let fifo = dir.join("fifo.yaml");
    rustix::fs::mknodat(
        rustix::fs::CWD,
        &fifo,
        rustix::fs::FileType::Fifo,
        rustix::fs::Mode::from_raw_mode(0o600),
        0,
    )
    .expect("mkfifo");
    let _socket = std::os::unix::net::UnixListener::bind(dir.join("socket.yaml")).expect("bind");
    std::os::unix::fs::symlink("/dev/zero", dir.join("zero.yaml")).expect("ln");
    std::os::unix::fs::symlink("/", dir.join("root.yaml")).expect("ln");
    std::fs::create_dir(dir.join("dir.yaml")).expect("mkdir");
    std::os::unix::fs::symlink("nowhere.yaml", dir.join("dangling.yaml")).expect("ln");
    std::os::unix::fs::symlink("loop.yaml", dir.join("loop.yaml")).expect("ln");
    let mut s = scanner(dir.to_path_buf(), 1000);
    let (l, stats) = s.scan();
    assert_eq!((stats.files, stats.read), (7, 0), "none of them is read");
    for (name, expected) in [
        ("fifo.yaml", "a FIFO, not a regular file"),
        ("socket.yaml", "a socket, not a regular file"),
        (
            "zero.yaml",
            "a symbolic link to /dev/zero, a character device, not a regular file",
        ),
        ("root.yaml", "a symbolic link to /, a directory"),
        ("dir.yaml", "a directory (subdirectories are not read)"),
        (
            "dangling.yaml",
            "a symbolic link to nowhere.yaml, which does not exist",
        ),
        ("loop.yaml", "cannot read: "),
    ] {
        let e = error_of(&l, &dir.join(name));
        assert!(e.message.starts_with(expected), "{name}: {e}");
    }
    // The FIFO was not opened: a writer would find no reader.
    let w = rustix::fs::open(
        &fifo,
        rustix::fs::OFlags::WRONLY | rustix::fs::OFlags::NONBLOCK,
        rustix::fs::Mode::empty(),
    );
    assert_eq!(w.err(), Some(rustix::io::Errno::NXIO));
    // Replaced by a regular file again: read as usual.
    std::fs::remove_file(&fifo).expect("rm");
    std::fs::write(&fifo, vm("f", 256)).expect("w");
    let (l, _) = s.scan();
    assert!(matches!(files(&l)[&fifo].content, Content::Valid(_)));
}

/// A parser that blocks on files containing `slow` until released, and
/// counts how often it ran on them.
#[derive(Default)]
struct Gate {
    open: Mutex<bool>,
    opened: Condvar,
    slow_parses: std::sync::atomic::AtomicUsize,
}

impl Gate {
    fn parser(self: &Arc<Self>) -> Arc<ParseFn> {
        let gate = self.clone();
        Arc::new(move |bytes: &[u8], dir: &Path| {
            if bytes.windows(4).any(|w| w == b"slow") {
                gate.slow_parses
                    .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let mut open = gate.open.lock().expect("gate");
                while !*open {
                    open = gate.opened.wait(open).expect("gate");
                }
            }
            parse_manifest(bytes, dir)
        })
    }

    fn release(&self) {
        *self.open.lock().expect("gate") = true;
        self.opened.notify_all();
    }

    fn slow_parses(&self) -> usize {
        self.slow_parses.load(std::sync::atomic::Ordering::SeqCst)
    }
}

fn gated_scanner(dir: &Path, gate: &Arc<Gate>) -> (Scanner, Arc<std::sync::atomic::AtomicUsize>) {
    let wakes = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let w = wakes.clone();
    let s = Scanner::with_parser(
        dir.to_path_buf(),
        1 << 20,
        Box::new(move || {
            w.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }),
        gate.parser(),
        // Every file on a thread of its own.
        0,
        // Long enough for any ungated parse, even on a loaded machine.
        Duration::from_secs(1),
    );
    (s, wakes)
}

fn wait_for(what: &str, f: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(Instant::now() < deadline, "{what}: not after 10 s");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_slow_parse_holds_up_neither_the_scan_nor_the_other_files() {
    let d = tempfile::tempdir().expect("tmp");
    let slow = d.path().join("slow.yaml");
    let fast = d.path().join("fast.yaml");
    std::fs::write(&slow, format!("{}# slow\n", vm("s", 256))).expect("w");
    std::fs::write(&fast, vm("f", 256)).expect("w");
    let gate = Arc::new(Gate::default());
    let (mut s, wakes) = gated_scanner(d.path(), &gate);

    let started = Instant::now();
    let (l, stats) = s.scan();
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    assert!(matches!(files(&l)[&fast].content, Content::Valid(_)));
    assert_eq!(files(&l)[&slow].content, Content::Parsing);
    assert_eq!((stats.parsed, stats.parsing), (1, 1));

    // Still running: listed as parsing again, not parsed a second time.
    let (l, stats) = s.scan();
    assert_eq!(files(&l)[&slow].content, Content::Parsing);
    assert_eq!(stats.parsing, 1);
    assert_eq!(gate.slow_parses(), 1);
    assert_eq!(wakes.load(std::sync::atomic::Ordering::SeqCst), 0);

    // Done: it asks for a scan, which takes the result.
    gate.release();
    wait_for("the wake", || {
        wakes.load(std::sync::atomic::Ordering::SeqCst) == 1
    });
    let (l, stats) = s.scan();
    let Content::Valid(decls) = &files(&l)[&slow].content else {
        panic!("{:?}", files(&l)[&slow])
    };
    assert_eq!(decls[0].object.name(), "s");
    assert_eq!((stats.parsed, stats.parse_errors, stats.parsing), (1, 0, 0));
    assert_eq!(gate.slow_parses(), 1);
}

#[test]
fn a_file_changed_while_its_parse_runs_takes_the_new_bytes() {
    let d = tempfile::tempdir().expect("tmp");
    let f = d.path().join("a.yaml");
    std::fs::write(&f, format!("{}# slow\n", vm("a", 256))).expect("w");
    let gate = Arc::new(Gate::default());
    let (mut s, _) = gated_scanner(d.path(), &gate);
    assert_eq!(files(&s.scan().0)[&f].content, Content::Parsing);
    std::fs::write(&f, vm("a", 512)).expect("w");
    let (l, _) = s.scan();
    let Content::Valid(decls) = &files(&l)[&f].content else {
        panic!("{:?}", files(&l)[&f])
    };
    assert!(decls[0].spec.contains("512"), "{}", decls[0].spec);
    // The old parse ends later; its result is for bytes no longer there.
    gate.release();
    wait_for("the old parse", || s.parses.lock().running.is_empty());
    let (l, _) = s.scan();
    let Content::Valid(decls) = &files(&l)[&f].content else {
        panic!("{:?}", files(&l)[&f])
    };
    assert!(decls[0].spec.contains("512"), "{}", decls[0].spec);
    assert!(
        s.parses.lock().done.is_empty(),
        "the stale result is dropped"
    );
}

#[test]
fn parses_beyond_the_limit_wait_for_a_free_slot() {
    let d = tempfile::tempdir().expect("tmp");
    let paths: Vec<PathBuf> = (0..MAX_PARSES + 1)
        .map(|i| d.path().join(format!("s{i}.yaml")))
        .collect();
    for (i, p) in paths.iter().enumerate() {
        std::fs::write(p, format!("{}# slow\n", vm(&format!("s{i}"), 256))).expect("w");
    }
    let gate = Arc::new(Gate::default());
    let (mut s, wakes) = gated_scanner(d.path(), &gate);
    let (l, stats) = s.scan();
    assert_eq!(stats.parsing, MAX_PARSES + 1);
    assert!(files(&l).values().all(|f| f.content == Content::Parsing));
    assert_eq!(gate.slow_parses(), MAX_PARSES, "one waits for a slot");
    gate.release();
    wait_for("the wake", || {
        wakes.load(std::sync::atomic::Ordering::SeqCst) >= 1
    });
    // The finished ones are taken, the waiting one starts (and, the
    // gate open, ends within the scan's wait; on a loaded machine a later
    // scan takes it).
    let mut l = s.scan().0;
    for _ in 0..50 {
        if files(&l)
            .values()
            .all(|f| matches!(f.content, Content::Valid(_)))
        {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
        l = s.scan().0;
    }
    assert!(
        files(&l)
            .values()
            .all(|f| matches!(f.content, Content::Valid(_))),
        "{:?}",
        files(&l)
    );
    assert_eq!(gate.slow_parses(), MAX_PARSES + 1);
}

#[test]
fn files_waiting_for_a_slot_start_as_slots_free_up_within_the_scan() {
    let d = tempfile::tempdir().expect("tmp");
    for i in 0..10 {
        std::fs::write(
            d.path().join(format!("f{i}.yaml")),
            vm(&format!("v{i}"), 256),
        )
        .expect("w");
    }
    // Every file on a thread, two at a time, and time enough for all.
    let mut s = Scanner::with_parser(
        d.path().to_path_buf(),
        1 << 20,
        Box::new(|| {}),
        Arc::new(parse_manifest),
        0,
        Duration::from_secs(10),
    );
    let (l, stats) = s.scan();
    assert_eq!((stats.parsed, stats.parsing), (10, 0));
    assert!(
        files(&l)
            .values()
            .all(|f| matches!(f.content, Content::Valid(_)))
    );
}

#[test]
fn a_missing_directory_is_missing_not_empty() {
    let d = tempfile::tempdir().expect("tmp");
    let mut s = scanner(d.path().join("nope"), 1000);
    assert!(matches!(s.scan().0, Listing::Missing(_)));
}
