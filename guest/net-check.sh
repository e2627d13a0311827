#!/usr/bin/env bash
# Check the test guests' networking with real parts, inside a network namespace
# of its own (nothing touches the host's network):
#
#   guest/net-check.sh [small|debian|debian-v1|debian-fallback|all]  (default: all)
#
# In namespace hth-gt-PID: a bridge hth-gt0 with 10.77.0.1/24, a tap htt-gt0
# enslaved to it, and dnsmasq on the bridge configured the way hearth configures
# it (static range: only the MACs it is given get an address; router option;
# DNS off). QEMU (TCG) runs inside the namespace with a virtio-net NIC on the tap.
#
#   small      the busybox guest (guest/out/vmlinuz + initrd.img), booted with
#              hearth.httpd=8080: waits for the console line
#                hearth-guest: eth0 lease 10.77.0.10/24 router 10.77.0.1 mac 52:54:00:77:00:10
#              then pings the guest from the namespace, pings the gateway from
#              the guest (agent guest-exec), fetches the guest's httpd page and
#              sends a line to `nc -l -p 7000` in the guest. Then two more boots:
#              no NIC (time to "hearth-guest: ready", no DHCP client started), a
#              NIC with hearth.net=0 (no udhcpc running), and a NIC whose MAC
#              dnsmasq does not know yet: the guest says
#                hearth-guest: eth0 no DHCP answer yet; still trying
#              then the MAC is added to dnsmasq's hosts file (SIGHUP) and the
#              guest's retry gets the lease.
#   debian     the Debian image (guest/out/debian-12.qcow2, SeaBIOS) with a NoCloud
#              seed whose network-config is v2 (match macaddress, dhcp4: true):
#              waits for dnsmasq's DHCPACK and cloud-init's ci-info line with the
#              address, pings both ways, checks iperf3 (a 1 s loopback run in
#              the guest) and what cloud-init rendered.
#   debian-v1  the same with a network-config v1 (physical + mac_address, dhcp).
#   debian-fallback  the same with no network-config in the seed (cloud-init's
#              fallback: DHCP on the first NIC).
#
# Every wait is bounded; the script prints what it saw and exits non-zero if any
# check failed. The namespace, QEMU and dnsmasq are removed on every exit path.
# Needs root, qemu-system-x86_64, qemu-img, dnsmasq (dnsmasq-base), iproute2,
# curl, socat, mkfs.vfat + mcopy, python3, busybox (for ping if iputils-ping is not
# installed). KEEP=1 keeps the work directory (serial logs, dnsmasq log);
# NIC_OPTS=,romfile= (say) is appended to the -device virtio-net-pci options.
set -euo pipefail
export PATH="/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="$HERE/out"
QGA=(python3 "$HERE/debian/qga.py")
QEMU="${QEMU:-qemu-system-x86_64}"

NS="hth-gt-$$"
BR=hth-gt0
TAP=htt-gt0
GW=10.77.0.1
SMALL_MAC=52:54:00:77:00:10 SMALL_IP=10.77.0.10
LATE_MAC=52:54:00:77:00:12 LATE_IP=10.77.0.12 # not known to dnsmasq at first
DEB_MAC=52:54:00:77:00:11 DEB_IP=10.77.0.11
SMALL_TIMEOUT="${SMALL_TIMEOUT:-120}"   # s, QEMU start to lease (TCG)
DEBIAN_TIMEOUT="${DEBIAN_TIMEOUT:-400}" # s, QEMU start to cloud-init's network stage

log() { printf 'net-check: %s\n' "$*" >&2; }
die() { printf 'net-check: error: %s\n' "$*" >&2; exit 1; }

what="${1:-all}"
case "$what" in
    small) RUNS=(small) ;;
    debian) RUNS=(debian) ;;
    debian-v1) RUNS=(debian-v1) ;;
    debian-fallback) RUNS=(debian-fallback) ;;
    all) RUNS=(small debian debian-v1 debian-fallback) ;;
    *) die "usage: $0 [small|debian|debian-v1|debian-fallback|all]" ;;
esac

[ "$(id -u)" -eq 0 ] || die "must run as root (network namespace, bridge, tap)"
for t in "$QEMU" qemu-img ip dnsmasq curl socat mkfs.vfat mcopy python3 busybox; do
    command -v "$t" >/dev/null || die "missing $t (run .ci/install-deps.sh as root)"
done
for r in "${RUNS[@]}"; do
    case "$r" in
        small) for f in vmlinuz initrd.img cmdline; do
            [ -s "$OUT/$f" ] || die "no $OUT/$f: run guest/build.sh"
        done ;;
        debian*) [ -s "$OUT/debian-12.qcow2" ] || die "no $OUT/debian-12.qcow2: run guest/debian/build.sh" ;;
    esac
done

TMP="$(mktemp -d /tmp/hearth-net-check.XXXXXX)"
chmod 0755 "$TMP" # dnsmasq runs as nobody
QEMU_PID=""
DNSMASQ_PID=""
NS_MADE=""

stop_qemu() {
    if [ -n "$QEMU_PID" ] && kill -0 "$QEMU_PID" 2>/dev/null; then
        kill "$QEMU_PID" 2>/dev/null || true
        wait "$QEMU_PID" 2>/dev/null || true
    fi
    QEMU_PID=""
}
cleanup() {
    stop_qemu
    if [ -n "$DNSMASQ_PID" ] && kill -0 "$DNSMASQ_PID" 2>/dev/null; then
        kill "$DNSMASQ_PID" 2>/dev/null || true
    fi
    if [ -n "$NS_MADE" ]; then
        # Anything left in the namespace was started by this script.
        local p
        for p in $(ip netns pids "$NS" 2>/dev/null); do
            log "stopping leftover process $p ($(tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null | cut -c1-60))"
            kill "$p" 2>/dev/null || true
        done
        ip netns del "$NS" 2>/dev/null || log "warning: could not delete namespace $NS"
    fi
    if [ "${KEEP:-0}" = 1 ]; then
        log "kept $TMP"
    else
        rm -rf "$TMP"
    fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

FAILS=0
RESULTS=()
result() { # result NAME ok|FAIL DETAIL
    RESULTS+=("$(printf '%-10s %-4s %-26s %s' "$RUN" "$2" "$1" "$3")")
    log "$RUN: $2 $1: $3"
    [ "$2" = ok ] || FAILS=$((FAILS + 1))
}
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
nsx() { ip netns exec "$NS" "$@"; }
# iputils ping when the host has it, else busybox's (busybox-static is a
# dependency of guest/build.sh anyway).
if command -v ping >/dev/null; then PING=(ping); else PING=(busybox ping); fi
gexec() { "${QGA[@]}" "$D/ga.sock" exec "$1"; }

# wait_line FILE ERE TIMEOUT: waits until a line of FILE matches ERE (or QEMU
# exits, or TIMEOUT s pass); prints the line.
wait_line() {
    local file="$1" re="$2" limit="$3" end line
    end=$(($(date +%s) + limit))
    while [ "$(date +%s)" -lt "$end" ]; do
        if line="$(grep -m1 -aE -- "$re" "$file" 2>/dev/null)"; then
            tr -d '\r' <<<"$line"
            return 0
        fi
        if [ -n "$QEMU_PID" ] && ! kill -0 "$QEMU_PID" 2>/dev/null; then
            return 1
        fi
        sleep 0.1
    done
    return 1
}

# --- the namespace: bridge, tap, dnsmasq ---------------------------------------------
log "host load average: $(cut -d" " -f1-3 /proc/loadavg) ($(nproc) CPUs); namespace $NS"
ip netns add "$NS"
NS_MADE=1
nsx ip link set lo up
nsx ip link add "$BR" type bridge stp_state 0
nsx ip addr add "$GW/24" dev "$BR"
nsx ip link set "$BR" up
nsx ip tuntap add dev "$TAP" mode tap
nsx ip link set "$TAP" master "$BR"
nsx ip link set "$TAP" up

cat >"$TMP/dnsmasq.conf" <<EOF
no-resolv
no-hosts
port=0
bind-interfaces
interface=$BR
except-interface=lo
dhcp-range=10.77.0.0,static,255.255.255.0,1h
dhcp-hostsfile=$TMP/hosts
dhcp-leasefile=$TMP/leases
pid-file=$TMP/dnsmasq.pid
log-facility=$TMP/dnsmasq.log
log-dhcp
dhcp-authoritative
dhcp-option=option:router,$GW
EOF
printf '%s,%s,hearth-guest\n%s,%s,hearth-debian\n' "$SMALL_MAC" "$SMALL_IP" "$DEB_MAC" "$DEB_IP" >"$TMP/hosts"
chmod 0644 "$TMP/hosts"
nsx dnsmasq --conf-file="$TMP/dnsmasq.conf" || die "dnsmasq did not start (see $TMP/dnsmasq.log)"
DNSMASQ_PID="$(cat "$TMP/dnsmasq.pid")"
log "dnsmasq $DNSMASQ_PID on $BR ($GW/24); tap $TAP"

# boot_qemu NAME ARGS...: QEMU inside the namespace; sets QEMU_PID, T0, SERIAL.
boot_qemu() {
    local name="$1"
    shift
    SERIAL="$D/serial-$name.log"
    rm -f "$D/ga.sock"
    T0="$(now)"
    # `ip netns exec` execs QEMU: $! is QEMU's own pid.
    ip netns exec "$NS" "$QEMU" -machine q35 -accel tcg -cpu max -nodefaults -nographic -no-reboot \
        -serial "file:$SERIAL" \
        -device virtio-serial-pci \
        -chardev "socket,id=ga,path=$D/ga.sock,server=on,wait=off" \
        -device virtserialport,chardev=ga,name=org.qemu.guest_agent.0 \
        "$@" </dev/null >"$D/qemu-$name.out" 2>&1 &
    QEMU_PID=$!
}
nic() { # the QEMU arguments of one virtio-net NIC on the tap
    echo "-netdev tap,id=n0,ifname=$TAP,script=no,downscript=no -device virtio-net-pci,netdev=n0,mac=$1${NIC_OPTS:-}"
}

shutdown_vm() { # guest-shutdown, then wait (bounded) for QEMU to exit
    local t end
    t="$(now)"
    if ! "${QGA[@]}" "$D/ga.sock" shutdown; then
        log "$RUN: guest-shutdown failed; stopping QEMU"
    fi
    end=$(($(date +%s) + 60))
    while kill -0 "$QEMU_PID" 2>/dev/null && [ "$(date +%s)" -lt "$end" ]; do
        sleep 0.1
    done
    if kill -0 "$QEMU_PID" 2>/dev/null; then
        log "$RUN: QEMU still running 60 s after guest-shutdown; stopping it"
    else
        log "$RUN: QEMU exited $(since "$t") s after guest-shutdown"
    fi
    stop_qemu
}

# --- the small guest ------------------------------------------------------------------
run_small() {
    D="$TMP/small"
    mkdir -p "$D"
    local cmdline line t
    cmdline="$(cat "$OUT/cmdline")"

    log "small: boot with a NIC ($SMALL_MAC) and hearth.httpd=8080"
    # shellcheck disable=SC2046
    boot_qemu nic -smp 1 -m 256M -kernel "$OUT/vmlinuz" -initrd "$OUT/initrd.img" \
        -append "$cmdline hearth.httpd=8080" $(nic "$SMALL_MAC")
    local want="hearth-guest: eth0 lease $SMALL_IP/24 router $GW mac $SMALL_MAC"
    if line="$(wait_line "$SERIAL" "hearth-guest: eth0 lease " "$SMALL_TIMEOUT")"; then
        t="$(since "$T0")"
        if [ "$line" = "$want" ]; then
            result "lease (console)" ok "'$line' ${t} s after QEMU start"
        else
            result "lease (console)" FAIL "got '$line', want '$want'"
        fi
    else
        result "lease (console)" FAIL "no lease line within ${SMALL_TIMEOUT} s; console:"
        tail -n 20 "$SERIAL" >&2
        stop_qemu
        return
    fi
    if line="$(grep -m1 "DHCPACK($BR) $SMALL_IP $SMALL_MAC" "$TMP/dnsmasq.log")"; then
        result "lease (dnsmasq)" ok "${line#*: }"
    else
        result "lease (dnsmasq)" FAIL "no DHCPACK for $SMALL_MAC in the dnsmasq log"
    fi
    if nsx "${PING[@]}" -c1 -W5 "$SMALL_IP" >"$D/ping.out" 2>&1; then
        result "ping ns -> guest" ok "$(grep -m1 'bytes from' "$D/ping.out")"
    else
        result "ping ns -> guest" FAIL "$(tr '\n' ' ' <"$D/ping.out")"
    fi

    if t="$("${QGA[@]}" "$D/ga.sock" wait 60)"; then
        result agent ok "answers (${t} s after the lease)"
        local out
        if out="$(gexec "ping -c1 -W5 $GW" 2>&1)"; then
            result "ping guest -> gateway" ok "$(grep -m1 'bytes from' <<<"$out")"
        else
            result "ping guest -> gateway" FAIL "$(tr '\n' ' ' <<<"$out")"
        fi
        out="$(gexec "ip -4 route; cat /etc/resolv.conf" 2>&1 || true)"
        if grep -q "^default via $GW dev eth0" <<<"$out"; then
            result "default route" ok "$(grep '^default' <<<"$out" | tr -s ' ')"
        else
            result "default route" FAIL "$(tr '\n' ' ' <<<"$out")"
        fi
        # nc: a one-shot listener in the guest, a line sent from the namespace.
        gexec "nc -l -p 7000 </dev/null >/tmp/nc.out 2>&1 &" >/dev/null 2>&1 || true
        local sent="" i
        for i in $(seq 50); do
            if echo "hello nc" | nsx socat -T5 - "TCP:$SMALL_IP:7000,connect-timeout=2" 2>/dev/null; then
                sent=1
                break
            fi
            sleep 0.1
        done
        out=""
        for i in $(seq 50); do
            out="$(gexec "cat /tmp/nc.out" 2>/dev/null || true)"
            [ "$out" = "hello nc" ] && break
            sleep 0.1
        done
        if [ -n "$sent" ] && [ "$out" = "hello nc" ]; then
            result "nc -l -p 7000" ok "the guest received '$out'"
        else
            result "nc -l -p 7000" FAIL "sent=${sent:-no}, guest has '$out'"
        fi
    else
        result agent FAIL "no answer"
    fi
    local page
    page="$(nsx curl -sS --max-time 10 "http://$SMALL_IP:8080/" 2>&1 || true)"
    if [ "$page" = "hello from hearth-guest" ]; then
        result "httpd :8080" ok "GET / -> '$page'"
    else
        result "httpd :8080" FAIL "GET / -> '$page'"
    fi
    shutdown_vm

    log "small: boot without a NIC"
    boot_qemu nonic -smp 1 -m 256M -kernel "$OUT/vmlinuz" -initrd "$OUT/initrd.img" -append "$cmdline"
    if wait_line "$SERIAL" "hearth-guest: ready" "$SMALL_TIMEOUT" >/dev/null; then
        t="$(since "$T0")"
        if grep -q "DHCP client started" "$SERIAL"; then
            result "no NIC" FAIL "a DHCP client was started"
        else
            result "no NIC" ok "'hearth-guest: ready' ${t} s after QEMU start, no DHCP client"
        fi
    else
        result "no NIC" FAIL "no 'ready' within ${SMALL_TIMEOUT} s"
    fi
    "${QGA[@]}" "$D/ga.sock" wait 60 >/dev/null 2>&1 || true
    shutdown_vm

    log "small: boot with a NIC and hearth.net=0"
    # shellcheck disable=SC2046
    boot_qemu net0 -smp 1 -m 256M -kernel "$OUT/vmlinuz" -initrd "$OUT/initrd.img" \
        -append "$cmdline hearth.net=0" $(nic "$SMALL_MAC")
    if wait_line "$SERIAL" "hearth-guest: ready" "$SMALL_TIMEOUT" >/dev/null &&
        "${QGA[@]}" "$D/ga.sock" wait 60 >/dev/null; then
        local ps
        ps="$(gexec "pidof udhcpc || echo none" 2>&1 || true)"
        if grep -q "network setup disabled (hearth.net=0)" "$SERIAL" && [ "$ps" = none ]; then
            result "hearth.net=0" ok "no udhcpc running, console says so"
        else
            result "hearth.net=0" FAIL "udhcpc: '$ps'"
        fi
    else
        result "hearth.net=0" FAIL "the guest did not come up"
    fi
    shutdown_vm

    log "small: boot with a NIC dnsmasq does not know yet ($LATE_MAC)"
    # shellcheck disable=SC2046
    boot_qemu late -smp 1 -m 256M -kernel "$OUT/vmlinuz" -initrd "$OUT/initrd.img" \
        -append "$cmdline" $(nic "$LATE_MAC")
    if line="$(wait_line "$SERIAL" "hearth-guest: eth0 no DHCP answer yet" "$SMALL_TIMEOUT")"; then
        result "no answer (console)" ok "'$line' $(since "$T0") s after QEMU start"
        printf '%s,%s,hearth-late\n' "$LATE_MAC" "$LATE_IP" >>"$TMP/hosts"
        kill -HUP "$DNSMASQ_PID"
        t="$(now)"
        want="hearth-guest: eth0 lease $LATE_IP/24 router $GW mac $LATE_MAC"
        if line="$(wait_line "$SERIAL" "hearth-guest: eth0 lease " 60)" && [ "$line" = "$want" ]; then
            result "retry gets lease" ok "'$line' $(since "$t") s after dnsmasq learnt the MAC"
        else
            result "retry gets lease" FAIL "got '${line:-nothing}' within 60 s, want '$want'"
        fi
    else
        result "no answer (console)" FAIL "no 'no DHCP answer yet' line within ${SMALL_TIMEOUT} s"
    fi
    if "${QGA[@]}" "$D/ga.sock" wait 60 >/dev/null 2>&1; then
        shutdown_vm
    else
        stop_qemu
    fi
}

# --- the Debian image -------------------------------------------------------------------
run_debian() {
    local v="$1"
    D="$TMP/$RUN"
    mkdir -p "$D"
    qemu-img create -q -f qcow2 -b "$OUT/debian-12.qcow2" -F qcow2 "$D/disk.qcow2" 4G
    printf 'instance-id: net-check-%s-%s\nlocal-hostname: hearth-debian\n' "$v" "$$" >"$D/meta-data"
    printf '#cloud-config\n' >"$D/user-data"
    if [ "$v" = v2 ]; then
        cat >"$D/network-config" <<EOF
version: 2
ethernets:
  id0:
    match:
      macaddress: "$DEB_MAC"
    dhcp4: true
EOF
    elif [ "$v" = v1 ]; then
        cat >"$D/network-config" <<EOF
version: 1
config:
  - type: physical
    name: eth0
    mac_address: "$DEB_MAC"
    subnets:
      - type: dhcp
EOF
    fi
    # v=none: no network-config at all (cloud-init's fallback: DHCP on the first NIC).
    mkfs.vfat -n CIDATA -C "$D/seed.img" 1024 >/dev/null
    MTOOLS_SKIP_CHECK=1 mcopy -i "$D/seed.img" "$D/user-data" "$D/meta-data" ::
    if [ -f "$D/network-config" ]; then
        MTOOLS_SKIP_CHECK=1 mcopy -i "$D/seed.img" "$D/network-config" ::
    fi

    log "$RUN: boot (SeaBIOS, network-config $v, NIC $DEB_MAC)"
    local acks_before
    acks_before="$(grep -c "DHCPACK($BR) $DEB_IP $DEB_MAC" "$TMP/dnsmasq.log" || true)"
    # shellcheck disable=SC2046
    boot_qemu debian -smp 2 -m 1024M \
        -blockdev "{\"driver\":\"file\",\"filename\":\"$D/disk.qcow2\",\"node-name\":\"f0\"}" \
        -blockdev '{"driver":"qcow2","file":"f0","node-name":"d0"}' \
        -device '{"driver":"virtio-blk-pci","drive":"d0","bootindex":0}' \
        -blockdev "{\"driver\":\"file\",\"filename\":\"$D/seed.img\",\"node-name\":\"f1\",\"read-only\":true}" \
        -blockdev '{"driver":"raw","file":"f1","node-name":"d1","read-only":true}' \
        -device '{"driver":"virtio-blk-pci","drive":"d1"}' \
        $(nic "$DEB_MAC")

    local t line end got=""
    end=$(($(date +%s) + DEBIAN_TIMEOUT))
    while [ "$(date +%s)" -lt "$end" ] && kill -0 "$QEMU_PID" 2>/dev/null; do
        if [ "$(grep -c "DHCPACK($BR) $DEB_IP $DEB_MAC" "$TMP/dnsmasq.log" || true)" -gt "$acks_before" ]; then
            got=1
            break
        fi
        sleep 0.1
    done
    if [ -n "$got" ]; then
        result "lease (dnsmasq)" ok "DHCPACK $DEB_IP $DEB_MAC $(since "$T0") s after QEMU start"
    else
        result "lease (dnsmasq)" FAIL "no DHCPACK within ${DEBIAN_TIMEOUT} s; console:"
        tail -n 30 "$SERIAL" >&2
        stop_qemu
        return
    fi
    # cloud-init's network stage prints the interfaces with their addresses.
    if line="$(wait_line "$SERIAL" "ci-info: .*\| *${DEB_IP//./\\.} *\|" "$DEBIAN_TIMEOUT")"; then
        result "lease (console)" ok "$(tr -s ' ' <<<"$line") $(since "$T0") s after QEMU start"
    else
        result "lease (console)" FAIL "no ci-info line with $DEB_IP"
    fi
    if nsx "${PING[@]}" -c1 -W5 "$DEB_IP" >"$D/ping.out" 2>&1; then
        result "ping ns -> guest" ok "$(grep -m1 'bytes from' "$D/ping.out")"
    else
        result "ping ns -> guest" FAIL "$(tr '\n' ' ' <"$D/ping.out")"
    fi
    if ! "${QGA[@]}" "$D/ga.sock" wait 120 >/dev/null; then
        result agent FAIL "no answer"
        stop_qemu
        return
    fi
    local out
    if out="$(gexec "ping -c1 -W5 $GW" 2>&1)"; then
        result "ping guest -> gateway" ok "$(grep -m1 'bytes from' <<<"$out")"
    else
        result "ping guest -> gateway" FAIL "$(tr '\n' ' ' <<<"$out")"
    fi
    if out="$(gexec "iperf3 --version | head -n1 && iperf3 -s -1 -D && sleep 0.5 && iperf3 -c 127.0.0.1 -t 1 | grep -E 'receiver\$'" 2>&1)"; then
        result iperf3 ok "$(head -n1 <<<"$out"); loopback: $(tail -n1 <<<"$out" | tr -s ' ' | cut -d' ' -f5-8)"
    else
        result iperf3 FAIL "$(tr '\n' ' ' <<<"$out")"
    fi
    out="$(gexec 'for f in /etc/network/interfaces /etc/network/interfaces.d/* /etc/netplan/*; do [ -e "$f" ] && echo "present: $f"; done; grep -H "" /etc/systemd/network/*.network; ip -4 -o addr show scope global' 2>&1 || true)"
    echo "$out" >"$D/rendered.txt"
    if grep -q 'present:' <<<"$out"; then
        result rendering FAIL "$(grep 'present:' <<<"$out" | tr '\n' ' ')"
    elif grep -q 'DHCP=ipv4' <<<"$out" && grep -qi "MACAddress=$DEB_MAC" <<<"$out"; then
        result rendering ok "systemd-networkd: $(grep -h -o '/etc/systemd/network/[^:]*' <<<"$out" | sort -u | tr '\n' ' ')(MACAddress=$DEB_MAC, DHCP=ipv4); $(grep -o "[a-z0-9]* *inet $DEB_IP/[0-9]*" <<<"$out" | tr -s ' ')"
    else
        result rendering FAIL "$(tr '\n' ' ' <<<"$out")"
    fi
    # A shutdown request in the middle of cloud-init's stages was lost (seen
    # twice): let the boot finish first.
    out="$(gexec "cloud-init status --wait >/dev/null; systemctl is-system-running --wait" 2>&1 || true)"
    log "$RUN: boot finished $(since "$T0") s after QEMU start (system: $out)"
    shutdown_vm
}

for RUN in "${RUNS[@]}"; do
    case "$RUN" in
        small) run_small ;;
        debian) run_debian v2 ;;
        debian-v1) run_debian v1 ;;
        debian-fallback) run_debian none ;;
    esac
done

echo "net-check results (namespace $NS, bridge $BR $GW/24, tap $TAP):"
printf '  %s\n' "${RESULTS[@]}"
if [ "$FAILS" -gt 0 ]; then
    echo "net-check: $FAILS check(s) failed"
    exit 1
fi
echo "net-check: all ${#RESULTS[@]} checks passed"
