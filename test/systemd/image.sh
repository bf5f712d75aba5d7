#!/usr/bin/env bash
# Customizes the guest's root for test/systemd/run.sh (test/systemd/image.sh
# ROOT): a fixed machine-id, a persistent journal, DHCP on the user-mode NIC
# (so network-online.target means something, as on a real host), apt's
# timers masked, root's console login without a password, and the unit that
# runs the test from the payload disk once the system is up and powers off.
# run.sh caches the image by this file's hash: change it and the image is
# made again.
set -euo pipefail
R=$1
echo 0123456789abcdef0123456789abcdef >"$R/etc/machine-id"
echo ferry-guest >"$R/etc/hostname"
printf '127.0.0.1 localhost\n127.0.1.1 ferry-guest\n' >"$R/etc/hosts"
mkdir -p "$R/var/log/journal"
cat >"$R/etc/fstab" <<'EOF'
/dev/vda / ext4 rw,errors=remount-ro 0 1
EOF
cat >"$R/etc/systemd/network/20-wired.network" <<'EOF'
[Match]
Name=eth0
[Network]
DHCP=ipv4
EOF
systemctl --root="$R" enable systemd-networkd.service systemd-networkd-wait-online.service >/dev/null 2>&1
systemctl --root="$R" mask apt-daily.timer apt-daily-upgrade.timer man-db.timer e2scrub_all.timer fstrim.timer >/dev/null 2>&1
sed -i 's/^root:[^:]*:/root::/' "$R/etc/shadow"

cat >"$R/etc/systemd/system/ferry-test.service" <<'EOF'
[Unit]
Description=ferry package test (test/systemd/guest.sh from the payload disk)
After=multi-user.target network-online.target
Wants=network-online.target

[Service]
Type=oneshot
ExecStartPre=/bin/mkdir -p /payload /results
ExecStartPre=/bin/mount -o ro /dev/vdb /payload
ExecStartPre=/bin/mount /dev/vdc /results
ExecStart=/bin/bash /payload/guest.sh
ExecStopPost=/bin/sh -c 'umount /results; systemctl --no-block poweroff'
StandardOutput=journal+console
StandardError=journal+console
TimeoutStartSec=15min

[Install]
WantedBy=multi-user.target
EOF
systemctl --root="$R" enable ferry-test.service >/dev/null 2>&1
