#!/usr/bin/env bash
# What the daemon adds over the bare transport, in one run: at each size,
# a staged send through two ferryd (ferrybench transfer: the client's send
# call, control round trip included) and a raw tcp transport write between
# two processes (ferrybench transfer --raw) alternate, and the median p50
# latencies are quoted as ratio=send/raw (1.10 = the send adds 10 %).
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
read -r -a sizes <<<"${SIZES:-1MiB}"
[[ -x $FERRYBENCH ]] || { echo "compare-raw: $FERRYBENCH is missing: run make build" >&2; exit 1; }

send() { ferrybench_column p50_us --sizes "$1" --concurrency 1 --duration "${SECONDS_PER_RUN}s"; }
raw() { ferrybench_column p50_us --raw --sizes "$1" --concurrency 1 --duration "${SECONDS_PER_RUN}s"; }

echo "# staged send vs raw tcp write, p50 latency, concurrency 1, loopback, $(date -u +%FT%TZ), $ROUNDS alternating rounds of ${SECONDS_PER_RUN}s, $(nproc) cpus"
compare send send raw raw us "$ROUNDS" "${sizes[@]}"
