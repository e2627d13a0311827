//! `hearth ssh VM [-- COMMAND...]`: log in to a VM with the system's OpenSSH
//! client.
//!
//! The CLI only decides where to connect and as whom, from the VM (and, for a
//! port forward on every host address, its network) as the API shows them;
//! then it replaces itself with `ssh`, so the terminal, the exit status and
//! every ssh feature are ssh's own. See docs/cli.md.
//!
//! The decisions are pure functions of the objects ([`choose_route`],
//! [`forward_target`], [`cloud_init_user`], [`ssh_argv`]); [`run`] does the
//! two requests and the `exec`.

use std::io::Write;
use std::net::IpAddr;

use hearth_api::Kind;
use serde_json::Value;

use super::get::first_ip;
use crate::client::ApiClient;
use crate::output::{at, str_at, u64_at};

/// The port sshd listens on in the guest.
pub const SSH_PORT: u16 = 22;

#[derive(Debug, clap::Args)]
#[command(
    about = "Log in to a VM with ssh, or run one command there",
    after_help = "\
Where it connects: the first address in the VM's status.interfaces (hearth's
NAT and Isolated networks put the host on the VM's bridge, so the address is
reachable from the host), port 22. A VM without an address yet but with a TCP
port forward to guestPort 22 (spec.networks[*].ports) is reached through the
forward: its hostAddress, or the network's gateway (status.gateway) when the
forward listens on every host address, and its hostPort.

As whom: -l, else the user the VM's #cloud-config user data creates (the first
named entry of users:, else user:, else system_info.default_user.name), else
ssh's own default (your ~/.ssh/config, or your local user name). Keys in
spec.cloudInit.sshAuthorizedKeys go to the image's default user (debian on
Debian's cloud images); name that user with -l if the user data does not.

Everything else is ssh's: host keys are checked against ~/.ssh/known_hosts as
for any host (hearth does not see the guest's host key, so it cannot vouch for
it). -o options come first on ssh's command line, so they win over what hearth
derives. Words after -- are the remote command, passed as they are.

Examples:
  hearth ssh web
  hearth ssh web -l debian -i ~/.ssh/id_ed25519
  hearth ssh web -- uname -a
  hearth ssh web -o StrictHostKeyChecking=accept-new -- sudo systemctl status
  hearth ssh web --print -- uname -a      # show the ssh command, run nothing"
)]
pub struct Args {
    /// The VirtualMachine's name.
    #[arg(value_name = "VM", value_parser = super::parse_name)]
    pub name: String,
    /// Log in as USER (ssh -l); overrides the user from the VM's cloud-init.
    #[arg(short = 'l', long = "login", value_name = "USER")]
    pub login: Option<String>,
    /// The private key to log in with (ssh -i).
    #[arg(short = 'i', long = "identity", value_name = "KEY")]
    pub identity: Option<String>,
    /// Connect to this port instead of the one hearth picks (22, or the
    /// forward's hostPort).
    #[arg(short = 'p', long = "port", value_name = "PORT",
          value_parser = clap::value_parser!(u16).range(1..))]
    pub port: Option<u16>,
    /// An ssh option (ssh -o), such as StrictHostKeyChecking=accept-new;
    /// may be given several times.
    #[arg(short = 'o', long = "option", value_name = "OPTION")]
    pub options: Vec<String>,
    /// Print the ssh command line instead of running it.
    #[arg(long = "print", visible_alias = "dry-run")]
    pub print: bool,
    /// The command to run in the VM instead of a login shell (after --).
    #[arg(last = true, value_name = "COMMAND")]
    pub command: Vec<String>,
}

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum SshError {
    #[error(
        "VirtualMachine {vm:?} is not running (phase {phase}{}), so there is nothing to ssh to; {next}",
        last_error.as_deref().map(|e| format!(": {e}")).unwrap_or_default()
    )]
    NotRunning {
        vm: String,
        phase: String,
        last_error: Option<String>,
        /// What to do about it.
        next: String,
    },
    #[error(
        "VirtualMachine {vm:?} has no network interface (spec.networks is empty), so it has no \
         address to ssh to; add one on a VirtualNetwork (spec.networks: [{{virtualNetworkName: NAME}}])"
    )]
    NoNetworks { vm: String },
    #[error(
        "VirtualMachine {vm:?} has no interface yet (status.interfaces is empty: the host has not \
         attached its network interfaces) and no TCP port forward to guestPort 22; \
         see `hearth describe vm {vm}`"
    )]
    NotAttached { vm: String },
    #[error(
        "VirtualMachine {vm:?} has no address yet (no entry of status.interfaces has an ipAddress) \
         and no TCP port forward to guestPort 22; the guest may still be booting: try again once \
         it is up (`hearth wait vm {vm} --for agent` waits for that when it runs the guest agent), \
         or see `hearth describe vm {vm}`"
    )]
    NoAddress { vm: String },
    #[error("VirtualMachine {vm:?}: {field}: {value:?} is not an IP address")]
    BadAddress {
        vm: String,
        field: String,
        value: String,
    },
    #[error("VirtualMachine {vm:?}: {field}: {value} is not a port (1..65535)")]
    BadPort {
        vm: String,
        field: String,
        value: String,
    },
    #[error(
        "VirtualMachine {vm:?}: {field} forwards host port {host_port} to guest port 22 on every \
         host address, but VirtualNetwork {network:?} {why}, so there is no address to reach it \
         on; wait with `hearth wait network {network} --for ready`, or give the forward a hostAddress"
    )]
    NoGateway {
        vm: String,
        field: String,
        host_port: u16,
        network: String,
        why: String,
    },
}

/// How to reach the guest's sshd, before any network is looked up.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Route {
    /// Straight to an interface's address, port 22.
    Interface { address: IpAddr },
    /// Through a port forward to guestPort 22.
    Forward {
        /// `spec.networks[i].ports[k]`, for messages.
        field: String,
        /// The interface's VirtualNetwork (whose gateway a forward without
        /// a host address is reached on).
        network: String,
        host_port: u16,
        host_address: Option<IpAddr>,
    },
}

/// Where ssh connects.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    pub address: IpAddr,
    pub port: u16,
}

/// Picks the route to a VM's sshd from the VM object (`GET
/// /v1/virtualmachines/NAME`): the first interface address, else the first
/// TCP forward to guest port 22.
pub fn choose_route(vm: &Value) -> Result<Route, SshError> {
    let name = str_at(vm, &["metadata", "name"]).unwrap_or("?").to_string();
    let phase = str_at(vm, &["status", "phase"]).unwrap_or("Pending");
    if phase != "Running" {
        let stopped = matches!(phase, "Stopped" | "Stopping");
        let next = match str_at(vm, &["spec", "runPolicy"]).unwrap_or("AlwaysOn") {
            "AlwaysOff" => format!(
                "its spec.runPolicy is AlwaysOff: set it to AlwaysOn, or to Manual and \
                 `hearth start {name}`"
            ),
            "Manual" if stopped => format!("start it with `hearth start {name}`"),
            _ => format!(
                "wait for it with `hearth wait vm {name} --for running` \
                 (`hearth describe vm {name}` says why it is not)"
            ),
        };
        return Err(SshError::NotRunning {
            vm: name,
            phase: phase.to_string(),
            last_error: str_at(vm, &["status", "lastError"]).map(str::to_string),
            next,
        });
    }
    let networks = at(vm, &["spec", "networks"])
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default();
    if networks.is_empty() {
        return Err(SshError::NoNetworks { vm: name });
    }
    if let Some((i, ip)) = first_ip(vm) {
        let address = ip.parse().map_err(|_| SshError::BadAddress {
            vm: name.clone(),
            field: format!("status.interfaces[{i}].ipAddress"),
            value: ip.to_string(),
        })?;
        return Ok(Route::Interface { address });
    }
    if let Some(route) = ssh_forward(&name, networks)? {
        return Ok(route);
    }
    let attached = at(vm, &["status", "interfaces"])
        .and_then(Value::as_array)
        .is_some_and(|a| !a.is_empty());
    Err(if attached {
        SshError::NoAddress { vm: name }
    } else {
        SshError::NotAttached { vm: name }
    })
}

/// The first TCP forward to guest port 22 in `spec.networks`, in order.
fn ssh_forward(vm: &str, networks: &[Value]) -> Result<Option<Route>, SshError> {
    for (i, nic) in networks.iter().enumerate() {
        let ports = nic
            .get("ports")
            .and_then(Value::as_array)
            .map(Vec::as_slice)
            .unwrap_or_default();
        for (k, p) in ports.iter().enumerate() {
            let tcp = str_at(p, &["protocol"]).is_none_or(|proto| proto == "TCP");
            if !tcp || u64_at(p, &["guestPort"]) != Some(u64::from(SSH_PORT)) {
                continue;
            }
            let field = format!("spec.networks[{i}].ports[{k}]");
            let host_port = p
                .get("hostPort")
                .and_then(Value::as_u64)
                .and_then(|n| u16::try_from(n).ok())
                .filter(|n| *n > 0)
                .ok_or_else(|| SshError::BadPort {
                    vm: vm.to_string(),
                    field: format!("{field}.hostPort"),
                    value: p.get("hostPort").map(Value::to_string).unwrap_or_default(),
                })?;
            let host_address = match str_at(p, &["hostAddress"]) {
                None => None,
                Some(a) => Some(a.parse().map_err(|_| SshError::BadAddress {
                    vm: vm.to_string(),
                    field: format!("{field}.hostAddress"),
                    value: a.to_string(),
                })?),
            };
            let network = str_at(nic, &["virtualNetworkName"])
                .unwrap_or("-")
                .to_string();
            return Ok(Some(Route::Forward {
                field,
                network,
                host_port,
                host_address,
            }));
        }
    }
    Ok(None)
}

/// Where a forward is reached: its host address, else the gateway of its
/// network (the host's address on the VM's bridge; a forward without an
/// address matches every local address but 127.0.0.1, see
/// docs/networking.md). `network` is the VirtualNetwork object, or
/// `None` when it does not exist.
pub fn forward_target(
    vm: &str,
    field: &str,
    host_port: u16,
    host_address: Option<IpAddr>,
    network_name: &str,
    network: Option<&Value>,
) -> Result<Target, SshError> {
    if let Some(address) = host_address {
        return Ok(Target {
            address,
            port: host_port,
        });
    }
    let no_gateway = |why: String| SshError::NoGateway {
        vm: vm.to_string(),
        field: field.to_string(),
        host_port,
        network: network_name.to_string(),
        why,
    };
    let Some(network) = network else {
        return Err(no_gateway("does not exist".to_string()));
    };
    let Some(gateway) = str_at(network, &["status", "gateway"]) else {
        let phase = str_at(network, &["status", "phase"]).unwrap_or("Pending");
        return Err(no_gateway(format!(
            "has no status.gateway yet (phase {phase})"
        )));
    };
    let address = gateway.parse().map_err(|_| {
        no_gateway(format!(
            "has a status.gateway {gateway:?} that is not an IP address"
        ))
    })?;
    Ok(Target {
        address,
        port: host_port,
    })
}

/// The user cloud-init creates, as `userData` names it, for logging in.
///
/// Only a `#cloud-config` document is read (a script, a MIME multipart or a
/// Jinja template names no user hearth could find). In order: the first entry
/// of `users:` that is a name other than `default` (a string, or a mapping
/// with `name`); else the default user's name, which cloud-init takes from
/// `user:` (a name, or a mapping with `name`) over
/// `system_info.default_user.name`. `None` when none of them is there, the
/// YAML does not parse, or the name is not a plausible login name.
pub fn cloud_init_user(user_data: &str) -> Option<String> {
    let first_line = user_data.lines().next()?;
    if !first_line.trim_end().starts_with("#cloud-config") {
        return None;
    }
    // Within the limits first: userData stored by an older hearthd was not.
    hearth_api::limits::check_yaml(user_data).ok()?;
    let doc: serde_yaml_ng::Value = serde_yaml_ng::from_str(user_data).ok()?;
    let name_of = |v: &serde_yaml_ng::Value| -> Option<String> {
        match v {
            serde_yaml_ng::Value::String(s) => Some(s.trim().to_string()),
            serde_yaml_ng::Value::Mapping(m) => {
                m.get("name").and_then(|n| n.as_str()).map(str::to_string)
            }
            _ => None,
        }
    };
    let listed: Vec<String> = match doc.get("users") {
        Some(serde_yaml_ng::Value::Sequence(list)) => list.iter().filter_map(name_of).collect(),
        // cloud-init also takes `users: "default, bob"`.
        Some(serde_yaml_ng::Value::String(s)) => {
            s.split(',').map(|n| n.trim().to_string()).collect()
        }
        _ => Vec::new(),
    };
    let from_users = listed.into_iter().find(|n| n != "default");
    let default_user = doc.get("user").and_then(name_of).or_else(|| {
        doc.get("system_info")
            .and_then(|s| s.get("default_user"))
            .and_then(|d| d.get("name"))
            .and_then(|n| n.as_str())
            .map(str::to_string)
    });
    from_users.or(default_user).filter(|n| is_login_name(n))
}

/// A name `useradd` would take: letters, digits, `.`, `_`, `-`, not
/// starting with `-`, at most 32 characters.
fn is_login_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 32
        && !name.starts_with('-')
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
}

/// The ssh command line: `ssh [-o OPTION]... [-l USER] [-i KEY] [-p PORT] --
/// ADDRESS [COMMAND...]`.
///
/// The user's `-o` options come first: ssh keeps the first value it is given
/// for a setting, so they win over the user and port hearth derives. `-p` is
/// left out for port 22 unless asked for, so a `Port` in ~/.ssh/config still
/// applies. `--` ends ssh's options before the address, so the remote command
/// is passed as it is, however its words begin.
pub fn ssh_argv(args: &Args, target: &Target, user: Option<&str>) -> Vec<String> {
    let mut argv = vec!["ssh".to_string()];
    for option in &args.options {
        argv.extend(["-o".to_string(), option.clone()]);
    }
    if let Some(user) = args.login.as_deref().or(user) {
        argv.extend(["-l".to_string(), user.to_string()]);
    }
    if let Some(key) = &args.identity {
        argv.extend(["-i".to_string(), key.clone()]);
    }
    match args.port {
        Some(port) => argv.extend(["-p".to_string(), port.to_string()]),
        None if target.port != SSH_PORT => {
            argv.extend(["-p".to_string(), target.port.to_string()]);
        }
        None => {}
    }
    argv.push("--".to_string());
    argv.push(target.address.to_string());
    argv.extend(args.command.iter().cloned());
    argv
}

/// A word as a POSIX shell would read it back: as it is when it is plain,
/// else in single quotes.
pub fn shell_quote(word: &str) -> String {
    let plain = !word.is_empty()
        && word
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "@%+=:,./_-".contains(c));
    if plain {
        word.to_string()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

/// Looks the VM (and, when needed, its network) up and builds the ssh
/// command line.
pub async fn plan(client: &ApiClient, args: &Args) -> anyhow::Result<Vec<String>> {
    let vm = client
        .get(&super::object_path(Kind::VirtualMachine, &args.name))
        .await?;
    let target = match choose_route(&vm)? {
        Route::Interface { address } => Target {
            address,
            port: SSH_PORT,
        },
        Route::Forward {
            field,
            network,
            host_port,
            host_address,
        } => {
            let object = match host_address {
                Some(_) => None,
                None => match client
                    .get(&super::object_path(Kind::VirtualNetwork, &network))
                    .await
                {
                    Ok(object) => Some(object),
                    Err(e) if e.is_not_found() => None,
                    Err(e) => return Err(e.into()),
                },
            };
            forward_target(
                &args.name,
                &field,
                host_port,
                host_address,
                &network,
                object.as_ref(),
            )?
        }
    };
    let user = if args.login.is_some() {
        None
    } else {
        str_at(&vm, &["spec", "cloudInit", "userData"]).and_then(cloud_init_user)
    };
    Ok(ssh_argv(args, &target, user.as_deref()))
}

pub async fn run(client: &ApiClient, args: &Args) -> anyhow::Result<()> {
    let argv = plan(client, args).await?;
    if args.print {
        let line: Vec<String> = argv.iter().map(|w| shell_quote(w)).collect();
        let mut out = std::io::stdout().lock();
        writeln!(out, "{}", line.join(" "))?;
        return Ok(());
    }
    exec(&argv)
}

/// Replaces this process with ssh; returns only if that fails.
fn exec(argv: &[String]) -> anyhow::Result<()> {
    use std::os::unix::process::CommandExt;
    let Some((program, rest)) = argv.split_first() else {
        anyhow::bail!("no ssh command to run");
    };
    let e = std::process::Command::new(program).args(rest).exec();
    if e.kind() == std::io::ErrorKind::NotFound {
        anyhow::bail!(
            "cannot run {program}: it is not on PATH (install the OpenSSH client: apt-get install openssh-client)"
        );
    }
    anyhow::bail!("cannot run {program}: {e}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn args(extra: &[&str]) -> Args {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            ssh: Args,
        }
        let argv = ["ssh", "web"].iter().chain(extra).copied();
        Cli::try_parse_from(argv).expect("parses").ssh
    }

    fn vm(spec: Value, status: Value) -> Value {
        json!({"metadata": {"name": "web"}, "spec": spec, "status": status})
    }

    fn net(name: &str, ports: Value) -> Value {
        json!({"virtualNetworkName": name, "ports": ports})
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("ip")
    }

    #[test]
    fn the_first_interface_with_an_address_wins_over_a_forward() {
        let v = vm(
            json!({"networks": [net("lan", json!([{"hostPort": 2222, "guestPort": 22}])), net("wan", json!([]))]}),
            json!({"phase": "Running", "interfaces": [
                {"network": "lan", "mac": "52:54:00:00:00:01"},
                {"network": "wan", "mac": "52:54:00:00:00:02", "ipAddress": "10.77.0.23"},
            ]}),
        );
        assert_eq!(
            choose_route(&v),
            Ok(Route::Interface {
                address: ip("10.77.0.23")
            })
        );
    }

    #[test]
    fn without_an_address_the_first_tcp_forward_to_port_22_is_used() {
        let v = vm(
            json!({"networks": [
                net("a", json!([{"hostPort": 8080, "guestPort": 80},
                                {"hostPort": 2200, "guestPort": 22, "protocol": "UDP"}])),
                net("b", json!([{"hostPort": 2222, "guestPort": 22, "protocol": "TCP", "hostAddress": "192.0.2.7"},
                                {"hostPort": 2223, "guestPort": 22}])),
            ]}),
            json!({"phase": "Running"}),
        );
        assert_eq!(
            choose_route(&v),
            Ok(Route::Forward {
                field: "spec.networks[1].ports[0]".into(),
                network: "b".into(),
                host_port: 2222,
                host_address: Some(ip("192.0.2.7")),
            })
        );
    }

    #[test]
    fn a_forward_without_a_host_address_goes_to_the_networks_gateway() {
        let gw = json!({"status": {"phase": "Ready", "gateway": "10.77.0.1"}});
        assert_eq!(
            forward_target(
                "web",
                "spec.networks[0].ports[0]",
                2222,
                None,
                "lan",
                Some(&gw)
            ),
            Ok(Target {
                address: ip("10.77.0.1"),
                port: 2222
            })
        );
        // A host address needs no network at all.
        assert_eq!(
            forward_target("web", "f", 2222, Some(ip("192.0.2.7")), "lan", None),
            Ok(Target {
                address: ip("192.0.2.7"),
                port: 2222
            })
        );
        let pending = json!({"status": {"phase": "Pending"}});
        let err = forward_target(
            "web",
            "spec.networks[0].ports[0]",
            2222,
            None,
            "lan",
            Some(&pending),
        )
        .expect_err("no gateway")
        .to_string();
        assert!(
            err.starts_with(
                "VirtualMachine \"web\": spec.networks[0].ports[0] forwards host port 2222 to guest port 22 on every host address, but VirtualNetwork \"lan\" has no status.gateway yet (phase Pending)"
            ),
            "{err}"
        );
        assert!(err.contains("hearth wait network lan --for ready"), "{err}");
        let err = forward_target("web", "f", 2222, None, "lan", None)
            .expect_err("no network")
            .to_string();
        assert!(
            err.contains("VirtualNetwork \"lan\" does not exist"),
            "{err}"
        );
        let odd = json!({"status": {"gateway": "gw.example"}});
        let err = forward_target("web", "f", 2222, None, "lan", Some(&odd))
            .expect_err("bad gateway")
            .to_string();
        assert!(
            err.contains("\"gw.example\" that is not an IP address"),
            "{err}"
        );
    }

    #[test]
    fn a_vm_that_is_not_running_is_refused_with_its_phase_and_how_to_wait() {
        let v = vm(
            json!({"networks": [net("lan", json!([]))]}),
            json!({"phase": "Failed", "lastError": "qemu exited", "interfaces": [
                {"network": "lan", "mac": "m", "ipAddress": "10.77.0.23"}]}),
        );
        let err = choose_route(&v).expect_err("failed VM");
        assert_eq!(
            err.to_string(),
            "VirtualMachine \"web\" is not running (phase Failed: qemu exited), so there is nothing to ssh to; \
             wait for it with `hearth wait vm web --for running` (`hearth describe vm web` says why it is not)"
        );
        // No status at all: Pending.
        let new = json!({"metadata": {"name": "web"}, "spec": {}});
        assert!(matches!(
            choose_route(&new),
            Err(SshError::NotRunning { ref phase, last_error: None, .. }) if phase == "Pending"
        ));
        // What to do depends on the run policy.
        let stopped = |policy: &str| {
            vm(
                json!({"runPolicy": policy, "networks": [net("lan", json!([]))]}),
                json!({"phase": "Stopped"}),
            )
        };
        assert_eq!(
            choose_route(&stopped("AlwaysOff"))
                .expect_err("off")
                .to_string(),
            "VirtualMachine \"web\" is not running (phase Stopped), so there is nothing to ssh to; \
             its spec.runPolicy is AlwaysOff: set it to AlwaysOn, or to Manual and `hearth start web`"
        );
        assert!(
            choose_route(&stopped("Manual"))
                .expect_err("manual")
                .to_string()
                .ends_with("; start it with `hearth start web`")
        );
        assert!(
            choose_route(&stopped("AlwaysOn"))
                .expect_err("on")
                .to_string()
                .contains("`hearth wait vm web --for running`")
        );
    }

    #[test]
    fn a_running_vm_without_networks_interfaces_or_addresses_says_which() {
        let none = vm(json!({}), json!({"phase": "Running"}));
        assert_eq!(
            choose_route(&none),
            Err(SshError::NoNetworks { vm: "web".into() })
        );
        assert!(
            choose_route(&none)
                .expect_err("no networks")
                .to_string()
                .contains("spec.networks is empty")
        );
        // Ports to something else do not help.
        let spec = json!({"networks": [net("lan", json!([{"hostPort": 8080, "guestPort": 80}]))]});
        assert_eq!(
            choose_route(&vm(spec.clone(), json!({"phase": "Running"}))),
            Err(SshError::NotAttached { vm: "web".into() })
        );
        let waiting = vm(
            spec,
            json!({"phase": "Running", "interfaces": [{"network": "lan", "mac": "m"}]}),
        );
        let err = choose_route(&waiting).expect_err("no address");
        assert_eq!(err, SshError::NoAddress { vm: "web".into() });
        assert!(
            err.to_string().contains("hearth wait vm web --for agent")
                && err.to_string().contains("hearth describe vm web"),
            "{err}"
        );
    }

    #[test]
    fn addresses_and_ports_from_the_daemon_are_checked_before_ssh_sees_them() {
        let v = vm(
            json!({"networks": [net("lan", json!([]))]}),
            json!({"phase": "Running", "interfaces": [{"network": "lan", "mac": "m", "ipAddress": "-oProxyCommand=x"}]}),
        );
        assert_eq!(
            choose_route(&v).expect_err("bad").to_string(),
            "VirtualMachine \"web\": status.interfaces[0].ipAddress: \"-oProxyCommand=x\" is not an IP address"
        );
        let v = vm(
            json!({"networks": [net("lan", json!([{"hostPort": 70000, "guestPort": 22}]))]}),
            json!({"phase": "Running"}),
        );
        assert_eq!(
            choose_route(&v).expect_err("bad port").to_string(),
            "VirtualMachine \"web\": spec.networks[0].ports[0].hostPort: 70000 is not a port (1..65535)"
        );
    }

    #[test]
    fn the_login_user_comes_from_the_cloud_config() {
        let cases = [
            // The first named entry of users:, skipping "default".
            (
                "#cloud-config\nusers:\n  - default\n  - name: alice\n    sudo: ALL=(ALL) NOPASSWD:ALL\n  - name: bob\n",
                Some("alice"),
            ),
            ("#cloud-config\nusers: [default, carol]\n", Some("carol")),
            (
                "#cloud-config\nusers:\n  - {groups: wheel}\n  - name: dave\n",
                Some("dave"),
            ),
            ("#cloud-config\nusers: \"default, erin\"\n", Some("erin")),
            // Only the default user: its name, from user: over system_info.
            (
                "#cloud-config\nusers: [default]\nuser: frank\n",
                Some("frank"),
            ),
            (
                "#cloud-config\nuser: {name: grace, shell: /bin/bash}\n",
                Some("grace"),
            ),
            (
                "#cloud-config\nsystem_info:\n  default_user:\n    name: heidi\n",
                Some("heidi"),
            ),
            (
                "#cloud-config\nuser: ivan\nsystem_info: {default_user: {name: heidi}}\n",
                Some("ivan"),
            ),
            // users: wins over the default user's name.
            (
                "#cloud-config\nusers: [default, judy]\nuser: ivan\n",
                Some("judy"),
            ),
            // Nothing named.
            ("#cloud-config\nruncmd: [[touch, /x]]\n", None),
            ("#cloud-config\nusers: [default]\n", None),
            ("#cloud-config\n", None),
            // Not a cloud-config: a script, a template, bad YAML.
            ("#!/bin/sh\nuseradd mallory\n", None),
            ("## template: jinja\n#cloud-config\nuser: x\n", None),
            ("#cloud-config\nusers: [unclosed\n", None),
            ("", None),
            // A name no login could have.
            ("#cloud-config\nuser: \"-oProxyCommand=x\"\n", None),
            ("#cloud-config\nuser: \"a b\"\n", None),
            ("#cloud-config\nuser: 42\n", None),
        ];
        for (data, want) in cases {
            assert_eq!(cloud_init_user(data).as_deref(), want, "{data:?}");
        }
        // CRLF line ends, as an editor on another system may write them.
        assert_eq!(
            cloud_init_user("#cloud-config\r\nuser: kim\r\n").as_deref(),
            Some("kim")
        );
    }

    #[test]
    fn ssh_argv_puts_options_first_and_ends_them_before_the_address() {
        let direct = Target {
            address: ip("10.77.0.23"),
            port: 22,
        };
        assert_eq!(
            ssh_argv(&args(&["--", "uname", "-a"]), &direct, Some("debian")),
            ["ssh", "-l", "debian", "--", "10.77.0.23", "uname", "-a"]
        );
        assert_eq!(
            ssh_argv(&args(&[]), &direct, None),
            ["ssh", "--", "10.77.0.23"]
        );
        let forward = Target {
            address: ip("10.77.0.1"),
            port: 2222,
        };
        assert_eq!(
            ssh_argv(
                &args(&[
                    "-l",
                    "root",
                    "-i",
                    "/k/id",
                    "-o",
                    "StrictHostKeyChecking=accept-new",
                    "-o",
                    "ConnectTimeout=5"
                ]),
                &forward,
                Some("debian")
            ),
            [
                "ssh",
                "-o",
                "StrictHostKeyChecking=accept-new",
                "-o",
                "ConnectTimeout=5",
                "-l",
                "root",
                "-i",
                "/k/id",
                "-p",
                "2222",
                "--",
                "10.77.0.1"
            ]
        );
        // -p wins over the port hearth picked, and is kept when it is 22.
        assert_eq!(
            ssh_argv(&args(&["-p", "22"]), &forward, None),
            ["ssh", "-p", "22", "--", "10.77.0.1"]
        );
    }

    #[test]
    fn the_command_line_parses_and_refuses_what_it_should() {
        let a = args(&[
            "-l", "u", "-p", "2200", "--print", "--", "ls", "-la", "--", "x",
        ]);
        assert_eq!(a.name, "web");
        assert_eq!(a.login.as_deref(), Some("u"));
        assert_eq!(a.port, Some(2200));
        assert!(a.print);
        assert_eq!(a.command, ["ls", "-la", "--", "x"]);
        assert!(args(&["--dry-run"]).print);
        use clap::Parser;
        #[derive(Debug, Parser)]
        struct Cli {
            #[command(flatten)]
            ssh: Args,
        }
        for bad in [
            &["ssh", "web", "-p", "0"][..],
            &["ssh", "web", "-p", "65536"],
            &["ssh", "Web"],
            // The remote command only after --.
            &["ssh", "web", "uname"],
        ] {
            assert!(Cli::try_parse_from(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn printed_words_read_back_in_a_shell() {
        assert_eq!(shell_quote("10.77.0.23"), "10.77.0.23");
        assert_eq!(
            shell_quote("StrictHostKeyChecking=accept-new"),
            "StrictHostKeyChecking=accept-new"
        );
        assert_eq!(shell_quote("echo hi"), "'echo hi'");
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
        assert_eq!(shell_quote(""), "''");
        assert_eq!(shell_quote("$HOME"), "'$HOME'");
    }

    #[tokio::test]
    async fn plan_asks_for_the_network_only_for_a_forward_without_a_host_address() {
        use crate::test_server::{ScriptedServer, ok};
        let dir = tempfile::tempdir().expect("tempdir");
        let forwarded = vm(
            json!({"networks": [net("lan", json!([{"hostPort": 2222, "guestPort": 22}]))],
                   "cloudInit": {"userData": "#cloud-config\nuser: debian\n"}}),
            json!({"phase": "Running"}),
        );
        let server = ScriptedServer::routes(
            dir.path(),
            vec![
                (
                    "GET",
                    "/v1/virtualmachines/web",
                    vec![ok(&forwarded.to_string())],
                ),
                (
                    "GET",
                    "/v1/virtualnetworks/lan",
                    vec![ok(
                        r#"{"metadata": {"name": "lan"}, "status": {"phase": "Ready", "gateway": "10.77.0.1"}}"#,
                    )],
                ),
            ],
        );
        let client = ApiClient::new(&server.socket);
        let argv = plan(&client, &args(&["--", "true"])).await.expect("plan");
        assert_eq!(
            argv,
            [
                "ssh",
                "-l",
                "debian",
                "-p",
                "2222",
                "--",
                "10.77.0.1",
                "true"
            ]
        );
        let paths: Vec<String> = server.seen().into_iter().map(|s| s.path).collect();
        assert_eq!(
            paths,
            ["/v1/virtualmachines/web", "/v1/virtualnetworks/lan"]
        );
    }
}
