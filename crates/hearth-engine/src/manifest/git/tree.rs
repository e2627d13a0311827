//! A commit's files as the manifest core's listing, free of I/O: git's
//! commit and tree objects read (as `git cat-file --batch` gives them),
//! which entries under the source's `path` are manifests, which are
//! ignored and why, and their blobs parsed (a blob is parsed once: its id
//! is its content).

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Arc;

use crate::manifest::core::{Content, Decl, FileScan, Listing};
use crate::manifest::names::is_candidate;
use crate::manifest::parse::{FileError, parse_manifest};

/// One file of a commit, as `git ls-tree -r -l` would list it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TreeEntry {
    /// Six octal digits (`100644`, `120000` for a link, `160000` for a
    /// submodule).
    pub mode: String,
    /// `blob` or `commit` (a submodule).
    pub kind: String,
    pub oid: String,
    /// Blobs only.
    pub size: Option<u64>,
    pub path: String,
}

/// Why a git object could not be read as what it should be.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("git object {oid}: {why}")]
pub struct BadObject {
    pub oid: String,
    pub why: String,
}

/// One entry of a tree object, its id in hexadecimal.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RawEntry {
    pub mode: String,
    pub name: String,
    pub oid: String,
}

impl RawEntry {
    pub fn is_tree(&self) -> bool {
        self.mode == "40000" || self.mode == "040000"
    }

    /// As `ls-tree` shows it: the mode in six digits and the kind.
    pub fn listed(&self, path: String) -> TreeEntry {
        TreeEntry {
            mode: format!("{:0>6}", self.mode),
            kind: if self.mode == "160000" {
                "commit"
            } else {
                "blob"
            }
            .to_string(),
            oid: self.oid.clone(),
            size: None,
            path,
        }
    }
}

/// Reads a tree object (`MODE NAME\0` and the raw id, each), whose ids are
/// as long as `oid`'s (SHA-1 or SHA-256).
pub fn parse_tree(oid: &str, mut raw: &[u8]) -> Result<Vec<RawEntry>, BadObject> {
    let bad = |why: &str| BadObject {
        oid: oid.to_string(),
        why: why.to_string(),
    };
    let id_len = oid.len() / 2;
    let mut out = Vec::new();
    while !raw.is_empty() {
        let space = raw
            .iter()
            .position(|b| *b == b' ')
            .ok_or_else(|| bad("a tree entry without a mode"))?;
        let nul = raw[space..]
            .iter()
            .position(|b| *b == 0)
            .map(|p| p + space)
            .ok_or_else(|| bad("a tree entry without a name"))?;
        let mode = std::str::from_utf8(&raw[..space])
            .ok()
            .filter(|m| !m.is_empty() && m.bytes().all(|b| (b'0'..=b'7').contains(&b)))
            .ok_or_else(|| bad("a tree entry with a bad mode"))?;
        let id = raw
            .get(nul + 1..nul + 1 + id_len)
            .ok_or_else(|| bad("a tree that ends inside an entry"))?;
        out.push(RawEntry {
            mode: mode.to_string(),
            name: String::from_utf8_lossy(&raw[space + 1..nul]).into_owned(),
            oid: id.iter().map(|b| format!("{b:02x}")).collect(),
        });
        raw = &raw[nul + 1 + id_len..];
    }
    Ok(out)
}

/// What a commit object says, as the API shows it (`git log`'s `%H`,
/// `%P`, `%an`, `%cI` and `%s`).
pub fn parse_commit(oid: &str, raw: &[u8]) -> Result<super::repo::CommitInfo, BadObject> {
    let text = String::from_utf8_lossy(raw);
    let (headers, message) = text.split_once("\n\n").unwrap_or((&text, ""));
    let mut info = super::repo::CommitInfo {
        id: oid.to_string(),
        ..Default::default()
    };
    let mut tree = false;
    for line in headers.lines() {
        // Continuation lines (a signature's) start with a space.
        let Some((key, value)) = line.split_once(' ') else {
            continue;
        };
        match key {
            "tree" => tree = true,
            "parent" => info.parents.push(value.to_string()),
            "author" => info.author = person(value).0,
            "committer" => info.date = person(value).1,
            _ => {}
        }
    }
    if !tree {
        return Err(BadObject {
            oid: oid.to_string(),
            why: "a commit without a tree".into(),
        });
    }
    // The first paragraph, on one line.
    let subject: Vec<&str> = message
        .lines()
        .skip_while(|l| l.trim().is_empty())
        .take_while(|l| !l.trim().is_empty())
        .map(str::trim)
        .collect();
    info.subject = subject.join(" ").chars().take(200).collect();
    Ok(info)
}

/// `NAME <EMAIL> SECONDS ±HHMM`: the name, and the time in strict ISO 8601
/// in its own offset ("" when it cannot be read).
fn person(value: &str) -> (String, String) {
    let (name, rest) = match value.rfind('<') {
        Some(i) => (value[..i].trim(), &value[i..]),
        None => (value.trim(), ""),
    };
    let when = rest.rsplit_once('>').map(|(_, t)| t.trim()).unwrap_or("");
    let date = (|| {
        let (secs, zone) = when.split_once(' ')?;
        let secs: i64 = secs.parse().ok()?;
        let sign = match zone.as_bytes().first()? {
            b'+' => 1,
            b'-' => -1,
            _ => return None,
        };
        let hhmm: i32 = zone.get(1..5)?.parse().ok()?;
        let offset = chrono::FixedOffset::east_opt(sign * (hhmm / 100 * 3600 + hhmm % 100 * 60))?;
        let at = chrono::DateTime::from_timestamp(secs, 0)?.with_timezone(&offset);
        Some(at.to_rfc3339_opts(chrono::SecondsFormat::Secs, false))
    })()
    .unwrap_or_default();
    (name.to_string(), date)
}

/// The source's folder in the repository, as a prefix of paths: "" for
/// the whole repository, else `a/b/`.
pub fn folder_prefix(path: &str) -> String {
    // As a user writes a folder: `hosts`, `/hosts/`, `./hosts`, `a//b`.
    let parts: Vec<&str> = path
        .split('/')
        .filter(|c| !c.is_empty() && *c != ".")
        .collect();
    if parts.is_empty() {
        String::new()
    } else {
        format!("{}/", parts.join("/"))
    }
}

/// What a commit holds under the source's folder.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Selected {
    /// Manifest blobs (path in the repository, entry).
    pub manifests: Vec<TreeEntry>,
    /// Entries not read, with why (a symlink, a submodule, too large).
    pub ignored: Vec<(String, String)>,
    /// Whether anything at all lies under the folder.
    pub folder_exists: bool,
}

/// Picks the manifests under `prefix` (every folder below it too), by
/// name as the directory does (`names::is_candidate`). A symlink or a
/// submodule is never followed; a blob over `max_size` is not read; past
/// `max_files` manifests the rest are ignored.
pub fn select(entries: &[TreeEntry], prefix: &str, max_size: u64, max_files: usize) -> Selected {
    let mut out = Selected::default();
    for e in entries {
        let Some(rel) = e.path.strip_prefix(prefix) else {
            continue;
        };
        out.folder_exists = true;
        let name = rel.rsplit('/').next().unwrap_or(rel);
        if !is_candidate(name) || rel.split('/').any(|c| c.starts_with('.')) {
            continue;
        }
        let why = match (e.mode.as_str(), e.kind.as_str()) {
            ("120000", _) => Some("a symlink: links are not followed".to_string()),
            ("160000", _) | (_, "commit") => Some("a submodule: not fetched".to_string()),
            (_, "blob") if e.size.unwrap_or(u64::MAX) > max_size => Some(format!(
                "{} bytes, over the limit of {max_size}",
                e.size.map(|s| s.to_string()).unwrap_or_else(|| "?".into())
            )),
            (_, "blob") if out.manifests.len() >= max_files => {
                Some(format!("past the limit of {max_files} manifest files"))
            }
            (_, "blob") => None,
            _ => Some(format!("a {} entry", e.kind)),
        };
        match why {
            Some(w) => out.ignored.push((e.path.clone(), w)),
            None => out.manifests.push(e.clone()),
        }
    }
    out
}

/// A Git LFS pointer in place of the file.
pub fn is_lfs_pointer(bytes: &[u8]) -> bool {
    bytes.starts_with(b"version https://git-lfs.github.com/spec/v1")
}

/// A blob's bytes as the core sees a file. Host paths in a repository's
/// manifests resolve against `/` (a repository has no place on the host).
pub fn content_of(bytes: &[u8]) -> Content {
    if is_lfs_pointer(bytes) {
        return Content::Invalid(FileError::new(
            "a Git LFS pointer, not the file: hearth does not fetch LFS objects; commit the manifest itself",
        ));
    }
    match parse_manifest(bytes, std::path::Path::new("/")) {
        Ok(objects) => Content::Valid(objects.into_iter().map(Decl::new).collect::<Arc<[Decl]>>()),
        Err(e) => Content::Invalid(e),
    }
}

/// The listing of a commit: each manifest's content from `parsed` (by blob
/// id), every path relative to the repository.
pub fn listing(manifests: &[TreeEntry], parsed: &HashMap<String, Content>) -> Listing {
    let mut files = BTreeMap::new();
    for e in manifests {
        let content = parsed.get(&e.oid).cloned().unwrap_or_else(|| {
            Content::Invalid(FileError::new(format!("blob {} was not read", e.oid)))
        });
        files.insert(PathBuf::from(&e.path), FileScan { id: None, content });
    }
    Listing::Files(files)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(mode: &str, kind: &str, size: Option<u64>, path: &str) -> TreeEntry {
        TreeEntry {
            mode: mode.into(),
            kind: kind.into(),
            oid: format!("{:0>40}", path.len()),
            size,
            path: path.into(),
        }
    }

    #[test]
    fn tree_objects_are_read_exactly() {
        let id = |b: u8| [b; 20];
        let mut raw = Vec::new();
        for (mode, name, b) in [
            ("100644", "a b.yaml", 1u8),
            ("40000", "deep", 2),
            ("120000", "link.yaml", 3),
            ("160000", "sub", 4),
        ] {
            raw.extend_from_slice(format!("{mode} {name}\0").as_bytes());
            raw.extend_from_slice(&id(b));
        }
        let oid = "ab".repeat(20);
        let e = parse_tree(&oid, &raw).unwrap();
        assert_eq!(e.len(), 4);
        assert_eq!(e[0].name, "a b.yaml");
        assert_eq!(e[0].oid, "01".repeat(20));
        assert!(e[1].is_tree() && !e[0].is_tree());
        let listed = e[0].listed("vms/a b.yaml".into());
        assert_eq!(
            (listed.mode.as_str(), listed.kind.as_str()),
            ("100644", "blob")
        );
        assert_eq!(e[3].listed("sub".into()).kind, "commit");
        assert_eq!(e[2].listed("l".into()).mode, "120000");
        // SHA-256 ids are 32 bytes.
        let mut long = b"100644 x\0".to_vec();
        long.extend_from_slice(&[7; 32]);
        assert_eq!(
            parse_tree(&"cd".repeat(32), &long).unwrap()[0].oid,
            "07".repeat(32)
        );
        // Cut short, or garbage: an error, never a guess.
        assert!(parse_tree(&oid, &raw[..raw.len() - 1]).is_err());
        assert!(parse_tree(&oid, b"100644 no-nul").is_err());
        assert!(parse_tree(&oid, b"9x9 a\0aaaaaaaaaaaaaaaaaaaa").is_err());
        assert!(parse_tree(&oid, b"").unwrap().is_empty());
    }

    #[test]
    fn commit_objects_give_what_git_log_shows() {
        let raw = b"tree 0123456789012345678901234567890123456789\n\
parent 1111111111111111111111111111111111111111\n\
parent 2222222222222222222222222222222222222222\n\
author Ann Example <ann@example.org> 1765098672 -0130\n\
committer Bob <bob@example.org> 1765098672 +0100\n\
gpgsig -----BEGIN SSH SIGNATURE-----\n \n -----END SSH SIGNATURE-----\n\
\n\
first line\n  goes on\n\nbody\n";
        let c = parse_commit("ff", raw).unwrap();
        assert_eq!(c.parents, ["1".repeat(40), "2".repeat(40)]);
        assert_eq!(c.author, "Ann Example");
        assert_eq!(c.date, "2025-12-07T10:11:12+01:00");
        assert_eq!(c.subject, "first line goes on");
        let utc = parse_commit("ff", b"tree 00\ncommitter C <c@d> 0 +0000\n\nx").unwrap();
        assert_eq!(utc.date, "1970-01-01T00:00:00+00:00");
        assert!(utc.parents.is_empty());
        assert!(parse_commit("ff", b"no tree here\n\nx").is_err());
    }

    #[test]
    fn only_manifests_under_the_folder_are_picked_and_links_and_submodules_are_not_followed() {
        let entries = vec![
            entry("100644", "blob", Some(10), "README.md"),
            entry("100644", "blob", Some(10), "vms/a.yaml"),
            entry("100644", "blob", Some(10), "vms/deep/b.yml"),
            entry("100644", "blob", Some(10), "vms/.hidden/c.yaml"),
            entry("100644", "blob", Some(10), "vms/d.yaml~"),
            entry("120000", "blob", Some(10), "vms/link.yaml"),
            entry("160000", "commit", None, "vms/sub.yaml"),
            entry("100644", "blob", Some(999), "vms/big.json"),
            entry("100644", "blob", Some(10), "vmsx/e.yaml"),
        ];
        let s = select(&entries, &folder_prefix("/vms/"), 100, 10);
        assert!(s.folder_exists);
        let picked: Vec<&str> = s.manifests.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(picked, ["vms/a.yaml", "vms/deep/b.yml"]);
        let ignored: Vec<&str> = s.ignored.iter().map(|(p, _)| p.as_str()).collect();
        assert_eq!(ignored, ["vms/link.yaml", "vms/sub.yaml", "vms/big.json"]);
        assert!(s.ignored[0].1.contains("symlink"));
        assert!(s.ignored[1].1.contains("submodule"));
        assert!(s.ignored[2].1.contains("over the limit"));
        // A folder the commit does not have.
        for written in ["vms", "./vms", "/vms", "vms/.", "./vms/"] {
            assert_eq!(folder_prefix(written), "vms/", "{written}");
        }
        assert_eq!(folder_prefix("a//b/./c"), "a/b/c/");
        for whole in ["", "/", ".", "./"] {
            assert_eq!(folder_prefix(whole), "", "{whole}");
        }
        let s = select(&entries, &folder_prefix("nowhere"), 100, 10);
        assert!(!s.folder_exists);
        // The whole repository, at most one file.
        let s = select(&entries, &folder_prefix(""), 100, 1);
        assert_eq!(s.manifests.len(), 1);
        assert!(
            s.ignored
                .iter()
                .any(|(_, w)| w.contains("limit of 1 manifest"))
        );
    }

    #[test]
    fn an_lfs_pointer_and_a_bad_file_are_invalid_and_a_good_one_declares() {
        let lfs = b"version https://git-lfs.github.com/spec/v1\noid sha256:00\nsize 3\n";
        assert!(matches!(content_of(lfs), Content::Invalid(e) if e.message.contains("LFS")));
        assert!(matches!(content_of(b"kind: [\n"), Content::Invalid(_)));
        let good = b"apiVersion: hearth.dev/v1alpha1\nkind: VirtualDisk\nmetadata: {name: d}\nspec: {source: {blank: {}}, size: 1Gi}\n";
        match content_of(good) {
            Content::Valid(d) => assert_eq!(d.len(), 1),
            other => panic!("{other:?}"),
        }
    }

    proptest::proptest! {
        /// Whatever bytes a repository hands over: an answer or an error,
        /// never a panic.
        #[test]
        fn any_bytes_are_read_or_refused(raw in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..400)) {
            let _ = parse_tree(&"ab".repeat(20), &raw);
            let _ = parse_tree(&"ab".repeat(32), &raw);
            let _ = parse_commit("ff", &raw);
        }

        /// A tree written from entries reads back as exactly those entries.
        #[test]
        fn a_tree_reads_back_as_written(
            entries in proptest::collection::vec(
                (
                    proptest::sample::select(vec!["100644", "100755", "120000", "160000", "40000"]),
                    "[^\\x00/]{1,20}",
                    proptest::array::uniform20(proptest::prelude::any::<u8>()),
                ),
                0..20,
            )
        ) {
            let mut raw = Vec::new();
            for (mode, name, id) in &entries {
                raw.extend_from_slice(format!("{mode} {name}\0").as_bytes());
                raw.extend_from_slice(id);
            }
            let back = parse_tree(&"ab".repeat(20), &raw).unwrap();
            proptest::prop_assert_eq!(back.len(), entries.len());
            for (b, (mode, name, id)) in back.iter().zip(&entries) {
                proptest::prop_assert_eq!(&b.mode, mode);
                proptest::prop_assert_eq!(&b.name, name);
                let hex: String = id.iter().map(|x| format!("{x:02x}")).collect();
                proptest::prop_assert_eq!(&b.oid, &hex);
            }
        }
    }
}
