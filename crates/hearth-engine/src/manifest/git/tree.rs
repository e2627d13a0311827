//! A commit's files as the manifest core's listing, free of I/O: which
//! entries of `git ls-tree -r -l -z` under the source's `path` are
//! manifests, which are ignored and why, and their blobs out of
//! `git cat-file --batch`, parsed (a blob is parsed once: its id is its
//! content).

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Arc;

use crate::manifest::core::{Content, Decl, FileScan, Listing};
use crate::manifest::names::is_candidate;
use crate::manifest::parse::{FileError, parse_manifest};

/// One entry of `git ls-tree -r -l -z`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TreeEntry {
    pub mode: String,
    pub kind: String,
    pub oid: String,
    /// Blobs only.
    pub size: Option<u64>,
    pub path: String,
}

/// Why `ls-tree`'s output could not be read.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("git ls-tree printed an entry hearth cannot read: {0:?}")]
pub struct BadEntry(pub String);

/// Reads `git ls-tree -r -l -z` (`MODE TYPE OID SIZE\tPATH\0` each).
pub fn parse_ls_tree(out: &[u8]) -> Result<Vec<TreeEntry>, BadEntry> {
    let mut entries = Vec::new();
    for raw in out.split(|b| *b == 0).filter(|r| !r.is_empty()) {
        let text = String::from_utf8_lossy(raw);
        let bad = || BadEntry(text.chars().take(200).collect());
        let (meta, path) = text.split_once('\t').ok_or_else(bad)?;
        let mut f = meta.split_whitespace();
        let (Some(mode), Some(kind), Some(oid), Some(size)) =
            (f.next(), f.next(), f.next(), f.next())
        else {
            return Err(bad());
        };
        entries.push(TreeEntry {
            mode: mode.to_string(),
            kind: kind.to_string(),
            oid: oid.to_string(),
            size: size.parse().ok(),
            path: path.to_string(),
        });
    }
    Ok(entries)
}

/// The source's folder in the repository, as a prefix of paths: "" for
/// the whole repository, else `a/b/`.
pub fn folder_prefix(path: &str) -> String {
    let p = path.trim_matches('/');
    if p.is_empty() || p == "." {
        String::new()
    } else {
        format!("{p}/")
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

/// Why `cat-file --batch` output could not be read.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BatchError {
    #[error("git cat-file --batch: an unreadable header {0:?}")]
    Header(String),
    #[error("git cat-file --batch: {0} is missing")]
    Missing(String),
    #[error("git cat-file --batch: the output ends inside an object")]
    Truncated,
}

/// Reads `git cat-file --batch` output: `OID TYPE SIZE\nBYTES\n` each.
pub fn parse_batch(mut out: &[u8]) -> Result<HashMap<String, Vec<u8>>, BatchError> {
    let mut blobs = HashMap::new();
    while !out.is_empty() {
        let nl = out
            .iter()
            .position(|b| *b == b'\n')
            .ok_or(BatchError::Truncated)?;
        let header = String::from_utf8_lossy(&out[..nl]).into_owned();
        out = &out[nl + 1..];
        let f: Vec<&str> = header.split(' ').collect();
        if f.len() == 2 && f[1] == "missing" {
            return Err(BatchError::Missing(f[0].to_string()));
        }
        if f.len() != 3 {
            return Err(BatchError::Header(header));
        }
        let size: usize = f[2]
            .parse()
            .map_err(|_| BatchError::Header(header.clone()))?;
        if out.len() < size + 1 {
            return Err(BatchError::Truncated);
        }
        blobs.insert(f[0].to_string(), out[..size].to_vec());
        out = &out[size + 1..];
    }
    Ok(blobs)
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
    fn ls_tree_lines_are_read() {
        let out = b"100644 blob 0123456789012345678901234567890123456789      42\tvms/a b.yaml\0\
160000 commit 1111111111111111111111111111111111111111       -\tsub\0";
        let e = parse_ls_tree(out).unwrap();
        assert_eq!(e.len(), 2);
        assert_eq!(e[0].path, "vms/a b.yaml");
        assert_eq!(e[0].size, Some(42));
        assert_eq!(e[1].size, None);
        assert!(parse_ls_tree(b"garbage\0").is_err());
        assert!(parse_ls_tree(b"").unwrap().is_empty());
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
    fn batch_output_is_read_exactly() {
        let out = b"aaa blob 3\nabc\nbbb blob 0\n\n";
        let b = parse_batch(out).unwrap();
        assert_eq!(b["aaa"], b"abc");
        assert_eq!(b["bbb"], b"");
        assert_eq!(
            parse_batch(b"ccc missing\n"),
            Err(BatchError::Missing("ccc".into()))
        );
        assert_eq!(
            parse_batch(b"aaa blob 9\nabc\n"),
            Err(BatchError::Truncated)
        );
        assert!(parse_batch(b"what\n").is_err());
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
}
