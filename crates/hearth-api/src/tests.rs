use crate::*;

const DEMO: &str = r#"
apiVersion: hearth.dev/v1alpha1
kind: VirtualDisk
metadata: {name: demo-data}
spec:
  size: 1Gi
  source: {blank: {}}
---
apiVersion: hearth.dev/v1alpha1
kind: VirtualMachine
metadata: {name: demo}
spec:
  runPolicy: AlwaysOn
  cpus: 1
  memory: 256Mi
  boot: {kernel: /boot/vmlinuz, initrd: /boot/initrd.img, cmdline: "console=ttyS0"}
  disks:
    - virtualDiskName: demo-data
  guestAgent: true
"#;

fn parse_err(text: &str) -> String {
    parse_documents(text, "test.yaml").unwrap_err().to_string()
}

#[test]
fn several_documents_in_one_file() {
    let objs = parse_documents(DEMO, "demo.yaml").unwrap();
    assert_eq!(objs.len(), 2);
    assert_eq!(objs[0].kind(), Kind::VirtualDisk);
    assert_eq!(objs[1].name(), "demo");
    let Object::VirtualMachine(vm) = &objs[1] else {
        panic!("not a VM")
    };
    assert_eq!(vm.spec.memory.mebibytes(), 256);
    assert_eq!(vm.spec.disks[0].virtual_disk_name, "demo-data");
}

#[test]
fn defaults_fill_what_is_left_out() {
    let objs = parse_documents(
        "apiVersion: hearth.dev/v1alpha1\nkind: VirtualMachine\nmetadata: {name: a}\nspec: {boot: {kernel: /k}}\n",
        "t",
    )
    .unwrap();
    let Object::VirtualMachine(vm) = &objs[0] else {
        panic!()
    };
    assert_eq!(vm.spec.cpus, 1);
    assert_eq!(vm.spec.memory.mebibytes(), 256);
    assert_eq!(vm.spec.run_policy, RunPolicy::AlwaysOn);
    assert!(vm.spec.guest_agent);
}

#[test]
fn json_is_accepted_and_round_trips() {
    let objs = parse_documents(DEMO, "demo.yaml").unwrap();
    let json = serde_json::to_string(&serde_json::json!({"items": objs})).unwrap();
    let again = parse_documents(&json, "list.json").unwrap();
    assert_eq!(objs, again);
}

#[test]
fn unknown_field_names_its_full_path() {
    let e = parse_err(&DEMO.replace("cpus: 1", "cpus: 1\n  cpu_count: 2"));
    assert!(e.contains(r#"VirtualMachine "demo""#), "{e}");
    assert!(e.contains("spec.cpu_count: unknown field"), "{e}");
    let e = parse_err(&DEMO.replace("initrd:", "initramfs:"));
    assert!(e.contains("spec.boot.initramfs"), "{e}");
}

#[test]
fn bad_memory_size_names_field_and_value() {
    let e = parse_err(&DEMO.replace("256Mi", "12XB"));
    assert!(e.contains("spec.memory"), "{e}");
    assert!(e.contains("\"12XB\""), "{e}");
}

#[test]
fn names_must_be_dns_labels() {
    for bad in ["Demo", "demo_1", "-demo", "a,b", "a b", ""] {
        let e = parse_err(&DEMO.replace("{name: demo}", &format!("{{name: {bad:?}}}")));
        assert!(e.contains("metadata.name"), "{bad}: {e}");
    }
    let e = parse_err(&DEMO.replace("- virtualDiskName: demo-data", "- virtualDiskName: Data,x"));
    assert!(e.contains("spec.disks[0].virtualDiskName"), "{e}");
}

#[test]
fn unknown_kind_and_missing_name_are_refused() {
    let e =
        parse_err("apiVersion: hearth.dev/v1alpha1\nkind: Pod\nmetadata: {name: x}\nspec: {}\n");
    assert!(e.contains("unknown kind \"Pod\""), "{e}");
    let e = parse_err("apiVersion: hearth.dev/v1alpha1\nkind: VirtualDisk\nspec: {}\n");
    assert!(e.contains("metadata.name: is missing"), "{e}");
    let e = parse_err(&DEMO.replace(
        "hearth.dev/v1alpha1\nkind: VirtualMachine",
        "v1\nkind: VirtualMachine",
    ));
    assert!(e.contains("apiVersion"), "{e}");
}

#[test]
fn yaml_syntax_error_has_line_and_column() {
    let err = parse_documents(
        "kind: VirtualDisk\nmetadata: {name: x\nspec: [\n",
        "bad.yaml",
    )
    .unwrap_err();
    match err {
        ParseError::Syntax { line, origin, .. } => {
            assert_eq!(origin, "bad.yaml");
            assert!(line >= 2, "line {line}");
        }
        other => panic!("expected a syntax error, got {other}"),
    }
}

#[test]
fn one_bad_document_fails_the_whole_file() {
    let text =
        format!("{DEMO}\n---\nkind: VirtualDisk\nmetadata: {{name: y}}\nspec: {{bogus: 1}}\n");
    assert!(parse_documents(&text, "t").is_err());
}

#[test]
fn blank_disk_needs_size_and_image_needs_absolute_path() {
    let e = parse_err(
        "apiVersion: hearth.dev/v1alpha1\nkind: VirtualDisk\nmetadata: {name: d}\nspec: {source: {blank: {}}}\n",
    );
    assert!(e.contains("spec.size"), "{e}");
    let e = parse_err(
        "apiVersion: hearth.dev/v1alpha1\nkind: VirtualDisk\nmetadata: {name: d}\nspec: {source: {image: base.qcow2}}\n",
    );
    assert!(e.contains("spec.source.image"), "{e}");
    let e = parse_err(
        "apiVersion: hearth.dev/v1alpha1\nkind: VirtualDisk\nmetadata: {name: d}\nspec: {source: {nfs: x}}\n",
    );
    assert!(e.contains("spec.source"), "{e}");
}

#[test]
fn relative_paths_resolve_against_the_manifest_directory() {
    let text = DEMO.replace("/boot/vmlinuz", "../guest/vmlinuz");
    // Relative paths fail validation until they are resolved...
    assert!(parse_documents(&text, "t").is_err());
    // ...so callers resolve them against the manifest's directory.
    let objs =
        parse_documents_in(&text, "t", Some(std::path::Path::new("/repo/examples"))).unwrap();
    let Object::VirtualMachine(vm) = &objs[1] else {
        panic!()
    };
    assert_eq!(
        vm.spec.boot.as_ref().expect("boot").kernel,
        Some(std::path::PathBuf::from("/repo/examples/../guest/vmlinuz"))
    );
    // Absolute paths stay as they are.
    assert_eq!(
        vm.spec.boot.as_ref().expect("boot").initrd,
        Some(std::path::PathBuf::from("/boot/initrd.img"))
    );
}

#[test]
fn user_cannot_set_server_fields() {
    let mut objs = parse_documents(
        &DEMO.replace(
            "{name: demo}",
            "{name: demo, generation: 7, managedBy: api}",
        ),
        "t",
    )
    .unwrap();
    objs[1].strip_server_fields();
    assert_eq!(objs[1].metadata().generation, 0);
    assert_eq!(objs[1].metadata().managed_by, None);
}

proptest::proptest! {
    /// Whatever bytes arrive, parsing returns an answer and never panics.
    #[test]
    fn parsing_never_panics(text in ".{0,400}") {
        let _ = parse_documents(&text, "fuzz");
    }

    #[test]
    fn dns_label_check_agrees_with_the_rule(name in "[a-z0-9-]{0,70}") {
        let ok = !name.is_empty() && name.len() <= 63 && !name.starts_with('-') && !name.ends_with('-');
        proptest::prop_assert_eq!(check_dns_label(&name).is_ok(), ok);
    }
}

#[test]
fn snapshot_kinds_parse_with_defaults() {
    let objs = parse_documents(
        "apiVersion: hearth.dev/v1alpha1\nkind: VirtualDiskSnapshot\nmetadata: {name: s1}\nspec: {virtualDiskName: demo-data}\n---\napiVersion: hearth.dev/v1alpha1\nkind: VirtualMachineSnapshot\nmetadata: {name: v1}\nspec: {virtualMachineName: demo, requiredConsistency: false}\n",
        "t",
    )
    .unwrap();
    let Object::VirtualDiskSnapshot(s) = &objs[0] else {
        panic!()
    };
    assert!(s.spec.required_consistency);
    let Object::VirtualMachineSnapshot(v) = &objs[1] else {
        panic!()
    };
    assert!(!v.spec.required_consistency);
    let e = parse_err(
        "apiVersion: hearth.dev/v1alpha1\nkind: VirtualDiskSnapshot\nmetadata: {name: s1}\nspec: {virtualDiskName: Bad_Disk}\n",
    );
    assert!(e.contains("spec.virtualDiskName"), "{e}");
    let e = parse_err(
        "apiVersion: hearth.dev/v1alpha1\nkind: VirtualDisk\nmetadata: {name: r}\nspec: {size: 1Gi, source: {snapshot: s1}}\n",
    );
    assert!(e.contains("spec.size"), "{e}");
}

#[test]
fn a_snapshot_group_names_each_vm_once_and_requires_consistency_by_default() {
    let objs = parse_documents(
        "apiVersion: hearth.dev/v1alpha1\nkind: VirtualMachineSnapshotGroup\nmetadata: {name: app-and-db}\nspec: {virtualMachineNames: [app, db]}\n",
        "t",
    )
    .unwrap();
    let Object::VirtualMachineSnapshotGroup(g) = &objs[0] else {
        panic!("{objs:?}")
    };
    assert_eq!(g.spec.virtual_machine_names, ["app", "db"]);
    assert!(g.spec.required_consistency);
    assert_eq!(
        Kind::from_user("vmsnapshotgroups"),
        Some(Kind::VirtualMachineSnapshotGroup)
    );
    assert_eq!(
        Kind::VirtualMachineSnapshotGroup.plural(),
        "virtualmachinesnapshotgroups"
    );
    let e = parse_err(
        "apiVersion: hearth.dev/v1alpha1\nkind: VirtualMachineSnapshotGroup\nmetadata: {name: g}\nspec: {virtualMachineNames: []}\n",
    );
    assert!(
        e.contains("spec.virtualMachineNames") && e.contains("at least one"),
        "{e}"
    );
    let e = parse_err(
        "apiVersion: hearth.dev/v1alpha1\nkind: VirtualMachineSnapshotGroup\nmetadata: {name: g}\nspec: {virtualMachineNames: [app, db, app]}\n",
    );
    assert!(
        e.contains("spec.virtualMachineNames[2]") && e.contains("twice"),
        "{e}"
    );
    let e = parse_err(
        "apiVersion: hearth.dev/v1alpha1\nkind: VirtualMachineSnapshotGroup\nmetadata: {name: g}\nspec: {virtualMachineNames: [Bad_Vm]}\n",
    );
    assert!(e.contains("spec.virtualMachineNames[0]"), "{e}");
}

// ---------------------------------------------------------------- ranges

/// A VM whose `spec` gets the `extra` lines and lists `disks`.
fn vm_with(extra: &str, disks: &[&str]) -> String {
    let disks = if disks.is_empty() {
        "  disks: []\n".to_string()
    } else {
        let list: String = disks
            .iter()
            .map(|d| format!("    - virtualDiskName: {d}\n"))
            .collect();
        format!("  disks:\n{list}")
    };
    format!(
        "apiVersion: hearth.dev/v1alpha1\nkind: VirtualMachine\nmetadata: {{name: demo}}\nspec:\n  boot: {{kernel: /boot/vmlinuz}}\n{extra}{disks}"
    )
}

fn blank_disk(size: &str) -> String {
    format!(
        "apiVersion: hearth.dev/v1alpha1\nkind: VirtualDisk\nmetadata: {{name: d}}\nspec: {{size: {size}, source: {{blank: {{}}}}}}\n"
    )
}

/// The validation error of a text that must be refused.
#[track_caller]
fn field_error(text: &str) -> FieldError {
    match parse_documents(text, "t") {
        Err(ParseError::Invalid { error, .. }) => error,
        Err(other) => panic!("refused, but not by validation: {other}\n{text}"),
        Ok(_) => panic!("accepted:\n{text}"),
    }
}

/// Refused, and the error names `field`, both as its field and when shown.
#[track_caller]
fn assert_refused(text: &str, field: &str) {
    let e = field_error(text);
    assert_eq!(e.field, field, "{e}");
    assert!(e.to_string().contains(field), "{e}");
}

#[track_caller]
fn assert_accepted(text: &str) {
    if let Err(e) = parse_documents(text, "t") {
        panic!("refused: {e}\n{text}");
    }
}

#[test]
fn memory_is_32mi_to_1ti_in_whole_mebibytes() {
    for ok in ["32Mi", "33Mi", "1024Gi", "1Ti"] {
        assert_accepted(&vm_with(&format!("  memory: {ok}\n"), &[]));
    }
    for bad in ["31Mi", "33554431", "0", "1025Gi", "2Ti"] {
        assert_refused(&vm_with(&format!("  memory: {bad}\n"), &[]), "spec.memory");
    }
    // In range, but not a whole MiB.
    assert_refused(&vm_with("  memory: 33555456\n", &[]), "spec.memory");
    let e = field_error(&vm_with("  memory: 31Mi\n", &[]));
    assert!(e.message.contains("31Mi"), "{e}");
}

#[test]
fn disk_size_is_1mi_to_16ti_in_whole_sectors() {
    for ok in ["1Mi", "1049088", "16Ti", "16384Gi"] {
        assert_accepted(&blank_disk(ok));
    }
    for bad in ["1023Ki", "1048575", "0", "16385Gi", "17Ti"] {
        assert_refused(&blank_disk(bad), "spec.size");
    }
    // In range, but not a multiple of 512 bytes.
    assert_refused(&blank_disk("1048577"), "spec.size");
    let e = field_error(&blank_disk("17Ti"));
    assert!(e.message.contains("17Ti"), "{e}");
}

#[test]
fn a_vm_has_at_most_16_disks() {
    let names: Vec<String> = (0..17).map(|i| format!("d{i}")).collect();
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    assert_accepted(&vm_with("", &names[..16]));
    assert_refused(&vm_with("", &names), "spec.disks");
}

#[test]
fn a_disk_listed_twice_in_a_vm_is_refused_at_its_second_place() {
    assert_accepted(&vm_with("", &["a", "b"]));
    let text = vm_with("", &["a", "b", "a"]);
    assert_refused(&text, "spec.disks[2].virtualDiskName");
    let e = field_error(&text);
    assert!(
        e.message.contains("\"a\"") && e.message.contains("twice"),
        "{e}"
    );
}

#[test]
fn freeze_deadline_must_leave_room_for_the_transaction() {
    // The freeze and its status read take time, and the 2 s transaction is
    // started only if it still fits before the deadline: 2 s never works.
    assert_eq!(MIN_FREEZE_DEADLINE_SECONDS, 3);
    let with = |s: u32| vm_with(&format!("  freezeDeadlineSeconds: {s}\n"), &[]);
    for ok in [
        MIN_FREEZE_DEADLINE_SECONDS,
        MIN_FREEZE_DEADLINE_SECONDS + 1,
        10,
        MAX_FREEZE_DEADLINE_SECONDS,
    ] {
        assert_accepted(&with(ok));
    }
    for bad in [
        0,
        1,
        MIN_FREEZE_DEADLINE_SECONDS - 1,
        MAX_FREEZE_DEADLINE_SECONDS + 1,
    ] {
        assert_refused(&with(bad), "spec.freezeDeadlineSeconds");
    }
    let e = field_error(&with(2));
    assert!(e.message.contains("3..300"), "{e}");
    // Left out, the default is in range.
    let objs = parse_documents(&vm_with("", &[]), "t").expect("valid");
    let Object::VirtualMachine(vm) = &objs[0] else {
        panic!()
    };
    assert!(
        (MIN_FREEZE_DEADLINE_SECONDS..=MAX_FREEZE_DEADLINE_SECONDS)
            .contains(&vm.spec.freeze_deadline_seconds)
    );
}

// ---------------------------------------------------------------- images, firmware, cloud-init

const SHA: &str = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08";

fn image_yaml(source: &str) -> String {
    format!(
        "apiVersion: hearth.dev/v1alpha1\nkind: VirtualImage\nmetadata: {{name: debian-12}}\nspec:\n  source: {source}\n"
    )
}

fn firmware_vm(extra: &str) -> String {
    format!(
        "apiVersion: hearth.dev/v1alpha1\nkind: VirtualMachine\nmetadata: {{name: web}}\nspec:\n  disks: [{{virtualDiskName: web-root}}]\n{extra}"
    )
}

#[test]
fn an_http_image_with_its_sha256_parses() {
    let objs = parse_documents(
        &image_yaml(&format!(
            "{{http: {{url: \"http://127.0.0.1:8080/debian-12.qcow2\", sha256: {SHA}}}}}"
        )),
        "t",
    )
    .unwrap();
    let Object::VirtualImage(img) = &objs[0] else {
        panic!("not an image: {objs:?}")
    };
    let ImageSource::Http(h) = &img.spec.source else {
        panic!("not http")
    };
    assert_eq!(h.url, "http://127.0.0.1:8080/debian-12.qcow2");
    assert_eq!(h.sha256, SHA);
    assert_eq!(Kind::from_user("images"), Some(Kind::VirtualImage));
    assert_eq!(Kind::VirtualImage.plural(), "virtualimages");
}

#[test]
fn image_sources_are_checked_field_by_field() {
    let e = parse_err(&image_yaml(
        "{http: {url: \"ftp://host/x.qcow2\", sha256: 9f86}}",
    ));
    assert!(e.contains("spec.source.http.url"), "{e}");
    let e = parse_err(&image_yaml(&format!(
        "{{http: {{url: \"http:///x\", sha256: {SHA}}}}}"
    )));
    assert!(
        e.contains("spec.source.http.url") && e.contains("no host"),
        "{e}"
    );
    let e = parse_err(&image_yaml("{http: {url: \"http://h/x\", sha256: 9f86}}"));
    assert!(
        e.contains("spec.source.http.sha256") && e.contains("64 hex"),
        "{e}"
    );
    let e = parse_err(&image_yaml("{http: {url: \"http://h/x\"}}"));
    assert!(
        e.contains("sha256"),
        "a download without a checksum is refused: {e}"
    );
    let e = parse_err(&image_yaml("{file: relative/x.qcow2}"));
    assert!(
        e.contains("spec.source.file") && e.contains("absolute"),
        "{e}"
    );
    let e = parse_err(&image_yaml("{oci: {reference: x}}"));
    assert!(e.contains("spec.source"), "{e}");
}

#[test]
fn an_image_file_path_resolves_against_the_manifest() {
    let objs = parse_documents_in(
        &image_yaml("{file: images/x.qcow2}"),
        "t",
        Some(std::path::Path::new("/srv/m")),
    )
    .unwrap();
    let Object::VirtualImage(img) = &objs[0] else {
        panic!()
    };
    assert_eq!(
        img.spec.source,
        ImageSource::File("/srv/m/images/x.qcow2".into())
    );
}

#[test]
fn a_disk_from_an_image_names_it() {
    let objs = parse_documents(
        "apiVersion: hearth.dev/v1alpha1\nkind: VirtualDisk\nmetadata: {name: web-root}\nspec: {size: 8Gi, source: {virtualImage: debian-12}}\n",
        "t",
    )
    .unwrap();
    let Object::VirtualDisk(d) = &objs[0] else {
        panic!()
    };
    assert_eq!(d.spec.source, DiskSource::VirtualImage("debian-12".into()));
    let e = parse_err(
        "apiVersion: hearth.dev/v1alpha1\nkind: VirtualDisk\nmetadata: {name: w}\nspec: {source: {virtualImage: Debian_12}}\n",
    );
    assert!(e.contains("spec.source.virtualImage"), "{e}");
}

#[test]
fn a_vm_without_boot_uses_firmware_and_needs_a_disk() {
    let objs = parse_documents(&firmware_vm("  firmware: UEFI\n"), "t").unwrap();
    let Object::VirtualMachine(vm) = &objs[0] else {
        panic!()
    };
    assert_eq!(vm.spec.firmware, Firmware::Uefi);
    assert!(vm.spec.boot.is_none());
    let objs = parse_documents(&firmware_vm(""), "t").unwrap();
    let Object::VirtualMachine(vm) = &objs[0] else {
        panic!()
    };
    assert_eq!(vm.spec.firmware, Firmware::Bios, "BIOS is the default");
    let e = parse_err(&firmware_vm("  firmware: CSM\n"));
    assert!(e.contains("spec.firmware"), "{e}");
    let e = parse_err(
        "apiVersion: hearth.dev/v1alpha1\nkind: VirtualMachine\nmetadata: {name: web}\nspec: {}\n",
    );
    assert!(e.contains("spec.disks") && e.contains("firmware"), "{e}");
}

#[test]
fn cloud_init_is_checked_before_the_guest_ever_sees_it() {
    let ok = firmware_vm(
        "  cloudInit:\n    userData: |\n      #cloud-config\n      runcmd: [[touch, /x]]\n    sshAuthorizedKeys: [\"ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIA me@laptop\"]\n    hostname: web-1\n",
    );
    let objs = parse_documents(&ok, "t").unwrap();
    let Object::VirtualMachine(vm) = &objs[0] else {
        panic!()
    };
    let ci = vm.spec.cloud_init.as_ref().expect("cloudInit");
    assert!(ci.user_data.as_deref().unwrap().contains("runcmd"));
    assert_eq!(ci.ssh_authorized_keys.len(), 1);

    let e = parse_err(&firmware_vm(
        "  cloudInit:\n    userData: |\n      #cloud-config\n      runcmd: [unclosed\n",
    ));
    assert!(
        e.contains("spec.cloudInit.userData") && e.contains("YAML"),
        "{e}"
    );
    // A script is not YAML and is passed as it is.
    parse_documents(
        &firmware_vm("  cloudInit:\n    userData: |\n      #!/bin/sh\n      echo [unclosed\n"),
        "t",
    )
    .unwrap();
    let e = parse_err(&firmware_vm(
        "  cloudInit:\n    sshAuthorizedKeys: [\"ssh-ed25519 AAAA me\", \"hunter2\"]\n",
    ));
    assert!(e.contains("spec.cloudInit.sshAuthorizedKeys[1]"), "{e}");
    let e = parse_err(&firmware_vm("  cloudInit:\n    hostname: Web_1\n"));
    assert!(e.contains("spec.cloudInit.hostname"), "{e}");
    let e = parse_err(&firmware_vm(
        "  cloudInit:\n    networkConfig: \"- a\\n- b\"\n",
    ));
    assert!(
        e.contains("spec.cloudInit.networkConfig") && e.contains("mapping"),
        "{e}"
    );
    let e = parse_err(&firmware_vm("  cloudInit:\n    userdata: x\n"));
    assert!(e.contains("spec.cloudInit.userdata: unknown field"), "{e}");
    let big = format!(
        "  cloudInit:\n    userData: \"{}\"\n",
        "x".repeat(MAX_CLOUD_INIT_TEXT + 1)
    );
    let e = parse_err(&firmware_vm(&big));
    assert!(
        e.contains("spec.cloudInit.userData") && e.contains("KiB"),
        "{e}"
    );
}

#[test]
fn stored_objects_are_read_back_as_their_own_kind() {
    // An image and a disk look alike (both have spec.source); the kind decides.
    let text = format!(
        "{}---\napiVersion: hearth.dev/v1alpha1\nkind: VirtualDisk\nmetadata: {{name: d}}\nspec: {{source: {{virtualImage: debian-12}}}}\n",
        image_yaml(&format!("{{http: {{url: \"http://h/x\", sha256: {SHA}}}}}"))
    );
    for obj in parse_documents(&text, "t").unwrap() {
        let json = serde_json::to_string(&obj).unwrap();
        let back: Object = serde_json::from_str(&json).unwrap();
        assert_eq!(back.kind(), obj.kind());
        assert_eq!(back, obj);
    }
    let e = serde_json::from_str::<Object>(r#"{"kind": "Nope"}"#).unwrap_err();
    assert!(e.to_string().contains("kind"), "{e}");
}

fn network_yaml(spec: &str) -> String {
    format!(
        "apiVersion: hearth.dev/v1alpha1\nkind: VirtualNetwork\nmetadata: {{name: lan}}\nspec: {spec}\n"
    )
}

fn vm_with_networks(networks: &str) -> String {
    format!(
        "apiVersion: hearth.dev/v1alpha1\nkind: VirtualMachine\nmetadata: {{name: web}}\nspec:\n  boot: {{kernel: /k}}\n  networks: {networks}\n"
    )
}

#[test]
fn a_network_defaults_to_nat_with_dhcp_and_no_subnet() {
    let text = "apiVersion: hearth.dev/v1alpha1\nkind: VirtualNetwork\nmetadata: {name: lan}\n";
    let objs = parse_documents(text, "t").unwrap();
    let Object::VirtualNetwork(n) = &objs[0] else {
        panic!("not a network: {objs:?}")
    };
    assert_eq!(n.spec.mode, NetworkMode::Nat);
    assert_eq!(n.spec.subnet, None);
    assert!(n.spec.dhcp_enabled());
    assert!(n.spec.dns_enabled(), "DNS along with DHCP by default");
    for short in ["network", "networks", "net", "vnet", "VirtualNetwork"] {
        assert_eq!(
            Kind::from_user(short),
            Some(Kind::VirtualNetwork),
            "{short}"
        );
    }
    assert_eq!(Kind::VirtualNetwork.plural(), "virtualnetworks");
    assert!(Kind::ALL.contains(&Kind::VirtualNetwork));
}

#[test]
fn network_specs_are_checked_field_by_field() {
    let ok = parse_documents(
        &network_yaml("{mode: Isolated, subnet: 10.77.4.0/24, dhcp: false}"),
        "t",
    );
    assert!(ok.is_ok(), "{ok:?}");
    let bridged = parse_documents(&network_yaml("{mode: Bridge, bridge: br0}"), "t").unwrap();
    let Object::VirtualNetwork(n) = &bridged[0] else {
        panic!()
    };
    assert!(
        !n.spec.dhcp_enabled(),
        "no DHCP on a bridge hearth does not own"
    );
    assert!(!n.spec.dns_enabled(), "nor DNS");
    for (spec, dns) in [
        ("{mode: NAT, dns: false}", false),
        ("{mode: Isolated}", true),
        ("{mode: NAT, dhcp: false}", false),
    ] {
        let objs = parse_documents(&network_yaml(spec), "t").unwrap();
        let Object::VirtualNetwork(n) = &objs[0] else {
            panic!()
        };
        assert_eq!(n.spec.dns_enabled(), dns, "{spec}");
    }

    let cases = [
        ("{subnet: 10.77.4.1/24}", "spec.subnet", "host bits"),
        ("{subnet: 10.77.4.0/31}", "spec.subnet", "/8../30"),
        ("{subnet: 10.77.4.0}", "spec.subnet", "CIDR"),
        (
            "{subnet: 300.1.1.0/24}",
            "spec.subnet",
            "not an IPv4 address",
        ),
        ("{mode: Bridge}", "spec.bridge", "existing host bridge"),
        (
            "{mode: Bridge, bridge: a-name-too-long0}",
            "spec.bridge",
            "15 bytes",
        ),
        (
            "{mode: Bridge, bridge: \"br 0\"}",
            "spec.bridge",
            "not an interface name",
        ),
        (
            "{mode: Bridge, bridge: \"a/b\"}",
            "spec.bridge",
            "not an interface name",
        ),
        (
            "{mode: NAT, bridge: br0}",
            "spec.bridge",
            "only for mode Bridge",
        ),
        (
            "{mode: Bridge, bridge: hth-lan}",
            "spec.bridge",
            "hearth's own",
        ),
        (
            // The kernel takes it; hearth's host side does not.
            "{mode: Bridge, bridge: \"br+0\"}",
            "spec.bridge",
            "ASCII letters, digits",
        ),
        (
            "{mode: Bridge, bridge: br0, dhcp: true}",
            "spec.dhcp",
            "no DHCP",
        ),
        (
            "{mode: NAT, dhcp: false, dns: true}",
            "spec.dns",
            "handed to guests by hearth's DHCP",
        ),
        (
            "{mode: Bridge, bridge: br0, dns: true}",
            "spec.dns",
            "does not serve",
        ),
        ("{mode: Routed}", "spec.mode", "unknown variant"),
    ];
    for (spec, field, words) in cases {
        let e = parse_err(&network_yaml(spec));
        assert!(
            e.contains(&format!("VirtualNetwork \"lan\": {field}")) && e.contains(words),
            "{spec}: {e}"
        );
    }
}

#[test]
fn vm_interfaces_parse_with_defaults() {
    let objs = parse_documents(
        &vm_with_networks(
            "[{virtualNetworkName: lan, macAddress: \"52:54:00:00:00:01\", ipAddress: 10.77.0.20, ports: [{hostPort: 2222, guestPort: 22}]}, {virtualNetworkName: lab}]",
        ),
        "t",
    )
    .unwrap();
    let Object::VirtualMachine(vm) = &objs[0] else {
        panic!()
    };
    assert_eq!(vm.spec.networks.len(), 2);
    assert_eq!(vm.spec.networks[0].ports[0].protocol, Protocol::Tcp);
    assert_eq!(vm.spec.networks[1].mac_address, None);
    // A VM without networks serialises as before: its spec is unchanged.
    let plain = parse_documents(&vm_with_networks("[]"), "t").unwrap();
    assert!(plain[0].spec_json().get("networks").is_none());
}

#[test]
fn vm_interfaces_are_checked_field_by_field() {
    let nine = ["{virtualNetworkName: lan}"; 9].join(", ");
    let cases = [
        (format!("[{nine}]"), "spec.networks", "more than the 8"),
        ("[{virtualNetworkName: Lan}]".into(), "spec.networks[0].virtualNetworkName", "DNS label"),
        ("[{virtualNetworkName: lan, macAddress: \"01:00:5e:00:00:01\"}]".into(), "spec.networks[0].macAddress", "multicast"),
        ("[{virtualNetworkName: lan, macAddress: \"00:00:00:00:00:00\"}]".into(), "spec.networks[0].macAddress", "all zero"),
        ("[{virtualNetworkName: lan, macAddress: \"52:54:00:0\"}]".into(), "spec.networks[0].macAddress", "not a MAC"),
        ("[{virtualNetworkName: a, macAddress: \"52:54:00:00:00:01\"}, {virtualNetworkName: b, macAddress: \"52:54:00:00:00:01\"}]".into(), "spec.networks[1].macAddress", "spec.networks[0]"),
        ("[{virtualNetworkName: lan, ipAddress: 10.77.0}]".into(), "spec.networks[0].ipAddress", "not an IPv4"),
        ("[{virtualNetworkName: lan, ports: [{hostPort: 0, guestPort: 22}]}]".into(), "spec.networks[0].ports[0].hostPort", "1..65535"),
        ("[{virtualNetworkName: lan, ports: [{hostPort: 22, guestPort: 70000}]}]".into(), "spec.networks[0].ports[0].guestPort", "1..65535"),
        ("[{virtualNetworkName: lan, ports: [{hostPort: 22, guestPort: 22, hostAddress: localhost}]}]".into(), "spec.networks[0].ports[0].hostAddress", "not an IPv4"),
        ("[{virtualNetworkName: lan, ports: [{hostPort: 22, guestPort: 22, protocol: SCTP}]}]".into(), "spec.networks[0].ports[0].protocol", "unknown variant"),
        ("[{virtualNetworkName: a, ports: [{hostPort: 80, guestPort: 80}]}, {virtualNetworkName: b, ports: [{hostPort: 80, guestPort: 8080, protocol: TCP}]}]".into(), "spec.networks[1].ports[0].hostPort", "TCP 80 is already forwarded by spec.networks[0].ports[0]"),
    ];
    for (networks, field, words) in cases {
        let e = parse_err(&vm_with_networks(&networks));
        assert!(
            e.contains(&format!("VirtualMachine \"web\": {field}")) && e.contains(words),
            "{networks}: {e}"
        );
    }
    // The same port over the other protocol is another forward.
    let ok = parse_documents(
        &vm_with_networks(
            "[{virtualNetworkName: a, ports: [{hostPort: 53, guestPort: 53}, {hostPort: 53, guestPort: 53, protocol: UDP}]}]",
        ),
        "t",
    );
    assert!(ok.is_ok(), "{ok:?}");
}

#[test]
fn status_on_input_is_dropped_unread() {
    for status in [
        "{phase: Exploded, capacity: lots}",
        "not a mapping",
        "[1, 2]",
    ] {
        let text = format!(
            "apiVersion: hearth.dev/v1alpha1\nkind: VirtualDisk\nmetadata: {{name: d}}\nspec: {{size: 1Gi, source: {{blank: {{}}}}}}\nstatus: {status}\n"
        );
        let objs = parse_documents(&text, "t.yaml").unwrap_or_else(|e| panic!("{status}: {e}"));
        let Object::VirtualDisk(d) = &objs[0] else {
            panic!("not a disk")
        };
        assert!(d.status.is_none(), "{status}");
    }
}

#[test]
fn cloud_init_yaml_nested_too_deep_is_refused_before_it_is_parsed() {
    let nested = "{a: ".repeat(60_000);
    for (field, text) in [
        ("networkConfig", nested.clone()),
        ("userData", format!("#cloud-config\n{nested}")),
    ] {
        let value = serde_json::json!({
            "apiVersion": "hearth.dev/v1alpha1",
            "kind": "VirtualMachine",
            "metadata": {"name": "ci"},
            "spec": {"boot": {"kernel": "/k"}, "cloudInit": {field: text}},
        });
        let e = object_from_value(value, "items[0]").expect_err("too deep");
        assert_eq!(e.field, format!("spec.cloudInit.{field}"), "{e}");
        let line = if field == "userData" { 2 } else { 1 };
        assert_eq!(
            e.message,
            format!(
                "line {line}, column 129: lists and mappings nested more than 32 levels deep; not parsed"
            )
        );
    }
}

#[test]
fn more_objects_than_the_limit_in_items_are_refused() {
    let disk = serde_json::json!({
        "apiVersion": "hearth.dev/v1alpha1", "kind": "VirtualDisk",
        "metadata": {"name": "d"}, "spec": {"size": "1Gi", "source": {"blank": {}}},
    });
    let text = |n: usize| serde_json::json!({"items": vec![disk.clone(); n]}).to_string();
    assert_eq!(raw_documents(&text(10_000), "t").unwrap().len(), 10_000);
    let e = raw_documents(&text(10_001), "t").unwrap_err();
    assert_eq!(
        e.to_string(),
        "t: document 1: items: 10001 objects in this text, more than the 10000 allowed in one apply"
    );
}

#[test]
fn the_apply_request_body_is_items_of_valid_objects() {
    let body = serde_json::json!({"items": [{
        "apiVersion": "hearth.dev/v1alpha1", "kind": "VirtualDisk",
        "metadata": {"name": "d"}, "spec": {"size": "1Gi", "source": {"blank": {}}},
    }]});
    let objs = apply_request(body.to_string().as_bytes()).unwrap();
    assert_eq!(objs[0].name(), "d");
    for (body, expected) in [
        (&b"{"[..], "request body is not JSON: EOF while parsing"),
        (b"[1]", "request body must be {\"items\": [objects]}"),
        (
            b"{\"items\": {}}",
            "request body must be {\"items\": [objects]}",
        ),
        (
            b"{\"items\": [1]}",
            "items[0]: (document): is not a mapping",
        ),
    ] {
        let e = apply_request(body).unwrap_err().to_string();
        assert!(e.starts_with(expected), "{e}");
    }
    let deep = format!("{{\"items\": [{}]}}", "[".repeat(200));
    let e = apply_request(deep.as_bytes()).unwrap_err().to_string();
    assert!(e.contains("recursion limit exceeded"), "{e}");
}

fn boot_vm(boot: &str, disks: &[&str]) -> String {
    let mut text = format!(
        "apiVersion: hearth.dev/v1alpha1\nkind: VirtualMachine\nmetadata: {{name: demo}}\nspec:\n  boot: {boot}\n"
    );
    if !disks.is_empty() {
        text.push_str("  disks:\n");
        for d in disks {
            text.push_str(&format!("  - virtualDiskName: {d}\n"));
        }
    }
    text
}

#[test]
fn a_kernel_comes_from_a_file_or_an_image_never_both() {
    assert_accepted(&boot_vm("{kernelImage: ignite-kernel}", &["root"]));
    assert_accepted(&boot_vm("{cmdline: quiet}", &["root"]));
    assert_refused(
        &boot_vm("{kernel: /k, kernelImage: ignite-kernel}", &["root"]),
        "spec.boot.kernelImage",
    );
    assert_refused(
        &boot_vm("{kernelImage: Not_A_Name}", &["root"]),
        "spec.boot.kernelImage",
    );
    // An initrd goes with a kernel file; an image brings its own.
    assert_refused(
        &boot_vm("{kernelImage: k, initrd: /i}", &["root"]),
        "spec.boot.initrd",
    );
    // Without a kernel file the kernel is found through the first disk.
    assert_refused(&boot_vm("{kernelImage: k}", &[]), "spec.disks");
    assert_accepted(&boot_vm("{kernel: /k}", &[]));
}

fn files_disk(source: &str, files: &str) -> String {
    format!(
        "apiVersion: hearth.dev/v1alpha1\nkind: VirtualDisk\nmetadata: {{name: d}}\nspec:\n  source: {source}\n  files:\n{files}"
    )
}

#[test]
fn files_go_only_into_an_image_disk_with_plain_paths_and_one_source() {
    let image = "{virtualImage: root}";
    assert_accepted(&files_disk(
        image,
        "  - {path: /root/.ssh/authorized_keys, content: \"ssh-ed25519 AAAA\", mode: \"0600\"}\n  - {path: /etc/app.conf, source: /srv/app.conf}\n",
    ));
    assert_refused(
        &files_disk("{image: /srv/base.qcow2}", "  - {path: /a, content: x}\n"),
        "spec.files",
    );
    for bad in ["relative", "/", "/etc/../shadow", "/a/./b"] {
        assert_refused(
            &files_disk(image, &format!("  - {{path: \"{bad}\", content: x}}\n")),
            "spec.files[0].path",
        );
    }
    assert_refused(
        &files_disk(
            image,
            "  - {path: /a, content: x}\n  - {path: /a, content: y}\n",
        ),
        "spec.files[1].path",
    );
    assert_refused(
        &files_disk(image, "  - {path: /a}\n"),
        "spec.files[0].source",
    );
    assert_refused(
        &files_disk(image, "  - {path: /a, content: x, source: /b}\n"),
        "spec.files[0].source",
    );
    assert_refused(
        &files_disk(image, "  - {path: /a, source: relative}\n"),
        "spec.files[0].source",
    );
    for bad in ["\"999\"", "\"17777\"", "\"rw\"", "\"\""] {
        assert_refused(
            &files_disk(
                image,
                &format!("  - {{path: /a, content: x, mode: {bad}}}\n"),
            ),
            "spec.files[0].mode",
        );
    }
    assert_eq!(crate::parse_file_mode("0600"), Ok(0o600));
    assert_eq!(crate::parse_file_mode("4755"), Ok(0o4755));
}

#[test]
fn relative_file_sources_and_oci_paths_resolve_against_the_manifest_directory() {
    let text = format!(
        "{}---\n{}",
        files_disk(
            "{virtualImage: root}",
            "  - {path: /etc/motd, source: motd}\n"
        ),
        image_yaml("{oci: {layout: oci/debian, tag: \"12\"}}"),
    );
    let objs = parse_documents_in(&text, "t", Some(std::path::Path::new("/m"))).unwrap();
    let Object::VirtualDisk(d) = &objs[0] else {
        panic!()
    };
    assert_eq!(
        d.spec.files[0].source,
        Some(std::path::PathBuf::from("/m/motd"))
    );
    let Object::VirtualImage(i) = &objs[1] else {
        panic!()
    };
    let ImageSource::Oci(oci) = &i.spec.source else {
        panic!()
    };
    assert_eq!(oci.layout, Some(std::path::PathBuf::from("/m/oci/debian")));
}
