#!/usr/bin/env bash
# What the daemon adds over the bare transport, in one run, at concurrency
# 1: at each size these alternate, and the median p50 latencies are quoted
# as ratio=send/raw (1.10: the send takes 10 % longer) and
# daemon_write_ratio=daemon_write/raw.
#   send          the client's send call through two ferryd (ferrybench
#                 transfer): control round trip + the daemon's send
#   daemon_write  the same send as the sending daemon times it: session,
#                 write, completion, without the control round trip
#   raw           ferrybench transfer --raw: a bare tcp transport write
#                 between two processes
#
# Environment: FERRYBENCH (default bin/ferrybench), ROUNDS (3),
# SECONDS_PER_RUN (2), SIZES ("1MiB").
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=compare.sh
. "$here/compare.sh"
FERRYBENCH=${FERRYBENCH:-$here/../bin/ferrybench}
ROUNDS=${ROUNDS:-3}
SECONDS_PER_RUN=${SECONDS_PER_RUN:-2}
SIZES=${SIZES:-1MiB}
[[ -x $FERRYBENCH ]] || { echo "compare-raw: $FERRYBENCH is missing: run make build" >&2; exit 1; }

send() { ferrybench_column p50_us --sizes "$1" --concurrency 1 --duration "${SECONDS_PER_RUN}s"; }
daemon_write() { ferrybench_column daemon_write_p50_us --sizes "$1" --concurrency 1 --duration "${SECONDS_PER_RUN}s"; }
raw() { ferrybench_column p50_us --raw --sizes "$1" --concurrency 1 --duration "${SECONDS_PER_RUN}s"; }

echo "# staged send vs raw tcp write, p50 latency, concurrency 1, loopback, $(date -u +%FT%TZ), $ROUNDS alternating rounds of ${SECONDS_PER_RUN}s, $(nproc) cpus"
compare us "$ROUNDS" "$SIZES" raw raw send send daemon_write daemon_write
