//! The `leases` table: the addresses of VM interfaces on VirtualNetworks.

use rusqlite::{Connection, params};

use super::{Store, StoreError};

/// One stored lease: the address of interface `interface` (its index in
/// the VM's `spec.networks`) of `vm` on `network`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StoredLease {
    pub network: String,
    pub vm: String,
    pub interface: u32,
    pub ip: std::net::Ipv4Addr,
    pub mac: String,
}

impl Store {
    /// Every lease, ordered by network, VM and interface.
    pub fn leases(&self) -> Result<Vec<StoredLease>, StoreError> {
        Self::leases_tx(&self.conn(), None)
    }

    /// The leases on one network.
    pub fn leases_of_network(&self, network: &str) -> Result<Vec<StoredLease>, StoreError> {
        Self::leases_tx(&self.conn(), Some(network))
    }

    pub fn leases_tx(
        conn: &Connection,
        network: Option<&str>,
    ) -> Result<Vec<StoredLease>, StoreError> {
        let mut stmt = conn.prepare(
            "SELECT network, vm, interface, ip, mac FROM leases
             WHERE ?1 IS NULL OR network = ?1 ORDER BY network, vm, interface",
        )?;
        let rows = stmt.query_map(params![network], |r| {
            Ok((
                r.get::<_, String>(0)?,
                r.get::<_, String>(1)?,
                r.get::<_, i64>(2)?,
                r.get::<_, String>(3)?,
                r.get::<_, String>(4)?,
            ))
        })?;
        let mut out = Vec::new();
        for row in rows {
            let (network, vm, interface, ip, mac) = row?;
            // Written by hearthd only; a row that does not read is skipped
            // (and replaced the next time its VM's leases are written).
            let (Ok(interface), Ok(ip)) = (u32::try_from(interface), ip.parse()) else {
                tracing::warn!(network, vm, ip, "skipping an unreadable lease");
                continue;
            };
            out.push(StoredLease {
                network,
                vm,
                interface,
                ip,
                mac,
            });
        }
        Ok(out)
    }

    /// Makes `leases` the whole set of `vm`'s leases, in one transaction:
    /// its other leases are released. The table's keys refuse a second
    /// holder of one address, so a bug above cannot store one.
    pub fn set_vm_leases(&self, vm: &str, leases: &[StoredLease]) -> Result<(), StoreError> {
        self.with_tx(|tx| Self::set_vm_leases_tx(tx, vm, leases))
    }

    pub fn set_vm_leases_tx(
        tx: &Connection,
        vm: &str,
        leases: &[StoredLease],
    ) -> Result<(), StoreError> {
        tx.execute("DELETE FROM leases WHERE vm = ?1", params![vm])?;
        for l in leases {
            tx.execute(
                "INSERT INTO leases (network, vm, interface, ip, mac) VALUES (?1, ?2, ?3, ?4, ?5)",
                params![
                    l.network,
                    vm,
                    i64::from(l.interface),
                    l.ip.to_string(),
                    l.mac
                ],
            )?;
        }
        Ok(())
    }

    /// Makes `leases` the whole set of leases on `network`, inside the
    /// caller's transaction.
    pub fn set_network_leases_tx(
        tx: &Connection,
        network: &str,
        leases: &[StoredLease],
    ) -> Result<(), StoreError> {
        Self::release_network_leases_tx(tx, network)?;
        for l in leases {
            tx.execute(
                "INSERT INTO leases (network, vm, interface, ip, mac) VALUES (?1, ?2, ?3, ?4, ?5)",
                params![
                    network,
                    l.vm,
                    i64::from(l.interface),
                    l.ip.to_string(),
                    l.mac
                ],
            )?;
        }
        Ok(())
    }

    /// Releases every lease of a VM (it is deleted).
    pub fn release_vm_leases_tx(tx: &Connection, vm: &str) -> Result<(), StoreError> {
        tx.execute("DELETE FROM leases WHERE vm = ?1", params![vm])?;
        Ok(())
    }

    /// Releases every lease on a network (it is deleted).
    pub fn release_network_leases_tx(tx: &Connection, network: &str) -> Result<(), StoreError> {
        tx.execute("DELETE FROM leases WHERE network = ?1", params![network])?;
        Ok(())
    }
}
