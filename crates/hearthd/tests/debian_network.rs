//! A real distribution on a hearth network: the Debian 12 test image boots
//! from its disk with a NIC on a NAT network, cloud-init configures DHCP on
//! it from hearth's seed (no networkConfig given), the agent confirms the
//! leased address, and `hearth ssh` logs in with the key cloud-init
//! installed, directly and through the forwarded port. hearthd and the
//! test's ssh run inside a namespace the test creates; no packet leaves it.
//! One Debian boot.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::debian::*;
use common::*;
use serde_json::json;

fn keypair(dir: &Path) -> (std::path::PathBuf, String) {
    let key = dir.join("id_ed25519");
    let out = Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "", "-C", "hearth-test", "-f"])
        .arg(&key)
        .output()
        .expect("ssh-keygen (apt-get install openssh-client)");
    assert!(out.status.success(), "ssh-keygen: {out:?}");
    let public = std::fs::read_to_string(key.with_extension("pub")).expect("public key");
    (key, public.trim().to_string())
}

/// `ssh -p 2222 HOST` inside the namespace: the guest's `$SSH_CONNECTION`
/// (client address, client port, server address, server port).
fn ssh_connection(d: &Daemon, key_arg: &str, user: &str, host: &str) -> Vec<String> {
    let mut args: Vec<&str> = vec!["-i", key_arg, "-p", "2222", "-l", user];
    args.extend(SSH_OPTS);
    args.extend([host, "echo $SSH_CONNECTION"]);
    let out = d.in_netns("ssh", &args);
    assert!(
        out.status.success(),
        "ssh -p 2222 {host}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .map(str::to_owned)
        .collect()
}

#[test]
fn hearth_ssh_reaches_a_debian_guest_configured_by_cloud_init() {
    let _serial = serial();
    let (image, _) = debian_image();
    let user = default_user();
    let keys = tempfile::tempdir().expect("tempdir");
    let (key, public) = keypair(keys.path());
    let image_dir = image.parent().expect("guest/out").to_path_buf();
    let d = Daemon::start_in_netns(&[&image_dir], &[]);
    let (status, v) = d.apply_json(vec![
        json!({"apiVersion": "hearth.dev/v1alpha1", "kind": "VirtualNetwork",
               "metadata": {"name": "lan"}, "spec": {"subnet": "10.77.0.0/24"}}),
        Image::file("debian-12", image.display().to_string()).json(),
        image_disk("deb-root", "debian-12", None),
        json!({"apiVersion": "hearth.dev/v1alpha1", "kind": "VirtualMachine",
               "metadata": {"name": "deb"},
               "spec": {"runPolicy": "AlwaysOn", "cpus": 1, "memory": "768Mi",
                        "stopTimeoutSeconds": 60,
                        "disks": [{"virtualDiskName": "deb-root"}],
                        "networks": [{"virtualNetworkName": "lan",
                                      "ports": [{"hostPort": 2222, "guestPort": 22}]}],
                        "cloudInit": {"sshAuthorizedKeys": [public]},
                        "guestAgent": true}}),
    ]);
    assert_eq!(status, 200, "apply: {v}");

    // cloud-init brought the NIC up with DHCP from the seed's network-config,
    // and the guest itself says it holds the leased address.
    let vm = d.wait_object(
        "virtualmachines",
        "deb",
        "its address confirmed by the agent",
        DEBIAN_BOOT_TIMEOUT,
        |v| v["status"]["interfaces"][0]["confirmed"] == true,
    );
    let ip = vm["status"]["interfaces"][0]["ipAddress"]
        .as_str()
        .expect("ipAddress")
        .to_string();
    assert!(ip.starts_with("10.77.0."), "{vm:#}");
    let route = d.agent_sh_ok("deb", "ip -4 route show default");
    assert!(route.contains("via 10.77.0.1"), "default route: {route}");

    // sshd accepts the key cloud-init installed; wait for it to listen.
    wait_guest(
        &d,
        "deb",
        "sshd listening",
        "ss -Htln | grep -q ':22 '",
        Duration::from_secs(120),
    );

    // `hearth ssh` picks the interface's address (no userData names a user:
    // the image's default one is given with -l).
    let key_arg = key.display().to_string();
    let printed = d.hearth_in_netns(
        &["ssh", "deb", "--print", "-i", &key_arg, "--", "true"],
        None,
    );
    let printed = String::from_utf8_lossy(&printed.stdout).into_owned();
    assert!(printed.contains(&format!("-- {ip} true")), "{printed}");
    let mut args = vec!["ssh", "deb", "-l", &user, "-i", &key_arg];
    args.extend(SSH_OPTS);
    args.extend(["--", "cat", "/etc/hostname"]);
    let out = d.hearth_in_netns(&args, None);
    assert!(
        out.status.success(),
        "hearth ssh: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "deb");

    // The forwarded port: the bridge's address, port 2222, reaches the
    // same sshd (the guest sees the connection from the gateway).
    let conn = ssh_connection(&d, &key_arg, &user, "10.77.0.1");
    assert_eq!(conn.get(2), Some(&ip), "{conn:?}");
    assert_eq!(conn.get(3).map(String::as_str), Some("22"), "{conn:?}");

    // And through 127.0.0.1:2222, where hearthd listens and copies the
    // connection; the guest sees it come from the gateway.
    let conn = ssh_connection(&d, &key_arg, &user, "127.0.0.1");
    assert_eq!(
        conn.first().map(String::as_str),
        Some("10.77.0.1"),
        "{conn:?}"
    );
    assert_eq!(conn.get(2), Some(&ip), "{conn:?}");
}
