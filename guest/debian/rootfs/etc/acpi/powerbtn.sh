#!/bin/sh
# acpid's action for the ACPI power button (events/powerbtn).
#
# systemd-logind handles the button (HandlePowerKey=poweroff) once it runs,
# honouring inhibitors: then leave it to logind. But logind starts only after
# basic.target, which waits for cloud-init's network stage (ordered before
# sysinit.target): under TCG that is tens of seconds into the boot, and a press
# before it would be lost. Until then, power off through systemd itself (PID 1's
# private socket needs no D-Bus): the same orderly shutdown, poweroff.target.
if systemctl --quiet is-active systemd-logind.service; then
    logger -t powerbtn "power button pressed: left to systemd-logind"
    exit 0
fi
logger -t powerbtn "power button pressed: systemd-logind is not running yet; powering off through systemd"
exec systemctl --no-block start poweroff.target --job-mode=replace-irreversibly
