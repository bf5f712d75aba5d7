#!/usr/bin/env bash
# ferry over TCP beside iperf3, one stream on loopback, in one run: at each
# size ferry, the bare transport and iperf3 alternate, and the medians are
# quoted as ratio=ferry/iperf3 and raw_ratio=raw/iperf3.
#   ferry   a ferrybench transfer point at concurrency 1: two ferryd, staged
#           data, the client's send call (control round trip included)
#           waiting for each completion
#   raw     ferrybench transfer --raw: the tcp transport's writes between
#           two processes, no daemon
#   iperf3  one stream with writes of the same size, capped at the 1 MiB
#           iperf3 allows; it never waits for a completion
#
# Environment: FERRYBENCH (default bin/ferrybench), ROUNDS (3),
# SECONDS_PER_RUN (2), SIZES ("1MiB 4MiB 16MiB"). Installs iperf3 if missing.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=compare.sh
. "$here/compare.sh"
FERRYBENCH=${FERRYBENCH:-$here/../bin/ferrybench}
ROUNDS=${ROUNDS:-3}
SECONDS_PER_RUN=${SECONDS_PER_RUN:-2}
SIZES=${SIZES:-1MiB 4MiB 16MiB}
[[ -x $FERRYBENCH ]] || { echo "compare-tcp: $FERRYBENCH is missing: run make build" >&2; exit 1; }
need_tool iperf3 iperf3

work=$(mktemp -d /tmp/ferry-compare.XXXXXX)
iperf_pid=
cleanup() {
  if [[ -n $iperf_pid ]]; then
    kill -TERM "$iperf_pid" 2>/dev/null || true
    timeout 10 tail --pid="$iperf_pid" -f /dev/null 2>/dev/null || kill -KILL "$iperf_pid" 2>/dev/null || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT

# One iperf3 server for the whole run, on the first free port from 5201;
# its "Server listening" line says it is up (bounded wait).
for port in $(seq 5201 5260); do
  iperf3 -s -B 127.0.0.1 -p "$port" --forceflush >"$work/iperf3.log" 2>&1 &
  iperf_pid=$!
  for _ in $(seq 100); do
    grep -q "Server listening" "$work/iperf3.log" && break 2
    kill -0 "$iperf_pid" 2>/dev/null || break
    sleep 0.05
  done
  kill -TERM "$iperf_pid" 2>/dev/null || true
  iperf_pid=
done
[[ -n $iperf_pid ]] || { echo "compare-tcp: no iperf3 server could listen on 127.0.0.1:5201-5260" >&2; cat "$work/iperf3.log" >&2; exit 1; }

ferry() {
  ferrybench_column gbit_per_s --sizes "$1" --concurrency 1 --duration "${SECONDS_PER_RUN}s"
}

raw() {
  ferrybench_column gbit_per_s --raw --sizes "$1" --concurrency 1 --duration "${SECONDS_PER_RUN}s"
}

iperf3_stream() {
  local len
  len=$(size_bytes "$1")
  ((len > 1048576)) && len=1048576
  iperf3 -c 127.0.0.1 -p "$port" -l "$len" -t "$SECONDS_PER_RUN" -f g |
    awk '/receiver/ {for (i = 2; i <= NF; i++) if ($i == "Gbits/sec") {print $(i - 1); found = 1}} END {exit !found}'
}

echo "# ferry tcp send and raw tcp transport (concurrency 1) vs iperf3 (1 stream), loopback, $(date -u +%FT%TZ), $ROUNDS alternating rounds of ${SECONDS_PER_RUN}s, $(nproc) cpus"
compare Gbit/s "$ROUNDS" "$SIZES" iperf3 iperf3_stream ferry ferry raw raw
