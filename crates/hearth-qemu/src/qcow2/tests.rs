//! The reader against `qemu-img map` and `info`, the writer against images
//! QEMU wrote itself: `qemu-img check` and `compare` are the ground truth.

use super::write::Layout;
use super::*;
use proptest::prelude::*;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

fn run(program: &str, args: &[&str], dir: &Path) -> String {
    let out = Command::new(program)
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap_or_else(|e| panic!("{program}: {e} (apt-get install qemu-utils)"));
    assert!(out.status.success(), "{program} {args:?}: {out:?}");
    String::from_utf8(out.stdout).unwrap()
}

/// `qemu-img create -f qcow2` in `dir` with `args` (options, backing,
/// name, size).
fn create(dir: &Path, args: &[&str]) {
    let mut all = vec!["create", "-q", "-f", "qcow2"];
    all.extend(args);
    run("qemu-img", &all, dir);
}

/// `qemu-img map` of one layer alone (its backing file not opened): per
/// guest cluster, what the layer holds.
fn own_map(path: &Path, cs: u64) -> BTreeMap<u64, Entry> {
    let spec = serde_json::json!({"driver": "qcow2", "backing": null,
        "file": {"driver": "file", "filename": path}});
    let out = run(
        "qemu-img",
        &["map", "--output=json", &format!("json:{spec}")],
        path.parent().unwrap(),
    );
    let extents: Vec<Value> = serde_json::from_str(&out).unwrap();
    let mut m = BTreeMap::new();
    for e in extents {
        if e["present"] != true {
            continue;
        }
        let (start, length) = (e["start"].as_u64().unwrap(), e["length"].as_u64().unwrap());
        for k in 0..length.div_ceil(cs) {
            let entry = match e["data"] == true {
                true => Entry::Data(e["offset"].as_u64().unwrap() + k * cs),
                false => Entry::Zero,
            };
            m.insert(start / cs + k, entry);
        }
    }
    m
}

#[test]
fn a_layers_own_clusters_are_what_qemu_img_map_says() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    create(d, &["base.qcow2", "1G"]);
    run("qemu-io", &["-c", "write -P 0xee 0 4M", "base.qcow2"], d);
    create(d, &["-F", "qcow2", "-b", "base.qcow2", "top.qcow2"]);
    // Data, zeroes over data, a second L2 table, a partial cluster at the end.
    run(
        "qemu-io",
        &[
            "-c",
            "write -P 0x11 0 192k",
            "-c",
            "write -z 1M 512k",
            "-c",
            "write -P 0x22 700M 64k",
            "-c",
            "write -P 0x33 1048572k 4k",
            "top.qcow2",
        ],
        d,
    );
    let layer = Layer::open(&d.join("top.qcow2"), usize::MAX).unwrap();
    assert_eq!(layer.header.size, 1 << 30);
    assert_eq!(layer.header.backing_file.as_deref(), Some("base.qcow2"));
    assert_eq!(layer.header.backing_format.as_deref(), Some("qcow2"));
    let ours: BTreeMap<u64, Entry> = layer.clusters.iter().copied().collect();
    let theirs = own_map(&d.join("top.qcow2"), 64 << 10);
    assert_eq!(ours, theirs);
    assert_eq!(ours.len(), 3 + 8 + 1 + 1, "{ours:?}");
    // A bound on the map: exactly enough, and one short.
    assert!(Layer::open(&d.join("top.qcow2"), 13).is_ok());
    let err = Layer::open(&d.join("top.qcow2"), 12).unwrap_err();
    assert!(err.is_unsupported(), "{err}");
    // The data reads back through the layer's offsets.
    let mut buf = vec![0u8; 64 << 10];
    let Entry::Data(at) = ours[&(700 * 16)] else {
        panic!("700 MiB is data")
    };
    layer.read_cluster(at, &mut buf).unwrap();
    assert!(buf.iter().all(|b| *b == 0x22));
}

#[test]
fn a_chain_read_from_headers_is_the_one_qemu_img_info_follows() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::create_dir(d.join("sub")).unwrap();
    run(
        "qemu-img",
        &["create", "-q", "-f", "raw", "base.raw", "64M"],
        d,
    );
    let base = d.join("base.raw");
    let base = base.to_str().unwrap();
    create(d, &["-F", "raw", "-b", base, "sub/mid.qcow2"]);
    // A relative name resolves from the layer's own folder.
    create(
        d,
        &["-F", "qcow2", "-b", "sub/mid.qcow2", "top.qcow2", "128M"],
    );
    let ours = Chain::read(&d.join("top.qcow2")).unwrap();
    let out = run(
        "qemu-img",
        &["info", "--output=json", "--backing-chain", "top.qcow2"],
        d,
    );
    let theirs: Vec<Value> = serde_json::from_str(&out).unwrap();
    assert_eq!(ours.len(), theirs.len());
    for (o, t) in ours.iter().zip(&theirs) {
        let name = std::fs::canonicalize(d.join(t["filename"].as_str().unwrap())).unwrap();
        assert_eq!(o.path, name);
        assert_eq!(o.format, t["format"].as_str().unwrap());
        assert_eq!(o.virtual_size, t["virtual-size"].as_u64().unwrap());
    }
    assert_eq!(ours[0].virtual_size, 128 << 20);
    // A raw file, and a compressed cluster, are left to qemu-img.
    assert!(matches!(
        Layer::open(&d.join("base.raw"), usize::MAX),
        Err(Qcow2Error::NotQcow2 { .. })
    ));
    create(d, &["-o", "compression_type=zlib", "c.qcow2", "8M"]);
    run("qemu-io", &["-c", "write -c -P 0x44 0 64k", "c.qcow2"], d);
    let err = Layer::open(&d.join("c.qcow2"), usize::MAX).unwrap_err();
    assert!(err.is_unsupported(), "{err}");
}

/// A version 2 header with its backing name right after it, no room for
/// any header extension (nor their end marker): QEMU reads it (probing the
/// backing file's format), and so does hearth.
#[test]
fn a_backing_name_right_after_a_version_2_header_is_read_as_qemu_reads_it() {
    use std::os::unix::fs::FileExt;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    run(
        "qemu-img",
        &["create", "-q", "-f", "raw", "base.raw", "16M"],
        d,
    );
    create(
        d,
        &[
            "-o",
            "compat=0.10",
            "-F",
            "raw",
            "-b",
            "base.raw",
            "v2.qcow2",
        ],
    );
    run("qemu-io", &["-c", "write -P 0x5a 1M 64k", "v2.qcow2"], d);
    // The name moved to offset 72, over the extensions QEMU wrote.
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(d.join("v2.qcow2"))
        .unwrap();
    let mut h = [0u8; 72];
    f.read_exact_at(&mut h, 0).unwrap();
    assert_eq!(u32::from_be_bytes(h[4..8].try_into().unwrap()), 2);
    let mut area = vec![0u8; 512 - 72];
    area[..8].copy_from_slice(b"base.raw");
    f.write_all_at(&area, 72).unwrap();
    f.write_all_at(&72u64.to_be_bytes(), 8).unwrap();
    f.write_all_at(&8u32.to_be_bytes(), 16).unwrap();
    drop(f);

    let out = run(
        "qemu-img",
        &["info", "--output=json", "--backing-chain", "v2.qcow2"],
        d,
    );
    let theirs: Vec<Value> = serde_json::from_str(&out).unwrap();
    assert_eq!(theirs[0]["backing-filename"], "base.raw", "{out}");
    assert_eq!(theirs[1]["format"], "raw", "{out}");
    let ours = Chain::read(&d.join("v2.qcow2")).unwrap();
    let paths: Vec<_> = ours.iter().map(|l| l.path.clone()).collect();
    assert_eq!(
        paths,
        [d.join("v2.qcow2"), d.join("base.raw")].map(|p| std::fs::canonicalize(p).unwrap())
    );
    assert_eq!(ours[1].format, "raw");
    let layer = Layer::open(&d.join("v2.qcow2"), usize::MAX).unwrap();
    assert_eq!(layer.header.backing_file.as_deref(), Some("base.raw"));
    assert_eq!(layer.header.backing_format, None);
    let held: BTreeMap<u64, Entry> = layer.clusters.iter().copied().collect();
    assert_eq!(held, own_map(&d.join("v2.qcow2"), 64 << 10));
}

#[test]
fn the_refcount_structures_count_themselves() {
    for (bits, data, size) in [
        (12u32, 0u64, 4096u64),
        (12, 2047, 8 << 20),
        (12, 2048, 8 << 20),
        (12, 600_000, 4 << 30),
        (16, 40_000, 4 << 30),
    ] {
        let cs = 1u64 << bits;
        let clusters: BTreeMap<u64, Cluster> = (0..data)
            .map(|g| (g % size.div_ceil(cs), Cluster::Data { source: 0, at: 0 }))
            .collect();
        let image = NewImage {
            virtual_size: size,
            cluster_bits: bits,
            backing_file: "b",
            backing_format: "qcow2",
        };
        let l = Layout::of(&image, &clusters);
        let per_block = cs / 2;
        assert!(l.refblocks * per_block >= l.total, "{l:?}");
        assert!(l.reftable * cs / 8 >= l.refblocks, "{l:?}");
        // Not more than needed, either.
        assert!((l.refblocks - 1) * per_block < l.total, "{l:?}");
        assert_eq!(
            l.total,
            1 + l.reftable + l.refblocks + l.l1_clusters + l.l2_tables.len() as u64 + l.data
        );
    }
}

/// Writes `picks` (guest cluster → `Some(byte)` data of that byte, `None`
/// zeroes) both ways, over a base with data: through qemu-io into an
/// overlay QEMU makes, and with [`NewImage`]; then checks ours.
fn both_ways(bits: u32, virtual_size: u64, picks: &BTreeMap<u64, Option<u8>>) {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let cs = 1u64 << bits;
    let size = virtual_size.to_string();
    create(d, &["base.qcow2", &size]);
    let head = (8 << 20).min(virtual_size).to_string();
    run(
        "qemu-io",
        &["-c", &format!("write -P 0xee 0 {head}"), "base.qcow2"],
        d,
    );
    let opt = format!("cluster_size={cs}");
    create(
        d,
        &[
            "-o",
            &opt,
            "-F",
            "qcow2",
            "-b",
            "base.qcow2",
            "expect.qcow2",
        ],
    );
    let mut cmds = Vec::new();
    for (&g, pick) in picks {
        let (at, len) = (g * cs, cs.min(virtual_size - g * cs));
        cmds.push("-c".to_string());
        cmds.push(match pick {
            Some(b) => format!("write -P {b} {at} {len}"),
            None => format!("write -z {at} {len}"),
        });
    }
    cmds.push("expect.qcow2".into());
    let args: Vec<&str> = cmds.iter().map(String::as_str).collect();
    run("qemu-io", &args, d);

    let clusters: BTreeMap<u64, Cluster> = picks
        .iter()
        .map(|(&g, p)| {
            let c = match p {
                Some(b) => Cluster::Data {
                    source: 7,
                    at: u64::from(*b),
                },
                None => Cluster::Zero,
            };
            (g, c)
        })
        .collect();
    let image = NewImage {
        virtual_size,
        cluster_bits: bits,
        backing_file: "base.qcow2",
        backing_format: "qcow2",
    };
    let mut out = std::io::BufWriter::new(std::fs::File::create(d.join("point.qcow2")).unwrap());
    let mut progress = 0;
    let w = image
        .write(
            &clusters,
            |source, at, buf| {
                assert_eq!(source, 7);
                buf.fill(at as u8);
                Ok(())
            },
            &mut out,
            |n| progress += n,
        )
        .unwrap();
    drop(out);
    let data = picks.values().filter(|p| p.is_some()).count() as u64;
    assert_eq!((w.data, progress), (data * cs, data * cs));
    assert_eq!(
        w.size,
        std::fs::metadata(d.join("point.qcow2")).unwrap().len()
    );
    // Sound (no leak, no error: exit status 0), the same bytes as QEMU's
    // own writes, and exactly the picked clusters held by the point.
    run("qemu-img", &["check", "-q", "point.qcow2"], d);
    run(
        "qemu-img",
        &["compare", "-q", "expect.qcow2", "point.qcow2"],
        d,
    );
    let held: BTreeMap<u64, bool> = own_map(&d.join("point.qcow2"), cs)
        .into_iter()
        .map(|(g, e)| (g, matches!(e, Entry::Data(_))))
        .collect();
    let picked: BTreeMap<u64, bool> = picks.iter().map(|(&g, p)| (g, p.is_some())).collect();
    assert_eq!(held, picked);
    // The reader reads the writer's image as QEMU does.
    let ours: BTreeMap<u64, Entry> = Layer::open(&d.join("point.qcow2"), usize::MAX)
        .unwrap()
        .clusters
        .into_iter()
        .collect();
    assert_eq!(ours, own_map(&d.join("point.qcow2"), cs));
}

#[test]
fn an_image_with_no_clusters_reads_as_its_backing_file() {
    both_ways(16, 10 << 20, &BTreeMap::new());
}

#[test]
fn many_l2_tables_and_refcount_blocks() {
    // 4 KiB clusters: an L2 table covers 2 MiB, a refcount block 8 MiB of
    // file; 3,000 data clusters take two blocks.
    let picks = (0..3000u64)
        .map(|i| (i * 7 % 20_000, Some((i % 200) as u8 + 1)))
        .chain((0..50u64).map(|i| (20_000 + i * 3, None)))
        .collect();
    both_ways(12, 80 << 20, &picks);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]

    #[test]
    fn a_written_image_is_sound_and_reads_as_qemus_own_writes(
        bits in prop::sample::select(vec![12u32, 16]),
        clusters in 1u64..3000,
        short in 0u64..8,
        picks in prop::collection::vec((0u64..3000, prop::option::of(1u8..255)), 0..200),
    ) {
        let cs = 1u64 << bits;
        let virtual_size = clusters * cs - short * 512;
        let picks: BTreeMap<u64, Option<u8>> =
            picks.into_iter().filter(|(g, _)| *g < clusters).collect();
        both_ways(bits, virtual_size, &picks);
    }
}
