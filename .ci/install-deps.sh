#!/usr/bin/env bash
# Install every system package hearth needs (build, tests, demo, guest build).
#
# Runs as root, non-interactive, idempotent. A second run, with everything
# already present at the right version, only checks dpkg and exits in seconds.
#
# QEMU comes from bookworm-backports: the machine image ships qemu-utils 10.x
# from backports, and installing bookworm's qemu-system-x86 7.2 would remove it
# (qemu-utils 10 Breaks qemu-system-common << 8.0). The backports suite is added
# with the same URIs as the existing Debian sources (read at run time).
set -euo pipefail

log() { printf 'install-deps: %s\n' "$*"; }

if [ "$(id -u)" -ne 0 ]; then
    echo "install-deps: must run as root" >&2
    exit 1
fi

export DEBIAN_FRONTEND=noninteractive

# Packages taken from bookworm-backports (NAME/bookworm-backports).
# qemu-utils also brings qemu-storage-daemon (with libfuse3-3), which opens a
# new rootfs disk's qcow2 for e2fsck, resize2fs and debugfs (e2fsprogs,
# below) over a FUSE export; hearthd runs as root and mounts the export
# itself, so fusermount3 (fuse3) is not needed (docs/images.md).
BPO_PKGS=(qemu-system-x86 qemu-system-common qemu-system-data seabios qemu-utils)
# Of those, the ones that must be at least this version (the QEMU 8+ line).
BPO_MIN_VERSION="1:8.0"
BPO_VERSIONED=(qemu-system-x86 qemu-system-common qemu-system-data qemu-utils)

# Packages taken from plain bookworm.
BASE_PKGS=(
    busybox-static e2fsprogs cpio lz4 gzip tmux vim git sed coreutils
    python3 socat dpkg apt libc-bin findutils
    # fault injection in the compaction tests (a qemu-img killed at its
    # fdatasync: strace -e inject=fdatasync:signal=KILL).
    strace
    build-essential pkg-config ca-certificates
    # the linker scripts/linker hands cargo's links to (much faster than
    # GNU ld for the ~60 test binaries).
    mold
    # host copies of qemu-ga's shared libraries (guest/build.sh puts them in
    # the initramfs); qemu-system-x86 pulls most of them in anyway.
    libglib2.0-0 libnuma1 liburing2 libudev1
    # OVMF for VMs with firmware: UEFI (/usr/share/OVMF/OVMF_CODE_4M.fd and
    # OVMF_VARS_4M.fd are hearthd's defaults; see docs/guests.md).
    ovmf
    # guest/debian/build.sh (the Debian 12 test image): the tree, the ESP, the
    # partition table; guest/debian/check.sh makes an SSH key for its seed.
    mmdebstrap dosfstools mtools fdisk openssh-client
    # git sources (docs/sources.md): sshd serves a repository over ssh in a
    # network namespace; gpg verifies OpenPGP-signed commits.
    openssh-server gnupg
    # the image-import benchmark compares hearth with curl + qemu-img convert.
    curl
    # host networking (docs/networking.md): DHCP per network, the
    # nftables table, ip netns for the network tests.
    dnsmasq-base nftables iproute2
    # the Debian package (docs/packaging.md): cargo-deb runs dpkg-shlibdeps
    # and strip; scripts/check-package builds its root with mmdebstrap
    # (above) and enters it with chroot and mountpoint.
    dpkg-dev binutils util-linux tar
    # OCI images (docs/images.md): the tests build image layouts with umoci
    # and read them back with skopeo; the registry tests run Debian's
    # docker-registry with an htpasswd file from apache2-utils and a CA made
    # by openssl.
    umoci skopeo docker-registry apache2-utils openssl
)

BPO_SOURCES=/etc/apt/sources.list.d/hearth-backports.sources

# --- fast path: is everything already there? ------------------------------
pkg_version() {
    # Prints the installed version, or nothing when not fully installed.
    dpkg-query -W -f='${db:Status-Abbrev} ${Version}\n' "$1" 2>/dev/null |
        awk '$1 == "ii" { print $2 }' || true
}

missing=()
for p in "${BASE_PKGS[@]}" "${BPO_PKGS[@]}"; do
    if [ -z "$(pkg_version "$p")" ]; then
        missing+=("$p")
    fi
done
for p in "${BPO_VERSIONED[@]}"; do
    v="$(pkg_version "$p")"
    if [ -n "$v" ] && ! dpkg --compare-versions "$v" ge "$BPO_MIN_VERSION"; then
        missing+=("$p(too old: $v)")
    fi
done

# --- the user QEMU runs as (hearthd --qemu-user, default hearth-qemu) --------
# hearthd refuses to start without it; the tests and the demo use the default.
# In the kvm group when there is one, so a host with usable KVM reaches
# /dev/kvm (hearthd passes kvm as QEMU's only supplementary group).
QEMU_USER=hearth-qemu
if ! getent passwd "$QEMU_USER" >/dev/null; then
    log "useradd $QEMU_USER"
    useradd --system --user-group --no-create-home --shell /usr/sbin/nologin "$QEMU_USER"
fi
if getent group kvm >/dev/null && ! id -nG "$QEMU_USER" | tr ' ' '\n' | grep -qx kvm; then
    log "usermod -aG kvm $QEMU_USER"
    usermod -aG kvm "$QEMU_USER"
fi

# --- cargo-nextest (scripts/test runs the suite with it) ------------------
# Pinned; built from crates.io with the locked dependencies the release was
# tested with, without its self-update (which would pull in a TLS stack to
# build). Skipped when that version is already installed.
NEXTEST_VERSION=0.9.151
install_nextest() {
    local have
    have="$(cargo nextest --version 2>/dev/null | awk 'NR == 1 { print $2 }' || true)"
    if [ "$have" = "$NEXTEST_VERSION" ]; then
        return 0
    fi
    log "cargo install cargo-nextest $NEXTEST_VERSION (have: ${have:-none})"
    cargo install --locked cargo-nextest --version "$NEXTEST_VERSION" \
        --no-default-features --features default-no-update
}

if [ "${#missing[@]}" -eq 0 ] && [ -f "$BPO_SOURCES" ]; then
    log "all packages present (qemu-system-x86 $(pkg_version qemu-system-x86), qemu-utils $(pkg_version qemu-utils)); nothing to do"
    install_nextest
    exit 0
fi
if [ "${#missing[@]}" -gt 0 ]; then
    log "missing or outdated: ${missing[*]}"
fi

# --- add bookworm-backports with the existing URIs -----------------------
find_debian_source() {
    # Prints "URIS|SIGNED_BY" of the deb822 stanza that carries the suite
    # "bookworm" (the main archive, not -security).
    local f
    for f in /etc/apt/sources.list.d/*.sources; do
        [ -f "$f" ] || continue
        [ "$f" = "$BPO_SOURCES" ] && continue
        awk '
            function flush() {
                if (types ~ /(^| )deb( |$)/ && suites ~ /(^| )bookworm( |$)/ && uris != "") {
                    print uris "|" signed; found = 1; exit
                }
                types = ""; suites = ""; uris = ""; signed = ""
            }
            /^[[:space:]]*$/ { flush(); next }
            /^[[:space:]]*#/ { next }
            {
                key = $1; sub(/:$/, "", key); val = $0; sub(/^[^:]*:[[:space:]]*/, "", val)
                if (key == "Types") types = val
                else if (key == "Suites") suites = val
                else if (key == "URIs") uris = val
                else if (key == "Signed-By") signed = val
            }
            END { if (!found) flush() }
        ' "$f" | head -n1 && return 0
    done
    # Fallback: one-line format in sources.list.
    if [ -f /etc/apt/sources.list ]; then
        awk '$1 == "deb" {
                i = 2; if ($2 ~ /^\[/) { while ($i !~ /\]$/) i++; i++ }
                if ($(i + 1) == "bookworm") { print $i "|"; exit }
            }' /etc/apt/sources.list
    fi
}

src="$(find_debian_source || true)"
uris="${src%%|*}"
signed="${src#*|}"
if [ -z "$uris" ]; then
    echo "install-deps: could not find a bookworm deb source in /etc/apt to copy for bookworm-backports" >&2
    exit 1
fi

want="Types: deb
URIs: $uris
Suites: bookworm-backports
Components: main"
if [ -n "$signed" ]; then
    want="$want
Signed-By: $signed"
fi
if [ ! -f "$BPO_SOURCES" ] || [ "$(cat "$BPO_SOURCES")" != "$want" ]; then
    log "writing $BPO_SOURCES (bookworm-backports, same URIs as the bookworm source)"
    printf '%s\n' "$want" >"$BPO_SOURCES"
fi

# --- update once, install ------------------------------------------------
log "apt-get update"
apt-get update -q

install_args=()
for p in "${BPO_PKGS[@]}"; do
    install_args+=("$p/bookworm-backports")
done
# Only the bookworm packages that are missing: naming an installed one would
# also upgrade it (apt, dpkg, ...), which is not this script's business.
for p in "${BASE_PKGS[@]}"; do
    if [ -z "$(pkg_version "$p")" ]; then
        install_args+=("$p")
    fi
done

log "apt-get install ${install_args[*]}"
# --no-remove: abort rather than remove anything (notably the shipped qemu-utils).
apt-get install -y -q --no-install-recommends --no-remove \
    -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold \
    "${install_args[@]}"

log "done: qemu-system-x86 $(pkg_version qemu-system-x86), qemu-utils $(pkg_version qemu-utils), busybox-static $(pkg_version busybox-static)"

# After the packages: building it needs the C toolchain installed above.
install_nextest
