//! A model of one network's host side across crashes, driven through the
//! real pure core: the lease plan over VMs with their networks in effect
//! (`plan_leases_in_effect`, `desired::vms_in_effect`), the desired state
//! (`desired::host_desired`, the dnsmasq config and hosts renderers) and the
//! dnsmasq decision and its steps (`dnsmasq::decide`, `dnsmasq::steps`,
//! `dnsmasq::record_after`). The host is simulated: the files, the record,
//! a dnsmasq that reads its hosts file at its start and whenever a pending
//! SIGHUP lands (at any later moment, or not before the daemon gives up
//! waiting), keeps every address it handed out until it restarts, and
//! guests that ask it for their address.
//!
//! Every step of a resync lands on its own, and hearthd may be killed
//! between any two. Checked after every operation: no address is held by
//! two running guests, and a running guest's address stays leased to it in
//! the store. After a last crash and one undisturbed resync: dnsmasq has
//! read the desired config and hosts, the record says so, and every running
//! guest that asks gets the address it was started with.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::net::Ipv4Addr;
use std::path::Path;

use hearth_api::{VirtualMachine, VirtualNetwork};
use proptest::prelude::*;

use super::desired::{self, StoredNetwork};
use super::host::dnsmasq::{self, DnsmasqFiles, Loaded, LoadedRecord, ProcId, Step};
use super::plan_leases_in_effect;
use crate::runtime::LaunchedInterface;
use crate::store::StoredLease;

const VMS: [&str; 4] = ["a", "b", "c", "d"];
/// Five guest addresses (.2 to .6): few enough that a released one is
/// handed out again soon.
const SUBNET: &str = "10.77.0.0/29";

fn network() -> VirtualNetwork {
    let doc = format!(
        "apiVersion: hearth.dev/v1alpha1\nkind: VirtualNetwork\nmetadata: {{name: lan}}\nspec: {{subnet: {SUBNET}}}\n"
    );
    match hearth_api::parse_documents(&doc, "model")
        .expect("network")
        .remove(0)
    {
        hearth_api::Object::VirtualNetwork(n) => n,
        other => panic!("not a network: {other:?}"),
    }
}

/// What a VM's spec says of its one possible interface: none, or one on
/// `lan` with an optional reservation (the last octet).
type Iface = Option<Option<u8>>;

fn vm(name: &str, iface: Iface) -> VirtualMachine {
    let networks = match iface {
        None => "[]".to_string(),
        Some(None) => "[{virtualNetworkName: lan}]".to_string(),
        Some(Some(last)) => {
            format!("[{{virtualNetworkName: lan, ipAddress: \"10.77.0.{last}\"}}]")
        }
    };
    let doc = format!(
        "apiVersion: hearth.dev/v1alpha1\nkind: VirtualMachine\nmetadata: {{name: {name}}}\nspec:\n  boot: {{kernel: /k}}\n  networks: {networks}\n"
    );
    match hearth_api::parse_documents(&doc, "model")
        .expect("vm")
        .remove(0)
    {
        hearth_api::Object::VirtualMachine(v) => v,
        other => panic!("not a vm: {other:?}"),
    }
}

#[derive(Clone, Debug)]
enum Op {
    /// `kubectl apply` of a new spec for the VM.
    Edit { vm: usize, iface: Iface },
    /// The network reconcile plans and writes the leases (one transaction).
    Plan,
    /// A launch is recorded (its marker, with the interfaces and their
    /// leases), if none is and the interfaces have their leases.
    Launch { vm: usize },
    /// Its QEMU is spawned: only after a resync that began once the launch
    /// was recorded has finished (the launch's own resync).
    Spawn { vm: usize },
    /// The VM's QEMU exits (stopped, restarted for its new spec, crashed),
    /// or a launch that never spawned is settled.
    QemuExits { vm: usize },
    /// A resync starts (it observes and decides) if none is under way.
    ResyncBegins,
    /// The next step of the resync under way; `lands` says whether a SIGHUP
    /// it waits for lands before it gives up.
    ResyncStep { lands: bool },
    /// A resync begins if none is under way, and `steps` of its steps are
    /// taken (it may not finish).
    Resync { steps: u8, lands: bool },
    /// A pending SIGHUP lands: dnsmasq rereads its hosts file.
    HupLands,
    /// The VM's guest asks for its address.
    GuestAsks { vm: usize },
    /// hearthd is killed: the resync under way stops where it is.
    Crash,
}

fn op() -> impl Strategy<Value = Op> {
    let iface = proptest::option::of(proptest::option::of(2u8..=6));
    prop_oneof![
        2 => (0..VMS.len(), iface).prop_map(|(vm, iface)| Op::Edit { vm, iface }),
        3 => Just(Op::Plan),
        3 => (0..VMS.len()).prop_map(|vm| Op::Launch { vm }),
        3 => (0..VMS.len()).prop_map(|vm| Op::Spawn { vm }),
        1 => (0..VMS.len()).prop_map(|vm| Op::QemuExits { vm }),
        2 => Just(Op::ResyncBegins),
        4 => any::<bool>().prop_map(|lands| Op::ResyncStep { lands }),
        4 => (0u8..8, any::<bool>()).prop_map(|(steps, lands)| Op::Resync { steps, lands }),
        2 => Just(Op::HupLands),
        4 => (0..VMS.len()).prop_map(|vm| Op::GuestAsks { vm }),
        1 => Just(Op::Crash),
    ]
}

/// The simulated dnsmasq process.
#[derive(Clone, Debug)]
struct Dnsmasq {
    id: ProcId,
    conf: String,
    /// The hosts file as it last read it.
    hosts: String,
    hup_pending: bool,
    /// How many times it logged `read HOSTS`.
    reads: u64,
    /// What it handed out (address -> MAC), kept until it restarts.
    handed_out: BTreeMap<Ipv4Addr, String>,
}

#[derive(Clone, Debug)]
struct Guest {
    mac: String,
    /// The address its DHCP client got, if any.
    holds: Option<Ipv4Addr>,
}

/// A resync under way: what it decided from, and the steps left.
#[derive(Clone, Debug)]
struct Run {
    want: Loaded,
    steps: VecDeque<Step>,
    running: Option<ProcId>,
    record: Option<LoadedRecord>,
    log_from: u64,
    /// Launches recorded when it began, not spawned yet.
    launches: BTreeSet<String>,
}

#[derive(Debug)]
struct Model {
    specs: BTreeMap<String, VirtualMachine>,
    launched: BTreeMap<String, Vec<LaunchedInterface>>,
    /// Launches whose resync has finished: their QEMU may be spawned.
    spawnable: BTreeSet<String>,
    leases: Vec<StoredLease>,
    guests: BTreeMap<String, Guest>,
    conf_file: String,
    hosts_file: String,
    lease_file: BTreeMap<Ipv4Addr, String>,
    record: Option<LoadedRecord>,
    dnsmasq: Option<Dnsmasq>,
    next_pid: u32,
    run: Option<Run>,
    network: VirtualNetwork,
    files: DnsmasqFiles,
}

impl Model {
    fn new() -> Model {
        Model {
            specs: VMS.iter().map(|n| (n.to_string(), vm(n, None))).collect(),
            launched: BTreeMap::new(),
            spawnable: BTreeSet::new(),
            leases: Vec::new(),
            guests: BTreeMap::new(),
            conf_file: String::new(),
            hosts_file: String::new(),
            lease_file: BTreeMap::new(),
            record: None,
            dnsmasq: None,
            next_pid: 100,
            run: None,
            network: network(),
            files: DnsmasqFiles::new("/run/hearth/networks/hth-lan"),
        }
    }

    fn vms_in_effect(&self) -> Vec<VirtualMachine> {
        let vms: Vec<VirtualMachine> = self.specs.values().cloned().collect();
        desired::running_first(desired::vms_in_effect(&vms, &self.launched), &self.launched)
    }

    /// The config and hosts dnsmasq must have, from the store.
    fn want(&self) -> Loaded {
        let nets = [StoredNetwork {
            network: &self.network,
            deleting: false,
            subnet: Some(SUBNET.parse().expect("subnet")),
        }];
        let host = desired::host_desired(
            &nets,
            &self.vms_in_effect(),
            &self.leases,
            Path::new("/etc/resolv.conf"),
        );
        let net = &host.networks[0];
        net.validate().expect("the desired state is valid");
        Loaded {
            conf: dnsmasq::render_config(net, &self.files),
            hosts: dnsmasq::render_hosts(&net.static_leases),
        }
    }

    fn mac(vm: &str) -> String {
        super::names::derived_mac(vm, 0).to_string()
    }

    fn apply(&mut self, op: &Op) -> Result<(), TestCaseError> {
        match *op {
            Op::Edit { vm: i, iface } => {
                self.specs.insert(VMS[i].to_string(), vm(VMS[i], iface));
            }
            Op::Plan => {
                let running: BTreeSet<String> = self.launched.keys().cloned().collect();
                let (leases, _) = plan_leases_in_effect(
                    "lan",
                    SUBNET.parse().expect("subnet"),
                    false,
                    &self.vms_in_effect(),
                    &running,
                    &self.leases,
                );
                let ips: BTreeSet<Ipv4Addr> = leases.iter().map(|l| l.ip).collect();
                prop_assert_eq!(ips.len(), leases.len(), "an address leased twice");
                self.leases = leases;
            }
            Op::Launch { vm: i } => {
                let name = VMS[i];
                if !self.launched.contains_key(name)
                    && let Ok(l) = desired::to_launch(&self.specs[name], &self.leases, |_| true)
                {
                    self.launched.insert(name.to_string(), l);
                }
            }
            Op::Spawn { vm: i } => {
                let name = VMS[i];
                let has_nic = self.launched.get(name).is_some_and(|l| !l.is_empty());
                if has_nic && self.spawnable.remove(name) {
                    self.guests.insert(
                        name.to_string(),
                        Guest {
                            mac: Self::mac(name),
                            holds: None,
                        },
                    );
                }
            }
            Op::QemuExits { vm: i } => {
                self.launched.remove(VMS[i]);
                self.spawnable.remove(VMS[i]);
                self.guests.remove(VMS[i]);
            }
            Op::ResyncBegins => {
                if self.run.is_none() {
                    let want = self.want();
                    let running = self.dnsmasq.as_ref().map(|d| d.id);
                    let action = dnsmasq::decide(running, self.record.as_ref(), &want);
                    let launches = self
                        .launched
                        .keys()
                        .filter(|n| !self.guests.contains_key(*n))
                        .cloned()
                        .collect();
                    self.run = Some(Run {
                        want,
                        steps: dnsmasq::steps(action).iter().copied().collect(),
                        running,
                        record: self.record.clone(),
                        log_from: 0,
                        launches,
                    });
                }
            }
            Op::ResyncStep { lands } => self.step(lands),
            Op::Resync { steps, lands } => {
                self.apply(&Op::ResyncBegins)?;
                for _ in 0..steps {
                    self.step(lands);
                }
            }
            Op::HupLands => {
                if let Some(d) = &mut self.dnsmasq
                    && d.hup_pending
                {
                    d.hup_pending = false;
                    d.hosts = self.hosts_file.clone();
                    d.reads += 1;
                }
            }
            Op::GuestAsks { vm: i } => {
                self.guest_asks(VMS[i])?;
            }
            Op::Crash => self.run = None,
        }
        self.check()
    }

    /// One step of the resync under way; a failed one ends the run, as an
    /// error ends `ensure`.
    fn step(&mut self, lands: bool) {
        let Some(mut run) = self.run.take() else {
            return;
        };
        let Some(step) = run.steps.pop_front() else {
            return;
        };
        let ok = match step {
            Step::WriteConf => {
                self.conf_file = run.want.conf.clone();
                true
            }
            Step::WriteHosts => {
                self.hosts_file = run.want.hosts.clone();
                true
            }
            Step::Stop => {
                self.dnsmasq = None;
                run.running = None;
                true
            }
            Step::ClearLeases => {
                self.lease_file.clear();
                true
            }
            Step::Start => {
                if self.dnsmasq.is_some() {
                    // Its sockets are taken: the start fails.
                    false
                } else {
                    self.next_pid += 1;
                    let id = ProcId {
                        pid: self.next_pid,
                        start_ticks: u64::from(self.next_pid),
                    };
                    self.dnsmasq = Some(Dnsmasq {
                        id,
                        conf: self.conf_file.clone(),
                        hosts: self.hosts_file.clone(),
                        hup_pending: false,
                        reads: 1,
                        handed_out: self.lease_file.clone(),
                    });
                    run.running = Some(id);
                    run.log_from = 0;
                    true
                }
            }
            Step::Signal => match &mut self.dnsmasq {
                Some(d) if Some(d.id) == run.running => {
                    run.log_from = d.reads;
                    d.hup_pending = true;
                    true
                }
                // The pidfd's process is gone: the signal fails.
                _ => false,
            },
            Step::AwaitReread => match &mut self.dnsmasq {
                Some(d) if Some(d.id) == run.running => {
                    if d.reads <= run.log_from && lands && d.hup_pending {
                        d.hup_pending = false;
                        d.hosts = self.hosts_file.clone();
                        d.reads += 1;
                    }
                    d.reads > run.log_from
                }
                _ => false,
            },
            Step::Offer | Step::Record => match run.running {
                Some(process) => {
                    if let Some(next) =
                        dnsmasq::record_after(step, run.record.as_ref(), process, &run.want)
                    {
                        self.record = Some(next.clone());
                        run.record = Some(next);
                    }
                    true
                }
                None => false,
            },
        };
        if ok && run.steps.is_empty() {
            // Finished: the launches it saw may spawn their QEMUs.
            self.spawnable.extend(run.launches);
        } else if ok {
            self.run = Some(run);
        }
    }

    /// DHCP: dnsmasq answers a MAC only with its host line's address, and
    /// refuses an address it handed out to another MAC.
    fn guest_asks(&mut self, name: &str) -> Result<Option<Ipv4Addr>, TestCaseError> {
        let (Some(guest), Some(d)) = (self.guests.get(name), &mut self.dnsmasq) else {
            return Ok(None);
        };
        let mac = guest.mac.clone();
        let offer = d.hosts.lines().find_map(|l| {
            let mut f = l.split(',');
            let (m, ip) = (f.next()?, f.next()?);
            (m == mac).then(|| ip.parse::<Ipv4Addr>().ok()).flatten()
        });
        let Some(ip) = offer else {
            return Ok(None);
        };
        if d.handed_out.get(&ip).is_some_and(|m| *m != mac) {
            return Ok(None);
        }
        d.handed_out.retain(|_, m| *m != mac);
        d.handed_out.insert(ip, mac.clone());
        self.lease_file = d.handed_out.clone();
        for (other, g) in &self.guests {
            prop_assert!(
                other == name || g.holds != Some(ip),
                "{ip} handed to {name} while {other}'s guest holds it"
            );
        }
        let started_with = self.launched[name].first().and_then(|l| l.ip);
        prop_assert_eq!(
            Some(ip),
            started_with,
            "{} got another address than it was started with",
            name
        );
        if let Some(g) = self.guests.get_mut(name) {
            g.holds = Some(ip);
        }
        Ok(Some(ip))
    }

    fn check(&self) -> Result<(), TestCaseError> {
        for (name, g) in &self.guests {
            if let Some(ip) = g.holds {
                prop_assert!(
                    self.leases
                        .iter()
                        .any(|l| l.vm == *name && l.interface == 0 && l.ip == ip),
                    "{}'s running guest holds {} but the store no longer leases it to it: {:?}",
                    name,
                    ip,
                    self.leases
                );
            }
        }
        Ok(())
    }

    /// A last crash, then the reconcile and one resync with nothing in the
    /// way.
    fn recover(&mut self) -> Result<(), TestCaseError> {
        self.apply(&Op::Crash)?;
        self.apply(&Op::Plan)?;
        self.apply(&Op::ResyncBegins)?;
        while self.run.is_some() {
            self.apply(&Op::ResyncStep { lands: true })?;
        }
        // A SIGHUP of a run that died may still land: it reads the file.
        self.apply(&Op::HupLands)?;
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// Any interleaving of spec edits, lease plans, QEMU starts and exits,
    /// resync steps, late or lost SIGHUP effects, DHCP requests and kills of
    /// hearthd: no address is ever held by two running guests or taken from
    /// a running one, and after recovery dnsmasq serves exactly the desired
    /// data, to every running guest.
    #[test]
    fn dnsmasq_ends_on_the_desired_data_and_no_address_is_handed_out_twice(
        ops in proptest::collection::vec(op(), 1..100)
    ) {
        let mut m = Model::new();
        for op in &ops {
            m.apply(op)?;
        }
        m.recover()?;
        let want = m.want();
        let d = m.dnsmasq.clone().expect("a dnsmasq runs after recovery");
        prop_assert_eq!(&d.conf, &want.conf, "dnsmasq runs on an old config");
        prop_assert_eq!(&d.hosts, &want.hosts, "dnsmasq serves old hosts");
        let record = m.record.clone().expect("a record after recovery");
        prop_assert_eq!(record.process, d.id);
        prop_assert_eq!(&record.loaded, &want);
        for name in VMS {
            if m.guests.contains_key(name) {
                let started_with = m.launched[name].first().and_then(|l| l.ip);
                prop_assert_eq!(m.guest_asks(name)?, started_with, "{} asked", name);
            }
        }
    }
}
