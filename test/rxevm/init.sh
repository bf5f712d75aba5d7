#!/bin/busybox sh
# PID 1 of the soft-RoCE VM (run.sh builds the initramfs around it): load
# rdma_rxe, add rxe0 and rxe1 on two bridged veths, run ferry's tests with
# a real verbs device required and the netem fault tests with netem
# required, benchmark ferry's RDMA writes beside ib_write_bw and ferrybench
# over both rxe devices, power off.
# Lines starting "== " are what run.sh reads.
/bin/busybox --install -s
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
mount -t tmpfs tmp /tmp
. /etc/rxevm.env
export PATH=/usr/bin:/usr/sbin HOME=/tmp TMPDIR=/tmp
# iproute2's ip: this shell runs its own applet for a bare "ip" whatever
# PATH says, and busybox's ip has no "ip rule ... oif" nor veth peer names.
ip() { /usr/sbin/ip "$@"; }
up() { cut -d' ' -f1 /proc/uptime; }
echo "== booted at $(up)s"
FAIL=0

# check NAME SECONDS CMD...: run CMD, killed after SECONDS, and report it.
check() {
  name=$1 limit=$2
  shift 2
  s=$(up)
  if timeout -s KILL "$limit" "$@"; then
    echo "== PASS $name ($(echo "$(up) $s" | awk '{printf "%.1f", $1 - $2}')s)"
  else
    echo "== FAIL $name (exit $?)"
    FAIL=1
  fi
}

for m in $(cat /opt/mod/order); do
  insmod /opt/mod/$m || { echo "== FAIL insmod $m"; FAIL=1; }
done
ip link set lo up
# The two soft-RoCE devices sit on veth0 and veth1, whose peers share a
# bridge: a wire between them, so that a lane from one to the other (a
# send out of one GPU's NIC into a slot on another GPU, rdma/rails.go)
# crosses it as on a fabric. Both addresses are this host's, which the
# kernel would deliver through lo, where no rxe listens: output from
# each netdev is routed out of it first (tables 10 and 11, before the
# local table), and each takes in packets from the other's address.
ip link add br0 type bridge
ip link set br0 up
for i in 0 1; do
  ip link add veth$i type veth peer name veth${i}p
  ip link set veth${i}p master br0
  ip link set veth${i}p up
done
echo 0 >/proc/sys/net/ipv4/conf/all/rp_filter
for i in 0 1; do
  echo 1 >/proc/sys/net/ipv4/conf/veth$i/accept_local
  echo 0 >/proc/sys/net/ipv4/conf/veth$i/rp_filter
done
ip rule add pref 10 oif veth0 lookup 10
ip rule add pref 11 oif veth1 lookup 11
ip rule add pref 100 lookup local
ip rule del pref 0 lookup local
ip addr add 10.11.12.1/24 dev veth0
ip link set veth0 up
ip route add 10.11.13.1 dev veth0 table 10
check "rdma link add rxe0" 10 rdma link add rxe0 type rxe netdev veth0
# The GID table fills a moment after the link is added: wait (5 s at
# most) for the RoCE v2 GID of 10.11.12.1.
GIDX=
for i in $(seq 1 50); do
  for g in /sys/class/infiniband/rxe0/ports/1/gids/*; do
    case $(cat "$g" 2>/dev/null) in *ffff:0a0b:0c01)
      t=$(cat /sys/class/infiniband/rxe0/ports/1/gid_attrs/types/$(basename "$g") 2>/dev/null)
      [ "$t" = "RoCE v2" ] && GIDX=$(basename "$g") && break 2 ;;
    esac
  done
  sleep 0.1
done
echo "== rxe0 RoCE v2 GID index ${GIDX:-none}"
[ -n "$GIDX" ] || FAIL=1
# A second soft-RoCE device on a second netdev, for the rails tests
# (rdma/rails_test.go: a write striped over two NICs, one failing).
ip addr add 10.11.13.1/24 dev veth1
ip link set veth1 up
ip route add 10.11.12.1 dev veth1 table 11
check "rdma link add rxe1" 10 rdma link add rxe1 type rxe netdev veth1
for i in $(seq 1 50); do
  grep -qs 'ffff:0a0b:0d01' /sys/class/infiniband/rxe1/ports/1/gids/* && break
  sleep 0.1
done
ibv_devinfo -d rxe0 | grep -E 'state|active_mtu|link_layer'
# What rxe0 says of memory windows (per-slot remote keys, not used yet):
# its device capability flags for them, and how many it allows.
ibv_devinfo -v -d rxe0 | grep -E 'MEM_WINDOW|max_mw' | tr -s ' \t' ' ' | sed 's/^/== rxe0 memory windows:/'

# Host files on this kernel's tmpfs (its fallocate stops at a signal),
# and the sealed memfd arena, on hugetlbfs pages too
# (a few 2 MiB pages).
mkdir -p /dev/hugepages
echo 8 >/proc/sys/vm/nr_hugepages
mount -t hugetlbfs none /dev/hugepages || { echo "== FAIL mount hugetlbfs"; FAIL=1; }
check "arena host-file and sealed-memory tests" 120 /opt/arena.test -test.v -test.count=${COUNT:-1} -test.run 'HostFile|Sealed'
export FERRY_RDMA_REQUIRED=1
check "rdma package tests" 600 /opt/rdma.test -test.v -test.count=${COUNT:-1} -test.timeout=590s -test.run "$RUN"
cd /opt && FERRY_BIN=/opt/bin FERRY_FAKECUDA=/opt/fakecuda check "e2e tests over rdma" 900 /opt/e2e.test -test.v -test.count=${COUNT:-1} -test.timeout=890s -test.run "${E2E:-RDMA}"
# A real Mooncake engine over rxe (run.sh with RXEVM_MOONCAKE_PY): two
# real engines first, then python/tests/test_mooncake_real.py over rdma,
# a "== MOONCAKE real rdma" line per test. MC_GID_INDEX: Mooncake's
# engines use rxe0's RoCE v2 GID index (rxe1 lists its GIDs alike).
if [ -n "$MOONCAKE_PY" ]; then
  export MC_GID_INDEX=$GIDX GLOG_logtostderr=1 LD_LIBRARY_PATH=$MOONCAKE_PY
  cd /opt/python
  PYTHONPATH=$MOONCAKE_PY check "two real Mooncake engines over rxe" 300 python3.11 mooncake_pair.py
  cd tests
  FERRYD=/opt/bin/ferryd PYTHONPATH=/opt/python FERRY_TEST_MOONCAKE_PY=$MOONCAKE_PY FERRY_TEST_MOONCAKE_PROTOCOL=rdma \
    check "test_mooncake_real.py over rdma" 900 sh -c 'python3.11 -m pytest -p no:cacheprovider -v --tb=short test_mooncake_real.py >/tmp/mcreal.log 2>&1'
  cat /tmp/mcreal.log
  sed -n 's/^test_mooncake_real.py::\([^ ]*\) \([A-Z]*\).*/== MOONCAKE real rdma \2 \1/p' /tmp/mcreal.log
  tail -n 1 /tmp/mcreal.log | sed -n 's/^=* *\(.*[0-9].*[^ =]\) *=*$/== MOONCAKE real rdma pytest: \1/p'
  unset LD_LIBRARY_PATH
  cd /
fi
# Loss, delay and reordering by netem, over TCP between two network
# namespaces joined by a veth pair (the host's kernel may have no netem).
FERRY_BIN=/opt/bin FERRY_NETEM_REQUIRED=1 check "e2e fault tests with netem" 240 /opt/e2e.test -test.v -test.count=${COUNT:-1} -test.timeout=230s -test.run "$NETEM"
cd /

# ---- benchmarks: ferry's write beside ib_write_bw, alternately ------------
# Both keep the same number of RC QPs busy on rxe0: ferry QPS lanes with
# FLIGHT writes in flight on each (BenchmarkWrite's -lanes and -writers),
# ib_write_bw -q QPS. Two per lane by default, as ferryd carries 16
# concurrent sends on its 8 lanes: side by side at 64 KiB, two per lane
# measured 0.01-0.13 above one per lane (ib_write_bw keeps up to 128
# writes in flight on each QP).
QPS=${QPS:-8}
FLIGHT=${FLIGHT:-2}
# ibbw SIZE ITERS: one ib_write_bw run of about ITERS messages in all;
# prints MB/s (1e6 bytes/s), from the finer of two columns: its average
# in Gb/s has 2 decimals, steps of 1.25 MB/s (6% of the 20 MB/s that
# 64 KiB writes reach under TCG); its message rate in Mpps has 6, steps
# of SIZE bytes/s, finer below about 1.2 MB. The bench functions run in
# $(...) subshells, so a failure is marked in a file.
# perqp ITERS: the messages ibbw has each QP write for ITERS in all.
perqp() { n=$(($1 / QPS)); [ $n -lt 5 ] && n=5; echo $n; }
ibbw() {
  n=$(perqp $2)
  # perftest times itself with the TSC, which TCG emulates: a run now and
  # then reports 0.00, and once in a while twice running; such a run is
  # taken again, up to twice.
  for try in 1 2 3; do
    ib_write_bw -d rxe0 -x "$GIDX" -q $QPS -s "$1" -n $n -F --report_gbits >/tmp/ibsrv.log 2>&1 &
    srv=$!
    # The server listens on TCP 18515 for the client's exchange; wait for it.
    for i in $(seq 1 100); do netstat -ltn 2>/dev/null | grep -q ':18515 ' && break; sleep 0.05; done
    ib_write_bw -d rxe0 -x "$GIDX" -q $QPS -s "$1" -n $n -F --report_gbits 127.0.0.1 >/tmp/ibcli.log 2>&1
    wait $srv
    awk -v s="$1" '$1 == s && NF >= 5 && $4 > 0 {printf "%.2f", (s < 1250000 ? $5 * s : $4 * 125); found=1} END {exit !found}' /tmp/ibcli.log && return
  done
  cat /tmp/ibcli.log /tmp/ibsrv.log >&2
  echo 0
  touch /tmp/benchfail
}
# benchbw BINARY NAME ITERS ARGS...: one run of BINARY's
# BenchmarkWrite/NAME; prints its MB/s.
benchbw() {
  bin=$1 name=$2 iters=$3
  shift 3
  $bin -test.run '^$' -test.bench "^BenchmarkWrite\$/^$name\$" -test.benchtime "${iters}x" "$@" >/tmp/fb.log 2>&1
  if ! awk '/MB\/s/ {for (i = 1; i < NF; i++) if ($(i+1) == "MB/s") {printf "%.2f", $i; found=1}} END {exit !found}' /tmp/fb.log; then
    cat /tmp/fb.log >&2
    echo 0
    touch /tmp/benchfail
  fi
}
ferrybw() { benchbw /opt/rdma.bench "$1" "$2" -lanes $QPS -writers $((QPS * FLIGHT)); }
# cpustat: the VM's CPU time so far, busy and in all (jiffies of every
# CPU), and its context switches.
cpustat() { awk '/^cpu / {b = $2 + $3 + $4 + $7 + $8; t = b + $5 + $6} /^ctxt / {c = $2} END {print b, t, c}' /proc/stat; }
# since SUM BEFORE: SUM plus what cpustat counted since BEFORE.
since() { echo "$1 $2 $(cpustat)" | awk '{print $1 + $7 - $4, $2 + $8 - $5, $3 + $9 - $6}'; }
# basebw: the same benchmark from the build run.sh was given as
# RXEVM_BASE (another revision), with its own arguments.
basebw() { benchbw /opt/base.bench "$1" "$2" $BASE_ARGS; }
if [ "$BENCH" = 1 ]; then
  base= order="both on rxe0, run A B A B ..."
  [ -x /opt/base.bench ] && base=" base = the RXEVM_BASE build ($BASE_ARGS);" order="all on rxe0, run A B C A B C ..."
  echo "== bench: ferry = $QPS lanes (RC QPs) with $FLIGHT writes in flight each, from the shared registration;$base ib_write_bw -q $QPS; $order"
  # BYTES:NAME:ITERATIONS[:ROUNDS]. 64 KiB runs are short and the noisiest
  # beside ib_write_bw (it is nearest to its rate there): more rounds. A
  # round's ratio there spreads over about 0.87-1.15 (quartiles of 190),
  # so a 15-round median still moved by about 0.1 from run to run.
  for spec in ${SPECS:-65536:64KiB:400:25 1048576:1MiB:40:9 4194304:4MiB:40:9}; do
    size=${spec%%:*} rest=${spec#*:}
    name=${rest%%:*} rest=${rest#*:}
    iters=${rest%%:*} rounds=${ROUNDS:-9}
    [ "$rest" != "$iters" ] && rounds=${ROUNDS:-${rest#*:}}
    ib= fe= ba= ibcpu="0 0 0" fecpu="0 0 0"
    for round in $(seq 1 "$rounds"); do
      c=$(cpustat); ib="$ib $(ibbw $size $iters)"; ibcpu=$(since "$ibcpu" "$c")
      c=$(cpustat); fe="$fe $(ferrybw $name $iters)"; fecpu=$(since "$fecpu" "$c")
      [ -x /opt/base.bench ] && ba="$ba $(basebw $name $iters)"
    done
    # A round runs each tool once, back to back, and the load of this
    # shared machine drifts over seconds: ratio= is the median of the
    # rounds' ratios, which that drift cancels from; ratio_of_medians=
    # compares the medians of each tool's runs.
    echo "$name|$rounds|$ib|$fe|$ba" | awk -F'|' 'function med(s,   v, n, t, i, j) { n = split(s, v, " "); for (i = 1; i <= n; i++) v[i] += 0; for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++) if (v[j] < v[i]) { t = v[i]; v[i] = v[j]; v[j] = t } return v[int((n + 1) / 2)] }
      function paired(s, r,   a, b, n, i, q) { n = split(s, a, " "); split(r, b, " "); q = ""; for (i = 1; i <= n; i++) q = q " " (b[i] > 0 ? a[i] / b[i] : 0); return med(q) }
      {ib = med($3); f = med($4);
      line = sprintf("== BENCH write size=%s rounds=%d ib_write_bw_MBps=%.2f ferry_MBps=%.2f ratio=%.2f ratio_of_medians=%.2f", $1, $2, ib, f, paired($4, $3), (ib > 0 ? f / ib : 0));
      if ($5 != "") { b = med($5); line = line sprintf(" base_MBps=%.2f base_ratio=%.2f base_ratio_of_medians=%.2f", b, paired($5, $3), (ib > 0 ? b / ib : 0)) }
      print line " (runs: ib" $3 ", ferry" $4 ($5 != "" ? ", base" $5 : "") ")"}'
    # What each run cost the VM, its start and set-up included: the share
    # of its CPUs busy, and context switches per message (ib_write_bw
    # writes QPS * (ITERS / QPS) messages a run, ferry ITERS and a
    # warm-up write per writer).
    echo "$name $ibcpu $(($(perqp $iters) * QPS)) $fecpu $((iters + QPS * FLIGHT)) $rounds $(grep -c '^processor' /proc/cpuinfo)" | awk '{
      printf "== BENCH cpu size=%s ib_write_bw_busy=%.0f%% ib_write_bw_ctxt_per_msg=%.1f ferry_busy=%.0f%% ferry_ctxt_per_msg=%.1f (of %d CPUs)\n",
        $1, 100 * $2 / $3, $4 / ($5 * $10), 100 * $6 / $7, $8 / ($9 * $10), $11}'
  done
  /opt/rdma.bench -test.run '^$' -test.bench '^BenchmarkRegister' -test.benchtime 5x >/tmp/reg.log 2>&1 || { cat /tmp/reg.log; FAIL=1; }
  grep '^BenchmarkRegister' /tmp/reg.log | sed 's/^/== BENCH /'
  for round in 1 2; do
    /opt/rdma.bench -test.run '^$' -test.bench '^BenchmarkWriteMode' -test.benchtime 40x -lanes $QPS -writers $((QPS * FLIGHT)) >/tmp/mode.log 2>&1 || { cat /tmp/mode.log >&2; FAIL=1; }
    awk '/^BenchmarkWriteMode/ {for (i = 1; i < NF; i++) if ($(i+1) == "MB/s") print $1, $i}' /tmp/mode.log
  done >/tmp/modes
  awk '/shared/ {s += $2; ns++} /per-send/ {p += $2; np++}
    END {s /= (ns ? ns : 1); p /= (np ? np : 1);
    printf "== BENCH registration 1MiB writes shared_MBps=%.2f per_send_MBps=%.2f ratio=%.2f (per-send/shared)\n", s, p, (s > 0 ? p / s : 0)}' /tmp/modes
  # ferrybench between two ferryd --rdma-device all (rxe0 and rxe1): a
  # send below rdma_stripe_min, through rxe0 alone, and a striped one;
  # its per-NIC GB/s is what left through each NIC, GB/s all of them.
  if /opt/bin/ferrybench transfer --transport rdma --rdma-device all --sizes 4MiB,16MiB --concurrency 1 --iterations 8 --warmup 2 >/tmp/fbr.log 2>&1; then
    awk '/^ *(op|send) / {sub(/^ +/, ""); print "== BENCH rails " $0}' /tmp/fbr.log
  else
    cat /tmp/fbr.log >&2
    touch /tmp/benchfail
  fi
  # A benchmark that errs (not one that is slow) fails the run.
  [ -e /tmp/benchfail ] && { echo "== FAIL a benchmark run failed (its output is above)"; FAIL=1; }
fi

# rxecount: rxe0's port counters (packets, retries, duplicates), a
# NAME=N line each.
rxecount() { for f in /sys/class/infiniband/rxe0/ports/1/hw_counters/*; do echo "${f##*/}=$(cat "$f")"; done; }
# perfof NAME CMD...: runs CMD under a system-wide perf record of the
# VM's CPU time, the kernel's included (soft-RoCE works there), and
# prints the busiest symbols as "== PERF NAME" lines and what rxe0's
# counters moved by as an "== RXE NAME" line. A fixed 999 Hz: at perf's
# default rate the kernel lowers the rate under TCG part way through,
# and two runs' sample counts no longer compare.
perfof() {
  name=$1
  shift
  before=$(rxecount)
  perf record -a -F 999 -e cpu-clock -o /tmp/perf.data >/tmp/perf.log 2>&1 &
  rec=$!
  "$@"
  kill -INT $rec; wait $rec
  perf report -i /tmp/perf.data --stdio --no-children -n --sort comm,sym 2>/dev/null |
    grep -v '^#' | grep . | head -40 | sed "s/^/== PERF $name /"
  { echo "$before"; echo --; rxecount; } | awk -F= -v name="$name" '$0 == "--" {after = 1; next}
    !after {b[$1] = $2; next} $2 != b[$1] {line = line " " $1 "=" $2 - b[$1]} END {print "== RXE " name line}'
}
if [ "$PROFILE" = 1 ]; then
  echo 0 >/proc/sys/kernel/kptr_restrict
  perfof ib_write_bw ibbw 65536 400
  profbench() { /opt/rdma.bench -test.run '^$' -test.bench '^BenchmarkWrite$/^64KiB$' -test.benchtime 400x -lanes $QPS -writers $((QPS * FLIGHT)) -test.cpuprofile /tmp/cpu.prof >/tmp/prof.log 2>&1; }
  perfof ferry profbench
  grep MB/s /tmp/prof.log
  echo "== PROFILE BEGIN"; base64 /tmp/cpu.prof; echo "== PROFILE END"
fi

[ $FAIL = 0 ] && echo "== RESULT: PASS at $(up)s" || echo "== RESULT: FAIL at $(up)s"
poweroff -f
