//! Port forwards from the host to VMs: one host port, protocol and address
//! belongs to one VM.
//!
//! A forward without `hostAddress` listens on every host address, so it
//! clashes with any forward of the same port and protocol; two with
//! different addresses do not clash.

use std::net::Ipv4Addr;

use hearth_api::{Protocol, VirtualMachine};

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Forward {
    pub vm: String,
    /// `spec.networks[i].ports[k]`: how an error names it.
    pub field: String,
    pub host_port: u32,
    pub protocol: Protocol,
    pub host_address: Option<Ipv4Addr>,
}

impl Forward {
    pub fn clashes(&self, other: &Forward) -> bool {
        self.host_port == other.host_port
            && self.protocol == other.protocol
            && match (self.host_address, other.host_address) {
                (Some(a), Some(b)) => a == b,
                _ => true,
            }
    }

    fn listen(&self) -> String {
        match self.host_address {
            Some(a) => format!("{} {a}:{}", self.protocol, self.host_port),
            None => format!("{} port {}", self.protocol, self.host_port),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "{field}: host {listen} is already forwarded to VirtualMachine {other_vm:?} ({other_field})"
)]
pub struct PortConflict {
    pub vm: String,
    pub field: String,
    pub listen: String,
    pub other_vm: String,
    pub other_field: String,
}

/// The forwards of a VM's spec. Addresses were validated with the object;
/// one that does not parse here listens nowhere and is left out.
pub fn forwards_of(vm: &VirtualMachine) -> Vec<Forward> {
    let mut out = Vec::new();
    for (i, nic) in vm.spec.networks.iter().enumerate() {
        for (k, p) in nic.ports.iter().enumerate() {
            let host_address = match &p.host_address {
                Some(a) => match a.parse() {
                    Ok(a) => Some(a),
                    Err(_) => continue,
                },
                None => None,
            };
            out.push(Forward {
                vm: vm.metadata.name.clone(),
                field: format!("spec.networks[{i}].ports[{k}].hostPort"),
                host_port: p.host_port,
                protocol: p.protocol,
                host_address,
            });
        }
    }
    out
}

/// The first forward of `mine` that clashes with one of another VM.
pub fn check(mine: &[Forward], others: &[Forward]) -> Result<(), PortConflict> {
    for f in mine {
        if let Some(o) = others.iter().find(|o| o.vm != f.vm && f.clashes(o)) {
            return Err(PortConflict {
                vm: f.vm.clone(),
                field: f.field.clone(),
                listen: f.listen(),
                other_vm: o.vm.clone(),
                other_field: o.field.clone(),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fwd(vm: &str, port: u32, protocol: Protocol, addr: Option<&str>) -> Forward {
        Forward {
            vm: vm.into(),
            field: "spec.networks[0].ports[0].hostPort".into(),
            host_port: port,
            protocol,
            host_address: addr.map(|a| a.parse().expect("test address")),
        }
    }

    #[test]
    fn a_taken_port_names_the_vm_that_has_it() {
        let others = vec![fwd("web", 2222, Protocol::Tcp, None)];
        let e = check(
            &[fwd("db", 2222, Protocol::Tcp, Some("127.0.0.1"))],
            &others,
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "spec.networks[0].ports[0].hostPort: host TCP 127.0.0.1:2222 is already forwarded to VirtualMachine \"web\" (spec.networks[0].ports[0].hostPort)"
        );
        assert_eq!(e.other_vm, "web");
    }

    #[test]
    fn other_protocols_addresses_and_the_vm_itself_do_not_clash() {
        let others = vec![
            fwd("web", 53, Protocol::Udp, None),
            fwd("web", 80, Protocol::Tcp, Some("127.0.0.1")),
        ];
        assert!(check(&[fwd("db", 53, Protocol::Tcp, None)], &others).is_ok());
        assert!(check(&[fwd("db", 80, Protocol::Tcp, Some("127.0.0.2"))], &others).is_ok());
        assert!(check(&[fwd("db", 80, Protocol::Tcp, None)], &others).is_err());
        // A VM re-applied with its own forwards is not in its own way.
        assert!(check(&[fwd("web", 53, Protocol::Udp, None)], &others).is_ok());
    }
}
