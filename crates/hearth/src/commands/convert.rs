//! `hearth convert ignite FILE`: prints the hearth objects an Ignite
//! manifest becomes, for people who move for good (docs/ignite.md). The
//! same translation `hearth apply` and the manifest directory use.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use hearth_api::Object;
use hearth_api::ignite::{ANNOTATION_VM, warnings_of};

use crate::manifest;

#[cfg(test)]
mod tests {
    #[test]
    fn the_yaml_reads_back_as_the_same_objects() {
        let text = include_str!("../../../hearth-api/src/ignite/fixtures/my-vm.yaml");
        let objs = hearth_api::parse_documents(text, "my-vm.yaml").unwrap();
        let yaml = super::render(&objs, "my-vm.yaml").unwrap();
        assert!(!yaml.contains('!'), "{yaml}");
        let back = hearth_api::parse_documents(&yaml, "converted").unwrap();
        assert_eq!(back, objs);
        let w = super::warnings(&objs);
        assert_eq!(w.len(), 1);
        assert_eq!((w[0].0.as_str(), w[0].1.as_str()), ("my-vm", "spec.ssh"));
        assert!(super::render(&[], "x").is_err());
    }
}

#[derive(Debug, clap::Args)]
#[command(
    about = "Print the hearth objects another tool's manifest becomes",
    after_help = "\
FORMAT is `ignite`: an Ignite VM (apiVersion ignite.weave.works/v1alpha4,
kind VM). The objects are printed as YAML documents, ready for
`hearth apply -f`; relative host paths (copyFiles, ssh) are made absolute
against the file's directory. Each object's annotations say which Ignite
field made which of its fields; a field hearth cannot honour is printed as
a warning on stderr and kept as an annotation of the VM.

hearth apply -f and the manifest directory read Ignite files as they are:
converting is only for leaving the Ignite file behind.

Example:
  hearth convert ignite my-vm.yaml > my-vm.hearth.yaml"
)]
pub struct Args {
    /// The manifest's format: `ignite`.
    #[arg(value_name = "FORMAT", value_parser = ["ignite"])]
    pub format: String,
    /// The manifest file, or `-` for stdin.
    #[arg(value_name = "FILE")]
    pub file: PathBuf,
}

pub fn run(args: &Args) -> anyhow::Result<()> {
    let (text, origin, base) = if args.file == Path::new("-") {
        let text = manifest::read_manifest(std::io::stdin().lock(), "<stdin>")?;
        (text, "<stdin>".to_string(), std::env::current_dir()?)
    } else {
        let origin = args.file.display().to_string();
        let f = std::fs::File::open(&args.file).with_context(|| origin.clone())?;
        let text = manifest::read_manifest(f, &origin)?;
        let abs = std::path::absolute(&args.file).with_context(|| origin.clone())?;
        let base = abs.parent().map(Path::to_path_buf).unwrap_or_default();
        (text, origin, base)
    };
    let objects = manifest::parse(&text, &origin, &base)?;
    let mut err = std::io::stderr();
    for (vm, field, message) in warnings(&objects) {
        writeln!(
            err,
            "warning: {origin}: Ignite VM {vm:?}: {field}: {message}"
        )?;
    }
    let mut out = std::io::stdout().lock();
    out.write_all(render(&objects, &origin)?.as_bytes())?;
    Ok(())
}

/// `(Ignite VM, Ignite field, message)` of every translated object.
pub fn warnings(objects: &[Object]) -> Vec<(String, String, String)> {
    let mut out = Vec::new();
    for o in objects {
        let a = &o.metadata().annotations;
        let Some(vm) = a.get(ANNOTATION_VM) else {
            continue;
        };
        for (field, message) in warnings_of(a) {
            out.push((vm.clone(), field.to_string(), message.to_string()));
        }
    }
    out
}

/// The objects as YAML documents.
pub fn render(objects: &[Object], origin: &str) -> anyhow::Result<String> {
    if !objects
        .iter()
        .any(|o| o.metadata().annotations.contains_key(ANNOTATION_VM))
    {
        bail!("{origin}: holds no Ignite VM (apiVersion ignite.weave.works/v1alpha4, kind VM)");
    }
    let mut text = format!("# hearth objects from the Ignite manifest {origin}\n");
    for o in objects {
        text.push_str("---\n");
        // Through JSON: hearth's YAML is plain mappings, never YAML tags
        // (which serde_yaml gives enums written directly).
        text.push_str(&serde_yaml_ng::to_string(&serde_json::to_value(o)?)?);
    }
    Ok(text)
}
