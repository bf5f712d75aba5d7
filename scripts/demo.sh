#!/usr/bin/env bash
# make demo: two ferryd on loopback with temporary sockets; stage a random
# 16x4096 bf16 embedding on one, allocate a receive slot on the other, send,
# wait, verify the bytes, print the figures, stop both daemons by PID.
set -euo pipefail
bin=${1:-bin}
work=$(mktemp -d /tmp/ferry-demo.XXXXXX)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do
    kill -TERM "$pid" 2>/dev/null || true
  done
  for pid in "${pids[@]}"; do
    # Bounded: ferryd drains for at most 5 s here, then exits.
    timeout 15 tail --pid="$pid" -f /dev/null 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
  done
  rm -rf "$work"
}
trap cleanup EXIT

# start NAME: runs ferryd with its socket in $work and waits (bounded) for
# its "ready" log line, which carries the address peers dial.
start() {
  local name=$1
  "$bin/ferryd" --socket "$work/$name.sock" --listen 127.0.0.1:0 --arena-size 64MiB \
    --drain-timeout 5s 2>"$work/$name.log" &
  pids+=($!)
  for _ in $(seq 200); do
    grep -q '"message":"ready"' "$work/$name.log" 2>/dev/null && return 0
    kill -0 "${pids[-1]}" 2>/dev/null || { cat "$work/$name.log" >&2; echo "demo: ferryd $name exited" >&2; exit 1; }
    sleep 0.05
  done
  cat "$work/$name.log" >&2
  echo "demo: ferryd $name was not ready within 10 s" >&2
  exit 1
}

start sender
start receiver
echo "== two ferryd on loopback: sender pid ${pids[0]}, receiver pid ${pids[1]}"
snd=(--socket "$work/sender.sock")
rcv=(--socket "$work/receiver.sock")

# Two embeddings: the first send also dials the session to the peer, the
# second runs on the open session; both are verified and both times shown.
for req in demo-req-1 demo-req-2; do
  head -c $((16 * 4096 * 2)) /dev/urandom >"$work/$req.bin"
  echo "== $req: stage a random 16x4096 bf16 embedding (131072 bytes) on the sender"
  "$bin/ferryctl" "${snd[@]}" stage "$req" --shape 16,4096 --dtype bf16 "$work/$req.bin"

  echo "== $req: allocate the receive slot on the receiver (handed to the sender out of band)"
  "$bin/ferryctl" "${rcv[@]}" --json recv "$req" --shape 16,4096 --dtype bf16 >"$work/$req.slot"
  tr -d ' \n' <"$work/$req.slot"; echo

  echo "== $req: send (the sender's ferryd writes into the receiver's slot)"
  "$bin/ferryctl" "${snd[@]}" send "$req" --slot "$work/$req.slot" | tee "$work/$req.sent"

  echo "== $req: wait for the data on the receiver and verify it"
  "$bin/ferryctl" "${rcv[@]}" wait "$req" -o "$work/$req.out" --for 10s
  if cmp -s "$work/$req.bin" "$work/$req.out"; then
    echo "MATCH: the 131072 received bytes equal the staged embedding"
  else
    echo "MISMATCH: $req: the received bytes differ from the staged embedding" >&2
    exit 1
  fi
done

echo "== figures (16x4096 bf16 = 131072 bytes, tcp, loopback)"
for req in demo-req-1 demo-req-2; do
  read -r ms gbps < <(sed -n 's/.* in \([0-9.]*\) ms (\([0-9.]*\) GB\/s.*/\1 \2/p' "$work/$req.sent")
  label="on the open session"
  [[ $req == demo-req-1 ]] && label="first send, includes dialing the session"
  echo "$req: ${ms} ms, ${gbps} GB/s ($label)"
done
"$bin/ferryctl" "${snd[@]}" sessions
