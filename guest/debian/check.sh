#!/usr/bin/env bash
# Boot guest/out/debian-12.qcow2 under plain QEMU (TCG, no network device) and
# check it end to end through the guest agent:
#
#   guest/debian/check.sh [bios|uefi|all]     (default: all)
#
# For each firmware (SeaBIOS; OVMF from the Debian ovmf package): a 4 GiB qcow2
# overlay on the image, a NoCloud seed (vfat, label CIDATA: user-data with
# hostname, runcmd and ssh_authorized_keys; meta-data), qemu-ga on a
# virtio-serial port. Checks: time to the first guest-ping, hostname, the runcmd
# file, ~debian/.ssh/authorized_keys, the root grown to the overlay's size,
# guest-get-fsinfo, guest-fsfreeze-freeze/status/thaw, cloud-init's DHCP
# rendering for systemd-networkd, no baked-in identity; then guest-shutdown, a
# second boot of the same disk, and the agent answering again.
#
# Env: QEMU (default qemu-system-x86_64), KEEP=1 keeps the work dir (serial logs).
set -euo pipefail
export PATH="/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
IMG="$(cd "$HERE/.." && pwd)/out/debian-12.qcow2"
QGA=(python3 "$HERE/qga.py")
QEMU="${QEMU:-qemu-system-x86_64}"
OVMF_CODE=/usr/share/OVMF/OVMF_CODE_4M.fd
OVMF_VARS=/usr/share/OVMF/OVMF_VARS_4M.fd
USER_NAME=debian
HOSTNAME_WANT=hearth-check

log() { printf 'guest/debian/check: %s\n' "$*" >&2; }
die() { printf 'guest/debian/check: error: %s\n' "$*" >&2; exit 1; }

what="${1:-all}"
case "$what" in
    bios) FIRMWARES=(bios) ;;
    uefi) FIRMWARES=(uefi) ;;
    all) FIRMWARES=(bios uefi) ;;
    *) die "usage: $0 [bios|uefi|all]" ;;
esac

[ -s "$IMG" ] || die "no $IMG: run guest/debian/build.sh"
for t in "$QEMU" qemu-img mkfs.vfat mcopy python3 ssh-keygen; do
    command -v "$t" >/dev/null || die "missing $t (run .ci/install-deps.sh)"
done
if [[ " ${FIRMWARES[*]} " == *" uefi "* ]]; then
    [ -f "$OVMF_CODE" ] && [ -f "$OVMF_VARS" ] || die "no $OVMF_CODE / $OVMF_VARS (apt-get install ovmf)"
fi

log "host load average: $(cut -d" " -f1-3 /proc/loadavg) ($(nproc) CPUs)"
TMP="$(mktemp -d /tmp/hearth-debian-check.XXXXXX)"
QEMU_PID=""
cleanup() {
    if [ -n "$QEMU_PID" ] && kill -0 "$QEMU_PID" 2>/dev/null; then
        kill "$QEMU_PID" 2>/dev/null || true
        wait "$QEMU_PID" 2>/dev/null || true
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
    RESULTS+=("$(printf '%-5s %-4s %-28s %s' "$FW" "$2" "$1" "$3")")
    log "$FW: $2 $1: $3"
    [ "$2" = ok ] || FAILS=$((FAILS + 1))
}
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

gexec() { "${QGA[@]}" "$D/ga.sock" exec "$1"; }

boot() { # boot N: start QEMU on $D's disks; sets QEMU_PID, T0
    local fwargs=()
    if [ "$FW" = uefi ]; then
        fwargs=(-drive "if=pflash,format=raw,unit=0,readonly=on,file=$OVMF_CODE"
            -drive "if=pflash,format=raw,unit=1,file=$D/OVMF_VARS_4M.fd")
    fi
    T0="$(now)"
    "$QEMU" -machine q35 -accel tcg -m 1024 -smp 2 -nodefaults -nographic \
        "${fwargs[@]}" \
        -serial "file:$D/serial-$1.log" \
        -qmp "unix:$D/qmp.sock,server=on,wait=off" \
        -blockdev "{\"driver\":\"file\",\"filename\":\"$D/disk.qcow2\",\"node-name\":\"f0\"}" \
        -blockdev '{"driver":"qcow2","file":"f0","node-name":"d0"}' \
        -device '{"driver":"virtio-blk-pci","drive":"d0"}' \
        -blockdev "{\"driver\":\"file\",\"filename\":\"$D/seed.img\",\"node-name\":\"f1\",\"read-only\":true}" \
        -blockdev '{"driver":"raw","file":"f1","node-name":"d1","read-only":true}' \
        -device '{"driver":"virtio-blk-pci","drive":"d1"}' \
        -device virtio-serial-pci \
        -chardev "socket,id=ga,path=$D/ga.sock,server=on,wait=off" \
        -device virtserialport,chardev=ga,name=org.qemu.guest_agent.0 \
        </dev/null >"$D/qemu-$1.out" 2>&1 &
    QEMU_PID=$!
}

wait_agent() { # wait_agent N: prints seconds from QEMU start to the first guest-ping answer
    local i
    for i in $(seq 100); do
        [ -S "$D/ga.sock" ] && break
        sleep 0.05
    done
    "${QGA[@]}" "$D/ga.sock" wait 600 >/dev/null || return 1
    since "$T0"
}

shutdown_vm() { # sets TD: seconds from guest-shutdown to QEMU's exit
    local t
    t="$(now)"
    "${QGA[@]}" "$D/ga.sock" shutdown
    local i
    for i in $(seq 1200); do
        kill -0 "$QEMU_PID" 2>/dev/null || break
        sleep 0.1
    done
    if kill -0 "$QEMU_PID" 2>/dev/null; then
        return 1
    fi
    wait "$QEMU_PID" 2>/dev/null || true
    QEMU_PID=""
    TD="$(since "$t")"
}

run() {
    FW="$1"
    D="$TMP/$FW"
    mkdir -p "$D"
    qemu-img create -q -f qcow2 -b "$IMG" -F qcow2 "$D/disk.qcow2" 4G
    [ "$FW" = uefi ] && cp "$OVMF_VARS" "$D/OVMF_VARS_4M.fd"

    # NoCloud seed: vfat labelled CIDATA.
    ssh-keygen -q -t ed25519 -N "" -C "check@hearth" -f "$D/id_ed25519"
    local key
    key="$(cat "$D/id_ed25519.pub")"
    cat >"$D/user-data" <<EOF
#cloud-config
hostname: $HOSTNAME_WANT
ssh_authorized_keys:
  - $key
runcmd:
  - [sh, -c, 'echo "runcmd ran at \$(date +%s)" >> /var/tmp/hearth-runcmd']
EOF
    printf 'instance-id: check-%s-%s\nlocal-hostname: %s\n' "$FW" "$$" "$HOSTNAME_WANT" >"$D/meta-data"
    mkfs.vfat -n CIDATA -C "$D/seed.img" 1024 >/dev/null
    MTOOLS_SKIP_CHECK=1 mcopy -i "$D/seed.img" "$D/user-data" "$D/meta-data" ::

    log "$FW: boot 1"
    boot 1
    local t
    if t="$(wait_agent 1)"; then
        result "agent (boot 1)" ok "first guest-ping ${t} s after QEMU start"
    else
        result "agent (boot 1)" FAIL "no answer; see $D/serial-1.log"
        tail -n 30 "$D/serial-1.log" >&2
        return
    fi
    "${QGA[@]}" "$D/ga.sock" call guest-info >"$D/guest-info.json"

    # cloud-init: wait for the end of its final stage.
    local i done=""
    for i in $(seq 600); do
        if gexec 'test -e /var/lib/cloud/instance/boot-finished' >/dev/null 2>&1; then
            done=1
            break
        fi
        sleep 1
    done
    if [ -n "$done" ]; then
        result "cloud-init done" ok "boot-finished $(since "$T0") s after QEMU start"
    else
        result "cloud-init done" FAIL "no boot-finished after 600 s"
    fi
    local st
    st="$(gexec 'cloud-init status --long 2>&1' || true)"
    echo "$st" >"$D/cloud-init-status.txt"
    if grep -q '^status: done' <<<"$st" && ! grep -qi 'errors:.*[a-z]' <<<"$st"; then
        result "cloud-init status" ok "$(grep -E '^(status|detail)' -A1 <<<"$st" | tr '\n' ' ' | tr -s ' ')"
    else
        result "cloud-init status" FAIL "$(tr '\n' ' ' <<<"$st")"
    fi

    local h
    h="$(gexec 'hostname' || true)"
    [ "$h" = "$HOSTNAME_WANT" ] && result hostname ok "$h" || result hostname FAIL "got '$h'"

    local rc
    rc="$(gexec 'cat /var/tmp/hearth-runcmd' 2>/dev/null || true)"
    [ "$(grep -c 'runcmd ran' <<<"$rc")" = 1 ] && result runcmd ok "$rc" || result runcmd FAIL "got '$rc'"

    local ak
    ak="$(gexec "cat ~$USER_NAME/.ssh/authorized_keys; stat -c '%U %a' ~$USER_NAME/.ssh/authorized_keys" 2>/dev/null || true)"
    if grep -qF "$key" <<<"$ak" && grep -q "^$USER_NAME 600\$" <<<"$ak"; then
        result authorized_keys ok "~$USER_NAME/.ssh/authorized_keys holds the seed's key ($USER_NAME, 600)"
    else
        result authorized_keys FAIL "got '$ak'"
    fi

    local df size
    df="$(gexec 'df -B1 --output=size,target / | tail -n1; lsblk -bno NAME,SIZE /dev/vda' || true)"
    size="$(awk 'NR == 1 { print $1 }' <<<"$df")"
    if [ -n "$size" ] && [ "$size" -gt $((3500 * 1024 * 1024)) ]; then
        result "root grown" ok "/ is $((size / 1024 / 1024)) MiB (image: 1919 MiB, disk: 4096 MiB)"
    else
        result "root grown" FAIL "df: $(tr '\n' ' ' <<<"$df")"
    fi

    local fsinfo
    if fsinfo="$("${QGA[@]}" "$D/ga.sock" call guest-get-fsinfo)"; then
        result guest-get-fsinfo ok "$(python3 -c '
import json, sys
fs = json.load(sys.stdin)
print(", ".join("%s %s %s" % (f["mountpoint"], f["type"], "+".join(d.get("dev", "?") for d in f.get("disk", []))) for f in fs))
' <<<"$fsinfo")"
    else
        result guest-get-fsinfo FAIL "error"
    fi

    local n1 s1 n2 s2
    if n1="$("${QGA[@]}" "$D/ga.sock" call guest-fsfreeze-freeze)" &&
        s1="$("${QGA[@]}" "$D/ga.sock" call guest-fsfreeze-status)" &&
        n2="$("${QGA[@]}" "$D/ga.sock" call guest-fsfreeze-thaw)" &&
        s2="$("${QGA[@]}" "$D/ga.sock" call guest-fsfreeze-status)" &&
        [ "$s1" = '"frozen"' ] && [ "$s2" = '"thawed"' ]; then
        result fsfreeze ok "freeze -> $n1 filesystems, status $s1; thaw -> $n2, status $s2"
    else
        result fsfreeze FAIL "freeze ${n1:-?} status ${s1:-?} thaw ${n2:-?} status ${s2:-?}"
        "${QGA[@]}" "$D/ga.sock" call guest-fsfreeze-thaw >/dev/null 2>&1 || true
    fi

    # cloud-init can render DHCP for systemd-networkd (no NIC here: offline).
    local net
    net="$(gexec 'set -e
d=$(mktemp -d)
printf "version: 2\nethernets:\n  eth0:\n    match: {macaddress: \"52:54:00:12:34:56\"}\n    set-name: eth0\n    dhcp4: true\n" >"$d/nc.yaml"
cloud-init devel net-convert -p "$d/nc.yaml" -k yaml -d "$d/out" -D debian -O networkd >/dev/null 2>&1
cat "$d"/out/etc/systemd/network/*.network
echo "networkd: $(systemctl is-enabled systemd-networkd)"
rm -rf "$d"' 2>&1 || true)"
    if grep -q '^DHCP=ipv4' <<<"$net" && grep -q 'networkd: enabled' <<<"$net"; then
        result "DHCP rendering" ok "net-convert -O networkd: $(grep -E '^(MACAddress|Name|DHCP)=' <<<"$net" | tr '\n' ' ')"
    else
        result "DHCP rendering" FAIL "$(tr '\n' ' ' <<<"$net")"
    fi

    local id
    id="$(gexec 'echo "machine-id $(cat /etc/machine-id)"; echo "root $(passwd -S root | cut -d" " -f2)"; ls /etc/ssh/ssh_host_*_key.pub | sed "s|.*/ssh_host_||; s|_key.pub||" | tr "\n" " "; echo; echo "ssh $(systemctl is-active ssh)"; echo "system $(systemctl is-system-running)"; systemctl --failed --no-legend --plain | cut -d" " -f1 | tr "\n" " "' || true)"
    echo "$id" >"$D/identity.txt"
    local mid
    mid="$(awk '$1 == "machine-id" { print $2 }' <<<"$id")"
    if [ "${#mid}" = 32 ] && grep -q '^root L' <<<"$id" && grep -q 'ssh active' <<<"$id" &&
        grep -q 'system running' <<<"$id"; then
        result "identity/services" ok "$(tr '\n' ' ' <<<"$id" | tr -s ' ')"
    else
        result "identity/services" FAIL "$(tr '\n' ' ' <<<"$id" | tr -s ' ')"
    fi
    gexec 'systemd-analyze; systemd-analyze critical-chain qemu-guest-agent.service cloud-final.service | grep -v "^The time"; systemd-analyze blame | head -n 12; cloud-init analyze blame | head -n 12' >"$D/analyze-1.txt" 2>&1 || true

    if shutdown_vm; then
        result "guest-shutdown" ok "QEMU exited ${TD} s after guest-shutdown"
    else
        result "guest-shutdown" FAIL "QEMU still running after 120 s"
        return
    fi

    log "$FW: boot 2 (same disk)"
    boot 2
    if t="$(wait_agent 2)"; then
        result "agent (boot 2)" ok "first guest-ping ${t} s after QEMU start"
    else
        result "agent (boot 2)" FAIL "no answer; see $D/serial-2.log"
        return
    fi
    for i in $(seq 300); do
        gexec 'cloud-init status 2>/dev/null | grep -q "status: done"' >/dev/null 2>&1 && break
        sleep 1
    done
    local again
    again="$(gexec 'hostname; cat /etc/machine-id; grep -c "runcmd ran" /var/tmp/hearth-runcmd' || true)"
    if [ "$(sed -n 1p <<<"$again")" = "$HOSTNAME_WANT" ] && [ "$(sed -n 2p <<<"$again")" = "$mid" ] &&
        [ "$(sed -n 3p <<<"$again")" = 1 ]; then
        result "boot 2 state" ok "cloud-init done $(since "$T0") s after QEMU start; same hostname and machine-id, runcmd not rerun"
    else
        result "boot 2 state" FAIL "$(tr '\n' ' ' <<<"$again")"
    fi
    gexec 'systemd-analyze' >"$D/analyze-2.txt" 2>&1 || true
    if shutdown_vm; then
        result "guest-shutdown (2)" ok "QEMU exited ${TD} s after guest-shutdown"
    else
        result "guest-shutdown (2)" FAIL "QEMU still running after 120 s"
    fi
}

for fw in "${FIRMWARES[@]}"; do
    run "$fw"
    cat "$TMP/$fw/analyze-1.txt" 2>/dev/null | sed "s/^/guest\/debian\/check: $fw: analyze: /" >&2 || true
done

echo
printf '%s\n' "${RESULTS[@]}"
if [ "$FAILS" -gt 0 ]; then
    echo "$FAILS check(s) failed"
    exit 1
fi
echo "all checks passed"
