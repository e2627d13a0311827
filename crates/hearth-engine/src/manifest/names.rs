//! Which directory entries are manifests. Pure: names in, yes/no out.
//!
//! A candidate is a `*.yaml`, `*.yml` or `*.json` name that no editor, package
//! manager or sync tool uses for its own temporary or backup files. Everything
//! else in the directory is somebody's scratch space and is never read.

/// Suffixes of manifest files. Lowercase only, like `hearth apply -f DIR`.
const SUFFIXES: [&str; 3] = [".yaml", ".yml", ".json"];

/// Suffixes editors and tools give their own files (backups, swap files,
/// patch leftovers, temporary names).
const IGNORED_SUFFIXES: [&str; 7] = ["~", ".swp", ".swx", ".tmp", ".bak", ".orig", ".rej"];

/// Whether `name`, an entry directly in the manifest directory, is a manifest.
///
/// Ignored, whatever their suffix:
/// - dotfiles: vim swap files (`.vm.yaml.swp`), Emacs lock links (`.#vm.yaml`),
///   rsync temporaries (`.vm.yaml.Xy12Ab`), Kubernetes ConfigMap internals
///   (`..data`, `..2024_01_01_...`), `.git`;
/// - `*~` backups (vim, Emacs), `#vm.yaml#` Emacs autosaves, vim's `4913`
///   write probe, `*.swp`/`*.swx`, `*.tmp`, `*.bak`, `*.orig`, `*.rej`, and
///   dpkg's `*.dpkg-new`/`*.dpkg-old`/`*.dpkg-dist`/...;
/// - GNU `sed -i` temporaries (`sedAbC123`) and anything else without a
///   manifest suffix.
pub fn is_candidate(name: &str) -> bool {
    if name.is_empty() || name.starts_with('.') || name.contains('/') {
        return false;
    }
    if name == "4913" || (name.starts_with('#') && name.ends_with('#')) {
        return false;
    }
    if IGNORED_SUFFIXES.iter().any(|s| name.ends_with(s)) || name.contains(".dpkg-") {
        return false;
    }
    SUFFIXES
        .iter()
        .any(|s| name.len() > s.len() && name.ends_with(s))
}

/// Whether a change to this entry can change what the directory declares, so
/// an inotify event on it should wake a re-list. Candidates can, and so can
/// `..`-names: a ConfigMap volume swaps its `..data` symlink to publish new
/// files. Editor scratch files (swap files written every few seconds while
/// someone types) cannot.
pub fn wakes_relist(name: &str) -> bool {
    name.starts_with("..") || is_candidate(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manifest_suffixes_are_candidates() {
        for name in ["vm.yaml", "vm.yml", "vm.json", "vm.v2.yaml", "tmp-123.yaml"] {
            assert!(is_candidate(name), "{name}");
        }
    }

    #[test]
    fn editor_tool_and_dot_names_are_ignored() {
        for name in [
            "",
            ".yaml",
            ".vm.yaml",
            ".vm.yaml.swp",
            ".vm.yaml.swx",
            "vm.yaml.swp",
            "vm.yaml~",
            "vm.yaml~.yaml~",
            "#vm.yaml#",
            ".#vm.yaml",
            "4913",
            "vm.yaml.tmp",
            "vm.yaml.bak",
            "vm.yaml.orig",
            "vm.yaml.rej",
            "vm.yaml.dpkg-new",
            "vm.yaml.dpkg-old",
            "vm.yaml.dpkg-dist",
            "vm.dpkg-tmp.yaml",
            "sedAbC123",
            ".vm.yaml.Xy12Ab",
            "..data",
            "..2024_01_01_00_00_00.123",
            ".git",
            "vm.yaml.disabled",
            "vm.YAML",
            "README.md",
        ] {
            assert!(!is_candidate(name), "{name:?} must be ignored");
        }
    }

    #[test]
    fn configmap_swaps_and_candidates_wake_but_scratch_files_do_not() {
        assert!(wakes_relist("..data"));
        assert!(wakes_relist("..data_tmp"));
        assert!(wakes_relist("vm.yaml"));
        assert!(!wakes_relist(".vm.yaml.swp"));
        assert!(!wakes_relist("4913"));
        assert!(!wakes_relist("vm.yaml~"));
        assert!(!wakes_relist("#vm.yaml#"));
    }
}
