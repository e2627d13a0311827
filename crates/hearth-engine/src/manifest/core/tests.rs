use super::*;
use hearth_api::parse_documents;

const GRACE: Duration = Duration::from_secs(2);

fn vm(name: &str, mem: u32) -> Decl {
    let text = format!(
        "apiVersion: hearth.dev/v1alpha1\nkind: VirtualMachine\nmetadata: {{name: {name}}}\nspec: {{memory: {mem}Mi, boot: {{kernel: /k}}}}\n"
    );
    Decl::new(parse_documents(&text, "t").expect("valid").remove(0))
}

fn disk(name: &str) -> Decl {
    let text = format!(
        "apiVersion: hearth.dev/v1alpha1\nkind: VirtualDisk\nmetadata: {{name: {name}}}\nspec: {{size: 1Gi, source: {{blank: {{}}}}}}\n"
    );
    Decl::new(parse_documents(&text, "t").expect("valid").remove(0))
}

fn p(name: &str) -> PathBuf {
    PathBuf::from(format!("/m/{name}"))
}

fn key(name: &str) -> Key {
    (Kind::VirtualMachine, name.to_string())
}

fn valid(ino: u64, decls: Vec<Decl>) -> FileScan {
    FileScan {
        id: Some(FileId { dev: 1, ino }),
        content: Content::Valid(decls.into()),
    }
}

fn invalid(ino: u64, why: &str) -> FileScan {
    FileScan {
        id: Some(FileId { dev: 1, ino }),
        content: Content::Invalid(FileError::new(why)),
    }
}

fn listing(files: Vec<(&str, FileScan)>) -> Listing {
    Listing::Files(files.into_iter().map(|(n, s)| (p(n), s)).collect())
}

/// A core plus a store that does what the engine would.
struct World {
    core: Core,
    t0: Instant,
    store: BTreeMap<Key, (PathBuf, String)>,
    log: Vec<Command>,
}

impl World {
    fn new() -> World {
        World::with_store(Vec::new())
    }

    fn with_store(stored: Vec<Stored>) -> World {
        let store = stored
            .iter()
            .map(|s| {
                let d = Decl::new(s.object.clone());
                (d.key(), (s.owner.clone(), d.spec))
            })
            .collect();
        World {
            core: Core::new(
                CoreConfig {
                    delete_grace: GRACE,
                    ..CoreConfig::default()
                },
                stored,
            ),
            t0: Instant::now(),
            store,
            log: Vec::new(),
        }
    }

    /// One re-list at `ms` after the start; returns the commands.
    fn scan(&mut self, ms: u64, l: Listing) -> Vec<Command> {
        let now = self.t0 + Duration::from_millis(ms);
        let mut out = self.core.scan(now, l);
        for c in &out {
            let outcome = match c {
                Command::Apply { file, decls } => {
                    for d in decls {
                        self.store.insert(d.key(), (file.clone(), d.spec.clone()));
                    }
                    Outcome::Done
                }
                Command::Delete { key, .. } => match self.store.remove(key) {
                    Some(_) => Outcome::Done,
                    None => Outcome::NotFound,
                },
                Command::Report { .. } => Outcome::Done,
            };
            self.core.done(now, c, &outcome);
        }
        out.extend(self.core.reports());
        self.log.extend(out.clone());
        out
    }

    fn spec_of(&self, name: &str) -> Option<String> {
        self.store.get(&key(name)).map(|(_, s)| s.clone())
    }

    fn owner_of(&self, name: &str) -> Option<PathBuf> {
        self.store.get(&key(name)).map(|(o, _)| o.clone())
    }

    fn deletes(&self) -> usize {
        self.log
            .iter()
            .filter(|c| matches!(c, Command::Delete { .. }))
            .count()
    }

    fn applies(&self) -> usize {
        self.log
            .iter()
            .filter(|c| matches!(c, Command::Apply { .. }))
            .count()
    }
}

fn applies(cmds: &[Command]) -> Vec<(PathBuf, Vec<Key>)> {
    cmds.iter()
        .filter_map(|c| match c {
            Command::Apply { file, decls } => {
                Some((file.clone(), decls.iter().map(Decl::key).collect()))
            }
            _ => None,
        })
        .collect()
}

#[test]
fn a_new_file_creates_and_an_unchanged_rescan_does_nothing() {
    let mut w = World::new();
    let cmds = w.scan(0, listing(vec![("a.yaml", valid(1, vec![vm("x", 256)]))]));
    assert_eq!(applies(&cmds), vec![(p("a.yaml"), vec![key("x")])]);
    let cmds = w.scan(100, listing(vec![("a.yaml", valid(1, vec![vm("x", 256)]))]));
    assert!(cmds.is_empty(), "{cmds:?}");
    assert!(w.core.is_quiet());
}

#[test]
fn an_edit_applies_only_the_changed_object() {
    let mut w = World::new();
    w.scan(
        0,
        listing(vec![("a.yaml", valid(1, vec![vm("x", 256), vm("y", 256)]))]),
    );
    let cmds = w.scan(
        100,
        listing(vec![("a.yaml", valid(2, vec![vm("x", 256), vm("y", 512)]))]),
    );
    assert_eq!(applies(&cmds), vec![(p("a.yaml"), vec![key("y")])]);
}

#[test]
fn vim_rename_dance_seen_mid_way_is_never_a_delete() {
    // vim: rename a.yaml -> a.yaml~ (ignored), write a new a.yaml.
    let mut w = World::new();
    w.scan(0, listing(vec![("a.yaml", valid(1, vec![vm("x", 256)]))]));
    // A re-list between the rename and the write sees no a.yaml at all.
    assert!(w.scan(100, listing(vec![])).is_empty());
    assert!(w.core.next_wake().is_some(), "asks to confirm the absence");
    // ...and then the new file, with the edit.
    let cmds = w.scan(150, listing(vec![("a.yaml", valid(2, vec![vm("x", 512)]))]));
    assert_eq!(applies(&cmds).len(), 1);
    // Long after: nothing is pending, nothing was deleted.
    assert!(
        w.scan(
            10_000,
            listing(vec![("a.yaml", valid(2, vec![vm("x", 512)]))])
        )
        .is_empty()
    );
    assert_eq!(w.deletes(), 0);
    assert!(w.core.is_quiet());
}

#[test]
fn a_delete_needs_absence_confirmed_after_the_grace_period() {
    let mut w = World::new();
    w.scan(0, listing(vec![("a.yaml", valid(1, vec![vm("x", 256)]))]));
    assert!(w.scan(1000, listing(vec![])).is_empty());
    let wake = w.core.next_wake().expect("a confirmation scan");
    assert_eq!(wake, w.t0 + Duration::from_millis(1000) + GRACE);
    assert!(w.scan(2999, listing(vec![])).is_empty(), "not yet");
    let cmds = w.scan(3000, listing(vec![]));
    assert_eq!(
        cmds,
        vec![Command::Delete {
            key: key("x"),
            file: p("a.yaml")
        }]
    );
    assert!(w.spec_of("x").is_none());
    assert!(w.scan(9000, listing(vec![])).is_empty(), "deleted once");
    assert!(w.core.is_quiet());
}

#[test]
fn reappearing_within_the_grace_period_cancels_the_delete() {
    let mut w = World::new();
    w.scan(0, listing(vec![("a.yaml", valid(1, vec![vm("x", 256)]))]));
    w.scan(100, listing(vec![]));
    w.scan(
        1500,
        listing(vec![("a.yaml", valid(1, vec![vm("x", 256)]))]),
    );
    w.scan(1600, listing(vec![]));
    // 3000 ms after the first absence but only 1400 after the second.
    assert!(w.scan(3000, listing(vec![])).is_empty());
    assert_eq!(w.scan(3600, listing(vec![])).len(), 1);
}

#[test]
fn a_rename_moves_the_owner_without_changing_the_spec() {
    let mut w = World::new();
    w.scan(0, listing(vec![("a.yaml", valid(1, vec![vm("x", 256)]))]));
    let spec = w.spec_of("x");
    let cmds = w.scan(100, listing(vec![("b.yaml", valid(1, vec![vm("x", 256)]))]));
    assert_eq!(applies(&cmds), vec![(p("b.yaml"), vec![key("x")])]);
    assert_eq!(w.spec_of("x"), spec);
    assert_eq!(w.owner_of("x"), Some(p("b.yaml")));
    w.scan(
        10_000,
        listing(vec![("b.yaml", valid(1, vec![vm("x", 256)]))]),
    );
    assert_eq!(w.deletes(), 0);
}

#[test]
fn an_invalid_file_holds_its_objects_forever_and_applies_once_fixed() {
    for bad in ["empty", "half written", "binary", "syntax", "too large"] {
        let mut w = World::new();
        w.scan(0, listing(vec![("a.yaml", valid(1, vec![vm("x", 256)]))]));
        let cmds = w.scan(100, listing(vec![("a.yaml", invalid(1, bad))]));
        assert!(
            cmds.iter().all(|c| matches!(
                c,
                Command::Report {
                    problem: Some(Problem::Invalid { .. }),
                    ..
                }
            )),
            "{bad}: {cmds:?}"
        );
        assert!(w.core.is_quiet(), "{bad}: nothing pending while held");
        assert!(
            w.scan(60_000, listing(vec![("a.yaml", invalid(1, bad))]))
                .is_empty()
        );
        let cmds = w.scan(
            61_000,
            listing(vec![("a.yaml", valid(1, vec![vm("x", 512)]))]),
        );
        assert_eq!(applies(&cmds).len(), 1, "{bad}");
        assert!(
            cmds.contains(&Command::Report {
                key: key("x"),
                problem: None
            }),
            "{bad}: resolved: {cmds:?}"
        );
        assert_eq!(w.deletes(), 0, "{bad}");
    }
}

#[test]
fn removing_an_invalid_file_deletes_after_grace_without_a_resolution() {
    let mut w = World::new();
    w.scan(0, listing(vec![("a.yaml", valid(1, vec![vm("x", 256)]))]));
    w.scan(100, listing(vec![("a.yaml", invalid(1, "bad"))]));
    let cmds = w.scan(200, listing(vec![]));
    assert!(
        cmds.is_empty(),
        "no 'resolved' for a file that is gone: {cmds:?}"
    );
    let cmds = w.scan(2200, listing(vec![]));
    assert!(matches!(&cmds[..], [Command::Delete { .. }]), "{cmds:?}");
}

#[test]
fn an_invalid_file_renamed_keeps_holding_by_inode() {
    let mut w = World::new();
    w.scan(0, listing(vec![("a.yaml", valid(7, vec![vm("x", 256)]))]));
    w.scan(100, listing(vec![("a.yaml", invalid(7, "half"))]));
    w.scan(200, listing(vec![("b.yaml", invalid(7, "half"))]));
    assert!(w.core.is_quiet(), "held by the renamed file");
    w.scan(9000, listing(vec![("b.yaml", invalid(7, "half"))]));
    assert_eq!(w.deletes(), 0);
}

fn parsing(ino: u64) -> FileScan {
    FileScan {
        id: Some(FileId { dev: 1, ino }),
        content: Content::Parsing,
    }
}

#[test]
fn a_file_still_parsing_holds_its_objects_and_reports_nothing() {
    let mut w = World::new();
    w.scan(0, listing(vec![("a.yaml", valid(1, vec![vm("x", 256)]))]));
    // Long past the grace period: nothing applied, deleted or reported.
    for ms in [100, 5000, 60_000] {
        let cmds = w.scan(ms, listing(vec![("a.yaml", parsing(1))]));
        assert!(cmds.is_empty(), "{cmds:?}");
        assert!(w.core.is_quiet());
    }
    let v = w.core.view(w.t0);
    assert!(v.files[0].parsing && !v.files[0].valid, "{v:?}");
    assert_eq!(v.files[0].objects[0].state, "Held");
    assert!(v.problems.is_empty(), "{:?}", v.problems);
    // The parse lands: applied like any edit.
    let cmds = w.scan(
        60_100,
        listing(vec![("a.yaml", valid(1, vec![vm("x", 512)]))]),
    );
    assert_eq!(applies(&cmds), vec![(p("a.yaml"), vec![key("x")])]);
    assert!(w.spec_of("x").is_some_and(|s| s.contains("512")));
}

#[test]
fn a_problem_stands_while_the_next_version_is_parsing() {
    let mut w = World::new();
    w.scan(0, listing(vec![("a.yaml", valid(1, vec![vm("x", 256)]))]));
    let cmds = w.scan(100, listing(vec![("a.yaml", invalid(1, "half"))]));
    assert!(matches!(
        &cmds[..],
        [Command::Report {
            problem: Some(Problem::Invalid { .. }),
            ..
        }]
    ));
    // Neither resolved nor reported again while the new bytes parse.
    assert!(
        w.scan(200, listing(vec![("a.yaml", parsing(1))]))
            .is_empty()
    );
    assert_eq!(w.core.view(w.t0).problems.len(), 1);
    let cmds = w.scan(300, listing(vec![("a.yaml", valid(1, vec![vm("x", 256)]))]));
    assert_eq!(
        cmds,
        vec![Command::Report {
            key: key("x"),
            problem: None
        }]
    );
}

#[test]
fn a_refused_apply_stands_while_the_next_version_is_parsing() {
    let mut core = Core::new(CoreConfig::default(), Vec::new());
    let t0 = Instant::now();
    let cmds = core.scan(t0, listing(vec![("a.yaml", valid(1, vec![vm("x", 256)]))]));
    core.done(
        t0,
        &cmds[0],
        &Outcome::Refused("kernel outside roots".into()),
    );
    assert_eq!(core.reports().len(), 1);
    let later = t0 + Duration::from_millis(100);
    assert!(
        core.scan(later, listing(vec![("a.yaml", parsing(1))]))
            .is_empty()
    );
    assert!(core.reports().is_empty(), "not resolved while parsing");
}

#[test]
fn a_renamed_file_still_parsing_keeps_holding_by_inode() {
    let mut w = World::new();
    w.scan(0, listing(vec![("a.yaml", valid(7, vec![vm("x", 256)]))]));
    w.scan(100, listing(vec![("b.yaml", parsing(7))]));
    assert!(w.core.is_quiet(), "held by the renamed file");
    w.scan(9000, listing(vec![("b.yaml", parsing(7))]));
    assert_eq!(w.deletes(), 0);
    let cmds = w.scan(
        9100,
        listing(vec![("b.yaml", valid(7, vec![vm("x", 256)]))]),
    );
    assert_eq!(applies(&cmds), vec![(p("b.yaml"), vec![key("x")])]);
    assert_eq!(w.owner_of("x"), Some(p("b.yaml")));
}

#[test]
fn a_file_invalid_at_first_sight_holds_what_the_store_says_it_owns() {
    let x = vm("x", 256);
    let mut w = World::with_store(vec![Stored {
        object: x.object.clone(),
        owner: p("a.yaml"),
    }]);
    assert!(
        w.scan(0, listing(vec![("a.yaml", invalid(1, "broken"))]))
            .iter()
            .all(|c| matches!(c, Command::Report { .. }))
    );
    w.scan(60_000, listing(vec![("a.yaml", invalid(1, "broken"))]));
    assert_eq!(w.deletes(), 0);
    assert_eq!(w.spec_of("x"), Some(x.spec));
}

#[test]
fn start_up_applies_only_what_changed_while_down() {
    let stored = vec![
        Stored {
            object: vm("same", 256).object,
            owner: p("same.yaml"),
        },
        Stored {
            object: vm("edited", 256).object,
            owner: p("edited.yaml"),
        },
        Stored {
            object: vm("removed", 256).object,
            owner: p("removed.yaml"),
        },
    ];
    let mut w = World::with_store(stored);
    let dir = || {
        listing(vec![
            ("same.yaml", valid(1, vec![vm("same", 256)])),
            ("edited.yaml", valid(2, vec![vm("edited", 512)])),
            ("new.yaml", valid(3, vec![vm("new", 256)])),
        ])
    };
    let cmds = w.scan(0, dir());
    assert_eq!(
        applies(&cmds),
        vec![
            (p("edited.yaml"), vec![key("edited")]),
            (p("new.yaml"), vec![key("new")])
        ]
    );
    let cmds = w.scan(GRACE.as_millis() as u64, dir());
    assert_eq!(
        cmds,
        vec![Command::Delete {
            key: key("removed"),
            file: p("removed.yaml")
        }]
    );
}

#[test]
fn a_missing_directory_deletes_nothing() {
    let mut w = World::new();
    w.scan(0, listing(vec![("a.yaml", valid(1, vec![vm("x", 256)]))]));
    for t in [100, 5000, 60_000] {
        assert!(w.scan(t, Listing::Missing("gone".into())).is_empty());
    }
    assert!(w.core.is_quiet());
    // Back, but empty: now it counts, with a fresh grace period.
    assert!(w.scan(61_000, listing(vec![])).is_empty());
    assert_eq!(w.scan(63_000, listing(vec![])).len(), 1);
}

#[test]
fn two_files_declaring_one_object_is_a_conflict_until_one_goes() {
    let mut w = World::new();
    w.scan(0, listing(vec![("a.yaml", valid(1, vec![vm("x", 256)]))]));
    let cmds = w.scan(
        100,
        listing(vec![
            ("a.yaml", valid(1, vec![vm("x", 256)])),
            ("b.yaml", valid(2, vec![vm("x", 512)])),
        ]),
    );
    assert_eq!(
        cmds,
        vec![Command::Report {
            key: key("x"),
            problem: Some(Problem::Conflict {
                files: vec![p("a.yaml"), p("b.yaml")]
            })
        }]
    );
    assert_eq!(w.spec_of("x"), Some(vm("x", 256).spec), "untouched");
    // Removing the original leaves the other copy in force.
    let cmds = w.scan(200, listing(vec![("b.yaml", valid(2, vec![vm("x", 512)]))]));
    assert_eq!(applies(&cmds), vec![(p("b.yaml"), vec![key("x")])]);
    assert_eq!(w.spec_of("x"), Some(vm("x", 512).spec));
    assert_eq!(w.owner_of("x"), Some(p("b.yaml")));
    w.scan(
        10_000,
        listing(vec![("b.yaml", valid(2, vec![vm("x", 512)]))]),
    );
    assert_eq!(w.deletes(), 0);
}

#[test]
fn a_conflict_between_two_new_files_creates_nothing() {
    let mut w = World::new();
    w.scan(
        0,
        listing(vec![
            ("a.yaml", valid(1, vec![vm("x", 256), vm("y", 256)])),
            ("b.yaml", valid(2, vec![vm("x", 512)])),
        ]),
    );
    assert!(w.spec_of("x").is_none());
    assert!(w.spec_of("y").is_some(), "the rest of the file applies");
}

#[test]
fn a_valid_copy_beside_an_invalid_holder_is_a_conflict() {
    let mut w = World::new();
    w.scan(0, listing(vec![("a.yaml", valid(1, vec![vm("x", 256)]))]));
    let cmds = w.scan(
        100,
        listing(vec![
            ("a.yaml", invalid(1, "typo")),
            ("b.yaml", valid(2, vec![vm("x", 512)])),
        ]),
    );
    assert!(applies(&cmds).is_empty());
    assert_eq!(w.spec_of("x"), Some(vm("x", 256).spec));
}

#[test]
fn a_refused_apply_is_reported_once_and_retried_with_backoff() {
    let mut core = Core::new(CoreConfig::default(), Vec::new());
    let t0 = Instant::now();
    let l = || listing(vec![("a.yaml", valid(1, vec![vm("x", 256)]))]);
    let cmds = core.scan(t0, l());
    assert_eq!(cmds.len(), 1);
    core.done(
        t0,
        &cmds[0],
        &Outcome::Refused("kernel outside roots".into()),
    );
    let reports = core.reports();
    assert!(matches!(
        &reports[..],
        [Command::Report {
            problem: Some(Problem::ApplyFailed { .. }),
            ..
        }]
    ));
    assert_eq!(core.next_wake(), Some(t0 + Duration::from_secs(1)));
    // Before the retry time an unchanged file is not tried again.
    assert!(core.scan(t0 + Duration::from_millis(500), l()).is_empty());
    let cmds = core.scan(t0 + Duration::from_secs(1), l());
    core.done(
        t0 + Duration::from_secs(1),
        &cmds[0],
        &Outcome::Refused("kernel outside roots".into()),
    );
    assert!(core.reports().is_empty(), "same problem: reported once");
    assert_eq!(
        core.next_wake(),
        Some(t0 + Duration::from_secs(3)),
        "backoff doubles"
    );
    // A changed file is tried at once.
    let cmds = core.scan(
        t0 + Duration::from_millis(1100),
        listing(vec![("a.yaml", valid(1, vec![vm("x", 512)]))]),
    );
    assert_eq!(cmds.len(), 1);
    core.done(t0 + Duration::from_millis(1100), &cmds[0], &Outcome::Done);
    assert_eq!(
        core.reports(),
        vec![Command::Report {
            key: key("x"),
            problem: None
        }]
    );
}

#[test]
fn a_refused_delete_is_retried_until_it_goes_through() {
    let mut core = Core::new(
        CoreConfig {
            delete_grace: GRACE,
            ..CoreConfig::default()
        },
        vec![Stored {
            object: disk("d").object,
            owner: p("d.yaml"),
        }],
    );
    let t0 = Instant::now();
    assert!(core.scan(t0, listing(vec![])).is_empty());
    let t = t0 + GRACE;
    let cmds = core.scan(t, listing(vec![]));
    assert_eq!(cmds.len(), 1);
    core.done(t, &cmds[0], &Outcome::Refused("in use".into()));
    assert!(matches!(
        &core.reports()[..],
        [Command::Report {
            problem: Some(Problem::DeleteFailed { .. }),
            ..
        }]
    ));
    assert_eq!(core.next_wake(), Some(t + Duration::from_secs(1)));
    let t = t + Duration::from_secs(1);
    let cmds = core.scan(t, listing(vec![]));
    assert_eq!(cmds.len(), 1);
    core.done(t, &cmds[0], &Outcome::Done);
    assert!(
        core.reports().is_empty(),
        "a deleted object needs no resolution"
    );
    assert!(core.is_quiet());
}

#[test]
fn deletes_come_after_applies_and_vms_before_disks() {
    let mut w = World::new();
    w.scan(
        0,
        listing(vec![("a.yaml", valid(1, vec![disk("d"), vm("x", 256)]))]),
    );
    w.scan(100, listing(vec![("n.yaml", valid(2, vec![vm("n", 256)]))]));
    let cmds = w.scan(
        5000,
        listing(vec![("n.yaml", valid(2, vec![vm("n", 256)]))]),
    );
    let kinds: Vec<Kind> = cmds
        .iter()
        .filter_map(|c| match c {
            Command::Delete { key, .. } => Some(key.0),
            _ => None,
        })
        .collect();
    assert_eq!(kinds, vec![Kind::VirtualMachine, Kind::VirtualDisk]);
}

#[test]
fn the_view_says_what_each_file_declares_and_why_not() {
    let mut w = World::new();
    w.scan(0, listing(vec![("a.yaml", valid(1, vec![vm("x", 256)]))]));
    w.scan(
        100,
        listing(vec![
            ("a.yaml", invalid(1, "line 3, column 1: bad")),
            ("b.yaml", valid(2, vec![vm("y", 256)])),
        ]),
    );
    let v = w.core.view(w.t0 + Duration::from_millis(200));
    assert_eq!(v.files.len(), 2);
    assert!(!v.files[0].valid);
    assert_eq!(v.files[0].objects[0].state, "Held");
    assert_eq!(v.files[1].objects[0].state, "Applied");
    assert_eq!(v.problems[0].reason, "ManifestInvalid");
    assert!(
        v.problems[0].message.contains("line 3, column 1"),
        "{:?}",
        v.problems
    );
}

#[test]
fn resync_with_the_store_repairs_a_lost_result() {
    let mut w = World::new();
    let l = || listing(vec![("a.yaml", valid(1, vec![vm("x", 256)]))]);
    w.scan(0, l());
    // Someone removed it from the store behind the core's back.
    w.store.clear();
    w.core.resync_store(Vec::new());
    let cmds = w.scan(100, l());
    assert_eq!(applies(&cmds).len(), 1);
    assert_eq!(w.applies(), 2);
}
