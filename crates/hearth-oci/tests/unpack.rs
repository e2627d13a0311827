//! The layer applier against an oracle hearth did not write: the same image
//! unpacked by `umoci unpack` and by hearth, compared entry by entry (path,
//! type, mode, owner, size, sha256, link target, device, xattrs, mtime, hard
//! link groups), then the ext4 image hearth builds from it, mounted, compared
//! again. And a layer that writes through an absolute link is refused.

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use hearth_oci::blobs::BlobStore;
use hearth_oci::layout::Layout;
use hearth_oci::unpack::Unpacker;
use hearth_oci::{OciError, ext4};
use hearth_test_support::oci::{tool, umoci_layers};

fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

/// One tar entry of a hand-made layer.
enum E<'a> {
    Dir(u32),
    File(u32, &'a [u8]),
    Owned(u32, u32, u32, &'a [u8]),
    Xattr(u32, &'a [u8], &'a str, &'a [u8]),
    Sym(&'a str),
    Hard(&'a str),
    Char(u32, u32),
    Fifo,
}

const MTIME: u64 = 1_700_000_000;

fn layer(entries: &[(&str, E)]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for (n, (path, e)) in entries.iter().enumerate() {
        let mut h = tar::Header::new_ustar();
        h.set_mtime(MTIME + n as u64);
        h.set_uid(0);
        h.set_gid(0);
        h.set_size(0);
        match e {
            E::Dir(mode) => {
                h.set_entry_type(tar::EntryType::Directory);
                h.set_mode(*mode);
                b.append_data(&mut h, path, &[][..]).unwrap();
            }
            E::File(mode, data) | E::Owned(mode, _, _, data) => {
                if let E::Owned(_, uid, gid, _) = e {
                    h.set_uid(*uid as u64);
                    h.set_gid(*gid as u64);
                }
                h.set_entry_type(tar::EntryType::Regular);
                h.set_mode(*mode);
                h.set_size(data.len() as u64);
                b.append_data(&mut h, path, *data).unwrap();
            }
            E::Xattr(mode, data, key, value) => {
                let record = format!("SCHILY.xattr.{key}");
                b.append_pax_extensions([(record.as_str(), *value)])
                    .unwrap();
                h.set_entry_type(tar::EntryType::Regular);
                h.set_mode(*mode);
                h.set_size(data.len() as u64);
                b.append_data(&mut h, path, *data).unwrap();
            }
            E::Sym(target) | E::Hard(target) => {
                h.set_entry_type(if matches!(e, E::Sym(_)) {
                    tar::EntryType::Symlink
                } else {
                    tar::EntryType::Link
                });
                h.set_mode(0o777);
                b.append_link(&mut h, path, target).unwrap();
            }
            E::Char(major, minor) => {
                h.set_entry_type(tar::EntryType::Char);
                h.set_mode(0o666);
                h.set_device_major(*major).unwrap();
                h.set_device_minor(*minor).unwrap();
                b.append_data(&mut h, path, &[][..]).unwrap();
            }
            E::Fifo => {
                h.set_entry_type(tar::EntryType::Fifo);
                h.set_mode(0o644);
                b.append_data(&mut h, path, &[][..]).unwrap();
            }
        }
    }
    b.into_inner().unwrap()
}

fn image(dir: &Path, layers: &[Vec<u8>]) -> PathBuf {
    umoci_layers(dir, layers)
}

fn run(program: &str, args: &[&str]) -> String {
    tool(program, args)
}

/// What the comparison looks at, for one path.
#[derive(Debug, PartialEq, Eq)]
struct Seen {
    kind: &'static str,
    mode: u32,
    uid: u32,
    gid: u32,
    size: u64,
    sha256: String,
    link: String,
    rdev: u64,
    xattrs: Vec<(String, Vec<u8>)>,
    mtime: i64,
    /// The first path (in order) of the hard-link group, for files linked.
    group: String,
}

fn sha256(p: &Path) -> String {
    use sha2::Digest as _;
    format!("{:x}", sha2::Sha256::digest(fs::read(p).unwrap()))
}

fn xattrs_of(p: &Path) -> Vec<(String, Vec<u8>)> {
    let mut names = vec![0u8; 4096];
    let n = rustix::fs::llistxattr(p, &mut names).unwrap_or(0);
    let mut out = Vec::new();
    for name in names[..n].split(|b| *b == 0).filter(|n| !n.is_empty()) {
        let key = String::from_utf8_lossy(name).into_owned();
        // Labels a host's security module puts on every file.
        if key == "security.selinux" {
            continue;
        }
        let mut value = vec![0u8; 4096];
        let m = rustix::fs::lgetxattr(p, key.as_str(), &mut value).unwrap();
        out.push((key, value[..m].to_vec()));
    }
    out.sort();
    out
}

fn walk(root: &Path) -> BTreeMap<String, Seen> {
    let mut out = BTreeMap::new();
    let mut groups: BTreeMap<u64, String> = BTreeMap::new();
    let mut paths = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(at) = stack.pop() {
        paths.push(at.clone());
        if fs::symlink_metadata(&at).unwrap().is_dir() {
            for e in fs::read_dir(&at).unwrap() {
                stack.push(e.unwrap().path());
            }
        }
    }
    paths.sort();
    for p in paths {
        let rel = p.strip_prefix(root).unwrap().to_string_lossy().into_owned();
        if rel == "lost+found" || rel.starts_with("lost+found/") {
            continue;
        }
        let m = fs::symlink_metadata(&p).unwrap();
        let ft = m.file_type();
        let kind = if ft.is_dir() {
            "dir"
        } else if ft.is_file() {
            "file"
        } else if ft.is_symlink() {
            "symlink"
        } else if ft.is_char_device() {
            "char"
        } else if ft.is_block_device() {
            "block"
        } else if ft.is_fifo() {
            "fifo"
        } else {
            "other"
        };
        let group = if ft.is_file() && m.nlink() > 1 {
            groups.entry(m.ino()).or_insert_with(|| rel.clone()).clone()
        } else {
            String::new()
        };
        out.insert(
            rel,
            Seen {
                kind,
                mode: if ft.is_symlink() {
                    0
                } else {
                    m.mode() & 0o7777
                },
                uid: m.uid(),
                gid: m.gid(),
                size: if ft.is_file() { m.len() } else { 0 },
                sha256: if ft.is_file() {
                    sha256(&p)
                } else {
                    String::new()
                },
                link: if ft.is_symlink() {
                    fs::read_link(&p).unwrap().to_string_lossy().into_owned()
                } else {
                    String::new()
                },
                rdev: m.rdev(),
                xattrs: xattrs_of(&p),
                mtime: if ft.is_dir() { 0 } else { m.mtime() },
                group,
            },
        );
    }
    out
}

fn compare(what: &str, ours: &BTreeMap<String, Seen>, oracle: &BTreeMap<String, Seen>) {
    let mut wrong = Vec::new();
    for (path, seen) in oracle {
        match ours.get(path) {
            None => wrong.push(format!("{path:?}: missing from {what}")),
            Some(o) if o != seen => {
                wrong.push(format!("{path:?}:\n  {what}: {o:?}\n  umoci: {seen:?}"))
            }
            Some(_) => {}
        }
    }
    for path in ours.keys().filter(|p| !oracle.contains_key(*p)) {
        wrong.push(format!("{path:?}: in {what} only"));
    }
    assert!(
        wrong.is_empty(),
        "{what} differs from umoci unpack:\n{}",
        wrong.join("\n")
    );
}

/// Unpacks the layout's image with hearth into `into`.
fn hearth_unpack(layout: &Path, store: &Path, into: &Path) -> Result<(), OciError> {
    let l = Layout::open(layout)?;
    let image = l.image(Some("t"))?;
    let store = BlobStore::open(store)?;
    l.copy_into(&image, &store, |_| {})?;
    fs::create_dir_all(into).unwrap();
    let mut u = Unpacker::new(into)?;
    for d in image.layers() {
        u.layer(d, store.open_blob(d.digest())?, 1 << 30)?;
    }
    u.finish()?;
    Ok(())
}

#[test]
fn layers_unpack_as_umoci_unpacks_them_and_the_ext4_holds_the_same_tree() {
    let long = format!("long/{}", "n".repeat(200));
    let zeros = vec![0u8; 3 << 20];
    let l1 = layer(&[
        ("etc/", E::Dir(0o755)),
        ("etc/passwd", E::File(0o644, b"root:x:0:0::/root:/bin/sh\n")),
        ("etc/passwd-hard", E::Hard("etc/passwd")),
        ("opt/app/", E::Dir(0o750)),
        ("opt/app/a.txt", E::File(0o644, b"a")),
        ("opt/app/b.txt", E::Owned(0o640, 1000, 1001, b"b")),
        ("var/", E::Dir(0o755)),
        ("var/old", E::File(0o644, b"old")),
        ("var/sub/", E::Dir(0o755)),
        ("var/sub/deep", E::File(0o644, b"deep")),
        ("bin/", E::Dir(0o755)),
        ("bin/tool", E::File(0o4755, b"\x7fELF setuid")),
        (
            "bin/ping",
            E::Xattr(
                0o755,
                b"\x7fELF ping",
                "security.capability",
                &[
                    1, 0, 0, 2, 0, 0x20, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                ],
            ),
        ),
        ("link1", E::Sym("link2")),
        ("link2", E::Sym("etc/passwd")),
        ("abs", E::Sym("/etc/passwd")),
        ("dev/", E::Dir(0o755)),
        ("dev/null", E::Char(1, 3)),
        ("run/fifo", E::Fifo),
        ("swap", E::File(0o644, b"first a file")),
        ("data/zeros", E::File(0o644, &zeros)),
        ("data/empty", E::File(0o600, b"")),
        (long.as_str(), E::File(0o644, b"long name")),
    ]);
    let l2 = layer(&[
        ("opt/app/.wh.a.txt", E::File(0o644, b"")),
        ("var/.wh..wh..opq", E::File(0o644, b"")),
        ("var/new", E::File(0o644, b"new")),
        ("swap/", E::Dir(0o755)),
        ("swap/inner", E::File(0o644, b"then a directory")),
        // A hard link to a file of the layer below.
        ("bin/tool-link", E::Hard("bin/tool")),
        (
            "etc/passwd",
            E::Xattr(
                0o600,
                b"root:x:0:0::/root:/bin/bash\n",
                "user.note",
                b"changed",
            ),
        ),
    ]);
    let l3 = layer(&[
        (".wh.swap", E::File(0o644, b"")),
        ("swap", E::File(0o644, b"and a file again")),
        ("link2", E::Sym("etc/passwd-hard")),
    ]);
    let dir = tempfile::tempdir().unwrap();
    let layout = image(dir.path(), &[l1, l2, l3]);

    let bundle = dir.path().join("bundle");
    run(
        "umoci",
        &[
            "unpack",
            "--image",
            &format!("{}:t", s(&layout)),
            s(&bundle),
        ],
    );
    let oracle = walk(&bundle.join("rootfs"));
    // The oracle did see what the test is about.
    assert_eq!(oracle["swap"].kind, "file");
    assert!(!oracle.contains_key("opt/app/a.txt") && !oracle.contains_key("var/old"));
    assert_eq!(oracle["bin/tool"].mode, 0o4755);
    assert!(!oracle["bin/ping"].xattrs.is_empty());

    let ours_dir = dir.path().join("ours");
    hearth_unpack(&layout, &dir.path().join("store"), &ours_dir).unwrap();
    compare("hearth's unpack", &walk(&ours_dir), &oracle);

    let img = dir.path().join("root.ext4");
    let size = ext4::build(&ours_dir, &img, 0).unwrap();
    assert_eq!(fs::metadata(&img).unwrap().len(), size);
    let mnt = dir.path().join("mnt");
    fs::create_dir_all(&mnt).unwrap();
    run("mount", &["-o", "loop,ro", s(&img), s(&mnt)]);
    let mounted = walk(&mnt);
    run("umount", &[s(&mnt)]);
    compare("the ext4 image", &mounted, &oracle);
}

#[test]
fn a_write_through_an_absolute_link_is_refused_and_nothing_lands_outside() {
    let dir = tempfile::tempdir().unwrap();
    let outside = dir.path().join("outside");
    fs::create_dir_all(&outside).unwrap();
    let evil = layer(&[("escape", E::Sym(s(&outside)))]);
    let through = layer(&[("escape/owned", E::File(0o644, b"x"))]);
    let layout = image(dir.path(), &[evil, through]);
    let e =
        hearth_unpack(&layout, &dir.path().join("store"), &dir.path().join("ours")).unwrap_err();
    let text = e.to_string();
    assert!(
        text.contains("\"escape/owned\"")
            && text.contains("outside the root")
            && text.contains("layer sha256:"),
        "{text}"
    );
    assert_eq!(
        fs::read_dir(&outside).unwrap().count(),
        0,
        "nothing written outside"
    );

    // The same through a relative link that climbs out.
    let dir2 = tempfile::tempdir().unwrap();
    let climb = layer(&[
        ("up", E::Sym("../../../../../../..")),
        ("up/tmp/x", E::File(0o644, b"x")),
    ]);
    let layout = image(dir2.path(), &[climb]);
    let e = hearth_unpack(
        &layout,
        &dir2.path().join("store"),
        &dir2.path().join("ours"),
    )
    .unwrap_err();
    assert!(e.to_string().contains("outside the root"), "{e}");
}

#[test]
fn a_file_the_room_check_refuses_is_not_written_and_the_error_says_what_was_needed() {
    let dir = tempfile::tempdir().unwrap();
    let small = vec![1u8; 1000];
    let big = vec![2u8; 5000];
    let l = layer(&[
        ("small", E::File(0o644, &small)),
        ("big", E::File(0o644, &big)),
    ]);
    let layout = image(dir.path(), &[l]);
    let image = Layout::open(&layout).unwrap().image(Some("t")).unwrap();
    let store = BlobStore::open(dir.path().join("store")).unwrap();
    Layout::open(&layout)
        .unwrap()
        .copy_into(&image, &store, |_| {})
        .unwrap();
    let into = dir.path().join("ours");
    fs::create_dir_all(&into).unwrap();
    // Room for 4096 bytes in all: the small file fits, the big one not.
    let asked = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = asked.clone();
    let mut left = 4096u64;
    let mut u = Unpacker::new(&into)
        .unwrap()
        .with_room_check(Box::new(move |n| {
            seen.lock().unwrap().push(n);
            if n > left {
                return Err(format!("{n} bytes do not fit in {left}"));
            }
            left -= n;
            Ok(())
        }));
    let d = &image.layers()[0];
    let e = u
        .layer(d, store.open_blob(d.digest()).unwrap(), 1 << 30)
        .unwrap_err();
    match &e {
        OciError::NoRoom { needs, message } => {
            assert_eq!(*needs, 6000, "{e}");
            assert!(
                message.contains("\"big\"") && message.contains("5000 bytes do not fit in 3096"),
                "{message}"
            );
        }
        other => panic!("not NoRoom: {other}"),
    }
    assert_eq!(*asked.lock().unwrap(), [1000, 5000]);
    assert_eq!(fs::read(into.join("small")).unwrap(), small);
    assert!(!into.join("big").exists(), "the refused file was made");
}
