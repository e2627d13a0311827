#!/usr/bin/env bash
# Makes libvirt ready for the snapshot latency benchmark (benchmark only,
# never CI): its daemons running, and /dev/kvm usable by libvirt's QEMU user
# (libvirt probes it for its capabilities; when it cannot, it probes again
# on every call, which would slow every virsh command down). Idempotent.
#
# Install (Debian 12, keeps QEMU 10 from bookworm-backports; check first with
# `apt-get -s` that nothing is removed or downgraded):
#   apt-get install -y --no-install-recommends libvirt-daemon-system \
#       libvirt-daemon-system-sysv libvirt-clients
set -euo pipefail

die() { printf 'libvirt-up: error: %s\n' "$*" >&2; exit 1; }

for tool in virsh libvirtd virtlogd; do
    command -v "$tool" >/dev/null || die "missing '$tool': apt-get install -y --no-install-recommends libvirt-daemon-system libvirt-daemon-system-sysv libvirt-clients"
done

# Debian's udev rule gives /dev/kvm to group kvm; without udev it stays
# root-only. libvirt's QEMU user (libvirt-qemu) is in group kvm.
if [ -e /dev/kvm ] && ! su -s /bin/sh libvirt-qemu -c 'test -r /dev/kvm -a -w /dev/kvm' 2>/dev/null; then
    chgrp kvm /dev/kvm
    chmod 0660 /dev/kvm
    echo "libvirt-up: /dev/kvm is now root:kvm 0660 (for libvirt-qemu)" >&2
fi

# No default network: the benchmark's domains have no network interface.
rm -f /etc/libvirt/qemu/networks/autostart/default.xml

if ! virsh -c qemu:///system version >/dev/null 2>&1; then
    if [ -d /run/systemd/system ]; then
        systemctl start libvirtd
    else
        pgrep -x virtlogd >/dev/null || virtlogd -d
        pgrep -x libvirtd >/dev/null || libvirtd -d
    fi
    for _ in $(seq 100); do
        virsh -c qemu:///system version >/dev/null 2>&1 && break
        sleep 0.1
    done
fi
virsh -c qemu:///system version >/dev/null || die "libvirtd does not answer on qemu:///system"
virsh -c qemu:///system version | sed 's/^/libvirt-up: /' >&2
