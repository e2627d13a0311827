use super::*;
use crate::{DiskSource, Object, RunPolicy, parse_documents};

const MY_VM: &str = include_str!("fixtures/my-vm.yaml");
const DECLARATIVE: &str = include_str!("fixtures/declarative-config-example.yaml");
const NO_NAME: &str = include_str!("fixtures/apply-vm-config.yaml");

fn objects(text: &str) -> Vec<Object> {
    parse_documents(text, "test.yaml").unwrap_or_else(|e| panic!("{e}"))
}

fn vm(objs: &[Object]) -> &crate::VirtualMachine {
    objs.iter()
        .find_map(|o| match o {
            Object::VirtualMachine(v) => Some(v),
            _ => None,
        })
        .expect("a VM")
}

fn disk(objs: &[Object]) -> &crate::VirtualDisk {
    objs.iter()
        .find_map(|o| match o {
            Object::VirtualDisk(d) => Some(d),
            _ => None,
        })
        .expect("a disk")
}

fn image<'a>(objs: &'a [Object], name: &str) -> &'a crate::OciSource {
    objs.iter()
        .find_map(|o| match o {
            Object::VirtualImage(i) if i.metadata.name == name => match &i.spec.source {
                crate::ImageSource::Oci(o) => Some(o),
                _ => None,
            },
            _ => None,
        })
        .unwrap_or_else(|| panic!("image {name}"))
}

fn names(objs: &[Object]) -> Vec<String> {
    objs.iter().map(|o| o.display_name()).collect()
}

#[test]
fn my_vm_from_ignites_docs() {
    let objs = objects(MY_VM);
    assert_eq!(
        names(&objs),
        [
            "VirtualImage \"my-vm-image\"",
            "VirtualDisk \"my-vm-root\"",
            "VirtualNetwork \"my-vm-net\"",
            "VirtualMachine \"my-vm\"",
        ]
    );
    let img = image(&objs, "my-vm-image");
    assert_eq!(
        img.reference.as_deref(),
        Some("docker.io/weaveworks/ignite-ubuntu:latest")
    );
    assert_eq!(img.shape, Some(crate::OciShape::Rootfs));
    let d = disk(&objs);
    assert_eq!(d.spec.size.as_ref().map(|q| q.bytes()), Some(3 << 30));
    assert_eq!(
        d.spec.source,
        DiskSource::VirtualImage("my-vm-image".into())
    );
    assert!(d.spec.files.is_empty());
    let v = vm(&objs);
    assert_eq!(v.spec.cpus, 2);
    assert_eq!(v.spec.memory.bytes(), 800 << 20);
    assert_eq!(v.spec.run_policy, RunPolicy::AlwaysOn);
    let boot = v.spec.boot.as_ref().expect("boot");
    assert_eq!(boot.kernel_image, None);
    assert_eq!(boot.kernel, None);
    assert_eq!(v.spec.disks[0].virtual_disk_name, "my-vm-root");
    assert_eq!(v.spec.networks[0].virtual_network_name, "my-vm-net");
    // `ssh: true` cannot make a key in a pure translation: warned.
    let w = warnings_of(&v.metadata.annotations);
    assert_eq!(w.len(), 1, "{w:?}");
    assert_eq!(w[0].0, "spec.ssh");
    assert_eq!(
        v.metadata.annotations["ignite.hearth.dev/uid"],
        "599615df99804ae8"
    );
    assert_eq!(v.metadata.annotations[ANNOTATION_VM], "my-vm");
    assert_eq!(
        v.metadata.annotations["ignite.hearth.dev/spec.memory"],
        "spec.memory \"800MB\""
    );
}

#[test]
fn declarative_config_example_and_ignites_defaults() {
    let objs = objects(DECLARATIVE);
    let v = vm(&objs);
    assert_eq!(v.spec.cpus, 2);
    assert_eq!(v.spec.memory.bytes(), 800 << 20);
    assert!(warnings_of(&v.metadata.annotations).is_empty());

    let bare = "apiVersion: ignite.weave.works/v1alpha4\nkind: VM\nmetadata: {name: bare}\nspec:\n  image: {oci: ubuntu}\n";
    let objs = objects(bare);
    let v = vm(&objs);
    assert_eq!(v.spec.cpus, 1);
    assert_eq!(v.spec.memory.bytes(), 512 << 20);
    assert_eq!(v.spec.memory.to_string(), "512Mi");
    assert_eq!(disk(&objs).spec.size.as_ref().unwrap().to_string(), "4Gi");
    assert_eq!(
        image(&objs, "bare-image").reference.as_deref(),
        Some("docker.io/library/ubuntu:latest")
    );
    assert_eq!(
        v.metadata.annotations["ignite.hearth.dev/spec.cpus"],
        "Ignite's default, 1"
    );
    assert!(
        v.metadata.annotations["ignite.hearth.dev/spec.boot.kernelImage"]
            .contains("boots the kernel under /boot")
    );
}

#[test]
fn a_vm_without_a_name_is_refused_naming_the_field() {
    let e = parse_documents(NO_NAME, "t.yaml").unwrap_err().to_string();
    assert!(e.contains("metadata.name: is missing"), "{e}");
    let e = parse_documents(
        "apiVersion: ignite.weave.works/v1alpha4\nkind: VM\nmetadata: {name: x}\nspec: {}\n",
        "t.yaml",
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("spec.image.oci: is missing"), "{e}");
    let e = parse_documents(
        "apiVersion: ignite.weave.works/v1alpha3\nkind: VM\nmetadata: {name: x}\n",
        "t.yaml",
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("apiVersion") && e.contains("v1alpha4"), "{e}");
    let e = parse_documents(
        "apiVersion: ignite.weave.works/v1alpha4\nkind: Image\nmetadata: {name: x}\n",
        "t.yaml",
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("kind"), "{e}");
    let e = parse_documents(
        "apiVersion: ignite.weave.works/v1alpha4\nkind: VM\nmetadata: {name: My_VM}\nspec: {image: {oci: a}}\n",
        "t.yaml",
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("metadata.name"), "{e}");
}

const EVERY_FIELD: &str = "\
apiVersion: ignite.weave.works/v1alpha4
kind: VM
metadata:
  name: full
  uid: 0123456789abcdef
  created: 2021-01-01T00:00:00Z
  labels: {foo: bar}
  annotations: {team: infra}
spec:
  cpus: 3
  memory: 1GB
  diskSize: 6GB
  image:
    oci: 127.0.0.1:5000/vm/rootfs:v1
  kernel:
    cmdLine: console=ttyS0 reboot=k panic=1 pci=off ip=dhcp
    oci: weaveworks/ignite-kernel:5.10.51
  sandbox:
    oci: weaveworks/ignite:dev
  network:
    ports:
    - hostPort: 433
      vmPort: 6443
      bindAddress: 10.0.0.2
      protocol: udp
    - hostPort: 2222
      vmPort: 22
  storage:
    volumeMounts:
    - mountPath: /mnt
      name: volume0
    volumes:
    - blockDevice:
        path: /dev/sdb1
      name: volume0
  copyFiles:
  - hostPath: /etc/kubernetes/admin.conf
    vmPath: /home/user/.kube/config
  ssh: keys/id.pub
status:
  running: false
";

#[test]
fn every_field() {
    let objs =
        crate::parse_documents_in(EVERY_FIELD, "t.yaml", Some(std::path::Path::new("/srv/m")))
            .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(objs.len(), 5, "{:?}", names(&objs));
    assert_eq!(
        image(&objs, "full-image").reference.as_deref(),
        Some("127.0.0.1:5000/vm/rootfs:v1")
    );
    assert_eq!(
        image(&objs, "full-kernel").reference.as_deref(),
        Some("docker.io/weaveworks/ignite-kernel:5.10.51")
    );
    let v = vm(&objs);
    assert_eq!(v.spec.cpus, 3);
    assert_eq!(v.spec.memory.bytes(), 1 << 30);
    assert_eq!(v.spec.run_policy, RunPolicy::AlwaysOff);
    let boot = v.spec.boot.as_ref().unwrap();
    assert_eq!(boot.kernel_image.as_deref(), Some("full-kernel"));
    assert_eq!(boot.cmdline, "console=ttyS0 reboot=k panic=1 ip=dhcp");
    let ports = &v.spec.networks[0].ports;
    assert_eq!(ports.len(), 2);
    assert_eq!((ports[0].host_port, ports[0].guest_port), (433, 6443));
    assert_eq!(ports[0].protocol, crate::Protocol::Udp);
    assert_eq!(ports[0].host_address.as_deref(), Some("10.0.0.2"));
    assert_eq!(ports[1].protocol, crate::Protocol::Tcp);
    assert_eq!(ports[1].host_address, None);
    let d = disk(&objs);
    assert_eq!(d.spec.size.as_ref().unwrap().bytes(), 6 << 30);
    assert_eq!(d.spec.files.len(), 2);
    assert_eq!(
        d.spec.files[0].path.to_str(),
        Some("/home/user/.kube/config")
    );
    assert_eq!(
        d.spec.files[0].source.as_deref().and_then(|p| p.to_str()),
        Some("/etc/kubernetes/admin.conf")
    );
    assert_eq!(d.spec.files[1].path.to_str(), Some(AUTHORIZED_KEYS));
    // Relative to the manifest's directory, as every host path is.
    assert_eq!(
        d.spec.files[1].source.as_deref().and_then(|p| p.to_str()),
        Some("/srv/m/keys/id.pub")
    );
    assert_eq!(d.spec.files[1].mode.as_deref(), Some("0600"));
    let a = &v.metadata.annotations;
    assert_eq!(a["team"], "infra");
    let mut warned: Vec<&str> = warnings_of(a).into_iter().map(|(f, _)| f).collect();
    warned.sort();
    assert_eq!(
        warned,
        [
            "metadata.labels",
            "spec.kernel.cmdLine",
            "spec.sandbox",
            "spec.storage.volumeMounts[0]",
            "spec.storage.volumes[0]",
        ]
    );
    assert!(a["ignite.hearth.dev/warning.spec.kernel.cmdLine"].contains("pci=off"));
    assert_eq!(
        a["ignite.hearth.dev/spec.runPolicy"],
        "status.running false"
    );
    let da = &d.metadata.annotations;
    assert!(da["ignite.hearth.dev/spec.files"].contains("spec.copyFiles"));
    assert!(da["ignite.hearth.dev/spec.files"].contains("spec.ssh"));
    assert_eq!(da["ignite.hearth.dev/spec.size"], "spec.diskSize \"6GB\"");
}

#[test]
fn unknown_fields_are_warned_about_by_name() {
    let text = "apiVersion: ignite.weave.works/v1alpha4\nkind: VM\nmetadata: {name: u}\nspec:\n  image: {oci: a/b}\n  gpus: 1\n  network: {mode: x}\n";
    let objs = objects(text);
    let w: Vec<&str> = warnings_of(&vm(&objs).metadata.annotations)
        .into_iter()
        .map(|(f, _)| f)
        .collect();
    assert_eq!(w, ["spec.gpus", "spec.network.mode"]);
}

#[test]
fn sizes_as_ignite_reads_them() {
    for (text, bytes) in [
        ("512MB", 512u64 << 20),
        ("1GB", 1 << 30),
        ("1gb", 1 << 30),
        ("4G", 4 << 30),
        ("800 MB", 800 << 20),
        ("1024", 1024),
        ("2kb", 2048),
        ("1 gigabytes", 1 << 30),
        ("1TB", 1 << 40),
    ] {
        assert_eq!(parse_size(text), Ok(bytes), "{text}");
    }
    for bad in [
        "",
        "MB",
        "1.5GB",
        "1Mb",
        "1GiB",
        " 1GB",
        "99999999999999999999",
    ] {
        assert!(parse_size(bad).is_err(), "{bad}");
    }
    let e = parse_documents(
        "apiVersion: ignite.weave.works/v1alpha4\nkind: VM\nmetadata: {name: s}\nspec: {image: {oci: a/b}, memory: 1.5GB}\n",
        "t.yaml",
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("spec.memory"), "{e}");
    // hearth's own bounds still hold, naming hearth's field.
    let e = parse_documents(
        "apiVersion: ignite.weave.works/v1alpha4\nkind: VM\nmetadata: {name: s}\nspec: {image: {oci: a/b}, memory: 16MB}\n",
        "t.yaml",
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("spec.memory"), "{e}");
}

#[test]
fn references_as_docker_reads_them() {
    for (given, want) in [
        ("ubuntu", "docker.io/library/ubuntu:latest"),
        (
            "weaveworks/ignite-ubuntu",
            "docker.io/weaveworks/ignite-ubuntu:latest",
        ),
        (
            "weaveworks/ignite-kernel:5.10.51",
            "docker.io/weaveworks/ignite-kernel:5.10.51",
        ),
        ("docker.io/ubuntu:22.04", "docker.io/library/ubuntu:22.04"),
        ("index.docker.io/a/b", "docker.io/a/b:latest"),
        (
            "127.0.0.1:5000/vm/rootfs",
            "127.0.0.1:5000/vm/rootfs:latest",
        ),
        ("localhost/x:1", "localhost/x:1"),
        ("quay.io/a/b:c", "quay.io/a/b:c"),
        (
            "a/b@sha256:0000000000000000000000000000000000000000000000000000000000000000",
            "docker.io/a/b@sha256:0000000000000000000000000000000000000000000000000000000000000000",
        ),
    ] {
        assert_eq!(normalize_reference(given), want, "{given}");
    }
}

#[test]
fn a_translation_is_the_same_every_time() {
    // The manifest directory parses a file again at every re-list: the
    // objects must not change when the file does not.
    let base = Some(std::path::Path::new("/srv/m"));
    let once = crate::parse_documents_in(EVERY_FIELD, "t.yaml", base).unwrap();
    let again = crate::parse_documents_in(EVERY_FIELD, "t.yaml", base).unwrap();
    assert_eq!(once, again);
}

#[test]
fn ignite_and_hearth_documents_mix_in_one_file() {
    let text = format!(
        "{MY_VM}---\napiVersion: hearth.dev/v1alpha1\nkind: VirtualNetwork\nmetadata: {{name: lan}}\nspec: {{}}\n"
    );
    assert_eq!(objects(&text).len(), 5);
    // Two Ignite VMs of one name declare the same objects twice.
    let twice = format!("{MY_VM}---\n{MY_VM}");
    let e =
        crate::manifest::parse_manifest(twice.as_bytes(), std::path::Path::new("/m")).unwrap_err();
    assert!(e.message.contains("declared twice"), "{e}");
}

#[test]
fn the_manifest_directory_locates_an_ignite_error() {
    let text = "apiVersion: ignite.weave.works/v1alpha4\nkind: VM\nmetadata:\n  name: loc\nspec:\n  image:\n    oci: a/b\n  memory: lots\n";
    let e =
        crate::manifest::parse_manifest(text.as_bytes(), std::path::Path::new("/m")).unwrap_err();
    assert_eq!(e.location.map(|l| l.0), Some(8), "{e}");
}
