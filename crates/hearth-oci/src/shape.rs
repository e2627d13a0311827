//! What an image holds, told from its content: a *containerDisk*
//! (KubeVirt's convention: the image's only regular file is a disk image
//! under `/disk/`) or a *rootfs* (a container filesystem, Ignite's images).
//!
//! The layers are read as the OCI image spec stacks them: a layer's
//! whiteouts (`.wh.NAME`, and `.wh..wh..opq` for a whole directory) remove
//! what lower layers put there, and an entry that is not a directory
//! replaces a directory with all below it.

use std::collections::BTreeMap;
use std::io::{Read, Write};

use oci_spec::image::Descriptor;

use crate::OciError;
use crate::layers::tar_stream;

/// The two shapes hearth boots.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Shape {
    Rootfs,
    /// The disk file: where it is in the image, its size and where its
    /// bytes are.
    ContainerDisk {
        path: String,
        size: u64,
        at: Source,
    },
}

/// Where a file's bytes are: the layer (bottom = 0) and the entry's path
/// in that layer's tar.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Source {
    pub layer: usize,
    pub entry: String,
}

#[derive(Clone, Debug)]
enum Node {
    Dir,
    File { size: u64, at: Source },
    Other,
}

const WHITEOUT: &str = ".wh.";
const OPAQUE: &str = ".wh..wh..opq";

/// A tar entry's path, relative to the image's root: leading `/` and `./`
/// go, `.` components go, and a `..` component is refused.
pub fn entry_path(raw: &[u8]) -> Result<String, String> {
    let text = std::str::from_utf8(raw)
        .map_err(|_| format!("the entry {:?} is not UTF-8", String::from_utf8_lossy(raw)))?;
    let mut parts = Vec::new();
    for part in text.split('/') {
        match part {
            "" | "." => {}
            ".." => return Err(format!("the entry {text:?} climbs out of the root (..)")),
            p => parts.push(p),
        }
    }
    Ok(parts.join("/"))
}

fn below(path: &str) -> String {
    if path.is_empty() {
        String::new()
    } else {
        format!("{path}/")
    }
}

/// Removes `path` and everything under it.
fn remove_tree(tree: &mut BTreeMap<String, Node>, path: &str) {
    tree.remove(path);
    remove_children(tree, path);
}

fn remove_children(tree: &mut BTreeMap<String, Node>, path: &str) {
    let prefix = below(path);
    let doomed: Vec<String> = tree
        .range(prefix.clone()..)
        .take_while(|(k, _)| k.starts_with(&prefix))
        .map(|(k, _)| k.clone())
        .collect();
    for k in doomed {
        tree.remove(&k);
    }
}

/// Tells the shape of an image from its layers, bottom first: each is its
/// descriptor and a reader of its blob. `limit` bounds each layer's
/// uncompressed tar.
pub fn detect<R: Read>(
    layers: impl IntoIterator<Item = (Descriptor, R)>,
    limit: u64,
) -> Result<Shape, OciError> {
    let mut tree: BTreeMap<String, Node> = BTreeMap::new();
    for (index, (layer, blob)) in layers.into_iter().enumerate() {
        let digest = layer.digest().to_string();
        let fail = |message: String| OciError::Layer {
            digest: digest.clone(),
            message,
        };
        let mut archive = tar::Archive::new(tar_stream(&layer, blob, limit)?);
        let entries = archive
            .entries()
            .map_err(|e| fail(format!("reading the tar: {e}")))?;
        // Whiteouts remove from the layers below only: gather this layer's
        // entries first.
        let mut whiteouts: Vec<String> = Vec::new();
        let mut opaque: Vec<String> = Vec::new();
        let mut added: Vec<(String, Node)> = Vec::new();
        for entry in entries {
            let entry = entry.map_err(|e| fail(format!("reading the tar: {e}")))?;
            let path = entry_path(&entry.path_bytes()).map_err(fail)?;
            let (dir, name) = match path.rsplit_once('/') {
                Some((d, n)) => (d.to_string(), n),
                None => (String::new(), path.as_str()),
            };
            if name == OPAQUE {
                opaque.push(dir);
                continue;
            }
            if let Some(hidden) = name.strip_prefix(WHITEOUT) {
                whiteouts.push(format!("{}{hidden}", below(&dir)));
                continue;
            }
            let header = entry.header();
            let node = match header.entry_type() {
                tar::EntryType::Directory => Node::Dir,
                tar::EntryType::Regular | tar::EntryType::Continuous => Node::File {
                    size: header.size().map_err(|e| fail(format!("{path:?}: {e}")))?,
                    at: Source {
                        layer: index,
                        entry: path.clone(),
                    },
                },
                tar::EntryType::Link => {
                    let target = entry
                        .link_name_bytes()
                        .map(|t| entry_path(&t))
                        .transpose()
                        .map_err(fail)?
                        .ok_or_else(|| fail(format!("the hard link {path:?} names no target")))?;
                    // The target is in this layer (earlier) or below.
                    let found = added
                        .iter()
                        .rev()
                        .find(|(p, _)| *p == target)
                        .map(|(_, n)| n.clone())
                        .or_else(|| tree.get(&target).cloned());
                    match found {
                        Some(n @ Node::File { .. }) => n,
                        _ => {
                            return Err(fail(format!(
                                "the hard link {path:?} points at {target:?}, which is no file"
                            )));
                        }
                    }
                }
                _ => Node::Other,
            };
            added.push((path, node));
        }
        for dir in &opaque {
            remove_children(&mut tree, dir);
        }
        for path in &whiteouts {
            remove_tree(&mut tree, path);
        }
        for (path, node) in added {
            if !matches!(node, Node::Dir) {
                remove_children(&mut tree, &path);
            }
            // A directory over a directory keeps what is below it.
            tree.insert(path, node);
        }
    }
    let mut files = tree.iter().filter_map(|(p, n)| match n {
        Node::File { size, at } => Some((p, *size, at)),
        _ => None,
    });
    match (files.next(), files.next()) {
        (Some((path, size, at)), None) if path.starts_with("disk/") => Ok(Shape::ContainerDisk {
            path: path.clone(),
            size,
            at: at.clone(),
        }),
        _ => Ok(Shape::Rootfs),
    }
}

/// Copies the bytes of the file at `at` (as [`detect`] found it) from its
/// layer's blob into `to`. Returns the bytes copied.
pub fn copy_file(
    layer: &Descriptor,
    blob: impl Read,
    at: &Source,
    limit: u64,
    to: &mut impl Write,
) -> Result<u64, OciError> {
    let digest = layer.digest().to_string();
    let fail = |message: String| OciError::Layer {
        digest: digest.clone(),
        message,
    };
    let mut archive = tar::Archive::new(tar_stream(layer, blob, limit)?);
    let entries = archive
        .entries()
        .map_err(|e| fail(format!("reading the tar: {e}")))?;
    // The last entry of that path in the layer is the one that counts;
    // the disk image is written as it streams, so a layer with the path
    // twice is refused rather than written twice.
    let mut copied = None;
    for entry in entries {
        let mut entry = entry.map_err(|e| fail(format!("reading the tar: {e}")))?;
        let path = entry_path(&entry.path_bytes()).map_err(fail)?;
        if path != at.entry {
            continue;
        }
        if copied.is_some() {
            return Err(fail(format!("{path:?} is in the layer twice")));
        }
        let n = std::io::copy(&mut entry, to).map_err(|e| fail(format!("{path:?}: {e}")))?;
        copied = Some(n);
    }
    copied.ok_or_else(|| fail(format!("{:?} is not in the layer", at.entry)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tar layer (uncompressed) from `(path, what)` entries, in order.
    enum E<'a> {
        Dir,
        File(&'a [u8]),
        Link(&'a str),
        Sym(&'a str),
    }

    fn layer(entries: &[(&str, E)]) -> (Descriptor, Vec<u8>) {
        let mut b = tar::Builder::new(Vec::new());
        for (path, e) in entries {
            let mut h = tar::Header::new_gnu();
            h.set_mode(0o644);
            match e {
                E::Dir => {
                    h.set_entry_type(tar::EntryType::Directory);
                    h.set_size(0);
                    b.append_data(&mut h, path, &[][..]).unwrap();
                }
                E::File(bytes) => {
                    h.set_entry_type(tar::EntryType::Regular);
                    h.set_size(bytes.len() as u64);
                    b.append_data(&mut h, path, *bytes).unwrap();
                }
                E::Link(t) | E::Sym(t) => {
                    h.set_entry_type(if matches!(e, E::Link(_)) {
                        tar::EntryType::Link
                    } else {
                        tar::EntryType::Symlink
                    });
                    h.set_size(0);
                    b.append_link(&mut h, path, t).unwrap();
                }
            }
        }
        let bytes = b.into_inner().unwrap();
        let d = serde_json::from_value(serde_json::json!({
            "mediaType": "application/vnd.oci.image.layer.v1.tar",
            "digest": format!("sha256:{}", "0".repeat(64)),
            "size": bytes.len(),
        }))
        .unwrap();
        (d, bytes)
    }

    fn shape(layers: &[(Descriptor, Vec<u8>)]) -> Shape {
        detect(layers.iter().map(|(d, b)| (d.clone(), &b[..])), 1 << 30).unwrap()
    }

    #[test]
    fn one_file_under_disk_is_a_container_disk_and_its_bytes_are_found() {
        let layers = [
            layer(&[("disk/", E::Dir)]),
            layer(&[
                ("./disk/disk.qcow2", E::File(b"QFI\xfb...")),
                ("etc/", E::Dir),
            ]),
        ];
        let s = shape(&layers);
        let Shape::ContainerDisk { path, size, at } = s.clone() else {
            panic!("{s:?}");
        };
        assert_eq!((path.as_str(), size, at.layer), ("disk/disk.qcow2", 7, 1));
        let mut out = Vec::new();
        let n = copy_file(&layers[1].0, &layers[1].1[..], &at, 1 << 20, &mut out).unwrap();
        assert_eq!((n, out.as_slice()), (7, &b"QFI\xfb..."[..]));
    }

    #[test]
    fn any_other_regular_file_makes_it_a_rootfs() {
        let s = shape(&[layer(&[
            ("disk/disk.img", E::File(b"raw")),
            ("bin/sh", E::File(b"elf")),
        ])]);
        assert_eq!(s, Shape::Rootfs);
        let s = shape(&[layer(&[
            ("disk/a.img", E::File(b"a")),
            ("disk/b.img", E::File(b"b")),
        ])]);
        assert_eq!(s, Shape::Rootfs);
        let s = shape(&[layer(&[("bin/", E::Dir), ("bin/sh", E::Sym("busybox"))])]);
        assert_eq!(s, Shape::Rootfs, "no file at all: not a disk");
    }

    #[test]
    fn whiteouts_and_opaque_directories_remove_what_is_below_only() {
        // A base with tools, removed by the layer above: a disk remains.
        let base = layer(&[
            ("usr/bin/qemu-img", E::File(b"x")),
            ("tmp/a", E::File(b"y")),
        ]);
        let top = layer(&[
            ("usr/.wh.bin", E::File(b"")),
            ("tmp/.wh..wh..opq", E::File(b"")),
            ("disk/d.img", E::File(b"disk")),
        ]);
        assert!(matches!(
            shape(&[base.clone(), top]),
            Shape::ContainerDisk { .. }
        ));
        // An opaque marker keeps what its own layer puts there.
        let top = layer(&[
            ("usr/.wh.bin", E::File(b"")),
            ("tmp/.wh..wh..opq", E::File(b"")),
            ("tmp/b", E::File(b"kept")),
            ("disk/d.img", E::File(b"disk")),
        ]);
        assert_eq!(shape(&[base, top]), Shape::Rootfs);
    }

    #[test]
    fn a_file_over_a_directory_replaces_all_below_it() {
        let base = layer(&[("opt/tool/a", E::File(b"a")), ("opt/tool/b", E::File(b"b"))]);
        let top = layer(&[
            ("opt/tool", E::Sym("/nowhere")),
            ("disk/x.qcow2", E::File(b"q")),
        ]);
        assert!(matches!(shape(&[base, top]), Shape::ContainerDisk { .. }));
    }

    #[test]
    fn a_hard_link_to_the_disk_counts_as_a_second_file_and_to_nothing_is_refused() {
        let s = shape(&[layer(&[
            ("disk/d.img", E::File(b"d")),
            ("disk/e.img", E::Link("disk/d.img")),
        ])]);
        assert_eq!(s, Shape::Rootfs);
        let (d, b) = layer(&[("disk/e.img", E::Link("disk/none"))]);
        let e = detect([(d, &b[..])], 1 << 20).unwrap_err();
        assert!(e.to_string().contains("which is no file"), "{e}");
    }

    #[test]
    fn an_entry_that_climbs_out_of_the_root_is_refused_naming_it() {
        assert_eq!(entry_path(b"/./a//b/").unwrap(), "a/b");
        let e = entry_path(b"a/../../etc/passwd").unwrap_err();
        assert!(e.contains("a/../../etc/passwd") && e.contains(".."), "{e}");
        let mut b = tar::Builder::new(Vec::new());
        let mut h = tar::Header::new_gnu();
        h.set_size(1);
        h.set_entry_type(tar::EntryType::Regular);
        // The tar crate refuses `..` in append paths: write the name raw.
        h.as_gnu_mut().unwrap().name[..9].copy_from_slice(b"../escape");
        h.set_cksum();
        b.append(&h, &b"x"[..]).unwrap();
        let bytes = b.into_inner().unwrap();
        let d: Descriptor = serde_json::from_value(serde_json::json!({
            "mediaType": "application/vnd.oci.image.layer.v1.tar",
            "digest": format!("sha256:{}", "1".repeat(64)),
            "size": bytes.len(),
        }))
        .unwrap();
        let e = detect([(d, &bytes[..])], 1 << 20).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!(
                "layer sha256:{}: the entry \"../escape\" climbs out of the root (..)",
                "1".repeat(64)
            )
        );
    }
}
