//! Builders for each kind, over the `hearth_api` types themselves: what a
//! test applies is serialised from the structs the API parses, so a field
//! renamed in the API breaks the build of the tests, not their meaning.
//!
//! Each builder starts from the spec the API would fill in for an empty
//! one (its own defaults), and a test sets only what it is about.

use std::path::Path;

use hearth_api::{
    API_VERSION, Boot, CloudInit, DiskRef, DiskSource, Empty, Firmware, HttpSource, ImageSource,
    NetworkInterface, NetworkMode, ObjectMeta, OciSource, Quantity, RunPolicy, VirtualDisk,
    VirtualDiskSnapshot, VirtualDiskSnapshotSpec, VirtualDiskSpec, VirtualImage, VirtualImageSpec,
    VirtualMachine, VirtualMachineSnapshot, VirtualMachineSnapshotGroup,
    VirtualMachineSnapshotGroupSpec, VirtualMachineSnapshotSpec, VirtualMachineSpec,
    VirtualNetwork, VirtualNetworkSpec,
};
use serde::Serialize;
use serde_json::Value;

/// What every builder gives: the object as JSON (`POST /v1/apply`'s
/// items) or as one YAML document (a manifest file, `hearth apply -f`).
pub trait ObjectBuilder {
    fn json(&self) -> Value;

    fn yaml(&self) -> String {
        serde_yaml_ng::to_string(&self.json()).expect("an object serialises to YAML")
    }
}

fn meta(name: &str) -> ObjectMeta {
    ObjectMeta {
        name: name.to_string(),
        ..ObjectMeta::default()
    }
}

fn quantity(text: &str) -> Quantity {
    Quantity::parse(text).unwrap_or_else(|e| panic!("{e}"))
}

fn to_json(object: &impl Serialize) -> Value {
    serde_json::to_value(object).expect("an object serialises to JSON")
}

/// A `VirtualMachine`.
#[derive(Clone, Debug)]
pub struct Vm(pub VirtualMachine);

impl Vm {
    /// A VM with the API's defaults for everything but its name.
    pub fn new(name: &str) -> Vm {
        let spec: VirtualMachineSpec =
            serde_json::from_value(serde_json::json!({})).expect("an empty spec takes defaults");
        Vm(VirtualMachine {
            api_version: API_VERSION.to_string(),
            kind: "VirtualMachine".to_string(),
            metadata: meta(name),
            spec,
            status: None,
        })
    }

    /// The tests' usual VM: 256 MiB, one CPU, stopped within 10 s.
    pub fn small(name: &str) -> Vm {
        Vm::new(name).memory("256Mi").stop_timeout(10)
    }

    pub fn run_policy(mut self, policy: RunPolicy) -> Vm {
        self.0.spec.run_policy = policy;
        self
    }

    /// The run policy by its name in a manifest (`AlwaysOn`, `AlwaysOff`,
    /// `Manual`).
    pub fn run_policy_named(self, policy: &str) -> Vm {
        let policy = serde_json::from_value(Value::String(policy.to_string()))
            .unwrap_or_else(|e| panic!("run policy {policy:?}: {e}"));
        self.run_policy(policy)
    }

    pub fn always_on(self) -> Vm {
        self.run_policy(RunPolicy::AlwaysOn)
    }

    pub fn always_off(self) -> Vm {
        self.run_policy(RunPolicy::AlwaysOff)
    }

    pub fn manual(self) -> Vm {
        self.run_policy(RunPolicy::Manual)
    }

    pub fn memory(mut self, quantity_text: &str) -> Vm {
        self.0.spec.memory = quantity(quantity_text);
        self
    }

    pub fn cpus(mut self, cpus: u32) -> Vm {
        self.0.spec.cpus = cpus;
        self
    }

    pub fn stop_timeout(mut self, seconds: u32) -> Vm {
        self.0.spec.stop_timeout_seconds = seconds;
        self
    }

    pub fn freeze_deadline(mut self, seconds: u32) -> Vm {
        self.0.spec.freeze_deadline_seconds = seconds;
        self
    }

    pub fn expedite_freeze(mut self, on: bool) -> Vm {
        self.0.spec.expedite_freeze = on;
        self
    }

    pub fn guest_agent(mut self, on: bool) -> Vm {
        self.0.spec.guest_agent = on;
        self
    }

    pub fn firmware(mut self, firmware: Firmware) -> Vm {
        self.0.spec.firmware = firmware;
        self
    }

    /// A direct kernel boot.
    pub fn boot(mut self, kernel: &Path, initrd: Option<&Path>, cmdline: &str) -> Vm {
        self.0.spec.boot = Some(Boot {
            kernel: Some(kernel.to_path_buf()),
            kernel_image: None,
            initrd: initrd.map(Path::to_path_buf),
            cmdline: cmdline.to_string(),
        });
        self
    }

    /// Firmware boot from the disks: no kernel.
    pub fn no_boot(mut self) -> Vm {
        self.0.spec.boot = None;
        self
    }

    /// Attaches a VirtualDisk (in order: the first is the boot disk).
    pub fn disk(mut self, name: &str) -> Vm {
        self.0.spec.disks.push(DiskRef {
            virtual_disk_name: name.to_string(),
        });
        self
    }

    pub fn disks(self, names: &[&str]) -> Vm {
        names.iter().fold(self, |vm, d| vm.disk(d))
    }

    /// An interface on a VirtualNetwork, with a MAC and address of hearth's
    /// choosing.
    pub fn network(self, name: &str) -> Vm {
        self.interface(NetworkInterface {
            virtual_network_name: name.to_string(),
            mac_address: None,
            ip_address: None,
            ports: Vec::new(),
        })
    }

    pub fn interface(mut self, interface: NetworkInterface) -> Vm {
        self.0.spec.networks.push(interface);
        self
    }

    pub fn cloud_init(mut self, cloud_init: CloudInit) -> Vm {
        self.0.spec.cloud_init = Some(cloud_init);
        self
    }

    pub fn build(self) -> VirtualMachine {
        self.0
    }
}

impl ObjectBuilder for Vm {
    fn json(&self) -> Value {
        to_json(&self.0)
    }
}

/// A `VirtualDisk`.
#[derive(Clone, Debug)]
pub struct Disk(pub VirtualDisk);

impl Disk {
    fn with_source(name: &str, source: DiskSource) -> Disk {
        Disk(VirtualDisk {
            api_version: API_VERSION.to_string(),
            kind: "VirtualDisk".to_string(),
            metadata: meta(name),
            spec: VirtualDiskSpec {
                size: None,
                source,
                files: Vec::new(),
            },
            status: None,
        })
    }

    /// An empty disk of `size` (`16Mi`, `1Gi`, ...).
    pub fn blank(name: &str, size: &str) -> Disk {
        Disk::with_source(name, DiskSource::Blank(Empty {})).size(size)
    }

    /// An overlay over a base image file, which is only read.
    pub fn from_image(name: &str, image: impl AsRef<Path>) -> Disk {
        Disk::with_source(name, DiskSource::Image(image.as_ref().to_path_buf()))
    }

    /// An overlay over a Ready VirtualDiskSnapshot.
    pub fn from_snapshot(name: &str, snapshot: &str) -> Disk {
        Disk::with_source(name, DiskSource::Snapshot(snapshot.to_string()))
    }

    /// An overlay over a Ready VirtualImage.
    pub fn from_virtual_image(name: &str, image: &str) -> Disk {
        Disk::with_source(name, DiskSource::VirtualImage(image.to_string()))
    }

    pub fn size(mut self, size: &str) -> Disk {
        self.0.spec.size = Some(quantity(size));
        self
    }

    pub fn build(self) -> VirtualDisk {
        self.0
    }
}

impl ObjectBuilder for Disk {
    fn json(&self) -> Value {
        to_json(&self.0)
    }
}

/// A `VirtualImage`.
#[derive(Clone, Debug)]
pub struct Image(pub VirtualImage);

impl Image {
    fn with_source(name: &str, source: ImageSource) -> Image {
        Image(VirtualImage {
            api_version: API_VERSION.to_string(),
            kind: "VirtualImage".to_string(),
            metadata: meta(name),
            spec: VirtualImageSpec { source },
            status: None,
        })
    }

    /// A file under one of hearthd's image roots.
    pub fn file(name: &str, path: impl AsRef<Path>) -> Image {
        Image::with_source(name, ImageSource::File(path.as_ref().to_path_buf()))
    }

    /// A download, checked against its SHA-256.
    pub fn http(name: &str, url: &str, sha256: &str) -> Image {
        Image::with_source(
            name,
            ImageSource::Http(HttpSource {
                url: url.to_string(),
                sha256: sha256.to_string(),
            }),
        )
    }

    /// An OCI image (`spec.source.oci`) as `source` says.
    pub fn oci(name: &str, source: OciSource) -> Image {
        Image::with_source(name, ImageSource::Oci(source))
    }

    pub fn build(self) -> VirtualImage {
        self.0
    }
}

impl ObjectBuilder for Image {
    fn json(&self) -> Value {
        to_json(&self.0)
    }
}

/// A `VirtualNetwork`.
#[derive(Clone, Debug)]
pub struct Network(pub VirtualNetwork);

impl Network {
    /// A network with the API's defaults (NAT, a subnet of hearth's choosing).
    pub fn new(name: &str) -> Network {
        Network(VirtualNetwork {
            api_version: API_VERSION.to_string(),
            kind: "VirtualNetwork".to_string(),
            metadata: meta(name),
            spec: VirtualNetworkSpec::default(),
            status: None,
        })
    }

    pub fn mode(mut self, mode: NetworkMode) -> Network {
        self.0.spec.mode = mode;
        self
    }

    pub fn subnet(mut self, cidr: &str) -> Network {
        self.0.spec.subnet = Some(cidr.to_string());
        self
    }

    pub fn bridge(mut self, bridge: &str) -> Network {
        self.0.spec.bridge = Some(bridge.to_string());
        self
    }

    pub fn dhcp(mut self, on: bool) -> Network {
        self.0.spec.dhcp = Some(on);
        self
    }

    pub fn dns(mut self, on: bool) -> Network {
        self.0.spec.dns = Some(on);
        self
    }

    pub fn build(self) -> VirtualNetwork {
        self.0
    }
}

impl ObjectBuilder for Network {
    fn json(&self) -> Value {
        to_json(&self.0)
    }
}

/// A `VirtualDiskSnapshot`.
#[derive(Clone, Debug)]
pub struct DiskSnapshot(pub VirtualDiskSnapshot);

impl DiskSnapshot {
    /// A snapshot of `disk` that must be consistent (the API's default).
    pub fn of(name: &str, disk: &str) -> DiskSnapshot {
        DiskSnapshot(VirtualDiskSnapshot {
            api_version: API_VERSION.to_string(),
            kind: "VirtualDiskSnapshot".to_string(),
            metadata: meta(name),
            spec: VirtualDiskSnapshotSpec {
                virtual_disk_name: disk.to_string(),
                required_consistency: true,
            },
            status: None,
        })
    }

    pub fn required_consistency(mut self, required: bool) -> DiskSnapshot {
        self.0.spec.required_consistency = required;
        self
    }

    pub fn build(self) -> VirtualDiskSnapshot {
        self.0
    }
}

impl ObjectBuilder for DiskSnapshot {
    fn json(&self) -> Value {
        to_json(&self.0)
    }
}

/// A `VirtualMachineSnapshot`.
#[derive(Clone, Debug)]
pub struct VmSnapshot(pub VirtualMachineSnapshot);

impl VmSnapshot {
    pub fn of(name: &str, vm: &str) -> VmSnapshot {
        VmSnapshot(VirtualMachineSnapshot {
            api_version: API_VERSION.to_string(),
            kind: "VirtualMachineSnapshot".to_string(),
            metadata: meta(name),
            spec: VirtualMachineSnapshotSpec {
                virtual_machine_name: vm.to_string(),
                required_consistency: true,
            },
            status: None,
        })
    }

    pub fn required_consistency(mut self, required: bool) -> VmSnapshot {
        self.0.spec.required_consistency = required;
        self
    }

    pub fn build(self) -> VirtualMachineSnapshot {
        self.0
    }
}

impl ObjectBuilder for VmSnapshot {
    fn json(&self) -> Value {
        to_json(&self.0)
    }
}

/// A `VirtualMachineSnapshotGroup`.
#[derive(Clone, Debug)]
pub struct SnapshotGroup(pub VirtualMachineSnapshotGroup);

impl SnapshotGroup {
    pub fn of(name: &str, vms: &[&str]) -> SnapshotGroup {
        SnapshotGroup(VirtualMachineSnapshotGroup {
            api_version: API_VERSION.to_string(),
            kind: "VirtualMachineSnapshotGroup".to_string(),
            metadata: meta(name),
            spec: VirtualMachineSnapshotGroupSpec {
                virtual_machine_names: vms.iter().map(|v| v.to_string()).collect(),
                required_consistency: true,
            },
            status: None,
        })
    }

    pub fn required_consistency(mut self, required: bool) -> SnapshotGroup {
        self.0.spec.required_consistency = required;
        self
    }

    pub fn build(self) -> VirtualMachineSnapshotGroup {
        self.0
    }
}

impl ObjectBuilder for SnapshotGroup {
    fn json(&self) -> Value {
        to_json(&self.0)
    }
}

/// Several objects as one apply: `items` for `POST /v1/apply`, or a
/// multi-document YAML manifest.
#[derive(Clone, Debug, Default)]
pub struct Manifest(Vec<Value>);

impl Manifest {
    pub fn new() -> Manifest {
        Manifest::default()
    }

    pub fn with(mut self, object: impl ObjectBuilder) -> Manifest {
        self.0.push(object.json());
        self
    }

    /// The objects, as `POST /v1/apply` takes them in `items`.
    pub fn items(&self) -> Vec<Value> {
        self.0.clone()
    }

    /// One YAML document per object, `---` between them.
    pub fn yaml(&self) -> String {
        self.0
            .iter()
            .map(|v| serde_yaml_ng::to_string(v).expect("an object serialises to YAML"))
            .collect::<Vec<_>>()
            .join("---\n")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hearth_api::{Object, parse_documents};

    fn parse_one(yaml: &str) -> Object {
        let mut objects = parse_documents(yaml, "t.yaml").unwrap_or_else(|e| panic!("{e}\n{yaml}"));
        assert_eq!(objects.len(), 1, "{yaml}");
        objects.remove(0)
    }

    #[test]
    fn a_small_vm_parses_back_to_what_was_built() {
        let vm = Vm::small("a")
            .always_off()
            .boot(Path::new("/k"), Some(Path::new("/i")), "console=ttyS0")
            .disk("d")
            .network("n");
        let Object::VirtualMachine(parsed) = parse_one(&vm.yaml()) else {
            panic!("not a VM");
        };
        assert_eq!(parsed.spec, vm.0.spec);
        assert_eq!(parsed.spec.memory.bytes(), 256 << 20);
        assert_eq!(parsed.spec.stop_timeout_seconds, 10);
        assert_eq!(parsed.spec.disks[0].virtual_disk_name, "d");
        assert_eq!(parsed.spec.networks[0].virtual_network_name, "n");
        assert_eq!(parsed.metadata.name, "a");
    }

    #[test]
    fn a_new_vm_has_the_apis_defaults() {
        let vm = Vm::new("a");
        let defaults: VirtualMachineSpec =
            serde_json::from_value(serde_json::json!({})).expect("defaults");
        assert_eq!(vm.0.spec, defaults);
        assert_eq!(vm.json()["apiVersion"], API_VERSION);
        assert_eq!(vm.json()["kind"], "VirtualMachine");
    }

    #[test]
    fn a_run_policy_by_name_is_the_enum() {
        assert_eq!(
            Vm::new("a").run_policy_named("Manual").0.spec.run_policy,
            RunPolicy::Manual
        );
    }

    #[test]
    fn every_kind_parses_back() {
        let manifest = Manifest::new()
            .with(Disk::blank("d", "16Mi"))
            .with(Disk::from_image("o", Path::new("/base.qcow2")))
            .with(Disk::from_snapshot("r", "s"))
            .with(Disk::from_virtual_image("vi", "img"))
            .with(Image::file("img", Path::new("/images/a.qcow2")))
            .with(Image::http(
                "web",
                "http://127.0.0.1:1/a.img",
                &"0".repeat(64),
            ))
            .with(Network::new("n").subnet("10.77.0.0/24"))
            .with(DiskSnapshot::of("s", "d").required_consistency(false))
            .with(VmSnapshot::of("vs", "a"))
            .with(SnapshotGroup::of("g", &["a", "b"]));
        let objects = parse_documents(&manifest.yaml(), "t.yaml").expect("parses");
        assert_eq!(objects.len(), 10);
        let kinds: Vec<Value> = manifest.items().iter().map(|v| v["kind"].clone()).collect();
        assert_eq!(
            kinds,
            [
                "VirtualDisk",
                "VirtualDisk",
                "VirtualDisk",
                "VirtualDisk",
                "VirtualImage",
                "VirtualImage",
                "VirtualNetwork",
                "VirtualDiskSnapshot",
                "VirtualMachineSnapshot",
                "VirtualMachineSnapshotGroup"
            ]
        );
        let Object::VirtualDisk(d) = &objects[0] else {
            panic!("not a disk")
        };
        assert_eq!(d.spec.size.as_ref().map(Quantity::bytes), Some(16 << 20));
    }
}
