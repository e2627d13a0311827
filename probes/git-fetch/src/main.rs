//! One repository of 1,000 manifests is served from `file://`; each round
//! commits one changed file to it, then fetches it twice into two bare
//! caches: once with `git fetch` (the options hearthd uses) and once with
//! gitoxide inside this process, the order alternating by round. For each:
//! the wall time, this process's CPU and its children's (for `file://` the
//! remote's `git-upload-pack` is a child of the client, whichever it is),
//! and for gitoxide the in-process read of the changed blob (the two
//! commits' trees compared, the changed entries' blobs read).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

const MANIFESTS: usize = 1000;
const FETCHED: &str = "refs/hearth/fetched";

#[derive(Clone, Copy, Default)]
struct Cost {
    wall_ms: f64,
    own_cpu_ms: f64,
    children_cpu_ms: f64,
}

fn cpu_ms(who: libc::c_int) -> f64 {
    // SAFETY: getrusage fills the struct it is given and nothing else.
    let mut r: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(who, &mut r) };
    let ms = |t: libc::timeval| t.tv_sec as f64 * 1e3 + t.tv_usec as f64 / 1e3;
    ms(r.ru_utime) + ms(r.ru_stime)
}

fn measure(f: impl FnOnce()) -> Cost {
    let (own, children) = (cpu_ms(libc::RUSAGE_SELF), cpu_ms(libc::RUSAGE_CHILDREN));
    let start = Instant::now();
    f();
    Cost {
        wall_ms: start.elapsed().as_secs_f64() * 1e3,
        own_cpu_ms: cpu_ms(libc::RUSAGE_SELF) - own,
        children_cpu_ms: cpu_ms(libc::RUSAGE_CHILDREN) - children,
    }
}

fn git(dir: &Path, args: &[&str]) {
    let status = Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(["-c", "user.name=probe", "-c", "user.email=probe@localhost"])
        .args(args)
        .status()
        .expect("git runs (apt-get install git)");
    assert!(status.success(), "git {args:?} in {}", dir.display());
}

fn manifest(i: usize, edit: usize) -> String {
    format!(
        "apiVersion: hearth.dev/v1alpha1\nkind: VirtualMachine\nmetadata:\n  name: vm-{i:04}\n  labels:\n    edit: \"{edit}\"\nspec:\n  cpus: 1\n  memory: 128Mi\n  runPolicy: AlwaysOff\n"
    )
}

/// The served bare repository and a work tree that pushes into it.
fn setup(root: &Path) -> (PathBuf, PathBuf) {
    let served = root.join("served.git");
    let work = root.join("work");
    git(root, &["init", "-q", "--bare", "-b", "main", "served.git"]);
    git(root, &["init", "-q", "-b", "main", "work"]);
    for i in 0..MANIFESTS {
        std::fs::write(work.join(format!("vm-{i:04}.yaml")), manifest(i, 0)).unwrap();
    }
    git(&work, &["add", "."]);
    git(&work, &["commit", "-qm", "1,000 VMs"]);
    git(&work, &["push", "-q", served.to_str().unwrap(), "main"]);
    (served, work)
}

fn git_fetch(cache: &Path, url: &str) {
    git(
        cache,
        &[
            "-c",
            "transfer.fsckObjects=true",
            "-c",
            "maintenance.auto=false",
            "fetch",
            "--quiet",
            "--no-tags",
            "--no-write-fetch-head",
            "--no-recurse-submodules",
            "--",
            url,
            &format!("+refs/heads/main:{FETCHED}"),
        ],
    );
}

fn gix_fetch(repo: &gix::Repository, url: &str) {
    let remote = repo
        .remote_at(url)
        .unwrap()
        .with_refspecs(
            Some(format!("+refs/heads/main:{FETCHED}").as_str()),
            gix::remote::Direction::Fetch,
        )
        .unwrap();
    remote
        .connect(gix::remote::Direction::Fetch)
        .unwrap()
        .prepare_fetch(gix::progress::Discard, Default::default())
        .unwrap()
        .receive(gix::progress::Discard, &gix::interrupt::IS_INTERRUPTED)
        .unwrap();
}

/// The blobs of `new`'s tree that differ from `old`'s, read: what a
/// commit of one changed file costs to read in-process.
fn gix_changed_blobs(repo: &gix::Repository, old: gix::ObjectId, new: gix::ObjectId) -> usize {
    let tree = |id| repo.find_commit(id).unwrap().tree().unwrap();
    let before: std::collections::HashMap<Vec<u8>, gix::ObjectId> = tree(old)
        .iter()
        .map(|e| {
            let e = e.unwrap();
            (e.filename().to_vec(), e.oid().to_owned())
        })
        .collect();
    let mut read = 0;
    for e in tree(new).iter() {
        let e = e.unwrap();
        if before.get(e.filename()).map(|id| id.as_ref()) != Some(e.oid()) {
            assert!(!repo.find_object(e.oid()).unwrap().data.is_empty());
            read += 1;
        }
    }
    read
}

fn fetched(repo: &gix::Repository) -> gix::ObjectId {
    repo.find_reference(FETCHED)
        .unwrap()
        .into_fully_peeled_id()
        .unwrap()
        .detach()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let rounds: usize = std::env::args()
        .nth(1)
        .map_or(30, |a| a.parse().expect("ROUNDS"));
    let root = std::env::temp_dir().join(format!("git-fetch-probe-{}", std::process::id()));
    std::fs::create_dir_all(&root).unwrap();
    let (served, work) = setup(&root);
    let url = format!("file://{}", served.display());
    git(&root, &["init", "-q", "--bare", "git-cache.git"]);
    let git_cache = root.join("git-cache.git");
    let gix_repo = gix::init_bare(root.join("gix-cache.git")).unwrap();
    // The first fetch of each brings the 1,000 manifests; not counted.
    git_fetch(&git_cache, &url);
    gix_fetch(&gix_repo, &url);
    let mut applied = fetched(&gix_repo);

    let (mut by_git, mut by_gix, mut reads) = (Vec::new(), Vec::new(), Vec::new());
    for round in 1..=rounds {
        let i = round % MANIFESTS;
        std::fs::write(work.join(format!("vm-{i:04}.yaml")), manifest(i, round)).unwrap();
        git(&work, &["commit", "-qam", &format!("edit {round}")]);
        git(&work, &["push", "-q", served.to_str().unwrap(), "main"]);
        let first_git = round % 2 == 0;
        for by_program in [first_git, !first_git] {
            if by_program {
                by_git.push(measure(|| git_fetch(&git_cache, &url)));
            } else {
                by_gix.push(measure(|| gix_fetch(&gix_repo, &url)));
                let new = fetched(&gix_repo);
                let mut changed = 0;
                reads.push(measure(|| {
                    changed = gix_changed_blobs(&gix_repo, applied, new)
                }));
                assert_eq!(changed, 1, "round {round}: one blob changed");
                applied = new;
            }
        }
    }
    std::fs::remove_dir_all(&root).unwrap();

    let show = |what: &str, costs: &[Cost]| {
        println!(
            "{what:<40} wall {:>6.2} ms   own CPU {:>6.2} ms   children's CPU {:>6.2} ms",
            median(costs.iter().map(|c| c.wall_ms).collect()),
            median(costs.iter().map(|c| c.own_cpu_ms).collect()),
            median(costs.iter().map(|c| c.children_cpu_ms).collect()),
        )
    };
    println!("{rounds} rounds, one file of {MANIFESTS} changed per commit, medians:");
    show("git fetch (the program)", &by_git);
    show("gitoxide fetch (in-process)", &by_gix);
    show("gitoxide: trees compared, blob read", &reads);
}
