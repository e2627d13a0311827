#!/usr/bin/env bash
# Build hearth's Debian 12 (bookworm) test guest: a distribution image made from
# Debian packages with mmdebstrap that behaves like Debian's cloud images
# (cloud-init from a NoCloud seed, qemu-guest-agent, openssh-server, the cloud
# kernel) and boots with both SeaBIOS and OVMF (UEFI) from the same disk.
#
# Outputs in guest/out/:
#   debian-12.qcow2    compressed qcow2, 2 GiB virtual: GPT with a BIOS boot
#                      partition (14), an EFI system partition (15) and the ext4
#                      root (1, last, so cloud-init's growpart can grow it)
#   debian-12.sha256   the qcow2's SHA-256 (64 hex digits and a newline)
#   debian-12.info     key=value lines: kernel version, default user, cmdline, ...
#
# Runs as root, non-interactive. The disk is assembled without loop devices or
# mounts, in one raw file: mkfs.ext4 -d -E offset=... fills the root filesystem
# from the tree, mkfs.vfat --offset and mtools make the ESP, sfdisk writes the
# partition table, and the BIOS boot code is put in place the way
# grub-bios-setup does it; qemu-img converts the file to qcow2.
#
# The mirrors are those of the host's apt sources (read at run time). Package
# lists and .debs are cached in ${HEARTH_GUEST_CACHE:-/var/cache/hearth/guest}/debian,
# so a rebuild (or a fresh clone on the same machine) downloads nothing new.
#
# Cached: when the outputs are newer than this script, hooks.sh and everything
# under rootfs/, it exits at once. `--force` (or HEARTH_GUEST_FORCE=1) rebuilds.
# HEARTH_GUEST_OUT=DIR builds into DIR instead of guest/out (a variant to try
# out while guest/out stays as it is).
set -euo pipefail
export PATH="/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
export LC_ALL=C.UTF-8

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="$(realpath -m "${HEARTH_GUEST_OUT:-$HERE/../out}")"
CACHE="${HEARTH_GUEST_CACHE:-/var/cache/hearth/guest}/debian"
SELF="$HERE/build.sh"
HOOKS="$HERE/hooks.sh"

NAME=debian-12
SUITE=bookworm
DEFAULT_USER=debian
CMDLINE="console=ttyS0"

# Partition layout (512-byte sectors), as in Debian's cloud images.
DISK_MIB=2048
BIOS_START=2048 BIOS_SECTORS=6144     # p14 BIOS boot, 1-4 MiB: GRUB's core.img
ESP_START=8192 ESP_SECTORS=253952     # p15 EFI system partition, 4-128 MiB, FAT32
ROOT_START=262144                     # p1 ext4 root, 128 MiB to the last MiB
ROOT_SECTORS=$(((DISK_MIB - 1) * 2048 - ROOT_START))

PACKAGES=(
    systemd systemd-sysv udev dbus systemd-resolved
    cloud-init cloud-guest-utils openssh-server qemu-guest-agent sudo
    linux-image-cloud-amd64 zstd
    grub-efi-amd64 grub-pc-bin
    e2fsprogs iproute2 iputils-ping netbase ca-certificates
    # Throughput between VMs (the network benchmark); its server is not started
    # at boot (debconf default), tests run `iperf3 -s` themselves.
    iperf3
    # Satisfies init-system-helpers' "usrmerge | usr-is-merged" without perl.
    usr-is-merged
    # The ACPI power button from early in the boot, before systemd-logind runs
    # (rootfs/etc/acpi/powerbtn.sh says why).
    acpid
)
DPKG_OPTS=(
    # Dropped again at the end of the build (hooks.sh customize): no fsync per
    # file while building; the image's dpkg keeps its defaults.
    'force-unsafe-io'
    'path-exclude=/usr/share/man/*'
    'path-exclude=/usr/share/info/*'
    'path-exclude=/usr/share/locale/*'
    'path-include=/usr/share/locale/locale.alias'
    'path-exclude=/usr/share/doc/*'
    'path-include=/usr/share/doc/*/copyright'
    'path-exclude=/usr/share/lintian/*'
)

log() { printf 'guest/debian: %s\n' "$*" >&2; }
die() { printf 'guest/debian: error: %s\n' "$*" >&2; exit 1; }

FORCE="${HEARTH_GUEST_FORCE:-0}"
for a in "$@"; do
    case "$a" in
        --force | -f) FORCE=1 ;;
        -h | --help) sed -n '2,27p' "$SELF"; exit 0 ;;
        *) die "unknown argument: $a" ;;
    esac
done

QCOW="$OUT/$NAME.qcow2"
SUM="$OUT/$NAME.sha256"
INFO="$OUT/$NAME.info"
STAMP="$OUT/.$NAME.stamp"

up_to_date() {
    [ -f "$STAMP" ] && [ -s "$QCOW" ] && [ -s "$SUM" ] && [ -s "$INFO" ] || return 1
    [ "$STAMP" -nt "$SELF" ] && [ "$STAMP" -nt "$HOOKS" ] || return 1
    [ -z "$(find "$HERE/rootfs" -newer "$STAMP" -print -quit)" ]
}

if [ "$FORCE" != 1 ] && up_to_date; then
    log "up to date: $QCOW ($(sed -n 's/^kernel=//p' "$INFO")); use --force to rebuild"
    exit 0
fi

[ "$(id -u)" -eq 0 ] || die "must run as root (mmdebstrap --mode=root, device nodes, file ownership)"

# tool:package pairs; a missing one names the package to install.
for tp in mmdebstrap:mmdebstrap mkfs.ext4:e2fsprogs mkfs.vfat:dosfstools mmd:mtools mcopy:mtools \
    sfdisk:fdisk qemu-img:qemu-utils python3:python3 sha256sum:coreutils flock:util-linux; do
    command -v "${tp%%:*}" >/dev/null ||
        die "missing host tool '${tp%%:*}': run .ci/install-deps.sh as root (or apt-get install ${tp#*:})"
done

mkdir -p "$OUT" "$CACHE/archives"

# One build at a time per output directory, and one at a time per package
# cache (builds into other directories share it).
exec 9>"$OUT/.$NAME.lock"
if ! flock -n 9; then
    log "another build is running; waiting for it"
    flock 9
    if [ "$FORCE" != 1 ] && up_to_date; then
        log "up to date: $QCOW (built by the other run)"
        exit 0
    fi
fi
exec 8>"$CACHE/.lock"
if ! flock -n 8; then
    log "another build uses the package cache $CACHE; waiting for it"
    flock 8
fi

start=$(date +%s)
phase_start=$start
phase() { # phase MSG: log MSG with the seconds since the previous phase
    local now
    now=$(date +%s)
    log "$* ($((now - phase_start)) s)"
    phase_start=$now
}

# --- mirrors: the host's apt sources ------------------------------------------------
# apt_uri SUITE: the first URI of an enabled "deb" source that carries SUITE.
apt_uri() {
    local suite="$1" f
    for f in /etc/apt/sources.list.d/*.sources; do
        [ -f "$f" ] || continue
        awk -v want="$suite" '
            function flush() {
                if (types ~ /(^| )deb( |$)/ && (" " suites " ") ~ (" " want " ") && uris != "" && enabled != "no") {
                    split(uris, u, " "); print u[1]; found = 1; exit
                }
                types = ""; suites = ""; uris = ""; enabled = ""
            }
            /^[[:space:]]*$/ { flush(); next }
            /^[[:space:]]*#/ { next }
            {
                key = $1; sub(/:$/, "", key); val = $0; sub(/^[^:]*:[[:space:]]*/, "", val)
                if (key == "Types") types = val
                else if (key == "Suites") suites = val
                else if (key == "URIs") uris = val
                else if (key == "Enabled") enabled = tolower(val)
            }
            END { if (!found) flush() }
        ' "$f" | grep . && return 0
    done
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
        [ -f "$f" ] || continue
        awk -v want="$suite" '$1 == "deb" {
                i = 2; if ($2 ~ /^\[/) { while ($i !~ /\]$/) i++; i++ }
                if ($(i + 1) == want) { print $i; found = 1; exit }
            }' "$f" | grep . && return 0
    done
    return 1
}

MAIN_URI="$(apt_uri "$SUITE")" || die "no '$SUITE' deb source in /etc/apt (sources.list.d/*.sources or sources.list)"
UPDATES_URI="$(apt_uri "$SUITE-updates" || echo "$MAIN_URI")"
MIRRORS=("deb $MAIN_URI $SUITE main" "deb $UPDATES_URI $SUITE-updates main")
if SECURITY_URI="$(apt_uri "$SUITE-security")"; then
    MIRRORS+=("deb $SECURITY_URI $SUITE-security main")
else
    log "warning: no $SUITE-security source on the host; building without security updates"
fi
log "mirrors: ${MIRRORS[*]}"

# --- work area; cleaned up on every exit path -----------------------------------------
WORK="$(mktemp -d "$OUT/.$NAME.work.XXXXXX")"
chmod 0755 "$WORK" # apt's download sandbox user must reach the tree
ROOT="$WORK/root"
cleanup() {
    local m
    # mmdebstrap unmounts what it mounted; should it have died half-way, never let
    # rm walk into a still-mounted /dev, /proc or /sys.
    if [ -d "$ROOT" ]; then
        awk -v r="$ROOT/" 'index($5, r) == 1 { print $5 }' /proc/self/mountinfo | sort -r |
            while read -r m; do umount -l "$m" 2>/dev/null || true; done
    fi
    rm -rf --one-file-system "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

ROOT_UUID="$(cat /proc/sys/kernel/random/uuid)"
ESP_SERIAL="$(od -An -N4 -tx4 /dev/urandom | tr -d ' \n' | tr a-f A-F)"
ESP_UUID="${ESP_SERIAL:0:4}-${ESP_SERIAL:4:4}"
export DEB_CACHE="$CACHE" DEB_WORK="$WORK" DEB_ROOT_UUID="$ROOT_UUID" DEB_ESP_UUID="$ESP_UUID" \
    DEB_CMDLINE="$CMDLINE" DEB_USER="$DEFAULT_USER"

# --- the root tree ----------------------------------------------------------------------
log "mmdebstrap $SUITE (${#PACKAGES[@]} packages + dependencies; log: $OUT/$NAME.build.log)"
mm_args=(--mode=root --variant=apt --format=directory
    --aptopt='Acquire::Languages "none"'
    --include="$(IFS=,; echo "${PACKAGES[*]}")"
    --skip=essential/unlink
    --setup-hook="\"$HOOKS\" setup \"\$1\""
    --essential-hook="\"$HOOKS\" essential \"\$1\""
    --customize-hook="\"$HOOKS\" cache-out \"\$1\""
    --customize-hook="\"$HOOKS\" customize \"\$1\"")
for o in "${DPKG_OPTS[@]}"; do
    mm_args+=(--dpkgopt="$o")
done
# The log, with the seconds since the start on each line, is kept as
# guest/out/debian-12.build.log.
BUILD_LOG="$OUT/$NAME.build.log"
stamp_lines() {
    local line
    while IFS= read -r line; do
        printf '%4d %s\n' $(($(date +%s) - start)) "$line"
    done
}
if ! mmdebstrap "${mm_args[@]}" "$SUITE" "$ROOT" "${MIRRORS[@]}" 2>&1 | stamp_lines >"$BUILD_LOG"; then
    tail -n 40 "$BUILD_LOG" >&2
    die "mmdebstrap failed (last lines above; all in $BUILD_LOG)"
fi
sed -n 's/^ *[0-9]* \(guest\/debian:\)/\1/p' "$BUILD_LOG" >&2

KVER="$(cd "$ROOT/boot" && ls vmlinuz-* | sed 's/^vmlinuz-//' | sort -V | tail -n1)"
NPKG="$(chroot "$ROOT" dpkg-query -W -f '${db:Status-Abbrev}\n' | grep -c '^ii')"
phase "tree ready: kernel $KVER, $NPKG packages, $(du -sh --one-file-system "$ROOT" | cut -f1)"
for f in core.img bootx64.efi boot.img; do
    [ -s "$WORK/$f" ] || die "the hooks made no $f"
done

# --- the disk: filesystems written in place, then the partition table ---------------
DISK="$WORK/disk.raw"
truncate -s "${DISK_MIB}M" "$DISK"
mkfs.ext4 -q -F -L debian-root -U "$ROOT_UUID" \
    -E offset=$((ROOT_START * 512)),lazy_itable_init=0,lazy_journal_init=0,nodiscard \
    -d "$ROOT" "$DISK" $((ROOT_SECTORS / 2))k || die "mkfs.ext4 -d failed"
phase "root filesystem: ext4 $((ROOT_SECTORS / 2048)) MiB, UUID $ROOT_UUID"

# One sector per cluster: enough clusters for a valid FAT32 (mkfs.vfat would size
# the clusters for the whole 2 GiB file). It warns that the file is larger.
out="$(mkfs.vfat -F 32 -s 1 -h "$ESP_START" -n ESP -i "$ESP_SERIAL" --offset="$ESP_START" \
    "$DISK" $((ESP_SECTORS / 2)) 2>&1)" || die "mkfs.vfat failed: $out"
export MTOOLS_SKIP_CHECK=1
ESP_IMG="$DISK@@$((ESP_START * 512))"
mmd -i "$ESP_IMG" ::/EFI ::/EFI/BOOT || die "mmd on the ESP failed"
mcopy -i "$ESP_IMG" "$WORK/bootx64.efi" ::/EFI/BOOT/BOOTX64.EFI || die "mcopy to the ESP failed"
log "ESP: FAT32 $((ESP_SECTORS / 2048)) MiB, UUID $ESP_UUID, EFI/BOOT/BOOTX64.EFI"

# sfdisk numbers the partitions from the names (disk.raw1, disk.raw14, ...) and,
# told so, leaves the filesystems alone.
out="$(sfdisk -q --no-reread --no-tell-kernel --wipe never --wipe-partitions never "$DISK" 2>&1 <<EOF
label: gpt
unit: sectors
first-lba: 2048
${DISK}14 : start=$BIOS_START, size=$BIOS_SECTORS, type=21686148-6449-6E6F-744E-656564454649, name="bios"
${DISK}15 : start=$ESP_START, size=$ESP_SECTORS, type=C12A7328-F81F-11D2-BA4B-00A0C93EC93B, name="esp"
${DISK}1 : start=$ROOT_START, size=$ROOT_SECTORS, type=0FC63DAF-8483-4772-8E79-3D69D8477DE4, name="root"
EOF
)" || die "sfdisk failed: $out"

# BIOS: boot.img's code into the MBR (not its partition table), pointing at
# core.img in the BIOS boot partition; core.img's first sector (diskboot) gets
# the location of the rest. The same patches grub-bios-setup makes.
python3 - "$DISK" "$WORK/boot.img" "$WORK/core.img" "$BIOS_START" "$BIOS_SECTORS" <<'EOF' || die "installing the BIOS boot code failed"
import struct, sys
disk, boot_path, core_path, start, room = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
boot = bytearray(open(boot_path, "rb").read())
core = bytearray(open(core_path, "rb").read())
if len(boot) != 512:
    sys.exit(f"boot.img is {len(boot)} bytes, not 512")
sectors = (len(core) + 511) // 512
if sectors > room:
    sys.exit(f"core.img needs {sectors} sectors, the BIOS boot partition has {room}")
struct.pack_into("<Q", boot, 0x5C, start)        # GRUB_BOOT_MACHINE_KERNEL_SECTOR
boot[0x66:0x68] = b"\x90\x90"                    # hard disk: drop the boot drive check
# diskboot's blocklist (GRUB_BOOT_MACHINE_LIST_SIZE = 12 bytes at the end of
# the first sector): start (u64), len (u16), segment (u16); mkimage set len.
off = 512 - 12
length = struct.unpack_from("<H", core, off + 8)[0]
if length != sectors - 1:
    sys.exit(f"unexpected diskboot blocklist length {length} (core.img has {sectors} sectors)")
struct.pack_into("<Q", core, off, start + 1)
with open(disk, "r+b") as f:
    mbr = bytearray(f.read(512))
    if mbr[510:512] != b"\x55\xaa":
        sys.exit("no protective MBR in sector 0")
    mbr[0:440] = boot[0:440]
    f.seek(0)
    f.write(mbr)
    f.seek(start * 512)
    f.write(core)
EOF
phase "disk: GPT, BIOS boot + ESP + root, $DISK_MIB MiB"

qemu-img convert -q -c -W -m 4 -f raw -O qcow2 "$DISK" "$WORK/$NAME.qcow2" || die "qemu-img convert failed"
rm -f "$DISK"
phase "qcow2 (compressed): $(du -h "$WORK/$NAME.qcow2" | cut -f1)"

sha256sum "$WORK/$NAME.qcow2" | cut -d' ' -f1 >"$WORK/$NAME.sha256"
cat >"$WORK/$NAME.info" <<EOF
name=$NAME
distribution=Debian GNU/Linux 12 ($SUITE)
kernel=$KVER
user=$DEFAULT_USER
cmdline=root=UUID=$ROOT_UUID ro $CMDLINE
root_uuid=$ROOT_UUID
esp_uuid=$ESP_UUID
partitions=1:root(ext4),14:bios-boot,15:esp(vfat)
firmware=bios,uefi
virtual_size=$((DISK_MIB * 1024 * 1024))
packages=$NPKG
cloud_init=$(chroot "$ROOT" dpkg-query -W -f '${Version}' cloud-init)
qemu_guest_agent=$(chroot "$ROOT" dpkg-query -W -f '${Version}' qemu-guest-agent)
built=$(date -u +%Y-%m-%dT%H:%M:%SZ)
EOF
for f in "$NAME.qcow2" "$NAME.sha256" "$NAME.info"; do
    mv -f "$WORK/$f" "$OUT/$f"
done
touch "$STAMP"

log "built in $(($(date +%s) - start)) s: $QCOW ($(du -h "$QCOW" | cut -f1), sha256 $(cut -c1-16 "$SUM")...)"
sed 's/^/guest\/debian:   /' "$INFO" >&2
