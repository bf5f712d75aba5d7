#!/usr/bin/env bash
# make test-gpu: ferry's checks on a real GPU. For a host with an NVIDIA
# GPU, its driver and python3 with torch; Go is not needed there. It runs
# from the folder make gpu-bundle builds (the binaries and scripts beside
# this file), in well under 5 minutes:
#   1. the cuda package's GPU tests: devices, a multi-GiB arena timed per
#      GiB, IPC round trips through a second process, dmabuf export (of
#      the arena, and of IPC-opened memory as ferryd exports GPU memory
#      an engine registered: "== GPU region dmabuf");
#   2. two ferryd on GPU memory over loopback TCP with the bytes verified,
#      a torch process staging and reading in place through IPC handles,
#      and GPU memory of the test's own (Go, then torch through the ferry
#      Python package) lent to both daemons as regions, a batch between them,
#      sglang's and vLLM's Mooncake sequences with torch.cuda tensors as
#      the receiving engines' memory (mooncake_replays.py: 2,048 scattered
#      pages into per-layer K and V, the encoder's landing buffer, vLLM's
#      caches, reads);
#      the path the NIC registers a GPU arena by ("== GPU registration"),
#      and, with an RDMA NIC, GPU memory an engine registered, written and
#      read by peers ("== ENGINE GPU registration"),
#      and the GPU-to-NIC table from the PCIe topology ("== AFFINITY");
#   3. ferry's host<->device copy bandwidth beside torch's, same sizes, run
#      A B A B, quoted as ratios.
# FERRY_REQUIRE_GPU=1 makes a missing GPU fail the tests instead of
# skipping them. Ends with "N passed, N failed, N skipped"; exits non-zero
# on any failure.
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cd "$here" || exit 1
export FERRY_REQUIRE_GPU=1 FERRY_BIN="$here" FERRY_GPU_SCRIPTS="$here"
log=$(mktemp -d /tmp/ferry-test-gpu.XXXXXX)
broken=0

echo "== host"
nvidia-smi -L 2>&1 || echo "(no nvidia-smi)"
timeout 60 python3 -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda, "devices", torch.cuda.device_count())' 2>&1

# run NAME SECONDS CMD...: a test binary under a time limit, its output kept.
run() {
  local name=$1 limit=$2
  shift 2
  echo "== $name"
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$log/$name.log"
  local rc=${PIPESTATUS[0]}
  if ((rc != 0)); then
    echo "== $name: exit status $rc"
    broken=1
  fi
}

run cuda 100 ./cuda.test -test.v -test.count=1 -test.run '^TestGPU' -test.timeout 90s
run e2e 120 ./e2e.test -test.v -test.count=1 -test.run '^TestGPU|^TestFerrydDoesNotLinkLibcuda' -test.timeout 110s
# The path this host's NIC registers a GPU arena by (dmabuf, peermem or
# bounce) and why not the others, or that there is no RDMA NIC here.
grep -a '^== GPU registration' "$log/e2e.log" || echo "== GPU registration: not reported (TestGPURegistrationReport's output above says why)"
# Whether the driver exports IPC-opened memory as a dmabuf, and the path
# GPU memory an engine registered took with this host's NIC.
grep -a '^== GPU region dmabuf' "$log/cuda.log" || echo "== GPU region dmabuf: not reported (TestGPUIPCInASecondProcess's output above says why)"
grep -a '^== ENGINE GPU registration' "$log/e2e.log" || echo "== ENGINE GPU registration: not reported (TestGPUEngineMemoryOverRDMA's output above says why: no RDMA NIC, or a failure)"

# sglang's and vLLM's sequences into torch.cuda tensors
# (TestGPUTorchMooncakeReceiver, mooncake_replays.py).
grep -a '== REPLAY' "$log/e2e.log" | sed 's/^ *//' | grep . || echo "== REPLAY: none reported (TestGPUTorchMooncakeReceiver's output above says why)"

# The GPU-to-NIC table this host gives (TestGPUAffinityTable).
grep -a '^== AFFINITY' "$log/e2e.log" || echo "== AFFINITY: not reported (TestGPUAffinityTable's output above says why)"

echo "== copy bandwidth: ferry (pinned bounce area <-> device arena) beside torch (pinned tensor <-> device tensor)"
for round in 1 2; do
  timeout 30 ./cuda.test -test.run '^$' -test.bench '^BenchmarkCopy$' -test.benchtime 1s 2>&1 | tee -a "$log/bw.log" || broken=1
  timeout 45 python3 torch_copy_bw.py 2>&1 | tee -a "$log/bw.log" || broken=1
done
# Best of the two rounds each; GB/s are 1e9 bytes per second on both sides.
awk '
  /^BenchmarkCopy\// {
    split($1, p, "/"); size = p[3]; sub(/-[0-9]+$/, "", size)
    for (i = 2; i < NF; i++) if ($(i + 1) == "MB/s") v = $i / 1000
    k = p[2] " " size; if (v > ferry[k]) ferry[k] = v
  }
  /^torch (HtoD|DtoH) / { k = $2 " " $3; if ($4 > torch[k]) torch[k] = $4 }
  END {
    printf "%-5s %-7s %12s %12s %8s\n", "dir", "size", "ferry GB/s", "torch GB/s", "ratio"
    n = split("4MiB 64MiB 256MiB", sizes, " ")
    for (d = 1; d <= 2; d++) for (s = 1; s <= n; s++) {
      k = (d == 1 ? "HtoD" : "DtoH") " " sizes[s]; split(k, kk, " ")
      r = (torch[k] > 0 && ferry[k] > 0) ? sprintf("%.3f", ferry[k] / torch[k]) : "n/a"
      printf "%-5s %-7s %12.2f %12.2f %8s\n", kk[1], kk[2], ferry[k], torch[k], r
    }
    print "(target: ratio >= 0.95 from 4 MiB up; measured here, not asserted)"
  }' "$log/bw.log"

pass=$(cat "$log"/cuda.log "$log"/e2e.log | grep -c -- '--- PASS: ')
fail=$(cat "$log"/cuda.log "$log"/e2e.log | grep -c -- '--- FAIL: ')
skip=$(cat "$log"/cuda.log "$log"/e2e.log | grep -c -- '--- SKIP: ')
echo "== skipped tests say why above (TestGPUIPCChild only runs as the child of the IPC test)"
echo "logs in $log"
echo "${pass} passed, ${fail} failed, ${skip} skipped"
((fail == 0 && broken == 0))
