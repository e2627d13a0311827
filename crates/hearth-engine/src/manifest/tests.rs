//! Property test of the manifest core against a model directory and a model
//! engine: random sequences of file operations (write in place, atomic
//! replace, partial write, garbage, truncate, rename, delete), re-lists at
//! random moments (some while the directory is missing, some while a file's
//! parse is still running) and time passing, with an engine that sometimes
//! refuses.
//!
//! Checked on every re-list:
//! - a delete only for an object no valid file declared in any re-list of
//!   the last grace period, and not declared now;
//! - an object whose file just became unusable (or is still being parsed) is
//!   neither changed nor deleted;
//! - an object declared by two files is never applied.
//!
//! Checked at the end: once every unusable file is fixed (removed) and no two
//! files declare the same object, and after quiescence, the engine holds
//! exactly what the directory declares, each object owned by its file.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use proptest::prelude::*;

use super::core::{
    Command, Content, Core, CoreConfig, Decl, FileId, FileScan, Key, Listing, Outcome,
};
use super::names::is_candidate;
use super::parse::parse_manifest;

const DIR: &str = "/m";
const GRACE_MS: u64 = 2000;
const FILES: [&str; 6] = [
    "a.yaml",
    "b.yaml",
    "c.json",
    "d.yml",
    "a.yaml~",
    ".b.yaml.swp",
];
const NAMES: [&str; 3] = ["x", "y", "z"];
const MEMORY: [u32; 2] = [256, 512];

#[derive(Clone, Debug)]
enum Op {
    /// Write in place (same inode), like `cp` over a file or VS Code.
    Write(usize, Vec<(usize, usize)>),
    /// Write a new file and rename it over (new inode), like vim or `sed -i`.
    Replace(usize, Vec<(usize, usize)>),
    /// Only the first part of a write has landed.
    Partial(usize, Vec<(usize, usize)>, u8),
    Garbage(usize),
    Truncate(usize),
    Rename(usize, usize),
    Delete(usize),
    Relist,
    /// A re-list that finds this file's parse still running.
    RelistParsing(usize),
    /// A re-list while the directory is gone (removed, being recreated).
    RelistMissing,
    Advance(u64),
}

fn objects() -> impl Strategy<Value = Vec<(usize, usize)>> {
    prop::collection::btree_map(0..NAMES.len(), 0..MEMORY.len(), 1..=2)
        .prop_map(|m| m.into_iter().collect())
}

fn op() -> impl Strategy<Value = Op> {
    let f = 0..FILES.len();
    prop_oneof![
        3 => (f.clone(), objects()).prop_map(|(f, o)| Op::Write(f, o)),
        3 => (f.clone(), objects()).prop_map(|(f, o)| Op::Replace(f, o)),
        2 => (f.clone(), objects(), any::<u8>()).prop_map(|(f, o, c)| Op::Partial(f, o, c)),
        1 => f.clone().prop_map(Op::Garbage),
        1 => f.clone().prop_map(Op::Truncate),
        2 => (f.clone(), f.clone()).prop_map(|(a, b)| Op::Rename(a, b)),
        2 => f.prop_map(Op::Delete),
        4 => Just(Op::Relist),
        2 => (0..FILES.len()).prop_map(Op::RelistParsing),
        1 => Just(Op::RelistMissing),
        3 => (1u64..3000).prop_map(Op::Advance),
    ]
}

fn text(objs: &[(usize, usize)]) -> String {
    objs.iter()
        .map(|&(n, m)| {
            format!(
                "apiVersion: hearth.dev/v1alpha1\nkind: VirtualMachine\nmetadata:\n  name: {}\nspec:\n  memory: {}Mi\n  boot:\n    kernel: /boot/vmlinuz\n",
                NAMES[n], MEMORY[m]
            )
        })
        .collect::<Vec<_>>()
        .join("---\n")
}

/// The directory: name -> (inode, bytes).
#[derive(Default)]
struct Dir {
    files: BTreeMap<String, (u64, Vec<u8>)>,
    next_ino: u64,
}

impl Dir {
    fn ino(&mut self) -> u64 {
        self.next_ino += 1;
        self.next_ino
    }

    fn write_in_place(&mut self, name: &str, bytes: Vec<u8>) {
        let ino = match self.files.get(name) {
            Some((ino, _)) => *ino,
            None => self.ino(),
        };
        self.files.insert(name.to_string(), (ino, bytes));
    }

    fn apply(&mut self, op: &Op) {
        match op {
            Op::Write(f, o) => self.write_in_place(FILES[*f], text(o).into_bytes()),
            Op::Replace(f, o) => {
                let ino = self.ino();
                self.files
                    .insert(FILES[*f].to_string(), (ino, text(o).into_bytes()));
            }
            Op::Partial(f, o, cut) => {
                let t = text(o).into_bytes();
                let n = t.len() * usize::from(*cut) / 256;
                self.write_in_place(FILES[*f], t[..n].to_vec());
            }
            Op::Garbage(f) => self.write_in_place(FILES[*f], vec![0xff, 0x00, 0x13, b'{', b':']),
            Op::Truncate(f) => self.write_in_place(FILES[*f], Vec::new()),
            Op::Rename(a, b) => {
                if let Some(v) = self.files.remove(FILES[*a]) {
                    self.files.insert(FILES[*b].to_string(), v);
                }
            }
            Op::Delete(f) => {
                self.files.remove(FILES[*f]);
            }
            Op::Relist | Op::RelistParsing(_) | Op::RelistMissing | Op::Advance(_) => {}
        }
    }

    /// What the scanner would hand the core.
    fn listing(&self) -> Listing {
        self.listing_parsing(None)
    }

    /// What the scanner would hand the core while the parse of `parsing`
    /// is still running.
    fn listing_parsing(&self, parsing: Option<&str>) -> Listing {
        let mut out = BTreeMap::new();
        for (name, (ino, bytes)) in &self.files {
            if !is_candidate(name) {
                continue;
            }
            let content = match parse_manifest(bytes, Path::new(DIR)) {
                _ if parsing == Some(name.as_str()) => Content::Parsing,
                Ok(objs) => Content::Valid(objs.into_iter().map(Decl::new).collect()),
                Err(e) => Content::Invalid(e),
            };
            out.insert(
                Path::new(DIR).join(name),
                FileScan {
                    id: Some(FileId { dev: 1, ino: *ino }),
                    content,
                },
            );
        }
        Listing::Files(out)
    }
}

/// Valid declarations per object in a listing.
fn declared(l: &Listing) -> BTreeMap<Key, Vec<(PathBuf, String)>> {
    let mut out: BTreeMap<Key, Vec<(PathBuf, String)>> = BTreeMap::new();
    if let Listing::Files(files) = l {
        for (path, scan) in files {
            if let Content::Valid(decls) = &scan.content {
                for d in decls.iter() {
                    out.entry(d.key())
                        .or_default()
                        .push((path.clone(), d.spec.clone()));
                }
            }
        }
    }
    out
}

/// The engine: objects with owner and spec; a delete marks, time removes.
#[derive(Default)]
struct Engine {
    objects: BTreeMap<Key, (PathBuf, String)>,
    deleting: BTreeSet<Key>,
    calls: u64,
    flaky_every: u64,
}

impl Engine {
    fn execute(&mut self, c: &Command) -> Outcome {
        self.calls += 1;
        match c {
            Command::Apply { file, decls } => {
                if self.flaky_every > 0 && self.calls.is_multiple_of(self.flaky_every) {
                    return Outcome::Refused("store busy".into());
                }
                if let Some(d) = decls.iter().find(|d| self.deleting.contains(&d.key())) {
                    return Outcome::Refused(format!("{:?} is being deleted", d.key()));
                }
                for d in decls {
                    self.objects.insert(d.key(), (file.clone(), d.spec.clone()));
                }
                Outcome::Done
            }
            Command::Delete { key, .. } => {
                if !self.objects.contains_key(key) {
                    return Outcome::NotFound;
                }
                if self.flaky_every > 0 && self.calls.is_multiple_of(self.flaky_every) {
                    return Outcome::Refused("store busy".into());
                }
                self.deleting.insert(key.clone());
                Outcome::Done
            }
            Command::Report { .. } => Outcome::Done,
        }
    }

    /// Reconcilers finish deleting.
    fn tick(&mut self) {
        for k in std::mem::take(&mut self.deleting) {
            self.objects.remove(&k);
        }
    }
}

struct Sim {
    core: Core,
    dir: Dir,
    engine: Engine,
    t0: Instant,
    now_ms: u64,
    /// (time, keys validly declared) of every re-list.
    history: Vec<(u64, BTreeSet<Key>)>,
    last_listing: Option<Listing>,
}

impl Sim {
    fn now(&self) -> Instant {
        self.t0 + Duration::from_millis(self.now_ms)
    }

    fn relist(&mut self) -> Vec<Command> {
        self.relist_parsing(None)
    }

    fn relist_parsing(&mut self, parsing: Option<&str>) -> Vec<Command> {
        let listing = self.dir.listing_parsing(parsing);
        let now_declared = declared(&listing);
        let commands = self.core.scan(self.now(), listing.clone());

        for c in &commands {
            match c {
                Command::Delete { key, .. } => {
                    assert!(
                        !now_declared.contains_key(key),
                        "deleted {key:?} while declared"
                    );
                    for (t, keys) in &self.history {
                        if *t + GRACE_MS > self.now_ms {
                            assert!(
                                !keys.contains(key),
                                "deleted {key:?} at {} ms, declared at {t} ms",
                                self.now_ms
                            );
                        }
                    }
                }
                Command::Apply { decls, .. } => {
                    for d in decls {
                        let n = now_declared.get(&d.key()).map_or(0, Vec::len);
                        assert_eq!(n, 1, "applied {:?} declared {n} times", d.key());
                    }
                }
                Command::Report { .. } => {}
            }
        }
        // A file that just became unusable changes nothing it declared.
        if let (Some(Listing::Files(prev)), Listing::Files(cur)) = (&self.last_listing, &listing) {
            for (path, scan) in cur {
                if let (
                    Content::Invalid(_) | Content::Parsing,
                    Some(FileScan {
                        content: Content::Valid(old),
                        ..
                    }),
                ) = (&scan.content, prev.get(path))
                {
                    for d in old.iter() {
                        let touched = commands.iter().any(|c| match c {
                            Command::Apply { decls, .. } => {
                                decls.iter().any(|x| x.key() == d.key())
                            }
                            Command::Delete { key, .. } => *key == d.key(),
                            Command::Report { .. } => false,
                        });
                        assert!(
                            !touched,
                            "{:?} touched while {} is unusable",
                            d.key(),
                            path.display()
                        );
                    }
                }
            }
        }

        let mut all = commands.clone();
        for c in &commands {
            let outcome = self.engine.execute(c);
            self.core.done(self.now(), c, &outcome);
        }
        all.extend(self.core.reports());
        assert_eq!(
            self.core.has_problems(),
            !self.core.view(self.now()).problems.is_empty(),
            "has_problems disagrees with the view"
        );
        self.history
            .push((self.now_ms, now_declared.keys().cloned().collect()));
        self.last_listing = Some(listing);
        all
    }

    fn advance(&mut self, ms: u64) {
        self.now_ms += ms;
        self.engine.tick();
    }

    /// Removes unusable files and duplicate declarations, as a person fixing
    /// the directory would.
    fn fix_directory(&mut self) {
        let listing = self.dir.listing();
        if let Listing::Files(files) = &listing {
            for (path, scan) in files {
                if matches!(scan.content, Content::Invalid(_)) {
                    let name = path
                        .file_name()
                        .and_then(|n| n.to_str())
                        .unwrap_or_default();
                    self.dir.files.remove(name);
                }
            }
        }
        loop {
            let d = declared(&self.dir.listing());
            let Some((_, sources)) = d.iter().find(|(_, s)| s.len() > 1) else {
                break;
            };
            let name = sources[1]
                .0
                .file_name()
                .and_then(|n| n.to_str())
                .unwrap_or_default()
                .to_string();
            self.dir.files.remove(&name);
        }
    }

    fn quiesce(&mut self) {
        for _ in 0..100 {
            let commands = self.relist();
            let busy = commands
                .iter()
                .any(|c| !matches!(c, Command::Report { .. }));
            if !busy && self.core.is_quiet() && self.engine.deleting.is_empty() {
                return;
            }
            self.advance(GRACE_MS.max(30_000));
        }
        panic!("did not settle");
    }
}

proptest! {
    // 400 cases per run; PROPTEST_CASES=20000 for a longer hunt.
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(400),
        ..ProptestConfig::default()
    })]

    #[test]
    fn any_file_operations_settle_on_what_the_directory_declares(
        ops in prop::collection::vec(op(), 1..60),
        flaky_every in prop_oneof![Just(0u64), 2u64..6],
    ) {
        let mut sim = Sim {
            core: Core::new(
                CoreConfig {
                    delete_grace: Duration::from_millis(GRACE_MS),
                    ..CoreConfig::default()
                },
                Vec::new(),
            ),
            dir: Dir::default(),
            engine: Engine { flaky_every, ..Engine::default() },
            t0: Instant::now(),
            now_ms: 0,
            history: Vec::new(),
            last_listing: None,
        };
        for op in &ops {
            sim.dir.apply(op);
            match op {
                Op::Relist => { sim.relist(); }
                Op::RelistParsing(f) => { sim.relist_parsing(Some(FILES[*f])); }
                Op::RelistMissing => {
                    let now = sim.now();
                    let commands = sim.core.scan(now, Listing::Missing("removed".into()));
                    prop_assert!(commands.is_empty(), "a missing directory changes nothing: {:?}", commands);
                }
                Op::Advance(ms) => sim.advance(*ms),
                _ => {}
            }
        }
        sim.fix_directory();
        // From here the engine accepts everything: whatever state the refusals
        // left behind (failed applies, pending retries) must still converge.
        sim.engine.flaky_every = 0;
        sim.quiesce();

        let expected: BTreeMap<Key, (PathBuf, String)> = declared(&sim.dir.listing())
            .into_iter()
            .map(|(k, mut v)| (k, v.remove(0)))
            .collect();
        prop_assert_eq!(&sim.engine.objects, &expected);
    }
}
