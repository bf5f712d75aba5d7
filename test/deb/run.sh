#!/usr/bin/env bash
# Checks ferry's Debian package (make test-deb builds it and runs this):
#   test/deb/run.sh bin/ferry_VERSION_ARCH.deb
# lintian finds no errors; the package holds exactly the expected files and
# declares its dependencies; dpkg installs it into a scratch root this
# script builds (busybox, plus the host's systemd-sysusers, systemd-tmpfiles
# and deb-systemd-helper with what they load), and its maintainer scripts
# make the ferry user, /run/ferry and the units' enablement there; an
# upgrade to a rebuilt package with a higher version keeps an edited
# ferryd.toml; remove keeps the configuration, and purge removes what
# install made. Stand-ins for systemctl and deb-systemd-invoke record what
# the scripts ask of systemd, once "systemd runs" in the root. Never
# touches this host's /etc, dpkg database or systemd: dpkg --root chroots
# into the scratch root for the scripts. Needs root.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PATH="$PATH:/usr/local/go/bin"
T0=$(date +%s)
pass() { printf 'PASS [%3ds] %s\n' $(($(date +%s) - T0)) "$*"; }
fail() {
	printf 'FAIL [%3ds] %s\n' $(($(date +%s) - T0)) "$*"
	exit 1
}
# Any other command that fails ends the test with a FAIL line naming it.
set -E
trap 'fail "line $LINENO: $BASH_COMMAND"' ERR

[[ $# -eq 1 && -f $1 ]] || fail "usage: $0 bin/ferry_VERSION_ARCH.deb (make test-deb builds it)"
deb=$(realpath "$1")
[[ $(id -u) -eq 0 ]] || fail "needs root: dpkg --root chroots into the scratch root to run the maintainer scripts"
tmp=$(mktemp -d /tmp/ferry-test-deb.XXXXXX)
trap '[[ -n ${KEEP:-} ]] || rm -rf "$tmp"' EXIT
v1=$(dpkg-deb -f "$deb" Version)

# --- the package itself ---

out=$(timeout 300 lintian --fail-on error "$deb" 2>&1) || fail "lintian found errors:"$'\n'"$out"
printf '%s\n' "$out" | grep -v '^running with root privileges' | sed 's/^/  lintian: /'
pass "lintian: no errors ($(grep -c '^W:' <<<"$out" || true) warnings)"

expected='./
./etc/
./etc/ferry/
./etc/ferry/ferryd.toml
./usr/
./usr/bin/
./usr/bin/ferrybench
./usr/bin/ferryctl
./usr/bin/ferryd
./usr/lib/
./usr/lib/systemd/
./usr/lib/systemd/system/
./usr/lib/systemd/system/ferryd.service
./usr/lib/systemd/system/ferryd.socket
./usr/lib/sysusers.d/
./usr/lib/sysusers.d/ferry.conf
./usr/lib/tmpfiles.d/
./usr/lib/tmpfiles.d/ferry.conf
./usr/share/
./usr/share/doc/
./usr/share/doc/ferry/
./usr/share/doc/ferry/README.md
./usr/share/doc/ferry/api.md
./usr/share/doc/ferry/changelog.gz
./usr/share/doc/ferry/copyright
./usr/share/doc/ferry/design.md
./usr/share/doc/ferry/features.md
./usr/share/doc/ferry/ferryd.toml
./usr/share/doc/ferry/mooncake-rdma-wire.md
./usr/share/doc/ferry/operations.md
./usr/share/doc/ferry/python.md
./usr/share/doc/ferry/rdma.md
./usr/share/doc/ferry/reliability.md
./usr/share/doc/ferry/security.md'
got=$(dpkg-deb -c "$deb" | awk '{ print $6 }' | LC_ALL=C sort)
diff <(echo "$expected") <(echo "$got") >"$tmp/files.diff" ||
	fail "dpkg -c: the package's files differ from the list in $0 (< expected, > in the package):"$'\n'"$(cat "$tmp/files.diff")"
pass "dpkg -c: the $(wc -l <<<"$got") expected paths, no others"

field() { dpkg-deb -f "$deb" "$1"; }
[[ $(field Depends) =~ (^|, )libibverbs1\ \(\>=\ [0-9] ]] || fail "Depends lacks a versioned libibverbs1: $(field Depends)"
[[ $(field Recommends) == ibverbs-providers ]] || fail "Recommends is not ibverbs-providers: $(field Recommends)"
[[ $(field Suggests) == nvidia-driver ]] || fail "Suggests is not nvidia-driver: $(field Suggests)"
[[ $(dpkg-deb --ctrl-tarfile "$deb" | tar -xOf - ./conffiles) == /etc/ferry/ferryd.toml ]] ||
	fail "conffiles does not list exactly /etc/ferry/ferryd.toml"
pass "control: Version $v1, Depends $(field Depends), Recommends, Suggests, conffiles"

# --- a scratch root to install into ---

R=$tmp/root
mkdir -p "$R"/usr/{bin,sbin,lib,lib64} "$R"/{etc,tmp,run,var/log} "$R"/var/lib/dpkg/{info,updates,triggers}
for d in bin sbin lib lib64; do ln -s "usr/$d" "$R/$d"; done # merged /usr, as on Debian 12
: >"$R/var/lib/dpkg/status"
mkdir "$R/dev" "$R/proc" && mknod -m 666 "$R/dev/null" c 1 3
cp /bin/busybox "$R/usr/bin/"
for a in $(busybox --list); do [[ -e $R/usr/bin/$a ]] || ln -s busybox "$R/usr/bin/$a"; done
# The tools the maintainer scripts call (deb-systemd-helper is perl), each
# with the libraries ldd finds. Not systemctl or deb-systemd-invoke: where
# systemd does not run, the scripts must not need them.
for f in /usr/bin/systemd-sysusers /usr/bin/systemd-tmpfiles /usr/bin/deb-systemd-helper /usr/bin/perl; do
	cp --parents -L "$f" "$R"
	if ldd "$f" >/dev/null 2>&1; then
		for lib in $(ldd "$f" | grep -o '/[^ ]*'); do cp --parents -L "$lib" "$R"; done
	fi
done
cp -a --parents "$(perl -e 'print grep /perl-base/, @INC')" "$R"
# systemctl and deb-systemd-invoke only record their calls. In /usr/local:
# deb-systemd-helper looks for a systemctl in /bin and /usr/bin, and with
# none there it makes the enablement links itself.
mkdir -p "$R/usr/local/bin"
for f in systemctl deb-systemd-invoke; do
	printf '#!/bin/sh
echo "%s $*" >>/tmp/systemd-calls
' "$f" >"$R/usr/local/bin/$f"
	chmod +x "$R/usr/local/bin/$f"
done
pass "scratch root: busybox, systemd-sysusers, systemd-tmpfiles, deb-systemd-helper ($(du -sm "$R" | cut -f1) MB)"

# The scratch root has no libc6 or libibverbs1 packages (the binaries run
# from the host below): --force-depends is for those alone. No script may
# ask anything: stdin is empty.
# systemd-tmpfiles needs /proc: it is mounted in a mount namespace of
# dpkg's own, which takes it away when dpkg exits.
dpkg_root() {
	# shellcheck disable=SC2016 # the inner sh expands them
	timeout 120 unshare --mount sh -c 'mount -t proc proc "$0/proc" && exec "$@"' "$R" \
		env PATH=/usr/local/bin:/usr/sbin:/usr/bin dpkg --root="$R" --log="$R/var/log/dpkg.log" "$@" </dev/null 2>&1 |
		sed 's/^/  dpkg: /' || fail "dpkg $* failed: its output is above"
}
# What the scripts asked of systemd since the last look, one call a line;
# not the plain daemon-reload deb-systemd-helper runs after changing links.
systemd_calls() {
	grep -vx 'systemctl daemon-reload' "$R/tmp/systemd-calls" 2>/dev/null || true
	rm -f "$R/tmp/systemd-calls"
}
# STEP WANT: fails unless the calls were WANT.
expect_calls() {
	local got
	got=$(systemd_calls)
	[[ $got == "$2" ]] || fail "$1: the scripts asked systemd for"$'\n'"${got:-nothing}"$'\n'"want"$'\n'"${2:-nothing}"
}
reload='systemctl --system daemon-reload'
installed() { dpkg-query --admindir="$R/var/lib/dpkg" -W -f='${Status} ${Version}' ferry 2>/dev/null || true; }
have() { [[ -e $R$1 || -L $R$1 ]]; }

# --- install ---

dpkg_root --force-depends -i "$deb"
[[ $(installed) == "install ok installed $v1" ]] || fail "install: dpkg's record is '$(installed)', want 'install ok installed $v1'"
for f in /usr/bin/ferryd /usr/bin/ferryctl /usr/bin/ferrybench /usr/lib/systemd/system/ferryd.service \
	/usr/lib/systemd/system/ferryd.socket /etc/ferry/ferryd.toml /usr/share/doc/ferry/copyright; do
	have "$f" || fail "install: $f is missing"
done
got=$("$R/usr/bin/ferryd" --version)
[[ $got == "ferryd $v1" ]] || fail "install: ferryd --version says '$got', want 'ferryd $v1'"
pass "install: ferryd --version: $got"
grep -q '^ferry:x:[0-9]*:[0-9]*:' "$R/etc/passwd" || fail "install: no ferry user in the root's /etc/passwd"
[[ $(grep -cE '^(ferry|rdma|video):' "$R/etc/group") == 3 ]] || fail "install: the ferry, rdma and video groups are not all in /etc/group"
uid=$(awk -F: '$1 == "ferry" { print $3 }' "$R/etc/passwd")
[[ $(stat -c '%u %a' "$R/run/ferry") == "$uid 755" ]] || fail "install: /run/ferry is not 0755 and owned by ferry ($uid)"
pass "install: sysusers made $(grep '^ferry:' "$R/etc/passwd"), tmpfiles made /run/ferry"
for l in multi-user.target.wants/ferryd.service sockets.target.wants/ferryd.socket; do
	# deb-systemd-helper names the unit by its /lib alias, the /usr it is in being merged.
	[[ $(readlink "$R/etc/systemd/system/$l") =~ ^(/usr)?/lib/systemd/system/${l#*/}$ ]] ||
		fail "install: /etc/systemd/system/$l does not link to the unit"
done
expect_calls install ""
pass "install: ferryd.service and ferryd.socket enabled; no systemd runs, and nothing asked it to start"
got=$("$R/usr/bin/ferryd" --config "$R/etc/ferry/ferryd.toml" --check-config)
pass "install: the installed ferryd.toml: $got"

# --- upgrade ---

# A rebuilt package with a higher version, whose ferryd.toml changed too,
# so that dpkg meets both files changed: the case that would prompt.
v2=$v1+upgradetest
dpkg --compare-versions "$v2" gt "$v1" || fail "upgrade: $v2 does not sort above $v1"
timeout 600 make --no-print-directory deb BIN="$tmp/build2" VERSION="$v2" >"$tmp/build2.log" 2>&1 ||
	fail "upgrade: make deb VERSION=$v2 failed:"$'\n'"$(tail -20 "$tmp/build2.log")"
dpkg-deb -R "$tmp/build2/ferry_${v2}_$(dpkg --print-architecture).deb" "$tmp/new"
echo '# (a line the new version added)' >>"$tmp/new/etc/ferry/ferryd.toml"
(cd "$tmp/new" && find . -path ./DEBIAN -prune -o -type f -printf '%P\0' | LC_ALL=C sort -z | xargs -0 md5sum) >"$tmp/new/DEBIAN/md5sums"
dpkg-deb -Zgzip --root-owner-group -b "$tmp/new" "$tmp/new.deb" >/dev/null
pass "upgrade: built $v2 (make deb VERSION=...), its ferryd.toml changed"

sed -i 's/^max_conns = 8$/max_conns = 3/' "$R/etc/ferry/ferryd.toml"
grep -qx 'max_conns = 3' "$R/etc/ferry/ferryd.toml" || fail "upgrade: could not edit max_conns in ferryd.toml"
# From here on systemd "runs" in the root. Unattended upgrades keep the
# operator's file: --force-confold (with confdef, the default answer
# wherever there is one).
mkdir -p "$R/run/systemd/system"
dpkg_root --force-depends --force-confdef --force-confold -i "$tmp/new.deb"
expect_calls upgrade "$reload"$'\n'"deb-systemd-invoke try-restart ferryd.service"
[[ $(installed) == "install ok installed $v2" ]] || fail "upgrade: dpkg's record is '$(installed)', want $v2"
got=$("$R/usr/bin/ferryd" --version)
[[ $got == "ferryd $v2" ]] || fail "upgrade: ferryd --version says '$got', want 'ferryd $v2'"
grep -qx 'max_conns = 3' "$R/etc/ferry/ferryd.toml" || fail "upgrade: the edited ferryd.toml was replaced"
grep -qx '# (a line the new version added)' "$R/etc/ferry/ferryd.toml.dpkg-dist" || fail "upgrade: the new ferryd.toml is not beside it as ferryd.toml.dpkg-dist"
pass "upgrade: ferryd --version: $got; /etc/ferry/ferryd.toml kept: $(grep '^max_conns' "$R/etc/ferry/ferryd.toml"); the new one is ferryd.toml.dpkg-dist"

# --- remove, then purge ---

dpkg_root -r ferry
expect_calls remove "deb-systemd-invoke stop ferryd.service ferryd.socket"$'\n'"$reload"
[[ $(installed) == "deinstall ok config-files $v2" ]] || fail "remove: dpkg's record is '$(installed)', want config-files"
for f in /usr/bin/ferryd /usr/lib/systemd/system/ferryd.service /usr/share/doc/ferry; do
	! have "$f" || fail "remove: $f is still there"
done
for f in /etc/ferry/ferryd.toml /run/ferry; do have "$f" || fail "remove: $f is gone; remove keeps it"; done
grep -qx 'max_conns = 3' "$R/etc/ferry/ferryd.toml" || fail "remove: the edited ferryd.toml changed"
pass "remove: binaries, units and docs gone; /etc/ferry/ferryd.toml (edited) and /run/ferry kept"

# dpkg warns that /usr/bin, /usr/lib and /etc stay: no package of the
# scratch root owns them.
dpkg_root --purge ferry
expect_calls purge ""
[[ -z $(installed) ]] || fail "purge: dpkg still records ferry: '$(installed)'"
for f in /usr/bin/ferryd /usr/bin/ferryctl /usr/bin/ferrybench /usr/lib/systemd/system/ferryd.service \
	/usr/lib/systemd/system/ferryd.socket /usr/lib/sysusers.d/ferry.conf /usr/lib/tmpfiles.d/ferry.conf \
	/usr/share/doc/ferry /etc/ferry /run/ferry \
	/etc/systemd/system/multi-user.target.wants/ferryd.service /etc/systemd/system/sockets.target.wants/ferryd.socket \
	/var/lib/systemd/deb-systemd-helper-enabled/ferryd.service.dsh-also; do
	! have "$f" || fail "purge: $f is still there"
done
left=$(find "$R/var/lib/dpkg/info" -name 'ferry.*')
[[ -z $left ]] || fail "purge: dpkg's info files remain: $left"
grep -q '^ferry:' "$R/etc/passwd" || fail "purge: the ferry user is gone; Debian packages leave it (postrm says why)"
pass "purge: binaries, units, sysusers/tmpfiles entries, docs, /etc/ferry, /run/ferry, enablement links and dpkg's record gone; the ferry user stays"

# --- starting on install ---

dpkg_root --force-depends -i "$deb" | tee "$tmp/install.log"
expect_calls "install under systemd" "$reload"
grep -q 'enabled but not started' "$tmp/install.log" || fail "install under systemd: postinst did not say the units are not started"
dpkg_root --purge ferry
systemd_calls >/dev/null
FERRY_START_ON_INSTALL=1 dpkg_root --force-depends -i "$deb"
expect_calls "install with FERRY_START_ON_INSTALL=1" "$reload"$'\n'"deb-systemd-invoke start ferryd.socket ferryd.service"
pass "install under systemd: enabled, not started; with FERRY_START_ON_INSTALL=1: started"
