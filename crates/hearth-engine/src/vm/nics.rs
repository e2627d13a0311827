//! A VM's network cards: waiting for its networks, fixing the interfaces a
//! QEMU gets (recorded with its launch), making their taps before QEMU opens
//! them, restarting the VM when its spec's networks change, and what its
//! status says about each interface (the lease, confirmed by the guest agent
//! when there is one).

use std::sync::Arc;
use std::time::Duration;

use hearth_api::{
    ConditionStatus, EventType, InterfaceStatus, Kind, NetworkMode, NetworkPhase, Object,
    VirtualMachine, VirtualNetworkStatus, set_condition,
};
use hearth_qemu::cmdline::NicAttachment;
use serde_json::Value;

use super::VmError;
use crate::context::Context;
use crate::network::desired::{self, Nic};
use crate::network::host::TapBackend;
use crate::network::{admission, names, sync};
use crate::runtime::{LaunchedInterface, RuntimeRecord};
use crate::store::StoreError;

/// The condition a running VM has while its QEMU runs with other networks
/// than its spec's.
pub const NETWORKS_IN_EFFECT: &str = "NetworksInEffect";

/// Longest wait for the agent's interface list; it answers at once.
const AGENT_CALL_TIMEOUT: Duration = Duration::from_secs(3);

/// Why the VM cannot start yet because of its networks, if it cannot: a
/// network missing, being deleted or not Ready, or an interface without the
/// lease it asks for yet (see [`desired::to_launch`]).
pub fn waiting_for(ctx: &Context, vm: &VirtualMachine) -> Result<Option<String>, StoreError> {
    let leases = ctx.store.leases()?;
    let mut bridge_mode = std::collections::BTreeMap::new();
    for (i, iface) in vm.spec.networks.iter().enumerate() {
        let net = &iface.virtual_network_name;
        let Some(stored) = ctx.store.get(Kind::VirtualNetwork, net)? else {
            return Ok(Some(format!(
                "spec.networks[{i}]: VirtualNetwork {net:?} does not exist yet"
            )));
        };
        if stored.deleting {
            return Ok(Some(format!(
                "spec.networks[{i}]: VirtualNetwork {net:?} is being deleted"
            )));
        }
        let status: VirtualNetworkStatus =
            serde_json::from_value(stored.status).unwrap_or_default();
        if status.phase != NetworkPhase::Ready {
            return Ok(Some(format!(
                "spec.networks[{i}]: VirtualNetwork {net:?} is not Ready yet ({}{})",
                status.phase,
                status.message.map(|m| format!(": {m}")).unwrap_or_default()
            )));
        }
        if let Object::VirtualNetwork(network) = stored.object {
            bridge_mode.insert(net.clone(), network.spec.mode == NetworkMode::Bridge);
        }
    }
    Ok(desired::to_launch(vm, &leases, |net| {
        !bridge_mode.get(net).copied().unwrap_or(false)
    })
    .err()
    .map(|e| e.to_string()))
}

/// The interfaces a QEMU of `vm` gets if it starts now: its spec's, each
/// with its stored lease. Called under the engine's address lock, and the
/// result recorded in the launch marker before the lock is let go: from then
/// on the lease plans keep these addresses for this QEMU.
pub fn to_launch(ctx: &Context, vm: &VirtualMachine) -> Result<Vec<LaunchedInterface>, VmError> {
    let leases = ctx.store.leases()?;
    let mut bridge_mode = std::collections::BTreeMap::new();
    for iface in &vm.spec.networks {
        let net = &iface.virtual_network_name;
        let mode = match ctx.store.get(Kind::VirtualNetwork, net) {
            Ok(Some(stored)) => match stored.object {
                Object::VirtualNetwork(n) => n.spec.mode,
                _ => NetworkMode::Nat,
            },
            Ok(None) => NetworkMode::Nat,
            Err(e) => return Err(e.into()),
        };
        bridge_mode.insert(net.clone(), mode == NetworkMode::Bridge);
    }
    Ok(desired::to_launch(vm, &leases, |net| {
        !bridge_mode.get(net).copied().unwrap_or(false)
    })?)
}

/// The taps of every VM in place, this launch's among them: a whole-host
/// resync, which makes the taps of the interfaces recorded in the launch
/// marker.
pub async fn prepare(ctx: &Context, launched: &[LaunchedInterface]) -> Result<(), VmError> {
    if launched.is_empty() {
        return Ok(());
    }
    let mut host = ctx.networking.lock().await;
    sync::resync(ctx, &mut host)
        .await
        .map(|_| ())
        .map_err(VmError::Taps)
}

/// QEMU's view of each launched interface, in guest order.
pub fn attachments(
    vm: &VirtualMachine,
    launched: &[LaunchedInterface],
) -> Vec<(Nic, NicAttachment)> {
    let effective = desired::in_effect(vm, Some(launched));
    let vhost = TapBackend::detect() == TapBackend::VhostNet;
    launched
        .iter()
        .enumerate()
        .map(|(i, l)| {
            let nic = Nic {
                network: l.spec.virtual_network_name.clone(),
                tap: names::tap_name(&vm.metadata.name, i as u32),
                mac: admission::mac_of(&effective, i)
                    .map(|m| m.to_string())
                    .unwrap_or_default(),
                ip: l.ip,
            };
            let attachment = NicAttachment {
                tap: nic.tap.clone(),
                mac: nic.mac.clone(),
                vhost,
            };
            (nic, attachment)
        })
        .collect()
}

/// Whether the VM's QEMU runs with other networks than its spec's: then it
/// is restarted to apply them (a record without interfaces never is).
pub fn networks_changed(vm: &VirtualMachine, record: &RuntimeRecord) -> bool {
    record
        .networks
        .as_ref()
        .is_some_and(|launched| desired::networks_changed(vm, launched))
}

/// Says, before the VM is stopped for a spec change, when that change is
/// one of its networks: an event, and a condition that stays until the new
/// QEMU runs. Until the old QEMU exits it keeps its taps, addresses and
/// forwards.
pub fn note_restart_for_networks(ctx: &Context, vm: &VirtualMachine, record: &RuntimeRecord) {
    if !networks_changed(vm, record) {
        return;
    }
    let name = &vm.metadata.name;
    ctx.set_vm_status(name, |s| {
        set_condition(
            &mut s.conditions,
            NETWORKS_IN_EFFECT,
            ConditionStatus::False,
            "RestartPending",
            "spec.networks changed: the VM is restarted to apply it; until its QEMU exits, that QEMU keeps the interfaces, addresses and port forwards it was started with",
            chrono::Utc::now(),
        );
    });
    ctx.event(
        Kind::VirtualMachine,
        name,
        EventType::Normal,
        "NetworksChanged",
        "spec.networks changed: restarting the VM so that its QEMU gets the new interfaces; the running QEMU keeps its taps, addresses and port forwards until it exits",
    );
}

/// A QEMU of the VM is gone: the networks it had and those of the spec plan
/// their leases again (its addresses are no longer pinned) and resync the
/// host (its old taps and forwards go, the spec's come).
pub fn qemu_gone(ctx: &Context, vm: &VirtualMachine, record: &RuntimeRecord) {
    let mut networks: Vec<&str> = vm
        .spec
        .networks
        .iter()
        .map(|n| n.virtual_network_name.as_str())
        .collect();
    networks.extend(
        record
            .networks
            .iter()
            .flatten()
            .map(|n| n.spec.virtual_network_name.as_str()),
    );
    networks.sort();
    networks.dedup();
    for n in networks {
        ctx.wake(Kind::VirtualNetwork, n);
    }
}

/// What the status says right after QEMU started with these NICs.
pub fn attached(nics: &[(Nic, NicAttachment)]) -> Vec<InterfaceStatus> {
    nics.iter()
        .map(|(nic, _)| InterfaceStatus {
            network: nic.network.clone(),
            mac: nic.mac.clone(),
            ip_address: nic.ip.map(|ip| ip.to_string()),
            host_interface: Some(nic.tap.clone()),
            guest_ip_addresses: Vec::new(),
            confirmed: None,
        })
        .collect()
}

/// For the start event: which data path the NICs use, and why.
pub fn describe_backend(nics: &[(Nic, NicAttachment)]) -> Option<String> {
    let (_, first) = nics.first()?;
    let taps: Vec<&str> = nics.iter().map(|(n, _)| n.tap.as_str()).collect();
    Some(if first.vhost {
        format!("NICs on {} with vhost-net", taps.join(", "))
    } else {
        format!(
            "NICs on {} with QEMU's own data path (no /dev/vhost-net on this host)",
            taps.join(", ")
        )
    })
}

/// The IPv4 addresses per MAC (lowercase) in a `guest-network-get-interfaces`
/// answer.
pub fn guest_addresses(answer: &Value) -> Vec<(String, Vec<String>)> {
    let Some(list) = answer.as_array() else {
        return Vec::new();
    };
    list.iter()
        .filter_map(|iface| {
            let mac = iface
                .get("hardware-address")?
                .as_str()?
                .to_ascii_lowercase();
            let ips = iface
                .get("ip-addresses")
                .and_then(Value::as_array)
                .map(|a| {
                    a.iter()
                        .filter(|ip| {
                            ip.get("ip-address-type").and_then(Value::as_str) == Some("ipv4")
                        })
                        .filter_map(|ip| Some(ip.get("ip-address")?.as_str()?.to_string()))
                        .collect()
                })
                .unwrap_or_default();
            Some((mac, ips))
        })
        .collect()
}

/// `interfaces` with what the guest reports merged in.
pub fn confirm(interfaces: &mut [InterfaceStatus], reported: &[(String, Vec<String>)]) {
    for iface in interfaces {
        let mac = iface.mac.to_ascii_lowercase();
        let ips = reported
            .iter()
            .find(|(m, _)| *m == mac)
            .map(|(_, ips)| ips.clone())
            .unwrap_or_default();
        iface.confirmed = Some(
            iface
                .ip_address
                .as_ref()
                .is_some_and(|want| ips.iter().any(|ip| ip == want)),
        );
        iface.guest_ip_addresses = ips;
    }
}

/// Asks the guest agent for its interfaces, if the channel is free right
/// now (a snapshot's freeze is never delayed by this), and merges the
/// answer into the VM's status. Returns when to ask again: until every
/// interface is confirmed, for a bounded time after the start; a restart of
/// the VM starts over.
pub async fn confirm_with_agent(ctx: &Arc<Context>, name: &str) -> Option<Duration> {
    let live = ctx.live_get(name)?;
    if !live
        .agent_connected
        .load(std::sync::atomic::Ordering::Relaxed)
    {
        return None;
    }
    let current: Vec<InterfaceStatus> = match ctx.store.get(Kind::VirtualMachine, name) {
        Ok(Some(stored)) => {
            serde_json::from_value::<hearth_api::VirtualMachineStatus>(stored.status)
                .map(|s| s.interfaces)
                .unwrap_or_default()
        }
        _ => return None,
    };
    if current.is_empty() || current.iter().all(|i| i.confirmed == Some(true)) {
        return None;
    }
    let answer = {
        let mut agent = live.agent.try_lock().ok()?;
        let client = agent.as_mut()?;
        match client
            .execute("guest-network-get-interfaces", None, AGENT_CALL_TIMEOUT)
            .await
        {
            Ok(v) => v,
            Err(e) => {
                tracing::debug!(vm = name, error = %e, "guest-network-get-interfaces");
                return None;
            }
        }
    };
    let reported = guest_addresses(&answer);
    let mut all_confirmed = false;
    let mut started = None;
    ctx.set_vm_status(name, |s| {
        confirm(&mut s.interfaces, &reported);
        all_confirmed = s.interfaces.iter().all(|i| i.confirmed == Some(true));
        started = s.start_time;
    });
    // A guest's DHCP client may still be on its way: ask again shortly,
    // for a bounded time after the start (a guest with its own static
    // configuration never confirms, and is not asked forever).
    let young = started
        .is_some_and(|t| chrono::Utc::now() - t < chrono::Duration::seconds(CONFIRM_WINDOW_SECS));
    (!all_confirmed && young).then_some(CONFIRM_RETRY)
}

/// How long after a start the agent is asked again until it confirms.
const CONFIRM_WINDOW_SECS: i64 = 300;
const CONFIRM_RETRY: Duration = Duration::from_secs(2);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_agents_answer_confirms_only_the_leased_address_on_that_mac() {
        let answer = serde_json::json!([
            {"name": "lo", "hardware-address": "00:00:00:00:00:00",
             "ip-addresses": [{"ip-address-type": "ipv4", "ip-address": "127.0.0.1", "prefix": 8}]},
            {"name": "eth0", "hardware-address": "02:AB:00:00:00:01",
             "ip-addresses": [
                {"ip-address-type": "ipv4", "ip-address": "10.77.0.10", "prefix": 24},
                {"ip-address-type": "ipv6", "ip-address": "fe80::1", "prefix": 64}]},
            {"name": "eth1", "hardware-address": "02:ab:00:00:00:02",
             "ip-addresses": [{"ip-address-type": "ipv4", "ip-address": "10.78.0.99", "prefix": 24}]}
        ]);
        let reported = guest_addresses(&answer);
        let mut ifaces = vec![
            InterfaceStatus {
                network: "a".into(),
                mac: "02:ab:00:00:00:01".into(),
                ip_address: Some("10.77.0.10".into()),
                ..Default::default()
            },
            InterfaceStatus {
                network: "b".into(),
                mac: "02:ab:00:00:00:02".into(),
                ip_address: Some("10.78.0.10".into()),
                ..Default::default()
            },
            InterfaceStatus {
                network: "c".into(),
                mac: "02:ab:00:00:00:03".into(),
                ip_address: Some("10.79.0.10".into()),
                ..Default::default()
            },
        ];
        confirm(&mut ifaces, &reported);
        assert_eq!(ifaces[0].confirmed, Some(true));
        assert_eq!(ifaces[0].guest_ip_addresses, ["10.77.0.10"]);
        assert_eq!(ifaces[1].confirmed, Some(false), "another address");
        assert_eq!(ifaces[1].guest_ip_addresses, ["10.78.0.99"]);
        assert_eq!(ifaces[2].confirmed, Some(false), "no such MAC in the guest");
        assert!(ifaces[2].guest_ip_addresses.is_empty());
    }
}
