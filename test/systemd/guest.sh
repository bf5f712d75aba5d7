#!/bin/bash
# Runs inside the booted guest of test/systemd/run.sh, as root, from the
# payload disk (/payload: ferry_1.deb, ferry_2.deb, base-ferryd.service).
# Each check appends one line to /results/results.txt (and the second
# serial port): PASS or FAIL, the seconds since boot, what it checked, and
# its evidence. The first boot installs and exercises the package, the
# second (after a reboot) checks what started at boot, then upgrades,
# removes and purges.
set -uo pipefail
OUT=/results/results.txt
STATE=/var/lib/ferry-test
mkdir -p "$STATE"
up() { cut -d. -f1 /proc/uptime; }
line() {
	printf '%s [%4ss] %s\n' "$1" "$(up)" "$2" | tee -a "$OUT" >/dev/ttyS1
	sync
}
pass() { line PASS "$*"; }
fail() { line FAIL "$*"; }
info() { line INFO "$*"; }
# check NAME EVIDENCE COMMAND...: PASS when the command succeeds.
check() {
	local name=$1 ev=$2
	shift 2
	if "$@"; then pass "$name: $ev"; else fail "$name: $ev"; fi
}
# until_ SECONDS COMMAND...: runs the command until it succeeds, at most
# SECONDS; a wait with a deadline, not a sleep standing in for an event.
until_() {
	local end=$(($(date +%s) + $1))
	shift
	until "$@"; do
		(($(date +%s) < end)) || return 1
		sleep 0.2
	done
}
prop() { systemctl show -P "$2" "$1"; }
there() { if [[ -e $1 ]]; then echo present; else echo gone; fi; }
active() { [[ $(systemctl is-active "$1") == "$2" ]]; }
SOCK=/run/ferry/ferryd.sock
status() { curl -sS --max-time "${1:-30}" --unix-socket "$SOCK" -o /dev/null -w '%{http_code}' http://ferryd/v1/status; }
journal_since() { journalctl -u ferryd.service --since "@$1" -o cat --no-pager; }
CONF=/etc/ferry/ferryd.toml
PEER=(--socket /run/ferry-peer.sock --listen 127.0.0.1:17200 --arena-size 64MiB
	--transport tcp --advertise 127.0.0.1:17200)
peer_pid=
start_peer() {
	ferryd "${PEER[@]}" >/var/log/ferry-peer.log 2>&1 &
	peer_pid=$!
	until_ 60 ferryctl --socket /run/ferry-peer.sock status >/dev/null 2>&1
}
stop_peer() { [[ -z $peer_pid ]] || { kill "$peer_pid"; wait "$peer_pid"; peer_pid=; }; }
# transfer FROM_SOCK TO_SOCK ID: stages 1 MiB of random bytes on FROM,
# sends them into a slot on TO, waits there and compares.
transfer() {
	local from=$1 to=$2 id=$3
	head -c 1048576 /dev/urandom >"/tmp/$id.in"
	ferryctl --socket "$to" --json recv "$id" --nbytes 1048576 >"/tmp/$id.slot" &&
		ferryctl --socket "$from" stage "$id" --shape 1048576 --dtype u8 "/tmp/$id.in" >/dev/null &&
		ferryctl --socket "$from" send "$id" --slot "/tmp/$id.slot" >/dev/null &&
		ferryctl --socket "$to" wait "$id" -o "/tmp/$id.out" --for 60s >/dev/null &&
		cmp "/tmp/$id.in" "/tmp/$id.out"
}
# dropin NAME TEXT: a runtime drop-in for ferryd.service (gone at reboot).
dropin() {
	mkdir -p /run/systemd/system/ferryd.service.d
	printf '[Service]\n%s\n' "$2" >"/run/systemd/system/ferryd.service.d/$1.conf"
	systemctl daemon-reload
}
undrop() {
	rm -f "/run/systemd/system/ferryd.service.d/$1.conf"
	systemctl daemon-reload
	systemctl reset-failed ferryd.service ferryd.socket 2>/dev/null
}
# refused_at_once: a client connecting now is refused, or its connection
# reset, rather than left waiting: curl fails, and not by its own time limit
# (exit 28), which a client queueing in the socket's backlog would meet.
# refused_ms is the whole curl run, process start under TCG included.
refused_at_once() {
	local t0 rc
	t0=$(date +%s%N)
	curl -sS --max-time 20 --unix-socket "$SOCK" http://ferryd/v1/status >/tmp/refused.out 2>&1
	rc=$?
	refused_ms=$((($(date +%s%N) - t0) / 1000000))
	refused_msg=$(head -c 200 /tmp/refused.out)
	((rc != 0 && rc != 28))
}

boot1() {
	info "guest: $(uname -r), $(systemctl --version | head -1), $(awk '/MemTotal/ {print $2 " kB"}' /proc/meminfo) memory, /run $(df -h --output=size /run | tail -1 | tr -d ' ')"

	# --- install ---
	dpkg -i /payload/ferry_1.deb >/tmp/install.log 2>&1
	local v
	v=$(dpkg-query -W -f='${Status} ${Version}' ferry 2>/dev/null)
	check "install" "dpkg: $v; $(ferryd --version); $(id ferry); ferryd.socket $(systemctl is-enabled ferryd.socket), ferryd.service $(systemctl is-enabled ferryd.service), not started: $(systemctl is-active ferryd.service); $(grep -o 'enabled but not started' /tmp/install.log)" \
		eval '[[ $v == "install ok installed "* ]] && [[ $(systemctl is-enabled ferryd.socket ferryd.service | sort -u) == enabled ]] && active ferryd.service inactive && grep -q "enabled but not started" /tmp/install.log'

	# --- the defaults on this guest ---
	local t
	t=$(date +%s)
	systemctl start ferryd.service
	if active ferryd.service active; then
		pass "defaults: ferryd starts with the installed ferryd.toml on this guest: $(prop ferryd StatusText)"
	else
		fail "defaults: ferryd does not start with the installed ferryd.toml on this guest: $(journal_since "$t" | grep -m1 '^ferryd:')"
	fi
	systemctl stop ferryd.socket ferryd.service
	systemctl reset-failed ferryd.service ferryd.socket 2>/dev/null
	# The rest runs with a small arena, an edit the upgrade must keep.
	sed -i -e 's/^arena_size = .*/arena_size = "64MiB"/' -e 's/^max_conns = 8$/max_conns = 3/' "$CONF"

	# --- socket activation ---
	systemctl start ferryd.socket
	local before code
	before=$(systemctl is-active ferryd.service)
	t=$(date +%s)
	code=$(status 120)
	check "socket activation" "ferryd.socket listening, ferryd.service $before; GET /v1/status through $SOCK: $code, then ferryd.service $(systemctl is-active ferryd.service); log: $(journal_since "$t" | grep -o -m1 'control socket passed by systemd[^"]*')" \
		eval '[[ $before == inactive && $code == 200 ]] && active ferryd.service active'

	# --- READY and the watchdog ---
	local w1 w2
	w1=$(prop ferryd WatchdogTimestampMonotonic)
	until_ 45 eval '[[ $(prop ferryd WatchdogTimestampMonotonic) != "$w1" ]]'
	w2=$(prop ferryd WatchdogTimestampMonotonic)
	check "READY and watchdog" "Type=$(prop ferryd Type), StatusText=\"$(prop ferryd StatusText)\", WatchdogUSec=$(prop ferryd WatchdogUSec), watchdog ping at ${w1}us then ${w2}us" \
		eval '[[ $(prop ferryd StatusText) == serving:* && $w2 != "$w1" && $w1 != 0 ]]'

	# --- ferryctl: root, the ferry user, nobody ---
	local asroot asferry asnobody
	asroot=$(ferryctl status 2>&1 | head -1)
	asferry=$(runuser -u ferry -- ferryctl status 2>&1 | head -1)
	asnobody=$(setpriv --reuid=nobody --regid=nogroup --clear-groups ferryctl status 2>&1)
	local rc=$?
	check "ferryctl as root" "$asroot" ferryctl status
	check "ferryctl as the ferry user" "$asferry" runuser -u ferry -- ferryctl status
	check "ferryctl refused as nobody" "exit $rc: ${asnobody:0:200}" eval '((rc != 0)) && [[ $asnobody == *"permission denied"* ]]'

	# --- two daemons, both ways ---
	start_peer
	check "two-daemon transfer, service to peer" "1 MiB byte-exact (cmp) from ferryd.service to a second ferryd on 127.0.0.1:17200" transfer "$SOCK" /run/ferry-peer.sock t1
	check "two-daemon transfer, peer to service" "1 MiB byte-exact (cmp) from the second ferryd into ferryd.service" transfer /run/ferry-peer.sock "$SOCK" t2

	# --- reload ---
	local pid
	pid=$(prop ferryd MainPID)
	t=$(date +%s)
	systemctl reload ferryd
	until_ 30 eval 'journal_since $t | grep -q "configuration reloaded"'
	check "reload" "systemctl reload: MainPID $pid -> $(prop ferryd MainPID), $(systemctl is-active ferryd); log: $(journal_since "$t" | grep -o -m1 '"message":"configuration reloaded"')" \
		eval '[[ $(prop ferryd MainPID) == "$pid" ]] && active ferryd.service active && journal_since $t | grep -q "configuration reloaded"'

	# --- stop with a wait in flight ---
	head -c 1048576 /dev/urandom >/tmp/t3.in
	ferryctl --json recv t3 --nbytes 1048576 >/tmp/t3.slot
	ferryctl --socket /run/ferry-peer.sock stage t3 --shape 1048576 --dtype u8 /tmp/t3.in >/dev/null
	# --keep: freeing the slot afterwards would be a new request, which
	# the drain refuses.
	ferryctl wait t3 -o /tmp/t3.out --for 60s --keep >/tmp/t3.wait 2>&1 &
	local waiter=$!
	until_ 30 eval 'curl -s --unix-socket "$SOCK" "http://ferryd/v1/receives/t3?format=json" | grep -q "\"waiters\":1"'
	t=$(date +%s)
	systemctl stop --no-block ferryd.service
	until_ 30 eval 'journal_since $t | grep -q "draining"'
	ferryctl --socket /run/ferry-peer.sock send t3 --slot /tmp/t3.slot >/tmp/t3.send 2>&1
	wait "$waiter"
	local wrc=$?
	until_ 60 active ferryd.service inactive
	check "stop with a request in flight" "a wait in flight at SIGTERM: exit $wrc, $(cmp /tmp/t3.in /tmp/t3.out 2>&1 && echo byte-exact); the send during the drain: $(head -c 120 /tmp/t3.send); then ferryd.service $(systemctl is-active ferryd.service), Result=$(prop ferryd Result); log: $(journal_since "$t" | grep -o -m1 '"message":"draining[^"]*"')" \
		eval '((wrc == 0)) && cmp -s /tmp/t3.in /tmp/t3.out && active ferryd.service inactive && [[ $(prop ferryd Result) == success ]]'

	# --- holding it stopped ---
	code=$(status 60)
	local restarted
	restarted=$(systemctl is-active ferryd.service)
	systemctl stop ferryd.socket ferryd.service
	refused_at_once
	local held=$?
	check "stop holds with both units" "after systemctl stop ferryd the socket started it again (GET: $code, $restarted); after systemctl stop ferryd.socket ferryd.service: $(systemctl is-active ferryd.socket)/$(systemctl is-active ferryd.service), a client gets an error in ${refused_ms} ms ($refused_msg)" \
		eval '[[ $code == 200 && $restarted == active ]] && ((held == 0)) && active ferryd.service inactive'

	# --- a broken configuration ---
	dropin broken 'Environment=FERRY_SEND_TIMEOUT=soon'
	systemctl start ferryd.socket
	t=$(date +%s)
	refused_at_once
	local firstrc=$? first=$refused_ms firstmsg=$refused_msg
	until_ 30 active ferryd.service failed
	refused_at_once
	local nextrc=$?
	check "broken configuration" "first client error in ${first} ms ($firstmsg); ferryd.service $(systemctl is-active ferryd.service), Result=$(prop ferryd Result), exit status $(prop ferryd ExecMainStatus), NRestarts=$(prop ferryd NRestarts), ferryd.socket $(systemctl is-active ferryd.socket); the next client: error in ${refused_ms} ms ($refused_msg); log: $(journal_since "$t" | grep -m1 '^ferryd:')" \
		eval '((firstrc == 0 && nextrc == 0)) && active ferryd.service failed && [[ $(prop ferryd ExecMainStatus) == 78 && $(prop ferryd NRestarts) == 0 ]] && ! active ferryd.socket active'
	undrop broken

	# --- a failure that restarts, bounded ---
	# The peer holds 127.0.0.1:17200: ferryd fails to listen (exit 1).
	dropin busy 'Environment=FERRY_LISTEN=127.0.0.1:17200'
	t=$(date +%s)
	systemctl start ferryd.socket ferryd.service
	# systemd 252 keeps the last start's result on the service
	# (exit-code) and gives the socket service-start-limit-hit.
	until_ 180 eval '[[ $(prop ferryd.socket Result) == service-start-limit-hit ]]'
	refused_at_once
	local bounded=$?
	check "restarts bounded" "a start that fails (port in use), given up on after $(($(date +%s) - t)) s: ferryd.service $(systemctl is-active ferryd.service), Result=$(prop ferryd Result), NRestarts=$(prop ferryd NRestarts); ferryd.socket $(systemctl is-active ferryd.socket), Result=$(prop ferryd.socket Result); a client: error in ${refused_ms} ms ($refused_msg); log: $(journalctl -u ferryd.service --since "@$t" -o cat --no-pager | grep -m1 'repeated too quickly')" \
		eval 'active ferryd.service failed && [[ $(prop ferryd NRestarts) == 5 && $(prop ferryd.socket Result) == service-start-limit-hit ]] && ((bounded == 0))'
	undrop busy
	stop_peer

	# --- the sandbox's score ---
	local score base=""
	score=$(systemd-analyze security ferryd.service 2>&1 | tail -1)
	[[ ! -f /payload/base-ferryd.service ]] || base=$(cd /payload && systemd-analyze security --offline=yes base-ferryd.service 2>&1 | tail -1)
	info "systemd-analyze security ferryd.service: before (the unit of $(cat /payload/base-commit 2>/dev/null)): ${base:-not scored}; the package's: $score"

	touch "$STATE/boot1-done"
	line BOOT1-DONE "rebooting"
}

boot2() {
	# --- start at boot ---
	local code
	code=$(status 120)
	check "reboot: start at boot" "ferryd.socket $(systemctl is-active ferryd.socket), ferryd.service $(systemctl is-active ferryd.service) since $(prop ferryd ActiveEnterTimestamp); GET /v1/status: $code" \
		eval 'active ferryd.socket active && active ferryd.service active && [[ $code == 200 ]]'

	# --- upgrade ---
	local pid v
	pid=$(prop ferryd MainPID)
	dpkg --force-confold -i /payload/ferry_2.deb >/tmp/upgrade.log 2>&1
	v=$(dpkg-query -W -f='${Version}' ferry)
	until_ 60 active ferryd.service active
	check "upgrade keeps the edited conffile" "dpkg: $v; $(grep -E '^(arena_size|max_conns)' "$CONF" | tr '\n' ' ')kept; ferryd.toml.dpkg-dist: $(ls /etc/ferry/ferryd.toml.dpkg-dist 2>&1); ferryd restarted: MainPID $pid -> $(prop ferryd MainPID), $(systemctl is-active ferryd)" \
		eval '[[ $v == *+upgradetest ]] && grep -qx "max_conns = 3" "$CONF" && [[ -f /etc/ferry/ferryd.toml.dpkg-dist && $(prop ferryd MainPID) != "$pid" ]] && active ferryd.service active'

	# --- remove, purge ---
	dpkg -r ferry >/tmp/remove.log 2>&1
	check "remove" "dpkg: $(dpkg-query -W -f='${Status}' ferry 2>&1); ferryd.service $(systemctl is-active ferryd.service), ferryd.socket $(systemctl is-active ferryd.socket); /usr/bin/ferryd $(there /usr/bin/ferryd); /etc/ferry/ferryd.toml $(there "$CONF")" \
		eval '! pgrep -x ferryd >/dev/null && ! active ferryd.service active && ! active ferryd.socket active && [[ ! -e /usr/bin/ferryd && -f $CONF ]]'
	dpkg -P ferry >/tmp/purge.log 2>&1
	check "purge" "dpkg: '$(dpkg-query -W -f='${Status}' ferry 2>&1 | head -c 80)'; /etc/ferry $(there /etc/ferry), /run/ferry $(there /run/ferry); enablement links: $(ls /etc/systemd/system/*/ferryd.* 2>/dev/null | wc -l)" \
		eval '[[ ! -e /etc/ferry && ! -e /run/ferry ]] && ! ls /etc/systemd/system/*/ferryd.* >/dev/null 2>&1 && ! dpkg-query -W ferry >/dev/null 2>&1'
	line BOOT2-DONE "powering off"
}

if [[ -e $STATE/boot1-done ]]; then boot2; else boot1; fi
