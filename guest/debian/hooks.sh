#!/usr/bin/env bash
# The mmdebstrap hooks of guest/debian/build.sh (run as root, on the host; in the
# essential and customize phases the chroot's /proc, /sys and /dev are mounted):
#
#   hooks.sh setup ROOTDIR       before `apt-get update`: copy the cached package
#                                lists and .debs in (hard links when possible)
#   hooks.sh essential ROOTDIR   after the Essential packages, before the rest:
#                                the rootfs/ overlay and /etc/fstab, so the
#                                packages installed next (kernel, initramfs,
#                                grub, cloud-init) already see them
#   hooks.sh cache-out ROOTDIR   after all packages: save new .debs and the lists
#                                to the cache, drop .debs no longer used
#   hooks.sh customize ROOTDIR   after all packages: services, identity, GRUB
#                                (grub.cfg, modules, and the BIOS and UEFI core
#                                images, written to $DEB_WORK)
#
# Environment: DEB_CACHE (the cache dir), DEB_WORK (where the GRUB images go),
# DEB_ROOT_UUID (ext4 root), DEB_ESP_UUID (vfat serial, XXXX-XXXX), DEB_CMDLINE
# (kernel cmdline after "root=UUID=... ro"), DEB_USER (the expected default user).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
phase="${1:?phase}"
R="${2:?rootdir}"

log() { printf 'guest/debian: %s\n' "$*" >&2; }
die() { printf 'guest/debian: error: %s\n' "$*" >&2; exit 1; }

: "${DEB_CACHE:?}" "${DEB_WORK:?}" "${DEB_ROOT_UUID:?}" "${DEB_ESP_UUID:?}" "${DEB_CMDLINE:?}" "${DEB_USER:?}"

# copy_tree SRC DST: SRC's contents into DST, as hard links when on one filesystem.
copy_tree() {
    mkdir -p "$2"
    [ -d "$1" ] || return 0
    cp -al "$1/." "$2/" 2>/dev/null || cp -a "$1/." "$2/"
}

setup() {
    local n
    n="$(find "$DEB_CACHE/archives" -maxdepth 1 -name '*.deb' 2>/dev/null | wc -l)"
    log "cache: $n .debs and the package lists from $DEB_CACHE"
    mkdir -p "$R/var/cache/apt/archives/partial" "$R/var/lib/apt/lists/partial"
    copy_tree "$DEB_CACHE/archives" "$R/var/cache/apt/archives"
    # Lists are copied, not linked: apt may rewrite them in place.
    if [ -d "$DEB_CACHE/lists" ]; then
        cp -a "$DEB_CACHE/lists/." "$R/var/lib/apt/lists/"
    fi
}

cache_out() {
    mkdir -p "$DEB_CACHE/archives"
    # Keep exactly the .debs of the installed versions (apt names them
    # NAME_VERSION_ARCH.deb with the epoch's ':' as %3a).
    local keep f n=0 gone=0
    keep="$(chroot "$R" dpkg-query -W -f '${Package}_${Version}_${Architecture}.deb\n' | sed 's/:/%3a/g')"
    for f in "$R"/var/cache/apt/archives/*.deb; do
        [ -f "$f" ] || continue
        if [ ! -e "$DEB_CACHE/archives/${f##*/}" ]; then
            ln "$f" "$DEB_CACHE/archives/" 2>/dev/null || cp -a "$f" "$DEB_CACHE/archives/"
            n=$((n + 1))
        fi
    done
    for f in "$DEB_CACHE"/archives/*.deb; do
        [ -f "$f" ] || continue
        if ! grep -qxF "${f##*/}" <<<"$keep"; then
            rm -f "$f"
            gone=$((gone + 1))
        fi
    done
    rm -rf "$DEB_CACHE/lists.new"
    mkdir -p "$DEB_CACHE/lists.new"
    find "$R/var/lib/apt/lists" -maxdepth 1 -type f ! -name lock -exec cp -a {} "$DEB_CACHE/lists.new/" \;
    rm -rf "$DEB_CACHE/lists"
    mv "$DEB_CACHE/lists.new" "$DEB_CACHE/lists"
    log "cache: $n new .debs saved, $gone unused removed ($(du -sh "$DEB_CACHE" | cut -f1) in $DEB_CACHE)"
}

essential() {
    log "installing the rootfs/ overlay and /etc/fstab"
    local f rel mode
    while IFS= read -r -d '' f; do
        rel="${f#"$HERE/rootfs/"}"
        mode=0644
        [ -x "$f" ] && mode=0755
        install -D -m "$mode" -o root -g root "$f" "$R/$rel"
    done < <(find "$HERE/rootfs" -type f -print0)

    mkdir -p "$R/boot/efi"
    cat >"$R/etc/fstab" <<EOF
# <file system> <mount point> <type> <options> <dump> <pass>
UUID=$DEB_ROOT_UUID / ext4 defaults,errors=remount-ro 0 1
UUID=$DEB_ESP_UUID /boot/efi vfat umask=0077,nofail 0 0
EOF
}

customize() {
    local kver
    kver="$(cd "$R/boot" && ls vmlinuz-* | sed 's/^vmlinuz-//' | sort -V | tail -n1)"
    [ -n "$kver" ] && [ -f "$R/boot/initrd.img-$kver" ] || die "no kernel/initrd in $R/boot"
    log "kernel $kver"

    # --- no perl ---------------------------------------------------------------------
    # The Essential set brings usrmerge (and with it perl) for init-system-helpers'
    # "usrmerge | usr-is-merged". The tree is merged-/usr from the start and
    # usr-is-merged (in the package list) satisfies the dependency, so both go.
    local perlpkgs
    perlpkgs="$(chroot "$R" dpkg-query -W -f '${Package}\n' 'libperl5.*' 'perl-modules-*' 2>/dev/null || true)"
    # shellcheck disable=SC2086
    chroot "$R" env DEBIAN_FRONTEND=noninteractive apt-get -y -q purge usrmerge libfile-find-rule-perl \
        libnumber-compare-perl libtext-glob-perl perl $perlpkgs >/dev/null ||
        die "purging usrmerge and perl failed"
    chroot "$R" dpkg-query -W -f '${db:Status-Abbrev}\n' usr-is-merged 2>/dev/null | grep -q '^ii' ||
        die "usr-is-merged is not installed"

    # --- identity: nothing that must differ per VM is baked in ---------------------
    rm -f "$R"/etc/ssh/ssh_host_*_key "$R"/etc/ssh/ssh_host_*_key.pub
    : >"$R/etc/machine-id"                     # empty: systemd makes one at boot
    rm -f "$R/var/lib/dbus/machine-id" "$R/var/lib/systemd/random-seed"
    local rootpw
    rootpw="$(awk -F: '$1 == "root" { print $2 }' "$R/etc/shadow")"
    case "$rootpw" in
        '*' | '!'*) ;;
        *) die "root has a password in /etc/shadow" ;;
    esac
    echo debian >"$R/etc/hostname"
    cat >"$R/etc/hosts" <<'EOF'
127.0.0.1	localhost
127.0.1.1	debian
::1		localhost ip6-localhost ip6-loopback
ff02::1		ip6-allnodes
ff02::2		ip6-allrouters
EOF
    echo 'LANG=C.UTF-8' >"$R/etc/default/locale"

    # --- services ------------------------------------------------------------------
    # systemd-networkd does the networking cloud-init renders (its Install section
    # also enables systemd-networkd-wait-online, made conditional by the overlay).
    chroot "$R" systemctl enable systemd-networkd.service systemd-resolved.service >/dev/null 2>&1 ||
        die "systemctl enable systemd-networkd failed"
    # Nothing else may configure the NICs: no ifupdown (cloud-init would render
    # to /etc/network/interfaces.d instead, and networking.service would run
    # dhclient besides networkd), no netplan, no NetworkManager.
    local pkg
    for pkg in ifupdown netplan.io network-manager isc-dhcp-server; do
        if chroot "$R" dpkg-query -W -f '${db:Status-Abbrev}' "$pkg" 2>/dev/null | grep -q '^ii'; then
            die "$pkg is installed: systemd-networkd alone must configure the network"
        fi
    done
    [ ! -e "$R/etc/network/interfaces" ] || die "/etc/network/interfaces exists (ifupdown leftovers)"
    # iperf3's own server unit stays off (tests start `iperf3 -s` when they need one).
    if [ -e "$R/lib/systemd/system/iperf3.service" ]; then
        chroot "$R" systemctl disable iperf3.service >/dev/null 2>&1 || die "systemctl disable iperf3 failed"
    fi
    # Periodic jobs that only cost time in a short-lived test VM.
    local u
    for u in apt-daily.timer apt-daily-upgrade.timer dpkg-db-backup.timer e2scrub_all.timer \
        e2scrub_reap.service fstrim.timer; do
        if [ -e "$R/lib/systemd/system/$u" ]; then
            chroot "$R" systemctl disable "$u" >/dev/null 2>&1 || die "systemctl disable $u failed"
        fi
    done

    # acpid, for the power button before systemd-logind runs: pulled in by
    # sysinit.target, ordered only after the local filesystems (its drop-ins).
    [ -e "$R/lib/systemd/system/acpid.service" ] || die "acpid.service is missing"
    [ -x "$R/etc/acpi/powerbtn.sh" ] || die "/etc/acpi/powerbtn.sh is missing"
    chroot "$R" systemctl add-wants sysinit.target acpid.service >/dev/null 2>&1 ||
        die "systemctl add-wants sysinit.target acpid.service failed"

    # qemu-ga: Debian starts it from udev when the port appears; check the rule is there.
    grep -qs 'org.qemu.guest_agent.0' "$R"/lib/udev/rules.d/*qemu-guest-agent*.rules ||
        die "qemu-guest-agent's udev rule is missing"

    # cloud-init's default user (the one ssh_authorized_keys go to).
    local user
    user="$(awk '/^ *default_user:/ { d = 1; next } d && /^ *name:/ { print $2; exit }' "$R/etc/cloud/cloud.cfg")"
    [ "$user" = "$DEB_USER" ] || die "cloud.cfg's default user is '$user', expected '$DEB_USER'"

    # --- GRUB ------------------------------------------------------------------------
    # What grub-install would put in /boot/grub: the modules of both platforms (the
    # core images built by build.sh load the rest from here). `update-grub` in the
    # guest regenerates grub.cfg from /etc/default/grub{,.d/*.cfg} to the same effect.
    local p
    for p in i386-pc x86_64-efi; do
        mkdir -p "$R/boot/grub/$p"
        cp "$R/usr/lib/grub/$p/"*.mod "$R/usr/lib/grub/$p/"*.lst "$R/boot/grub/$p/"
    done
    chroot "$R" grub-editenv /boot/grub/grubenv create
    cat >"$R/boot/grub/grub.cfg" <<EOF
# Written by guest/debian/build.sh. \`update-grub\` rewrites it from
# /etc/default/grub and /etc/default/grub.d/*.cfg (same kernel cmdline).
set default=0
set timeout_style=hidden
set timeout=0
terminal_input console
terminal_output console
insmod part_gpt
insmod ext2
search --no-floppy --fs-uuid --set=root $DEB_ROOT_UUID
menuentry 'Debian GNU/Linux' --class debian --class gnu-linux --class os \$menuentry_id_option 'gnulinux-simple-$DEB_ROOT_UUID' {
	insmod gzio
	echo 'Loading Linux $kver ...'
	linux /boot/vmlinuz-$kver root=UUID=$DEB_ROOT_UUID ro $DEB_CMDLINE
	echo 'Loading initial ramdisk ...'
	initrd /boot/initrd.img-$kver
}
EOF

    # The core images (grub-install's job, done here without a block device),
    # made with the image's own grub-mkimage and modules. Both find the root
    # filesystem by UUID and go on with /boot/grub/grub.cfg there.
    cat >"$R/tmp/grub-early.cfg" <<EOF
search.fs_uuid $DEB_ROOT_UUID root
set prefix=(\$root)/boot/grub
EOF
    local common=(part_gpt part_msdos ext2 search search_fs_uuid normal configfile linux echo test gzio
        terminal)
    chroot "$R" grub-mkimage -O i386-pc -d /usr/lib/grub/i386-pc -c /tmp/grub-early.cfg -p /boot/grub \
        -o /tmp/core.img biosdisk "${common[@]}" || die "grub-mkimage (i386-pc) failed"
    chroot "$R" grub-mkimage -O x86_64-efi -d /usr/lib/grub/x86_64-efi -c /tmp/grub-early.cfg -p /boot/grub \
        -o /tmp/bootx64.efi fat efi_gop all_video "${common[@]}" || die "grub-mkimage (x86_64-efi) failed"
    mv "$R/tmp/core.img" "$R/tmp/bootx64.efi" "$DEB_WORK/"
    cp "$R/usr/lib/grub/i386-pc/boot.img" "$DEB_WORK/boot.img"
    rm -f "$R/tmp/grub-early.cfg"

    # --- leftovers -----------------------------------------------------------------------
    # force-unsafe-io was for the build only.
    sed -i '/^force-unsafe-io$/d' "$R/etc/dpkg/dpkg.cfg.d/99mmdebstrap"
    rm -f "$R"/var/cache/debconf/*-old "$R"/var/lib/dpkg/*-old
    rm -rf "$R"/var/lib/cloud/* "$R"/var/log/cloud-init*.log
    find "$R/var/log" -type f \( -name '*.log' -o -name '*.gz' \) -delete
}

case "$phase" in
    setup) setup ;;
    essential) essential ;;
    cache-out) cache_out ;;
    customize) customize ;;
    *) die "unknown phase: $phase" ;;
esac
