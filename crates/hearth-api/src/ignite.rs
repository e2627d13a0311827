//! Ignite manifests (`apiVersion: ignite.weave.works/v1alpha4`, `kind: VM`)
//! read as they are: one Ignite VM becomes hearth's own objects. Pure: the
//! same text always gives the same objects, so the manifest directory can
//! parse a file again and again and see no change (docs/ignite.md).
//!
//! Objects, named after the VM so two files never declare the same one:
//! `NAME-image` (spec.image.oci), `NAME-kernel` (spec.kernel.oci, when
//! given), `NAME-root` (the disk), `NAME-net` (the NAT network Ignite's CNI
//! gives every VM) and `NAME` (the VM). Each carries annotations saying
//! which Ignite field made which of its fields, and the VM carries a
//! warning annotation for each field hearth cannot honour.

use std::collections::BTreeMap;

use serde_json::{Map, Value, json};

use crate::meta::API_VERSION;
use crate::object::{FieldError, check_dns_label};
use crate::quantity::Quantity;

/// The Ignite API version read here.
pub const IGNITE_API_VERSION: &str = "ignite.weave.works/v1alpha4";

/// Prefix of the annotations a translated object carries.
pub const ANNOTATION_PREFIX: &str = "ignite.hearth.dev/";
/// The Ignite VM an object was made from.
pub const ANNOTATION_VM: &str = "ignite.hearth.dev/vm";
/// `ignite.hearth.dev/warning.<ignite field>`: what hearth does not honour.
pub const ANNOTATION_WARNING: &str = "ignite.hearth.dev/warning.";

/// Ignite's defaults (pkg/constants/vm.go).
pub const DEFAULT_CPUS: u64 = 1;
pub const DEFAULT_MEMORY: u64 = 512 << 20;
pub const DEFAULT_DISK_SIZE: u64 = 4 << 30;

/// Where the public key of `spec.ssh` goes, as Ignite puts it.
pub const AUTHORIZED_KEYS: &str = "/root/.ssh/authorized_keys";

/// The longest Ignite VM name: the longest suffix (`-kernel`) must still
/// leave a DNS label.
const MAX_NAME: usize = 63 - "-kernel".len();

/// A field of the Ignite file that hearth does not honour, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Warning {
    /// The Ignite field, such as `spec.sandbox`.
    pub field: String,
    pub message: String,
}

/// The hearth objects of one Ignite VM, as raw values (validated later by
/// the same code as any other document), and its warnings.
#[derive(Clone, Debug, PartialEq)]
pub struct Translation {
    pub objects: Vec<Value>,
    pub warnings: Vec<Warning>,
}

/// Whether a document is an Ignite object (of any kind or version).
pub fn is_ignite(value: &Value) -> bool {
    value
        .get("apiVersion")
        .and_then(Value::as_str)
        .is_some_and(|v| v.starts_with("ignite.weave.works/"))
}

/// The warnings recorded on a translated object, `(ignite field, message)`.
pub fn warnings_of(annotations: &BTreeMap<String, String>) -> Vec<(&str, &str)> {
    annotations
        .iter()
        .filter_map(|(k, v)| Some((k.strip_prefix(ANNOTATION_WARNING)?, v.as_str())))
        .collect()
}

/// A size as Ignite reads it (github.com/c2h5oh/datasize): digits, then an
/// optional unit `B`, `KB`, `MB`, `GB`, `TB`, `PB`, `EB` (any case, also `k`,
/// `kilo`, `kilobyte`, ...), all powers of 1024: `512MB` is 512 MiB.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let digits = text.bytes().take_while(u8::is_ascii_digit).count();
    if digits == 0 {
        return Err(format!(
            "{text:?} is not a size (digits and a unit, such as \"512MB\" or \"4GB\")"
        ));
    }
    let number: u64 = text[..digits]
        .parse()
        .map_err(|_| format!("{text:?} is too large"))?;
    let unit = text[digits..].trim();
    if matches!(unit, "Kb" | "Mb" | "Gb" | "Tb" | "Pb" | "Eb") {
        return Err(format!(
            "{text:?}: {unit} is bits; Ignite sizes are bytes (\"MB\", \"GB\")"
        ));
    }
    let shift = match unit.to_ascii_lowercase().as_str() {
        "" | "b" | "byte" => 0,
        "k" | "kb" | "kilo" | "kilobyte" | "kilobytes" => 10,
        "m" | "mb" | "mega" | "megabyte" | "megabytes" => 20,
        "g" | "gb" | "giga" | "gigabyte" | "gigabytes" => 30,
        "t" | "tb" | "tera" | "terabyte" | "terabytes" => 40,
        "p" | "pb" | "peta" | "petabyte" | "petabytes" => 50,
        "e" | "eb" | "exa" | "exabyte" | "exabytes" => 60,
        _ => {
            return Err(format!(
                "{text:?}: unknown unit {unit:?} (B, KB, MB, GB, TB, PB or EB)"
            ));
        }
    };
    number
        .checked_mul(1u64 << shift)
        .ok_or_else(|| format!("{text:?} is too large"))
}

/// A reference as Docker (and so Ignite) reads it: `ubuntu` is
/// `docker.io/library/ubuntu:latest`, `weaveworks/ignite-ubuntu` is
/// `docker.io/weaveworks/ignite-ubuntu:latest`; a first component with a
/// `.` or `:`, or `localhost`, is a registry.
pub fn normalize_reference(r: &str) -> String {
    let (name, digest) = match r.split_once('@') {
        Some((n, d)) => (n, Some(d)),
        None => (r, None),
    };
    let mut name = match name.split_once('/') {
        Some((first, _)) if first.contains(['.', ':']) || first == "localhost" => {
            let name = name
                .strip_prefix("index.docker.io/")
                .map_or_else(|| name.to_string(), |rest| format!("docker.io/{rest}"));
            if let Some(rest) = name.strip_prefix("docker.io/")
                && !rest.contains('/')
            {
                format!("docker.io/library/{rest}")
            } else {
                name
            }
        }
        Some(_) => format!("docker.io/{name}"),
        None => format!("docker.io/library/{name}"),
    };
    match digest {
        Some(d) => format!("{name}@{d}"),
        None => {
            let last = name.rsplit('/').next().unwrap_or_default();
            if !last.contains(':') {
                name.push_str(":latest");
            }
            name
        }
    }
}

/// The fields of an Ignite VM this module reads; any other is warned about.
const KNOWN_TOP: &[&str] = &["apiVersion", "kind", "metadata", "spec", "status"];
const KNOWN_SPEC: &[&str] = &[
    "image",
    "sandbox",
    "kernel",
    "cpus",
    "memory",
    "diskSize",
    "network",
    "storage",
    "copyFiles",
    "ssh",
];

/// Ignite's kernel argument that only Firecracker survives: QEMU's disks and
/// NICs are PCI devices, so a guest booted with it finds no root disk.
const FIRECRACKER_ONLY_ARGS: &[&str] = &["pci=off"];

/// Translates one Ignite document. `label` names it in errors (`document 2`).
pub fn translate(doc: &Value, label: &str) -> Result<Translation, FieldError> {
    let name_of = doc
        .get("metadata")
        .and_then(|m| m.get("name"))
        .and_then(Value::as_str);
    let object = match name_of {
        Some(n) => format!("Ignite VM {n:?}"),
        None => format!("Ignite VM in {label}"),
    };
    let err = |field: &str, message: String| FieldError {
        object: object.clone(),
        field: field.to_string(),
        message,
    };
    let api_version = doc.get("apiVersion").and_then(Value::as_str).unwrap_or("");
    if api_version != IGNITE_API_VERSION {
        return Err(err(
            "apiVersion",
            format!("{api_version:?} is not supported (hearth reads {IGNITE_API_VERSION:?})"),
        ));
    }
    let kind = doc.get("kind").and_then(Value::as_str).unwrap_or("");
    if kind != "VM" {
        return Err(err(
            "kind",
            format!(
                "{kind:?}: hearth reads Ignite's VM kind only (an Image or Kernel is pulled for the VM that names it)"
            ),
        ));
    }
    let Some(top) = doc.as_object() else {
        return Err(err("(document)", "is not a mapping".into()));
    };
    let mut t = Translator {
        warnings: Vec::new(),
    };
    for key in top.keys().filter(|k| !KNOWN_TOP.contains(&k.as_str())) {
        t.warn(key, "not a field of an Ignite VM; ignored");
    }
    let name = name_of.ok_or_else(|| err("metadata.name", "is missing".into()))?;
    check_dns_label(name).map_err(|m| {
        err(
            "metadata.name",
            format!("{m}; hearth names objects after the Ignite VM"),
        )
    })?;
    if name.len() > MAX_NAME {
        return Err(err(
            "metadata.name",
            format!(
                "{name:?} is longer than {MAX_NAME} characters (the objects made from it, such as {name}-kernel, must stay DNS labels)"
            ),
        ));
    }
    let meta = top.get("metadata").and_then(Value::as_object);
    let mut vm_notes = BTreeMap::new();
    if let Some(meta) = meta {
        for (key, value) in meta {
            match key.as_str() {
                "name" | "created" => {}
                "uid" => {
                    vm_notes.insert(
                        format!("{ANNOTATION_PREFIX}uid"),
                        value.as_str().unwrap_or_default().to_string(),
                    );
                }
                "annotations" => {
                    if let Some(map) = value.as_object() {
                        for (k, v) in map {
                            if !k.starts_with(ANNOTATION_PREFIX) {
                                vm_notes.insert(k.clone(), text_of(v));
                            }
                        }
                    }
                }
                "labels" => t.warn(
                    "metadata.labels",
                    "hearth objects have no labels; not carried over",
                ),
                other => t.warn(
                    &format!("metadata.{other}"),
                    "not a field of Ignite's metadata; ignored",
                ),
            }
        }
    }

    let empty = Map::new();
    let spec = match top.get("spec") {
        Some(Value::Object(s)) => s,
        None | Some(Value::Null) => &empty,
        Some(_) => return Err(err("spec", "must be a mapping".into())),
    };
    for key in spec.keys().filter(|k| !KNOWN_SPEC.contains(&k.as_str())) {
        t.warn(
            &format!("spec.{key}"),
            "not a field of an Ignite VM's spec; ignored",
        );
    }
    let field_map = |path: &str, v: Option<&Value>| -> Result<Map<String, Value>, FieldError> {
        match v {
            None | Some(Value::Null) => Ok(Map::new()),
            Some(Value::Object(m)) => Ok(m.clone()),
            Some(_) => Err(err(path, "must be a mapping".into())),
        }
    };

    // spec.image.oci: the root filesystem.
    let image = field_map("spec.image", spec.get("image"))?;
    let image_ref = match image.get("oci") {
        Some(Value::String(r)) if !r.is_empty() => r.clone(),
        Some(Value::String(_)) | None | Some(Value::Null) => {
            return Err(err(
                "spec.image.oci",
                "is missing: the OCI image of the VM's root filesystem, such as weaveworks/ignite-ubuntu".into(),
            ));
        }
        Some(_) => return Err(err("spec.image.oci", "must be an image reference".into())),
    };
    for key in image.keys().filter(|k| *k != "oci") {
        t.warn(
            &format!("spec.image.{key}"),
            "not a field of Ignite's image spec; ignored",
        );
    }
    let image_name = format!("{name}-image");
    let mut objects = vec![image_object(
        &image_name,
        name,
        &image_ref,
        "spec.image.oci",
    )];

    // spec.kernel: a kernel image and the command line.
    let kernel = field_map("spec.kernel", spec.get("kernel"))?;
    let mut boot = Map::new();
    let mut vm_fields = BTreeMap::new();
    match kernel.get("oci") {
        Some(Value::String(r)) if !r.is_empty() => {
            let kernel_name = format!("{name}-kernel");
            objects.push(image_object(&kernel_name, name, r, "spec.kernel.oci"));
            boot.insert("kernelImage".into(), Value::String(kernel_name));
            vm_fields.insert("spec.boot.kernelImage", format!("spec.kernel.oci {r:?}"));
        }
        None | Some(Value::Null) => {
            vm_fields.insert(
                "spec.boot.kernelImage",
                "spec.kernel.oci left out: Ignite's default kernel image is not used; the VM boots the kernel under /boot of its root image".to_string(),
            );
        }
        Some(Value::String(_)) => return Err(err("spec.kernel.oci", "must not be empty".into())),
        Some(_) => return Err(err("spec.kernel.oci", "must be an image reference".into())),
    }
    match kernel.get("cmdLine") {
        Some(Value::String(c)) => {
            let (kept, dropped): (Vec<&str>, Vec<&str>) = c
                .split_whitespace()
                .partition(|a| !FIRECRACKER_ONLY_ARGS.contains(a));
            if !dropped.is_empty() {
                t.warn(
                    "spec.kernel.cmdLine",
                    &format!(
                        "{} left out: it is for Firecracker; under QEMU the disks and NICs are PCI devices",
                        dropped.join(" ")
                    ),
                );
            }
            boot.insert("cmdline".into(), Value::String(kept.join(" ")));
            vm_fields.insert("spec.boot.cmdline", format!("spec.kernel.cmdLine {c:?}"));
        }
        None | Some(Value::Null) => {}
        Some(_) => return Err(err("spec.kernel.cmdLine", "must be text".into())),
    }
    for key in kernel.keys().filter(|k| *k != "oci" && *k != "cmdLine") {
        t.warn(
            &format!("spec.kernel.{key}"),
            "not a field of Ignite's kernel spec; ignored",
        );
    }
    if spec.contains_key("sandbox") {
        t.warn(
            "spec.sandbox",
            "Ignite's Firecracker sandbox container has no counterpart: hearth runs QEMU itself",
        );
    }

    // cpus, memory, diskSize, with Ignite's defaults.
    let cpus = match spec.get("cpus") {
        None | Some(Value::Null) => {
            vm_fields.insert("spec.cpus", format!("Ignite's default, {DEFAULT_CPUS}"));
            DEFAULT_CPUS
        }
        Some(v) => {
            let n = v
                .as_u64()
                .ok_or_else(|| err("spec.cpus", format!("{v} is not a whole number")))?;
            vm_fields.insert("spec.cpus", format!("spec.cpus {n}"));
            if n == 0 { DEFAULT_CPUS } else { n }
        }
    };
    let size_field =
        |field: &str, default: u64, notes: &mut BTreeMap<&str, String>, target: &'static str| {
            match spec.get(field) {
                None | Some(Value::Null) => {
                    notes.insert(target, format!("Ignite's default, {}", human(default)));
                    Ok(default)
                }
                Some(Value::String(s)) => {
                    let b = parse_size(s).map_err(|m| err(&format!("spec.{field}"), m))?;
                    notes.insert(target, format!("spec.{field} {s:?}"));
                    Ok(if b == 0 { default } else { b })
                }
                Some(v) => Err(err(
                    &format!("spec.{field}"),
                    format!("{v} is not a size; Ignite writes sizes as text, such as \"512MB\""),
                )),
            }
        };
    let memory = size_field("memory", DEFAULT_MEMORY, &mut vm_fields, "spec.memory")?;
    let mut disk_fields = BTreeMap::new();
    let disk_size = size_field("diskSize", DEFAULT_DISK_SIZE, &mut disk_fields, "spec.size")?;
    disk_fields.insert(
        "spec.source.virtualImage",
        format!("spec.image.oci {image_ref:?}"),
    );

    // copyFiles and ssh become files written into the root disk.
    let mut files = Vec::new();
    match spec.get("copyFiles") {
        None | Some(Value::Null) => {}
        Some(Value::Array(list)) => {
            for (i, m) in list.iter().enumerate() {
                let f = |k: &str| format!("spec.copyFiles[{i}].{k}");
                let host = m.get("hostPath").and_then(Value::as_str);
                let vm = m.get("vmPath").and_then(Value::as_str);
                let (Some(host), Some(vm)) = (host, vm) else {
                    return Err(err(
                        &f(if host.is_none() { "hostPath" } else { "vmPath" }),
                        "is missing (each copyFiles entry has hostPath and vmPath)".into(),
                    ));
                };
                files.push(json!({"path": vm, "source": host}));
            }
            disk_fields.insert("spec.files", "spec.copyFiles".to_string());
        }
        Some(_) => return Err(err("spec.copyFiles", "must be a list".into())),
    }
    match spec.get("ssh") {
        None | Some(Value::Null) | Some(Value::Bool(false)) => {}
        Some(Value::Bool(true)) => t.warn(
            "spec.ssh",
            "`true` asks Ignite to make a key; hearth makes none for a manifest (it would change at every read): give a public key's path, or use `hearth run --ssh`",
        ),
        Some(Value::String(s)) if s == "true" => t.warn(
            "spec.ssh",
            "`true` asks Ignite to make a key; hearth makes none for a manifest (it would change at every read): give a public key's path, or use `hearth run --ssh`",
        ),
        Some(Value::String(path)) if !path.is_empty() => {
            if files.iter().any(|f| f["path"] == AUTHORIZED_KEYS) {
                return Err(err(
                    "spec.ssh",
                    format!("{AUTHORIZED_KEYS} is also written by spec.copyFiles"),
                ));
            }
            files.push(json!({"path": AUTHORIZED_KEYS, "source": path, "mode": "0600"}));
            let prev = disk_fields.remove("spec.files");
            disk_fields.insert(
                "spec.files",
                match prev {
                    Some(p) => format!("{p}, spec.ssh {path:?} (to {AUTHORIZED_KEYS})"),
                    None => format!("spec.ssh {path:?} (to {AUTHORIZED_KEYS})"),
                },
            );
        }
        Some(_) => {
            return Err(err(
                "spec.ssh",
                "must be true or the path of a public key".into(),
            ));
        }
    }

    // storage: host block devices handed to the guest.
    if let Some(storage) = spec.get("storage").and_then(Value::as_object) {
        for key in ["volumes", "volumeMounts"] {
            if let Some(Value::Array(list)) = storage.get(key) {
                for (i, _) in list.iter().enumerate() {
                    t.warn(
                        &format!("spec.storage.{key}[{i}]"),
                        "hearth attaches only its own VirtualDisks (qcow2 files it manages), not a host block device, and mounts nothing in the guest; not honoured",
                    );
                }
            }
        }
        for key in storage
            .keys()
            .filter(|k| *k != "volumes" && *k != "volumeMounts")
        {
            t.warn(
                &format!("spec.storage.{key}"),
                "not a field of Ignite's storage spec; ignored",
            );
        }
    }

    // network: Ignite's CNI gives every VM a NAT network; so does hearth.
    let net_name = format!("{name}-net");
    let mut ports = Vec::new();
    let network = field_map("spec.network", spec.get("network"))?;
    for key in network.keys().filter(|k| *k != "ports") {
        t.warn(
            &format!("spec.network.{key}"),
            "not a field of Ignite's network spec; ignored",
        );
    }
    match network.get("ports") {
        None | Some(Value::Null) => {}
        Some(Value::Array(list)) => {
            for (i, p) in list.iter().enumerate() {
                let f = |k: &str| format!("spec.network.ports[{i}].{k}");
                let port = |k: &str| -> Result<u64, FieldError> {
                    p.get(k)
                        .and_then(Value::as_u64)
                        .ok_or_else(|| err(&f(k), "is missing or not a port number".into()))
                };
                let mut fwd = json!({"hostPort": port("hostPort")?, "guestPort": port("vmPort")?});
                match p.get("protocol").and_then(Value::as_str) {
                    None | Some("tcp") => {}
                    Some("udp") => fwd["protocol"] = json!("UDP"),
                    Some(other) => {
                        return Err(err(&f("protocol"), format!("{other:?} is not tcp or udp")));
                    }
                }
                match p.get("bindAddress").and_then(Value::as_str) {
                    None | Some("0.0.0.0") | Some("") => {}
                    Some(addr) => fwd["hostAddress"] = json!(addr),
                }
                ports.push(fwd);
            }
            vm_fields.insert("spec.networks[0].ports", "spec.network.ports".to_string());
        }
        Some(_) => return Err(err("spec.network.ports", "must be a list".into())),
    }
    let mut nic = json!({"virtualNetworkName": net_name});
    if !ports.is_empty() {
        nic["ports"] = Value::Array(ports);
    }
    vm_fields.insert(
        "spec.networks[0]",
        "Ignite's CNI network (every Ignite VM has one): a NAT VirtualNetwork of its own".into(),
    );

    // status.running is Ignite's desired state.
    let running = match top.get("status").and_then(|s| s.get("running")) {
        Some(Value::Bool(b)) => {
            vm_fields.insert("spec.runPolicy", format!("status.running {b}"));
            *b
        }
        None | Some(Value::Null) => {
            vm_fields.insert(
                "spec.runPolicy",
                "status.running left out: the VM runs, as `ignite run --config` does".into(),
            );
            true
        }
        Some(v) => return Err(err("status.running", format!("{v} is not true or false"))),
    };

    let mut disk_spec = json!({
        "size": Quantity::from_bytes(disk_size).to_string(),
        "source": {"virtualImage": image_name},
    });
    if !files.is_empty() {
        disk_spec["files"] = Value::Array(files);
    }
    let disk_name = format!("{name}-root");
    objects.push(hearth_object(
        "VirtualDisk",
        &disk_name,
        notes(name, &disk_fields),
        disk_spec,
    ));
    objects.push(hearth_object(
        "VirtualNetwork",
        &net_name,
        notes(
            name,
            &BTreeMap::from([(
                "spec.mode",
                "spec.network (Ignite's CNI network is NAT)".to_string(),
            )]),
        ),
        json!({"mode": "NAT"}),
    ));

    let mut vm_annotations = notes(name, &vm_fields);
    vm_annotations.extend(vm_notes);
    for w in &t.warnings {
        vm_annotations.insert(
            format!("{ANNOTATION_WARNING}{}", w.field),
            w.message.clone(),
        );
    }
    objects.push(hearth_object(
        "VirtualMachine",
        name,
        vm_annotations,
        json!({
            "runPolicy": if running { "AlwaysOn" } else { "AlwaysOff" },
            "cpus": cpus,
            "memory": Quantity::from_bytes(memory).to_string(),
            "boot": Value::Object(boot),
            "disks": [{"virtualDiskName": disk_name}],
            "networks": [nic],
        }),
    ));
    Ok(Translation {
        objects,
        warnings: t.warnings,
    })
}

struct Translator {
    warnings: Vec<Warning>,
}

impl Translator {
    fn warn(&mut self, field: &str, message: &str) {
        self.warnings.push(Warning {
            field: field.to_string(),
            message: message.to_string(),
        });
    }
}

fn text_of(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// `512MB` for 512 MiB: how Ignite prints a size.
fn human(bytes: u64) -> String {
    if bytes.is_multiple_of(1 << 30) {
        format!("{}GB", bytes >> 30)
    } else {
        format!("{}MB", bytes >> 20)
    }
}

fn notes(vm: &str, fields: &BTreeMap<&str, String>) -> BTreeMap<String, String> {
    let mut out = BTreeMap::from([(ANNOTATION_VM.to_string(), vm.to_string())]);
    for (k, v) in fields {
        out.insert(format!("{ANNOTATION_PREFIX}{k}"), v.clone());
    }
    out
}

fn image_object(name: &str, vm: &str, reference: &str, field: &str) -> Value {
    let normalized = normalize_reference(reference);
    let note = if normalized == reference {
        format!("{field} {reference:?}")
    } else {
        format!("{field} {reference:?}, which Docker and Ignite read as {normalized:?}")
    };
    hearth_object(
        "VirtualImage",
        name,
        notes(vm, &BTreeMap::from([("spec.source.oci.reference", note)])),
        json!({"source": {"oci": {"reference": normalized, "shape": "rootfs"}}}),
    )
}

fn hearth_object(
    kind: &str,
    name: &str,
    annotations: BTreeMap<String, String>,
    spec: Value,
) -> Value {
    json!({
        "apiVersion": API_VERSION,
        "kind": kind,
        "metadata": {"name": name, "annotations": annotations},
        "spec": spec,
    })
}

#[cfg(test)]
mod tests;
