#!/usr/bin/env bash
# Installs the system packages ferry's build, demo and tests need on a
# Debian machine. A no-op when everything is present.
#   scripts/deps.sh      what build, demo, unit and e2e tests need
#   scripts/deps.sh vm   and what the soft-RoCE VM of make test-rdma needs
#   scripts/deps.sh deb  and what make deb and make test-deb need
#   scripts/deps.sh systemdvm  and what the booted guest of make test-systemd needs
#   scripts/deps.sh python  and what make test-python needs
set -euo pipefail
export PATH="$PATH:/usr/local/go/bin"

if ! command -v go >/dev/null; then
  echo "deps: Go is not installed: install Go $(sed -n 's/^go //p' go.mod) or newer from go.dev/dl into /usr/local/go" >&2
  exit 1
fi

need=()
command -v gcc >/dev/null || need+=(gcc libc6-dev)   # cgo and the race detector
command -v ip >/dev/null || need+=(iproute2)         # network-namespace tests; rdma(8) for the VM
command -v cmp >/dev/null || need+=(diffutils)       # the demo's byte check
command -v systemd-analyze >/dev/null || need+=(systemd)  # verifying the unit files
command -v nft >/dev/null || need+=(nftables)          # packet loss in the fault tests where the kernel lacks netem
# rdma/ is cgo over libibverbs; the library loads no provider and finds
# no device on a host without RDMA, and ferryd then runs TCP.
[[ -e /usr/include/infiniband/verbs.h ]] || need+=(libibverbs-dev)
if [[ ${1:-} == vm ]]; then
  # test/rxevm: QEMU, a busybox initramfs, the soft-RoCE provider and
  # tools, perftest for ib_write_bw, kmod/cpio/xz/zstd to build the image.
  for c in qemu-system-x86_64:qemu-system-x86 busybox:busybox-static ib_write_bw:perftest \
    ibv_devices:ibverbs-utils modprobe:kmod cpio:cpio xz:xz-utils zstd:zstd; do
    command -v "${c%%:*}" >/dev/null || need+=("${c#*:}")
  done
  [[ -e /etc/libibverbs.d/rxe.driver ]] || need+=(ibverbs-providers)
fi
if [[ ${1:-} == systemdvm ]]; then
  # test/systemd: mmdebstrap builds the guest's root, mkfs.ext4 images it,
  # qemu-img overlays it, QEMU boots it, debugfs reads the results back.
  for c in mmdebstrap:mmdebstrap qemu-system-x86_64:qemu-system-x86 qemu-img:qemu-utils \
    mkfs.ext4:e2fsprogs debugfs:e2fsprogs; do
    command -v "${c%%:*}" >/dev/null || need+=("${c#*:}")
  done
fi
if [[ ${1:-} == deb ]]; then
  # dpkg-shlibdeps for the package's dependencies, lintian to check it,
  # busybox for the shell and tools of the scratch root it is installed in.
  for c in dpkg-shlibdeps:dpkg-dev lintian:lintian busybox:busybox-static; do
    command -v "${c%%:*}" >/dev/null || need+=("${c#*:}")
  done
fi
if [[ ${1:-} == python ]]; then
  # Debian's Python (/usr/bin/python3, whatever python3 is first on PATH)
  # with pytest, torch for the tensor tests, and pip, setuptools and wheel
  # to install python/ offline into a venv (--without-pip: Debian's pip).
  for m in pytest:python3-pytest torch:python3-torch pip:python3-pip setuptools:python3-setuptools wheel:python3-wheel; do
    /usr/bin/python3 -c "import importlib.util as u, sys; sys.exit(u.find_spec('${m%%:*}') is None)" 2>/dev/null ||
      need+=("${m#*:}")
  done
fi
if ((${#need[@]})); then
  if [[ $(id -u) -ne 0 ]]; then
    echo "deps: missing packages ${need[*]}: run 'sudo make deps' or apt-get install -y ${need[*]}" >&2
    exit 1
  fi
  echo "deps: installing ${need[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}"
fi
