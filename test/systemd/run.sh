#!/usr/bin/env bash
# Checks ferry's Debian package on a booted Debian 12 with systemd as init
# (make test-systemd builds the package and runs this):
#   test/systemd/run.sh bin/ferry_VERSION_ARCH.deb
# A QEMU guest (TCG; 4 GiB, 2 CPUs) boots Debian's own kernel and systemd
# from a root that mmdebstrap builds from this host's apt sources (cached
# in .cache/systemdvm), installs the package, and runs test/systemd/guest.sh
# twice: on the first boot, from install to a broken configuration, on the
# second (start at boot), upgrade, remove and purge. The guest writes one
# PASS or FAIL line per check, with its evidence, to a results disk this
# script reads back afterwards; each boot runs on a qcow2 overlay, so the
# cached image stays clean.
#
# Exit status 0 only when the guest finished both boots and every check
# passed.
#
# Environment:
#   SYSTEMDVM_CACHE    the root and image cache (default .cache/systemdvm)
#   SYSTEMDVM_MEM      guest memory (default 4G)
#   SYSTEMDVM_TIMEOUT  seconds each boot may run (default 900)
#   SYSTEMDVM_BASE     a commit whose ferryd.service is scored beside the
#                      package's by systemd-analyze security (default
#                      ae8b40e, the unit before its hardening; empty: none)
#   KEEP=1             keeps the work folder (console logs, images)
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
T0=$(date +%s)
say() { printf 'systemdvm [%3ds] %s\n' $(($(date +%s) - T0)) "$*"; }
die() {
	say "FAIL: $*"
	exit 1
}

[[ $# -eq 1 && -f $1 ]] || die "usage: $0 bin/ferry_VERSION_ARCH.deb (make test-systemd builds it)"
deb=$(realpath "$1")
[[ $(id -u) -eq 0 ]] || die "needs root: mmdebstrap builds the guest's root, owned by root, and mkfs.ext4 images it"
CACHE=${SYSTEMDVM_CACHE:-$ROOT/.cache/systemdvm}
MEM=${SYSTEMDVM_MEM:-4G}
BOOT_TIMEOUT=${SYSTEMDVM_TIMEOUT:-900}
BASE=${SYSTEMDVM_BASE-ae8b40e}
scripts/deps.sh systemdvm

# ---- the guest's root: Debian's packages, cached ----------------------
# Everything the guest needs, and what the package depends on, so dpkg -i
# installs it offline.
PKGS=systemd-sysv,udev,libibverbs1,ibverbs-providers,iproute2,curl,kmod,procps,linux-image-amd64,zstd,initramfs-tools
key=$(printf '%s\n' "$PKGS" "$(cat /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null)" | sha256sum | cut -c1-12)
rootdir=$CACHE/root-$key
mkdir -p "$CACHE"
if [[ ! -d $rootdir ]]; then
	say "building the guest's root with mmdebstrap (bookworm, the host's apt sources; minutes, once)"
	sources=()
	for f in /etc/apt/sources.list.d/*.sources /etc/apt/sources.list; do
		[[ -s $f ]] && sources+=("$f")
	done
	rm -rf "$rootdir.new"
	timeout 1800 mmdebstrap --variant=apt --include="$PKGS" bookworm "$rootdir.new" "${sources[@]}" \
		</dev/null >"$CACHE/mmdebstrap.log" 2>&1 ||
		die "mmdebstrap failed; the end of $CACHE/mmdebstrap.log:"$'\n'"$(tail -20 "$CACHE/mmdebstrap.log")"
	mv "$rootdir.new" "$rootdir"
fi
kernel=$(ls "$rootdir"/boot/vmlinuz-* | sort -V | tail -1)
initrd=$(ls "$rootdir"/boot/initrd.img-* | sort -V | tail -1)
[[ -f $kernel && -f $initrd ]] || die "the guest's root has no kernel and initramfs in /boot"

# ---- the image: the root, customized for the test, cached ---------------
# Its key covers the customization (test/systemd/image.sh) too.
img=$CACHE/root-$key-$(sha256sum test/systemd/image.sh | cut -c1-12).img
if [[ ! -f $img ]]; then
	say "imaging the root (cp, image.sh, mkfs.ext4 -d)"
	work=$(mktemp -d "$CACHE/image.XXXXXX")
	cp -a "$rootdir" "$work/root"
	test/systemd/image.sh "$work/root"
	mkfs.ext4 -q -F -L root -d "$work/root" "$work/root.img" 4G
	mv "$work/root.img" "$img"
	rm -rf "$work"
	find "$CACHE" -maxdepth 1 -name "root-$key-*.img" ! -name "$(basename "$img")" -delete
fi

tmp=$(mktemp -d /tmp/ferry-test-systemd.XXXXXX)
trap '[[ -n ${KEEP:-} ]] && say "kept $tmp" || rm -rf "$tmp"' EXIT

# ---- the payload: the package, its upgrade, the guest's script ----------
pl=$tmp/payload
mkdir -p "$pl"
cp "$deb" "$pl/ferry_1.deb"
# The upgrade: the same package with a higher version, whose ferryd.toml
# changed too, so dpkg meets both files changed (the case that would
# prompt; the guest answers --force-confold).
v1=$(dpkg-deb -f "$deb" Version)
dpkg-deb -R "$deb" "$tmp/v2"
sed -i "s/^Version: .*/Version: $v1+upgradetest/" "$tmp/v2/DEBIAN/control"
echo '# (a line the new version added)' >>"$tmp/v2/etc/ferry/ferryd.toml"
(cd "$tmp/v2" && find . -path ./DEBIAN -prune -o -type f -printf '%P\0' | LC_ALL=C sort -z | xargs -0 md5sum) >"$tmp/v2/DEBIAN/md5sums"
dpkg-deb -Zgzip --root-owner-group -b "$tmp/v2" "$pl/ferry_2.deb" >/dev/null
cp test/systemd/guest.sh "$pl/"
if [[ -n $BASE ]] && git cat-file -e "$BASE:systemd/ferryd.service" 2>/dev/null; then
	git show "$BASE:systemd/ferryd.service" >"$pl/base-ferryd.service"
	echo "$BASE" >"$pl/base-commit"
fi
mkfs.ext4 -q -F -L payload -d "$pl" "$tmp/payload.img" 64M
say "payload: ferry $v1 and $v1+upgradetest, guest.sh"

# ---- two boots on one overlay ------------------------------------------
qemu-img create -q -f qcow2 -F raw -b "$img" "$tmp/overlay.qcow2"
mkfs.ext4 -q -F -L results "$tmp/results.img" 32M
boot() {
	local n=$1 rc=0
	say "boot $n (QEMU TCG, $MEM, 2 CPUs; console in $tmp/console-$n.log)"
	timeout "$BOOT_TIMEOUT" qemu-system-x86_64 -accel tcg,thread=multi -smp 2 -m "$MEM" \
		-nographic -no-reboot -monitor none \
		-kernel "$kernel" -initrd "$initrd" \
		-append "root=/dev/vda rw console=ttyS0 net.ifnames=0 systemd.show_status=1 panic=-1" \
		-drive file="$tmp/overlay.qcow2",if=virtio,format=qcow2 \
		-drive file="$tmp/payload.img",if=virtio,format=raw,readonly=on \
		-drive file="$tmp/results.img",if=virtio,format=raw \
		-netdev user,id=n0 -device virtio-net-pci,netdev=n0 \
		-serial file:"$tmp/console-$n.log" -serial file:"$tmp/results-$n.log" \
		</dev/null >"$tmp/qemu-$n.log" 2>&1 || rc=$?
	((rc != 124)) || say "boot $n ran past ${BOOT_TIMEOUT}s and was stopped"
	((rc == 0 || rc == 124)) || say "qemu exited $rc: $(tail -3 "$tmp/qemu-$n.log")"
}
results() { debugfs -R "cat /results.txt" "$tmp/results.img" 2>/dev/null || true; }
boot 1
n1=$(results | wc -l)
results | grep -q '^BOOT1-DONE' || say "the first boot did not finish its checks; the end of its console:"$'\n'"$(tail -30 "$tmp/console-1.log")"
boot 2
out=$(results)
printf '%s\n' "$out" | grep -E '^(PASS|FAIL|INFO)'
grep -q '^BOOT2-DONE' <<<"$out" || {
	say "the second boot did not finish its checks; the end of its console:"
	tail -30 "$tmp/console-2.log"
}
pass=$(grep -c '^PASS' <<<"$out" || true)
fail=$(grep -c '^FAIL' <<<"$out" || true)
say "$pass passed, $fail failed ($n1 lines from the first boot)"
[[ $fail -eq 0 && $pass -gt 0 ]] && grep -q '^BOOT2-DONE' <<<"$out"
