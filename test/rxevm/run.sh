#!/usr/bin/env bash
# Runs ferry's verbs path for real: builds the rdma and end-to-end test
# binaries and ferryd here, boots Debian's stock kernel under QEMU (TCG)
# with a busybox initramfs that carries them, the rdma_rxe (soft-RoCE)
# module and rdma-core's rxe provider, adds a soft-RoCE device on a dummy
# netdev, runs the tests inside (init.sh) with FERRY_RDMA_REQUIRED=1, runs
# the fault tests that need netem (which the host's kernel may lack) over
# TCP between network namespaces, benchmarks ferry's RDMA writes
# beside ib_write_bw on the same device, and runs ferrybench between two
# ferryd striping over both devices.
#
# Exit status 0 only when the VM reached its checks and every one passed.
#
# Environment:
#   RXEVM_CACHE  kernel cache (default .cache/rxevm in the repository)
#   RXEVM_BENCH  0 skips the benchmarks (default 1)
#   RXEVM_RUN    -test.run pattern for the rdma package tests (default all)
#   RXEVM_E2E    -test.run pattern for the end-to-end tests (default RDMA)
#   RXEVM_NETEM  -test.run pattern for the end-to-end tests run with netem
#                required (default TestLinkFaults/(Loss|Delay|Reorder))
#   RXEVM_COUNT  -test.count for every test run (default 1), to hunt flakes:
#                narrow RXEVM_RUN and RXEVM_E2E to fit the runs' time limits
#   RXEVM_RACE   1 builds the test binaries with the race detector
#   RXEVM_TIMEOUT  seconds the VM may run (default 2400: a busy host slows
#                the VM threefold)
#   RXEVM_APPEND   more of the VM kernel's command line (e.g. clocksource=tsc
#                tsc=reliable)
#   RXEVM_PROFILE  1 also takes a CPU profile of the 64 KiB write benchmark,
#                and a perf profile of the VM beside one of ib_write_bw
#   RXEVM_QPS    lanes (RC QPs) for ferry and QPs for ib_write_bw (default 8)
#   RXEVM_FLIGHT ferry's writes in flight per lane (default 2)
#   RXEVM_ROUNDS alternating runs of every size in the write benchmark
#                (default: each size's own, 25 at 64 KiB and 9 above)
#   RXEVM_SPECS  its sizes, as BYTES:NAME:ITERATIONS[:ROUNDS] ... (default
#                64 KiB, 1 MiB and 4 MiB)
#   RXEVM_BASE   an rdma test binary from another revision (go test -c
#                ./rdma there), benchmarked beside this one in the same
#                run: base_MBps= and base_ratio= in the BENCH lines
#   RXEVM_BASE_ARGS  its benchmark flags (default -writers $RXEVM_QPS)
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
export PATH="$PATH:/usr/local/go/bin"
T0=$(date +%s)
say() { printf 'rxevm [%3ds] %s\n' $(($(date +%s) - T0)) "$*"; }

CACHE=${RXEVM_CACHE:-$ROOT/.cache/rxevm}
BENCH=${RXEVM_BENCH:-1}
RUN=${RXEVM_RUN:-.}
VM_TIMEOUT=${RXEVM_TIMEOUT:-2400}

scripts/deps.sh vm

# ---- kernel: Debian's stock image, downloaded once into the cache -------
kpkg() { apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/{print $2; exit}'; }
KPKG=${RXEVM_KPKG:-$(kpkg)}
if [[ -z $KPKG ]]; then # a fresh machine may have no package lists yet
  apt-get update -qq
  KPKG=$(kpkg)
fi
[[ -n $KPKG ]] || { echo "rxevm: apt knows no linux-image-amd64: check /etc/apt/sources.list" >&2; exit 1; }
K=$CACHE/$KPKG
if [[ ! -e $K/vmlinux ]]; then
  say "downloading $KPKG"
  rm -rf "$K" && mkdir -p "$K"
  (cd "$K" && apt-get download "$KPKG" 2>&1 | grep -v 'Download is performed unsandboxed' || true)
  deb=$(ls "$K"/*.deb)
  dpkg-deb --fsys-tarfile "$deb" | tar -x -C "$K" --wildcards './boot/vmlinuz-*' './lib/modules/*' './usr/lib/modules/*' 2>/dev/null || true
  [[ -d $K/lib/modules ]] || { mkdir -p "$K/lib"; ln -s ../usr/lib/modules "$K/lib/modules"; }
  kver=$(ls "$K/lib/modules")
  depmod -b "$K" "$kver"
  # QEMU boots the uncompressed ELF directly (PVH entry point, which
  # Debian kernels have): no real-mode setup, no decompression in the
  # guest, both slow under TCG.
  vmlinuz=$K/boot/vmlinuz-$kver
  for m in 'xz:\xfd7zXZ\x00' 'zstd:\x28\xb5\x2f\xfd' 'gzip:\x1f\x8b\x08'; do
    for off in $(LC_ALL=C grep -aobUP "${m#*:}" "$vmlinuz" | cut -d: -f1); do
      tail -c +$((off + 1)) "$vmlinuz" | ${m%%:*} -dc >"$K/vmlinux.part" 2>/dev/null || true
      if [[ $(head -c4 "$K/vmlinux.part" | tail -c3) == ELF ]]; then break 2; fi
    done
  done
  [[ $(head -c4 "$K/vmlinux.part" | tail -c3) == ELF ]] || { echo "rxevm: no ELF kernel inside $vmlinuz" >&2; exit 1; }
  mv "$K/vmlinux.part" "$K/vmlinux"
  rm -f "$deb"
fi
KVER=$(ls "$K/lib/modules")
say "kernel $KVER"

# ---- binaries, built here ------------------------------------------------
W=$(mktemp -d "${TMPDIR:-/tmp}/rxevm.XXXXXX")
trap 'rm -rf "$W"' EXIT
R=$W/root
mkdir -p "$R"/{usr/bin,usr/sbin,usr/lib64,usr/lib/x86_64-linux-gnu,etc,proc,sys,dev,tmp,run,opt/bin,opt/mod}
ln -s usr/bin "$R/bin"
ln -s usr/sbin "$R/sbin"
ln -s usr/lib "$R/lib"
ln -s usr/lib64 "$R/lib64"
# The tests run from a plain build: under TCG on a loaded machine the
# race detector's cost on the conformance suite's 64 MiB copies can push
# a write past the suite's 30 s patience. make unit runs the same logic
# race-built on the host (fake NIC); RXEVM_RACE=1 builds them so here.
race=()
[[ ${RXEVM_RACE:-0} == 1 ]] && race=(-race)
go build "${race[@]}" -o "$R/opt/bin/" ./cmd/ferryd ./cmd/ferryctl
go test "${race[@]}" -c -o "$R/opt/rdma.test" ./rdma
go test "${race[@]}" -c -o "$R/opt/e2e.test" ./test/e2e
go test "${race[@]}" -c -o "$R/opt/arena.test" ./arena
if [[ $BENCH == 1 || ${RXEVM_PROFILE:-0} == 1 ]]; then
  if ((${#race[@]})); then go test -c -o "$R/opt/rdma.bench" ./rdma; else cp "$R/opt/rdma.test" "$R/opt/rdma.bench"; fi
fi
[[ $BENCH == 1 ]] && go build -o "$R/opt/bin/" ./cmd/ferrybench
[[ ${RXEVM_PROFILE:-0} == 1 ]] && cp "$R/opt/rdma.bench" "$CACHE/"
if [[ -n ${RXEVM_BASE:-} ]]; then cp "$RXEVM_BASE" "$R/opt/base.bench"; fi
# The stand-in CUDA driver for the GPU-arena tests (the VM has no gcc):
# e2e finds it through FERRY_FAKECUDA (internal/fakecuda).
mkdir -p "$R/opt/fakecuda"
gcc -shared -fPIC -Wall -o "$R/opt/fakecuda/libcuda.so.1" internal/fakecuda/testdata/fakecuda.c
say "binaries built${race:+ (tests with -race)}"

# ---- initramfs -------------------------------------------------------------
cp "$(command -v busybox)" "$R/usr/bin/busybox"
# libs FILE...: the shared libraries ldd says each file needs (none for
# a static one).
libs() {
  local f l
  for f in "$@"; do
    while read -r l; do
      [[ -e $R$l ]] || { mkdir -p "$R$(dirname "$l")"; cp -L "$l" "$R$l"; }
    done < <(ldd "$f" 2>/dev/null | awk '/=>/ && $3 ~ /^\// {print $3} /^\t\/lib64/ {print $1}')
  done
}
# copy FILE...: each file, at the same path, and its libraries.
copy() {
  local f
  for f in "$@"; do
    [[ -e $R$f ]] || { mkdir -p "$R$(dirname "$f")"; cp -L "$f" "$R$f"; }
  done
  libs "$@"
}
copy /usr/bin/rdma /usr/bin/ibv_devices /usr/bin/ibv_devinfo /usr/bin/ib_write_bw \
  /usr/lib/x86_64-linux-gnu/libibverbs/librxe-rdmav*.so /lib/x86_64-linux-gnu/libgcc_s.so.1
# iproute2's ip and tc for the netem fault tests: busybox's lack network
# namespaces and netem. They land where busybox would put its own, which
# --install then leaves alone. tc reads netem's delay distributions.
copy "$(command -v ip)" "$(command -v tc)" /usr/lib/x86_64-linux-gnu/tc/*.dist
libs "$R"/opt/*.test "$R"/opt/bin/* "$R"/opt/fakecuda/libcuda.so.1
if [[ ${RXEVM_PROFILE:-0} == 1 ]]; then
  command -v perf >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends linux-perf
  copy "$(command -v perf)"
fi
mkdir -p "$R/etc/libibverbs.d"
cp /etc/libibverbs.d/rxe.driver "$R/etc/libibverbs.d/"
# Modules in load order. rdma_rxe asks the crypto API for "crc32" at run
# time, which no modules.dep entry names: crc32_generic goes first. veth
# and sch_netem are for the netem fault tests; veth and bridge carry the
# two soft-RoCE devices' netdevs (init.sh).
: >"$R/opt/mod/order"
for m in crc32_generic dummy rdma_rxe veth bridge sch_netem; do
  modprobe -d "$K" -S "$KVER" --show-depends "$m" | awk '$1 == "insmod" {print $2}' | while read -r ko; do
    b=$(basename "$ko")
    grep -qx "$b" "$R/opt/mod/order" || { cp "$ko" "$R/opt/mod/"; echo "$b" >>"$R/opt/mod/order"; }
  done
done
cp test/rxevm/init.sh "$R/init"
cat >"$R/etc/rxevm.env" <<EOF
BENCH=$BENCH
RUN='$RUN'
E2E='${RXEVM_E2E:-RDMA}'
NETEM='${RXEVM_NETEM:-TestLinkFaults/(Loss|Delay|Reorder)}'
COUNT=${RXEVM_COUNT:-1}
PROFILE=${RXEVM_PROFILE:-0}
QPS=${RXEVM_QPS:-8}
FLIGHT=${RXEVM_FLIGHT:-2}
ROUNDS='${RXEVM_ROUNDS:-}'
SPECS='${RXEVM_SPECS:-}'
BASE_ARGS='${RXEVM_BASE_ARGS:--writers ${RXEVM_QPS:-8}}'
EOF
(cd "$R" && find . | cpio -o -H newc --quiet | gzip -1) >"$W/initramfs.gz"
say "initramfs $(du -h "$W/initramfs.gz" | cut -f1)"

# ---- boot (TCG: these machines have no usable KVM) --------------------------
# The log is this run's own until the VM ends (runs may share a cache),
# then kept as $CACHE/vm.log, the last run's.
LOG=$W/vm.log
say "booting; the VM's log goes to $CACHE/vm.log when it ends"
set +e
timeout "$VM_TIMEOUT" qemu-system-x86_64 -accel tcg,thread=multi -cpu max -smp 2 -m 2G \
  -nographic -no-reboot -nodefaults -serial stdio -monitor none \
  -kernel "$K/vmlinux" -initrd "$W/initramfs.gz" \
  -append "console=ttyS0 quiet panic=-1 ${RXEVM_APPEND:-}" >"$LOG" 2>&1
qemu=$?
set -e
cp "$LOG" "$CACHE/vm.log.$$" && mv "$CACHE/vm.log.$$" "$CACHE/vm.log"
tr -d '\r' <"$LOG" | grep -a -E '^(== | *--- (PASS|FAIL|SKIP)|ok |FAIL|PASS$|panic:|Benchmark| +[A-Za-z0-9_]+\.go:[0-9]+:)' || true
count() { tr -d '\r' <"$LOG" | grep -ac -E "^ *--- $1: " || true; }
if [[ ${RXEVM_PROFILE:-0} == 1 ]]; then
  tr -d '\r' <"$LOG" | sed -n '/^== PROFILE BEGIN/,/^== PROFILE END/p' | grep -v '^==' | base64 -d >"$CACHE/cpu.prof"
  say "CPU profile of the 64 KiB write benchmark: go tool pprof -top $CACHE/rdma.bench $CACHE/cpu.prof"
fi
say "VM done: $(count PASS) passed, $(count FAIL) failed, $(count SKIP) skipped; the VM's log is $CACHE/vm.log"
# Each failed test's own lines last, where a CI log's tail shows them: its
# messages and the daemon logs they carry, its last 40 lines, cut at 300
# characters. go test -v names the test each line belongs to (=== RUN,
# === CONT, === NAME) whenever that changes; a parent's own lines are
# apart from its subtests'.
tr -d '\r' <"$LOG" | awk '
  /^=== (RUN|CONT|NAME) / {cur = $3}
  cur != "" {n[cur]++; buf[cur, n[cur]] = substr($0, 1, 300)}
  /^ *--- FAIL: / {
    t = $3; print "rxevm: " t " failed:"
    for (i = (n[t] > 40 ? n[t] - 39 : 1); i <= n[t]; i++) print "  " buf[t, i]
  }' || true
if ((qemu == 124)); then
  echo "rxevm: the VM ran past ${VM_TIMEOUT}s and was stopped" >&2
  exit 1
fi
if ! tr -d '\r' <"$LOG" | grep -aq '^== RESULT: PASS'; then
  tr -d '\r' <"$LOG" | grep -aq '^== RESULT' || echo "rxevm: the VM never reached its checks (qemu exit $qemu); see $CACHE/vm.log" >&2
  exit 1
fi
