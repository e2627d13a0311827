//! Reading manifests for `hearth apply`: files, directories and stdin, with
//! relative host paths made absolute against the manifest's own directory.
//!
//! hearthd requires absolute paths because it does not know where the CLI
//! was run from; a manifest that says `kernel: vmlinuz` means "the vmlinuz
//! next to this file", wherever the user happens to stand.

use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use hearth_api::limits::MAX_MANIFEST_BYTES;
use hearth_api::{Kind, Object, ParseError};

/// Where one manifest text comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    Stdin,
    File(PathBuf),
}

impl Source {
    /// How errors name this source.
    pub fn origin(&self) -> String {
        match self {
            Source::Stdin => "<stdin>".to_string(),
            Source::File(p) => p.display().to_string(),
        }
    }
}

/// One object read from a manifest, and where it came from.
#[derive(Clone, Debug)]
pub struct Loaded {
    pub object: Object,
    pub origin: String,
}

/// The suffixes `apply -f DIR` picks up.
pub fn is_manifest_file_name(name: &std::ffi::OsStr) -> bool {
    let bytes = name.as_encoded_bytes();
    if bytes.starts_with(b".") {
        return false;
    }
    [".yaml", ".yml", ".json"]
        .iter()
        .any(|suffix| bytes.len() > suffix.len() && bytes.ends_with(suffix.as_bytes()))
}

/// The manifest files directly in `dir` (not recursive), sorted by name,
/// skipping dotfiles (editor locks and swap files) and other suffixes.
pub fn list_dir(dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    let entries = std::fs::read_dir(dir).with_context(|| format!("{}", dir.display()))?;
    for entry in entries {
        let entry = entry.with_context(|| format!("{}", dir.display()))?;
        let name = entry.file_name();
        if !is_manifest_file_name(&name) {
            continue;
        }
        let path = entry.path();
        // Follows symlinks, so a linked manifest counts and a linked directory does not.
        let meta = std::fs::metadata(&path).with_context(|| format!("{}", path.display()))?;
        if meta.is_file() {
            out.push(path);
        }
    }
    out.sort();
    Ok(out)
}

/// Turns the `-f` arguments into sources: `-` is stdin, a directory is its
/// manifest files.
pub fn expand(inputs: &[PathBuf]) -> anyhow::Result<Vec<Source>> {
    let mut out = Vec::new();
    let mut stdin_seen = false;
    for input in inputs {
        if input.as_os_str() == "-" {
            if stdin_seen {
                bail!("-f - (stdin) is given more than once");
            }
            stdin_seen = true;
            out.push(Source::Stdin);
            continue;
        }
        let meta = std::fs::metadata(input).with_context(|| format!("{}", input.display()))?;
        if meta.is_dir() {
            let files = list_dir(input)?;
            if files.is_empty() {
                bail!(
                    "{}: no manifest files in this directory (*.yaml, *.yml, *.json)",
                    input.display()
                );
            }
            out.extend(files.into_iter().map(Source::File));
        } else {
            out.push(Source::File(input.clone()));
        }
    }
    Ok(out)
}

/// The directory relative paths in this source are resolved against: the
/// file's directory (made absolute, symlinks not followed), or for stdin the
/// current directory.
pub fn base_dir(source: &Source) -> anyhow::Result<PathBuf> {
    match source {
        Source::Stdin => std::env::current_dir().context("cannot read the current directory"),
        Source::File(path) => {
            let abs = std::path::absolute(path).with_context(|| format!("{}", path.display()))?;
            Ok(abs
                .parent()
                .map(Path::to_path_buf)
                .unwrap_or_else(|| PathBuf::from("/")))
        }
    }
}

/// Reads, parses and checks every source. All or nothing: the first bad
/// document stops everything, so a half-valid set is never sent.
pub fn load(inputs: &[PathBuf]) -> anyhow::Result<Vec<Loaded>> {
    let mut out: Vec<Loaded> = Vec::new();
    let mut seen: HashMap<(Kind, String), String> = HashMap::new();
    for source in expand(inputs)? {
        let origin = source.origin();
        let text = match &source {
            Source::Stdin => read_manifest(std::io::stdin().lock(), &origin)?,
            Source::File(path) => {
                let file =
                    std::fs::File::open(path).with_context(|| format!("{}", path.display()))?;
                read_manifest(file, &origin)?
            }
        };
        let base = base_dir(&source)?;
        for object in parse(&text, &origin, &base)? {
            let key = (object.kind(), object.name().to_string());
            if let Some(first) = seen.get(&key) {
                bail!(
                    "{origin}: {} is declared twice (also in {first})",
                    object.display_name()
                );
            }
            seen.insert(key, origin.clone());
            out.push(Loaded {
                object,
                origin: origin.clone(),
            });
        }
    }
    Ok(out)
}

/// Reads one manifest, at most [`MAX_MANIFEST_BYTES`] of it: a larger one
/// (or an endless one, such as `/dev/zero`) is refused without reading on.
pub fn read_manifest(reader: impl Read, origin: &str) -> anyhow::Result<String> {
    let mut bytes = Vec::new();
    reader
        .take(MAX_MANIFEST_BYTES as u64 + 1)
        .read_to_end(&mut bytes)
        .with_context(|| origin.to_string())?;
    if bytes.len() > MAX_MANIFEST_BYTES {
        bail!(
            "{origin}: larger than {MAX_MANIFEST_BYTES} bytes, the most a manifest may have; not read further"
        );
    }
    String::from_utf8(bytes).map_err(|e| {
        anyhow::anyhow!(
            "{origin}: not UTF-8 text (binary data?) at byte {}",
            e.utf8_error().valid_up_to()
        )
    })
}

/// Parses one text of YAML or JSON documents (`{"items": [...]}` lists are
/// expanded), resolves relative host paths against `base`, then checks each
/// object the way hearthd will.
pub fn parse(text: &str, origin: &str, base: &Path) -> Result<Vec<Object>, ParseError> {
    hearth_api::parse_documents_in(text, origin, Some(base))
}

#[cfg(test)]
mod tests {
    use super::*;
    use hearth_api::DiskSource;

    const VM_RELATIVE: &str = "\
apiVersion: hearth.dev/v1alpha1
kind: VirtualMachine
metadata: {name: demo}
spec:
  boot: {kernel: boot/vmlinuz, initrd: ../images/initrd.img, cmdline: console=ttyS0}
";

    fn vm_of(obj: &Object) -> &hearth_api::VirtualMachine {
        match obj {
            Object::VirtualMachine(vm) => vm,
            other => panic!("expected a VirtualMachine, got {other:?}"),
        }
    }

    #[test]
    fn relative_kernel_and_initrd_resolve_against_the_manifest_directory() {
        let objs = parse(VM_RELATIVE, "m/vm.yaml", Path::new("/srv/manifests")).expect("parses");
        let vm = vm_of(&objs[0]);
        assert_eq!(
            vm.spec.boot.as_ref().expect("boot").kernel,
            Some(PathBuf::from("/srv/manifests/boot/vmlinuz"))
        );
        assert_eq!(
            vm.spec.boot.as_ref().expect("boot").initrd,
            Some(PathBuf::from("/srv/manifests/../images/initrd.img"))
        );
    }

    #[test]
    fn absolute_paths_are_left_alone() {
        let text = VM_RELATIVE.replace("boot/vmlinuz", "/boot/vmlinuz-6.1");
        let objs = parse(&text, "vm.yaml", Path::new("/srv/manifests")).expect("parses");
        assert_eq!(
            vm_of(&objs[0]).spec.boot.as_ref().expect("boot").kernel,
            Some(PathBuf::from("/boot/vmlinuz-6.1"))
        );
    }

    #[test]
    fn relative_image_of_a_disk_resolves_too() {
        let text = "\
apiVersion: hearth.dev/v1alpha1
kind: VirtualDisk
metadata: {name: root}
spec: {source: {image: base.qcow2}}
";
        let objs = parse(text, "d.yaml", Path::new("/data")).expect("parses");
        let Object::VirtualDisk(d) = &objs[0] else {
            panic!("expected a disk: {objs:?}");
        };
        assert_eq!(
            d.spec.source,
            DiskSource::Image(PathBuf::from("/data/base.qcow2"))
        );
    }

    #[test]
    fn stdin_resolves_against_the_current_directory() {
        let base = base_dir(&Source::Stdin).expect("cwd");
        assert_eq!(base, std::env::current_dir().expect("cwd"));
        let objs = parse(VM_RELATIVE, "<stdin>", &base).expect("parses");
        assert_eq!(
            vm_of(&objs[0]).spec.boot.as_ref().expect("boot").kernel,
            Some(base.join("boot/vmlinuz"))
        );
    }

    #[test]
    fn a_relative_file_argument_gets_an_absolute_base() {
        let base = base_dir(&Source::File(PathBuf::from("sub/vm.yaml"))).expect("base");
        assert_eq!(base, std::env::current_dir().expect("cwd").join("sub"));
        let base = base_dir(&Source::File(PathBuf::from("/etc/hearth/vm.yaml"))).expect("base");
        assert_eq!(base, PathBuf::from("/etc/hearth"));
    }

    #[test]
    fn items_lists_and_multiple_documents_are_expanded() {
        let text = r#"{"items": [
  {"apiVersion": "hearth.dev/v1alpha1", "kind": "VirtualDisk", "metadata": {"name": "a"}, "spec": {"size": "1Gi", "source": {"blank": {}}}},
  {"apiVersion": "hearth.dev/v1alpha1", "kind": "VirtualDisk", "metadata": {"name": "b"}, "spec": {"size": "1Gi", "source": {"blank": {}}}}
]}
---
---
"#;
        let text = format!("{text}{VM_RELATIVE}");
        let objs = parse(&text, "x.yaml", Path::new("/m")).expect("parses");
        let names: Vec<_> = objs.iter().map(|o| o.name().to_string()).collect();
        assert_eq!(names, ["a", "b", "demo"]);
    }

    #[test]
    fn syntax_errors_name_the_file_line_and_column_once() {
        let err = parse(
            "kind: VirtualMachine\nspec: [\n",
            "bad.yaml",
            Path::new("/"),
        )
        .expect_err("broken YAML");
        let text = err.to_string();
        assert!(text.starts_with("bad.yaml: line "), "{text}");
        assert!(matches!(err, ParseError::Syntax { line: 3, .. }), "{err:?}");
        assert_eq!(text.matches("line").count(), 1, "{text}");
    }

    #[test]
    fn field_errors_name_the_file_object_and_field() {
        let text = VM_RELATIVE.replace("spec:\n", "spec:\n  memory: 1Mi\n");
        let err = parse(&text, "vm.yaml", Path::new("/m")).expect_err("too small");
        assert!(
            err.to_string()
                .starts_with("vm.yaml: VirtualMachine \"demo\": spec.memory: "),
            "{err}"
        );
    }

    #[test]
    fn manifest_suffixes() {
        use std::ffi::OsStr;
        for ok in ["a.yaml", "b.yml", "c.json", "vm.v2.yaml"] {
            assert!(is_manifest_file_name(OsStr::new(ok)), "{ok}");
        }
        for skip in [
            ".hidden.yaml",
            ".#vm.yaml",
            "vm.yaml~",
            "#vm.yaml#",
            "vm.yaml.swp",
            "README.md",
            "4913",
            ".yaml",
            "vm.YAML.bak",
        ] {
            assert!(!is_manifest_file_name(OsStr::new(skip)), "{skip}");
        }
    }

    #[test]
    fn directories_expand_sorted_without_dotfiles_or_other_suffixes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let d = dir.path();
        for name in [
            "b.yml",
            "a.yaml",
            "c.json",
            ".a.yaml.swp",
            ".hidden.yaml",
            "notes.txt",
            "vm.yaml~",
        ] {
            std::fs::write(d.join(name), "").expect("write");
        }
        std::fs::create_dir(d.join("sub.yaml")).expect("mkdir");
        std::fs::write(d.join("sub.yaml").join("deep.yaml"), "").expect("write");

        let sources = expand(&[d.to_path_buf()]).expect("expands");
        let names: Vec<_> = sources
            .iter()
            .map(|s| match s {
                Source::File(p) => p.file_name().map(|n| n.to_string_lossy().into_owned()),
                Source::Stdin => None,
            })
            .collect();
        assert_eq!(
            names,
            [
                Some("a.yaml".into()),
                Some("b.yml".into()),
                Some("c.json".into())
            ]
        );
    }

    #[test]
    fn stdin_and_files_mix_but_stdin_only_once() {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = dir.path().join("vm.yaml");
        std::fs::write(&f, VM_RELATIVE).expect("write");
        let sources = expand(&[PathBuf::from("-"), f.clone()]).expect("expands");
        assert_eq!(sources, [Source::Stdin, Source::File(f)]);
        let err = expand(&[PathBuf::from("-"), PathBuf::from("-")]).expect_err("twice");
        assert!(err.to_string().contains("more than once"), "{err}");
    }

    #[test]
    fn an_empty_directory_or_missing_file_is_an_error() {
        let dir = tempfile::tempdir().expect("tempdir");
        let err = expand(&[dir.path().to_path_buf()]).expect_err("empty dir");
        assert!(err.to_string().contains("no manifest files"), "{err}");
        let missing = dir.path().join("nope.yaml");
        let err = expand(std::slice::from_ref(&missing)).expect_err("missing");
        assert!(
            format!("{err:#}").starts_with(&missing.display().to_string()),
            "{err:#}"
        );
    }

    #[test]
    fn load_resolves_each_file_against_its_own_directory_and_refuses_duplicates() {
        let dir = tempfile::tempdir().expect("tempdir");
        let sub = dir.path().join("vms");
        std::fs::create_dir(&sub).expect("mkdir");
        std::fs::write(sub.join("vm.yaml"), VM_RELATIVE).expect("write");
        let loaded = load(std::slice::from_ref(&sub)).expect("loads");
        assert_eq!(loaded.len(), 1);
        let abs_sub = std::path::absolute(&sub).expect("absolute");
        assert_eq!(
            vm_of(&loaded[0].object)
                .spec
                .boot
                .as_ref()
                .expect("boot")
                .kernel,
            Some(abs_sub.join("boot/vmlinuz"))
        );

        std::fs::write(sub.join("vm-copy.yaml"), VM_RELATIVE).expect("write");
        let err = load(&[sub]).expect_err("declared twice");
        assert!(
            err.to_string()
                .contains("VirtualMachine \"demo\" is declared twice"),
            "{err}"
        );
    }

    #[test]
    fn an_endless_or_oversized_input_is_refused_after_the_limit() {
        let zero = std::fs::File::open("/dev/zero").expect("/dev/zero");
        let err = read_manifest(zero, "/dev/zero").expect_err("endless");
        assert!(
            err.to_string()
                .starts_with("/dev/zero: larger than 4194304 bytes"),
            "{err}"
        );
        let exact = vec![b'#'; MAX_MANIFEST_BYTES];
        assert_eq!(
            read_manifest(&exact[..], "x").expect("at the limit").len(),
            MAX_MANIFEST_BYTES
        );
        let err = read_manifest(&b"a: \xff"[..], "bin.yaml").expect_err("binary");
        assert!(err.to_string().contains("bin.yaml: not UTF-8"), "{err}");
    }

    #[test]
    fn a_deeply_nested_text_is_refused_with_its_origin_and_line() {
        let text = format!("kind: VirtualDisk\nspec: {}", "[".repeat(100_000));
        let err = parse(&text, "deep.yaml", Path::new("/")).expect_err("too deep");
        assert_eq!(
            err.to_string(),
            "deep.yaml: line 2, column 38: lists and mappings nested more than 32 levels deep; not parsed"
        );
    }

    #[test]
    fn tab_indented_json_is_accepted() {
        let text = "{\n\t\"apiVersion\": \"hearth.dev/v1alpha1\",\n\t\"kind\": \"VirtualDisk\",\n\t\"metadata\": {\"name\": \"t\"},\n\t\"spec\": {\"size\": \"1Gi\", \"source\": {\"blank\": {}}}\n}\n";
        let objs = parse(text, "t.json", Path::new("/")).expect("parses");
        assert_eq!(objs[0].name(), "t");
    }
}
