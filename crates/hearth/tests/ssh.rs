//! `hearth ssh` end to end: the real binary against a scripted hearthd on a
//! unix socket, printing the ssh command line (`--print`) or exec'ing an
//! `ssh` found on PATH.

#[path = "../src/test_server.rs"]
#[allow(dead_code)]
mod test_server;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Output;

use serde_json::{Value, json};
use test_server::{ScriptedServer, ok};

const CLOUD_CONFIG: &str =
    "#cloud-config\nusers:\n  - default\n  - name: debian\n    sudo: ALL=(ALL) NOPASSWD:ALL\n";

fn vm(name: &str, networks: Value, status: Value) -> String {
    json!({
        "apiVersion": "hearth.dev/v1alpha1",
        "kind": "VirtualMachine",
        "metadata": {"name": name},
        "spec": {"networks": networks, "cloudInit": {"userData": CLOUD_CONFIG}},
        "status": status,
    })
    .to_string()
}

async fn hearth(socket: &Path, args: &[&str], path: Option<&Path>) -> Output {
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_hearth"));
    cmd.arg("--socket").arg(socket).args(args);
    cmd.env_remove("HEARTH_SOCKET");
    if let Some(path) = path {
        cmd.env("PATH", path);
    }
    cmd.output().await.expect("run hearth")
}

/// A scripted hearthd in `dir` answering `routes`, and what
/// `hearth ssh web --print -- uname -a` printed against it.
async fn print_uname(
    dir: &Path,
    routes: Vec<(&str, &str, Vec<test_server::Answer>)>,
) -> (ScriptedServer, Output) {
    let server = ScriptedServer::routes(dir, routes);
    let out = hearth(
        &server.socket,
        &["ssh", "web", "--print", "--", "uname", "-a"],
        None,
    )
    .await;
    (server, out)
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[tokio::test]
async fn ssh_print_connects_to_the_first_interface_address_as_the_cloud_init_user() {
    let dir = tempfile::tempdir().expect("tempdir");
    let object = vm(
        "web",
        json!([{"virtualNetworkName": "default", "ports": [{"hostPort": 2222, "guestPort": 22}]}]),
        json!({"phase": "Running", "interfaces": [
            {"network": "default", "mac": "52:54:00:12:34:56", "ipAddress": "10.77.0.23", "hostInterface": "htt-web-0"}
        ]}),
    );
    let (server, out) = print_uname(
        dir.path(),
        vec![("GET", "/v1/virtualmachines/web", vec![ok(&object)])],
    )
    .await;
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out), "ssh -l debian -- 10.77.0.23 uname -a\n");
    // The address was there: no network was looked up.
    let paths: Vec<String> = server.seen().into_iter().map(|s| s.path).collect();
    assert_eq!(paths, ["/v1/virtualmachines/web"]);

    // -l, -i, -p and -o reach ssh; words that need quoting are quoted.
    let out = hearth(
        &server.socket,
        &[
            "ssh",
            "web",
            "--dry-run",
            "-l",
            "root",
            "-i",
            "/keys/id web",
            "-p",
            "2200",
            "-o",
            "StrictHostKeyChecking=accept-new",
            "--",
            "echo",
            "it's here",
        ],
        None,
    )
    .await;
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        stdout(&out),
        "ssh -o StrictHostKeyChecking=accept-new -l root -i '/keys/id web' -p 2200 -- 10.77.0.23 echo 'it'\\''s here'\n"
    );
}

#[tokio::test]
async fn ssh_print_goes_through_a_forward_of_port_22_when_the_vm_has_no_address() {
    let dir = tempfile::tempdir().expect("tempdir");
    let no_address = json!({"phase": "Running", "interfaces": [
        {"network": "default", "mac": "52:54:00:12:34:56"}
    ]});
    // On every host address: reached on the network's gateway.
    let wildcard = vm(
        "web",
        json!([{"virtualNetworkName": "default", "ports": [
            {"hostPort": 8080, "guestPort": 80},
            {"hostPort": 2222, "guestPort": 22, "protocol": "TCP"}
        ]}]),
        no_address.clone(),
    );
    let network = json!({
        "apiVersion": "hearth.dev/v1alpha1", "kind": "VirtualNetwork",
        "metadata": {"name": "default"}, "spec": {"mode": "NAT"},
        "status": {"phase": "Ready", "bridge": "hth-default", "gateway": "10.77.0.1",
                   "subnet": "10.77.0.0/24", "leases": 1}
    })
    .to_string();
    let (server, out) = print_uname(
        dir.path(),
        vec![
            ("GET", "/v1/virtualmachines/web", vec![ok(&wildcard)]),
            ("GET", "/v1/virtualnetworks/default", vec![ok(&network)]),
        ],
    )
    .await;
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        stdout(&out),
        "ssh -l debian -p 2222 -- 10.77.0.1 uname -a\n"
    );
    let paths: Vec<String> = server.seen().into_iter().map(|s| s.path).collect();
    assert_eq!(
        paths,
        ["/v1/virtualmachines/web", "/v1/virtualnetworks/default"]
    );

    // On one host address: that address, and no network look-up.
    let dir2 = tempfile::tempdir().expect("tempdir");
    let pinned = vm(
        "web",
        json!([{"virtualNetworkName": "default", "ports": [
            {"hostPort": 2022, "guestPort": 22, "hostAddress": "192.0.2.10"}
        ]}]),
        json!({"phase": "Running"}),
    );
    let (server, out) = print_uname(
        dir2.path(),
        vec![("GET", "/v1/virtualmachines/web", vec![ok(&pinned)])],
    )
    .await;
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        stdout(&out),
        "ssh -l debian -p 2022 -- 192.0.2.10 uname -a\n"
    );
    assert_eq!(server.seen().len(), 1);
}

#[tokio::test]
async fn ssh_fails_clearly_for_a_vm_without_networks_an_unknown_vm_or_a_network_without_gateway() {
    let dir = tempfile::tempdir().expect("tempdir");
    let bare = json!({
        "apiVersion": "hearth.dev/v1alpha1", "kind": "VirtualMachine",
        "metadata": {"name": "web"}, "spec": {}, "status": {"phase": "Running"}
    })
    .to_string();
    let stopped = vm(
        "db",
        json!([{"virtualNetworkName": "default"}]),
        json!({"phase": "Stopped"}),
    );
    let forward_only = vm(
        "app",
        json!([{"virtualNetworkName": "lab", "ports": [{"hostPort": 2222, "guestPort": 22}]}]),
        json!({"phase": "Running"}),
    );
    let pending = json!({"metadata": {"name": "lab"}, "spec": {}, "status": {"phase": "Pending",
                         "message": "host networking is not wired yet"}})
    .to_string();
    let server = ScriptedServer::routes(
        dir.path(),
        vec![
            ("GET", "/v1/virtualmachines/web", vec![ok(&bare)]),
            ("GET", "/v1/virtualmachines/db", vec![ok(&stopped)]),
            ("GET", "/v1/virtualmachines/app", vec![ok(&forward_only)]),
            ("GET", "/v1/virtualnetworks/lab", vec![ok(&pending)]),
            (
                "GET",
                "/v1/virtualmachines/gone",
                vec![(
                    hyper::StatusCode::NOT_FOUND,
                    r#"{"error": "VirtualMachine \"gone\" not found"}"#.to_string(),
                )],
            ),
        ],
    );
    let cases = [
        (
            "web",
            "error: VirtualMachine \"web\" has no network interface (spec.networks is empty), so it has no address to ssh to; add one on a VirtualNetwork (spec.networks: [{virtualNetworkName: NAME}])\n",
        ),
        (
            "db",
            "error: VirtualMachine \"db\" is not running (phase Stopped), so there is nothing to ssh to; wait for it with `hearth wait vm db --for running` (`hearth describe vm db` says why it is not)\n",
        ),
        (
            "app",
            "error: VirtualMachine \"app\": spec.networks[0].ports[0] forwards host port 2222 to guest port 22 on every host address, but VirtualNetwork \"lab\" has no status.gateway yet (phase Pending), so there is no address to reach it on; wait with `hearth wait network lab --for ready`, or give the forward a hostAddress\n",
        ),
        ("gone", "error: VirtualMachine \"gone\" not found\n"),
    ];
    for (name, want) in cases {
        let out = hearth(
            &server.socket,
            &["ssh", name, "--print", "--", "uname", "-a"],
            None,
        )
        .await;
        assert_eq!(out.status.code(), Some(1), "{name}: {}", stderr(&out));
        assert_eq!(stdout(&out), "", "{name}");
        assert_eq!(stderr(&out), want, "{name}");
    }
}

/// Without --print hearth replaces itself with the `ssh` on PATH: here a
/// script that prints its arguments one per line and exits 7, so the test
/// sees exactly the argv ssh would get and that its exit status is ssh's.
#[tokio::test]
async fn ssh_execs_the_ssh_on_path_with_the_argv_and_its_exit_status_is_ssh_s() {
    let dir = tempfile::tempdir().expect("tempdir");
    let bin = dir.path().join("bin");
    std::fs::create_dir(&bin).expect("mkdir");
    let script = bin.join("ssh");
    std::fs::write(
        &script,
        "#!/bin/sh\nfor a in \"$@\"; do printf '[%s]\\n' \"$a\"; done\nexit 7\n",
    )
    .expect("write");
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let object = vm(
        "web",
        json!([{"virtualNetworkName": "default"}]),
        json!({"phase": "Running", "interfaces": [
            {"network": "default", "mac": "52:54:00:12:34:56", "ipAddress": "10.77.0.23"}
        ]}),
    );
    let server = ScriptedServer::routes(
        dir.path(),
        vec![("GET", "/v1/virtualmachines/web", vec![ok(&object)])],
    );
    // /bin for the script's own sh.
    let path = std::env::join_paths([bin.as_path(), Path::new("/bin"), Path::new("/usr/bin")])
        .expect("PATH");
    let out = hearth(
        &server.socket,
        &["ssh", "web", "--", "echo", "two words", "-x"],
        Some(Path::new(&path)),
    )
    .await;
    assert_eq!(out.status.code(), Some(7), "{}", stderr(&out));
    assert_eq!(
        stdout(&out),
        "[-l]\n[debian]\n[--]\n[10.77.0.23]\n[echo]\n[two words]\n[-x]\n"
    );

    // No ssh on PATH: the error says what to install.
    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).expect("mkdir");
    let out = hearth(&server.socket, &["ssh", "web"], Some(&empty)).await;
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        stderr(&out),
        "error: cannot run ssh: it is not on PATH (install the OpenSSH client: apt-get install openssh-client)\n"
    );
}
