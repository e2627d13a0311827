#!/usr/bin/env bash
# Build hearth's small test guest into guest/out/:
#   vmlinuz      Debian cloud kernel (linux-image-<ver>-cloud-amd64-unsigned)
#   initrd.img   gzip cpio: busybox-static + virtio modules + qemu-ga + /init
#   data.qcow2   64 MiB qcow2 base image, ext4, with /hello.txt
#   cmdline      recommended kernel cmdline
#   (the initramfs also holds /bin/stallwatch, built from stallwatch.c with
#   gcc -static; the freeze-window benchmark runs it in the guest;
#   /bin/randread, from randread.c, the chain-compaction benchmark's random
#   4 KiB reader; and
#   /etc/hearth/udhcpc.script, from udhcpc.script: the DHCP client's hook)
#
# Guest pieces are fetched with `apt-get download` into guest/cache/ (never
# installed on the host) and unpacked with `dpkg-deb -x`. Host needs (see
# .ci/install-deps.sh): busybox-static, e2fsprogs, cpio, gzip, qemu-utils,
# and the shared libraries of qemu-ga (libglib2.0-0, libnuma1, liburing2,
# libudev1), which are copied from the host into the initramfs.
#
# Cached: when every output is newer than this script, guest/init,
# guest/udhcpc.script, guest/stallwatch.c and guest/randread.c, it exits at once. `guest/build.sh --force` (or
# HEARTH_GUEST_FORCE=1) rebuilds.
# HEARTH_GUEST_CACHE=DIR puts the download cache elsewhere (default
# guest/cache/), e.g. somewhere that outlives a fresh clone.
set -euo pipefail

GUEST_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="$GUEST_DIR/out"
CACHE="${HEARTH_GUEST_CACHE:-$GUEST_DIR/cache}" # downloaded .debs, unpacked trees
INIT_SRC="$GUEST_DIR/init"
STALL_SRC="$GUEST_DIR/stallwatch.c"
RANDREAD_SRC="$GUEST_DIR/randread.c"
DHCP_SRC="$GUEST_DIR/udhcpc.script"
SELF="$GUEST_DIR/build.sh"
CMDLINE="console=ttyS0 quiet panic=-1"
DATA_SIZE=64M

log() { printf 'guest/build: %s\n' "$*" >&2; }
die() { printf 'guest/build: error: %s\n' "$*" >&2; exit 1; }

FORCE="${HEARTH_GUEST_FORCE:-0}"
for a in "$@"; do
    case "$a" in
        --force | -f) FORCE=1 ;;
        -h | --help) sed -n '2,20p' "$SELF"; exit 0 ;;
        *) die "unknown argument: $a" ;;
    esac
done

OUTPUTS=("$OUT/vmlinuz" "$OUT/initrd.img" "$OUT/data.qcow2" "$OUT/cmdline")
STAMP="$OUT/.stamp"

up_to_date() {
    [ -f "$STAMP" ] || return 1
    local f
    for f in "${OUTPUTS[@]}"; do
        [ -s "$f" ] || return 1
    done
    [ "$STAMP" -nt "$SELF" ] && [ "$STAMP" -nt "$INIT_SRC" ] && [ "$STAMP" -nt "$STALL_SRC" ] && [ "$STAMP" -nt "$RANDREAD_SRC" ] &&
        [ "$STAMP" -nt "$DHCP_SRC" ]
}

if [ "$FORCE" != 1 ] && up_to_date; then
    log "up to date: $OUT ($(cat "$OUT/kernel-version" 2>/dev/null || echo '?')); use --force to rebuild"
    exit 0
fi

start=$(date +%s)

for tool in apt-get apt-cache dpkg-deb cpio gzip mkfs.ext4 qemu-img ldd busybox gcc; do
    command -v "$tool" >/dev/null || die "missing host tool '$tool' (run .ci/install-deps.sh as root)"
done
BUSYBOX="$(command -v busybox)"
# The static busybox is needed: the initramfs has no libc for a dynamic one.
if ldd "$BUSYBOX" >/dev/null 2>&1; then
    die "$BUSYBOX is dynamically linked; install busybox-static"
fi

mkdir -p "$OUT" "$CACHE"

# --- download (cached) --------------------------------------------------------
KPKG_META=linux-image-cloud-amd64
QGA_PKG=qemu-guest-agent
APT_OPTS=(-q)
[ "$(id -u)" = 0 ] && APT_OPTS+=(-o APT::Sandbox::User=root) # no "_apt cannot access" note

# resolve: sets KVER (uname -r of the guest kernel) and KPKG from apt's lists.
resolve() {
    local kdep
    kdep="$(apt-cache depends "$KPKG_META" 2>/dev/null |
        sed -n 's/^ *Depends: linux-image-\([0-9][^ ]*\)-cloud-amd64\(-unsigned\)\{0,1\}$/\1/p' | head -n1)"
    [ -n "$kdep" ] || return 1
    KVER="${kdep}-cloud-amd64"
    KPKG="linux-image-${KVER}-unsigned"
}

# fetch PKG: downloads (unless cached) the candidate version's .deb into
# $CACHE and prints its path.
fetch() {
    local pkg="$1" ver deb
    ver="$(apt-cache policy "$pkg" 2>/dev/null | sed -n 's/^ *Candidate: //p')"
    if [ -z "$ver" ] || [ "$ver" = "(none)" ]; then
        log "no candidate version for $pkg"
        return 1
    fi
    # apt-get download names files with the epoch's ':' escaped as %3a.
    deb="$CACHE/${pkg}_${ver//:/%3a}_amd64.deb"
    if [ ! -s "$deb" ]; then
        log "downloading $pkg $ver"
        (cd "$CACHE" && apt-get download "${APT_OPTS[@]}" "$pkg=$ver" >/dev/null) || return 1
        [ -s "$deb" ] || { log "expected $deb after download"; return 1; }
    fi
    echo "$deb"
}

get_debs() {
    resolve || { log "cannot resolve the version of $KPKG_META"; return 1; }
    kdeb="$(fetch "$KPKG")" || return 1
    qdeb="$(fetch "$QGA_PKG")" || return 1
}

if ! get_debs; then
    # Stale or missing apt lists (e.g. the archive moved on to a newer
    # kernel): refresh them once when we can, and try again.
    [ "$(id -u)" = 0 ] || die "apt lists missing or stale: run 'apt-get update' (or .ci/install-deps.sh) as root"
    log "apt-get update, then retrying"
    apt-get update -q >/dev/null || die "apt-get update failed"
    get_debs || die "cannot download the guest packages ($KPKG_META's kernel, $QGA_PKG)"
fi

# unpack DEB: prints a directory with its contents (cached by file name).
unpack() {
    local deb="$1" dir
    dir="$CACHE/unpacked/$(basename "$deb" .deb)"
    if [ ! -f "$dir/.done" ] || [ "$deb" -nt "$dir/.done" ]; then
        rm -rf "$dir"
        mkdir -p "$dir"
        dpkg-deb -x "$deb" "$dir"
        touch "$dir/.done"
    fi
    echo "$dir"
}

log "kernel: $(basename "$kdeb")"
log "agent:  $(basename "$qdeb")"
kdir="$(unpack "$kdeb")"
qdir="$(unpack "$qdeb")"

MODDIR="$kdir/lib/modules/$KVER"
[ -d "$MODDIR" ] || die "no $MODDIR in $kdeb"
[ -f "$kdir/boot/vmlinuz-$KVER" ] || die "no boot/vmlinuz-$KVER in $kdeb"
[ -x "$qdir/usr/sbin/qemu-ga" ] || die "no usr/sbin/qemu-ga in $qdeb"

# Clean up unpacked trees and debs of versions no longer used.
for d in "$CACHE"/unpacked/*; do
    [ -d "$d" ] || continue
    case "$d" in "$kdir" | "$qdir") ;; *) rm -rf "$d" ;; esac
done
for f in "$CACHE"/linux-image-*-cloud-amd64-unsigned_*.deb "$CACHE"/"$QGA_PKG"_*.deb; do
    [ -f "$f" ] || continue
    case "$f" in "$kdeb" | "$qdeb") ;; *) log "removing old $(basename "$f")"; rm -f "$f" ;; esac
done

WORK="$(mktemp -d "$OUT/.work.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

# --- initramfs root ------------------------------------------------------------
ROOT="$WORK/root"
mkdir -p "$ROOT"/{bin,sbin,usr/bin,usr/sbin,etc/hearth,lib,lib64,proc,sys,dev,run,tmp,mnt,data,root,var}
ln -s ../run "$ROOT/var/run"
chmod 1777 "$ROOT/tmp"

# busybox with applet links (ours for shutdown/poweroff/reboot come later).
cp "$BUSYBOX" "$ROOT/bin/busybox"
while read -r applet; do
    [ -n "$applet" ] || continue
    name="${applet##*/}"
    [ "$name" = busybox ] && continue
    dir="$ROOT/$(dirname "$applet")"
    mkdir -p "$dir"
    [ -e "$dir/$name" ] || ln -s /bin/busybox "$dir/$name"
done < <("$BUSYBOX" --list-full)
ln -sf /bin/busybox "$ROOT/bin/sh"

# Modules: the virtio stack (disks, the agent's serial port, NICs) plus
# whatever of ext4 is not built in, closed over each module's depends= and
# ordered so dependencies load first (virtio_net brings net_failover and
# failover).
WANT_MODS=(virtio_pci virtio_mmio virtio_blk virtio_console virtio_net ext4)
declare -A MOD_PATH=() SEEN=()
while read -r rel; do
    base="${rel##*/}"
    base="${base%.ko*}"
    MOD_PATH["${base//-/_}"]="$rel"
done < <(cd "$MODDIR" && find kernel -name '*.ko*')
builtin_mod() { grep -qE "/${1//_/[_-]}\.ko\$" "$MODDIR/modules.builtin"; }
mod_depends() {
    local f="$MODDIR/${MOD_PATH[$1]}"
    case "$f" in
        *.ko) tr '\0' '\n' <"$f" ;;
        *.ko.xz) xz -dc "$f" | tr '\0' '\n' ;;
        *.ko.zst) zstd -dc "$f" | tr '\0' '\n' ;;
        *.ko.gz) gzip -dc "$f" | tr '\0' '\n' ;;
    esac | sed -n 's/^depends=//p' | head -n1 | tr ',' ' '
}
ORDER=()
visit() {
    local m="${1//-/_}" d
    [ -n "${SEEN[$m]:-}" ] && return 0
    SEEN[$m]=1
    if [ -z "${MOD_PATH[$m]:-}" ]; then
        builtin_mod "$m" && return 0
        die "module $m is neither built in nor shipped in $KPKG"
    fi
    for d in $(mod_depends "$m"); do
        visit "$d"
    done
    ORDER+=("$m")
}
for m in "${WANT_MODS[@]}"; do
    visit "$m"
done
: >"$ROOT/etc/hearth/modules"
for m in "${ORDER[@]}"; do
    rel="${MOD_PATH[$m]}"
    mkdir -p "$ROOT/lib/modules/$KVER/$(dirname "$rel")"
    case "$rel" in
        *.ko) cp "$MODDIR/$rel" "$ROOT/lib/modules/$KVER/$rel" ;;
        *) die "compressed module $rel: not supported by busybox insmod here" ;;
    esac
    echo "$rel" >>"$ROOT/etc/hearth/modules"
done
log "modules: ${ORDER[*]}"

# qemu-ga and the shared libraries it needs, taken from the host.
cp "$qdir/usr/sbin/qemu-ga" "$ROOT/usr/sbin/qemu-ga"
ldd_out="$(ldd "$qdir/usr/sbin/qemu-ga")"
if grep -q 'not found' <<<"$ldd_out"; then
    die "qemu-ga needs libraries missing on the host:
$(grep 'not found' <<<"$ldd_out")
(run .ci/install-deps.sh)"
fi
while read -r lib; do
    [ -n "$lib" ] || continue
    mkdir -p "$ROOT$(dirname "$lib")"
    cp -L "$lib" "$ROOT$lib"
done < <(awk '/=> \// { print $3 } /^[[:space:]]*\/[^ ]+ \(/ { print $1 }' <<<"$ldd_out")

# /init and helper scripts.
install -m 0755 "$INIT_SRC" "$ROOT/init"
install -m 0755 "$DHCP_SRC" "$ROOT/etc/hearth/udhcpc.script"
# A page for httpd (`httpd -p 80 -h /srv/www`, or hearth.httpd=PORT).
mkdir -p "$ROOT/srv/www"
echo "hello from hearth-guest" >"$ROOT/srv/www/index.html"
# The benchmarks' in-guest write-stall probe (static: no libc in the guest).
gcc -static -O2 -o "$ROOT/bin/stallwatch" "$STALL_SRC" || die "cannot build $STALL_SRC (needs gcc and libc6-dev)"
# The compaction benchmark's random 4 KiB reader (O_DIRECT).
gcc -static -O2 -Wall -o "$ROOT/bin/randread" "$RANDREAD_SRC" || die "cannot build $RANDREAD_SRC (needs gcc and libc6-dev)"

cat >"$ROOT/etc/hearth/fsfreeze-hook" <<'EOF'
#!/bin/sh
# qemu-ga fsfreeze hook: called with "freeze" (before the freeze) or "thaw".
# With hearth.freeze_hook_sleep=N on the kernel cmdline, "freeze" sleeps N s.
# Each call also appends "<action> <uptime s>" to /run/fsfreeze-times (tmpfs,
# never frozen; read is a builtin, so no process): the freeze lies between a
# "freeze" line and the "thaw" line after it, on the guest's own clock.
read up _ </proc/uptime 2>/dev/null && echo "$1 $up" >>/run/fsfreeze-times
n=""
for arg in $(cat /proc/cmdline); do
    case "$arg" in
        hearth.freeze_hook_sleep=*) n="${arg#*=}" ;;
    esac
done
if [ "$1" = freeze ] && [ -n "$n" ]; then
    echo "hearth-guest: fsfreeze hook: freeze (sleeping $n s)" >/dev/console 2>/dev/null
    sleep "$n"
elif [ "$1" = freeze ]; then
    # Runs just before qemu-ga's FIFREEZE: whether that freeze's RCU grace
    # periods are expedited (hearth's step before a freeze sets it).
    # (read is a shell builtin: no process is started.)
    r=?
    if [ -p /sys/kernel/rcu_expedited ]; then
        r=fifo # hearth.rcu_expedited_hangs=1: opening it would hang
    else
        read r </sys/kernel/rcu_expedited 2>/dev/null
    fi
    echo "hearth-guest: fsfreeze hook: freeze (rcu_expedited=$r)" >/dev/console 2>/dev/null
else
    echo "hearth-guest: fsfreeze hook: $1" >/dev/console 2>/dev/null
fi
exit 0
EOF
chmod 0755 "$ROOT/etc/hearth/fsfreeze-hook"

cat >"$ROOT/sbin/hearth-halt" <<'EOF'
#!/bin/sh
# hearth-halt poweroff|reboot: stop processes, sync, unmount (or remount
# read-only) the data filesystems, then power off or reboot at once.
action="${1:-poweroff}"
echo "hearth-guest: $action" >/dev/console 2>/dev/null
sync
kill -TERM -1 2>/dev/null   # everything but PID 1 and this script
sleep 0.2
kill -KILL -1 2>/dev/null
sync
for m in $(awk '$1 ~ /^\/dev\/vd/ { print $2 }' /proc/mounts | tac); do
    umount "$m" 2>/dev/null || mount -o remount,ro "$m" 2>/dev/null
done
sync
case "$action" in
    reboot) exec busybox reboot -f ;;
    *) exec busybox poweroff -f ;;
esac
EOF
chmod 0755 "$ROOT/sbin/hearth-halt"

cat >"$ROOT/sbin/shutdown" <<'EOF'
#!/bin/sh
# Minimal shutdown(8) for qemu-ga: "shutdown -h -P +0 msg" powers off,
# "-r" reboots; "-H" (halt) also powers off, so the VM really stops.
action=poweroff
for arg in "$@"; do
    case "$arg" in
        -r) action=reboot ;;
        -c) exit 0 ;;
    esac
done
# Detach so the caller (qemu-ga) sees success before processes are stopped.
setsid /sbin/hearth-halt "$action" </dev/null >/dev/null 2>&1 &
exit 0
EOF
chmod 0755 "$ROOT/sbin/shutdown"
for a in poweroff halt reboot; do
    rm -f "$ROOT/sbin/$a" "$ROOT/bin/$a"
    act=poweroff
    [ "$a" = reboot ] && act=reboot
    printf '#!/bin/sh\nsetsid /sbin/hearth-halt %s </dev/null >/dev/null 2>&1 &\nexit 0\n' "$act" >"$ROOT/sbin/$a"
    chmod 0755 "$ROOT/sbin/$a"
done

printf 'root:x:0:0:root:/root:/bin/sh\n' >"$ROOT/etc/passwd"
printf 'root:x:0:\n' >"$ROOT/etc/group"
printf '127.0.0.1\tlocalhost\n127.0.1.1\thearth-guest\n::1\t\tlocalhost\n' >"$ROOT/etc/hosts"
printf 'NAME="hearth test guest"\nID=hearth-guest\nPRETTY_NAME="hearth test guest (%s, %s)"\n' \
    "$KVER" "$(basename "$qdeb" .deb)" >"$ROOT/etc/os-release"
echo hearth-guest >"$ROOT/etc/hostname"
if [ "$(id -u)" = 0 ]; then
    mknod -m 600 "$ROOT/dev/console" c 5 1
    mknod -m 666 "$ROOT/dev/null" c 1 3
fi

log "packing initramfs"
(cd "$ROOT" && find . -mindepth 1 | LC_ALL=C sort | cpio -o -H newc -R 0:0 --quiet) |
    gzip -6 -n >"$WORK/initrd.img"

# --- data disk --------------------------------------------------------------------
log "making data disk ($DATA_SIZE ext4 -> qcow2)"
SEED="$WORK/seed"
mkdir -p "$SEED"
echo "hello from hearth" >"$SEED/hello.txt"
truncate -s "$DATA_SIZE" "$WORK/data.raw"
mkfs.ext4 -q -F -L hearth-data -E root_owner=0:0 -d "$SEED" "$WORK/data.raw"
qemu-img convert -f raw -O qcow2 "$WORK/data.raw" "$WORK/data.qcow2"

# --- install outputs ----------------------------------------------------------------
cp "$kdir/boot/vmlinuz-$KVER" "$WORK/vmlinuz"
echo "$CMDLINE" >"$WORK/cmdline"
for f in vmlinuz initrd.img data.qcow2 cmdline; do
    mv -f "$WORK/$f" "$OUT/$f"
done
echo "$KVER" >"$OUT/kernel-version"
touch "$STAMP"

log "built in $(($(date +%s) - start)) s: $OUT"
ls -l "${OUTPUTS[@]}" | sed 's/^/guest\/build:   /' >&2
