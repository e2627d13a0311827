//! Who declares an object: `metadata.managedBy`. `api` (the default) for
//! objects written through the API; `file:PATH` for the manifest
//! directory's; `git:NAME:PATH` for a git source's. A source may move an
//! object between its own files; nobody else may change or delete what a
//! source declares (the same object in two sources is a conflict).

use std::path::{Path, PathBuf};

/// `metadata.managedBy` of an object from the directory is this prefix and
/// the absolute path of its file.
pub const FILE_PREFIX: &str = "file:";
/// A git source's objects: this, the source's name, `:`, the file's path
/// in the repository.
pub const GIT_PREFIX: &str = "git:";

/// The owners of one source: a prefix, and each file's path after it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SourceOwner {
    prefix: String,
}

impl SourceOwner {
    /// The manifest directory.
    pub fn directory() -> SourceOwner {
        SourceOwner {
            prefix: FILE_PREFIX.to_string(),
        }
    }

    /// The git source `name`.
    pub fn git(name: &str) -> SourceOwner {
        SourceOwner {
            prefix: format!("{GIT_PREFIX}{name}:"),
        }
    }

    /// The owner string of objects declared in `file`.
    pub fn owner_string(&self, file: &Path) -> String {
        format!("{}{}", self.prefix, file.display())
    }

    /// The file an owner string names, when it is this source's.
    pub fn file_of(&self, managed_by: &str) -> Option<PathBuf> {
        managed_by.strip_prefix(&self.prefix).map(PathBuf::from)
    }
}

/// The source an owner string belongs to (`file`, `git:NAME`), or None for
/// objects no source declares (`api`).
pub fn source_of(managed_by: &str) -> Option<String> {
    if managed_by.starts_with(FILE_PREFIX) {
        return Some("file".to_string());
    }
    let rest = managed_by.strip_prefix(GIT_PREFIX)?;
    let (name, _) = rest.split_once(':')?;
    Some(format!("{GIT_PREFIX}{name}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owners_name_their_source_and_file() {
        let d = SourceOwner::directory();
        let g = SourceOwner::git("prod");
        assert_eq!(d.owner_string(Path::new("/m/a.yaml")), "file:/m/a.yaml");
        assert_eq!(
            g.owner_string(Path::new("vms/a.yaml")),
            "git:prod:vms/a.yaml"
        );
        assert_eq!(
            g.file_of("git:prod:vms/a.yaml"),
            Some(PathBuf::from("vms/a.yaml"))
        );
        assert_eq!(g.file_of("git:production:vms/a.yaml"), None);
        assert_eq!(g.file_of("file:/m/a.yaml"), None);
        assert_eq!(source_of("file:/m/a.yaml").as_deref(), Some("file"));
        assert_eq!(source_of("git:prod:a:b.yaml").as_deref(), Some("git:prod"));
        assert_eq!(source_of("api"), None);
        assert_eq!(source_of("git:broken"), None);
    }
}
