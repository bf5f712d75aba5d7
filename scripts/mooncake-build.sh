#!/usr/bin/env bash
# Builds a real Mooncake Transfer Engine's Python module for the interop
# tests (make test-mooncake-real): Mooncake's own engine, TCP and RDMA,
# without CUDA, etcd or its store. About 15 minutes on two cores.
#
#   scripts/mooncake-build.sh SRC OUT
#
# SRC: a Mooncake checkout with its submodules (git clone --recursive
# https://github.com/kvcache-ai/Mooncake; extern/yalantinglibs and
# extern/pybind11 filled). OUT gets mooncake/engine*.so, libasio.so and a
# one-line mooncake/__init__.py: put OUT on PYTHONPATH and LD_LIBRARY_PATH
# (make test-mooncake-real MOONCAKE_PY=OUT does).
set -euo pipefail
[[ $# -eq 2 ]] || { echo "usage: $0 MOONCAKE_SOURCE_DIR OUT_DIR" >&2; exit 2; }
SRC=$(realpath "$1")
mkdir -p "$2"
OUT=$(realpath "$2")
[[ -f $SRC/extern/yalantinglibs/CMakeLists.txt && -f $SRC/extern/pybind11/CMakeLists.txt ]] ||
  { echo "$SRC lacks its submodules (extern/yalantinglibs, extern/pybind11): git submodule update --init there" >&2; exit 1; }
if [[ $(id -u) -eq 0 ]]; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq cmake ninja-build g++ libgoogle-glog-dev libgflags-dev \
    libjsoncpp-dev libyaml-cpp-dev libnuma-dev libcurl4-openssl-dev libasio-dev libunwind-dev libibverbs-dev python3-dev >/dev/null
fi
YLT=$OUT/.ylt
cmake -S "$SRC/extern/yalantinglibs" -B "$OUT/.build-ylt" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX="$YLT" \
  -DBUILD_EXAMPLES=OFF -DBUILD_BENCHMARK=OFF -DBUILD_UNIT_TESTS=OFF >/dev/null
ninja -C "$OUT/.build-ylt" install >/dev/null
cmake -S "$SRC" -B "$OUT/.build" -G Ninja -DCMAKE_PREFIX_PATH="$YLT" -DCMAKE_BUILD_TYPE=Release \
  -DWITH_STORE=OFF -DWITH_STORE_RUST=OFF -DWITH_P2P_STORE=OFF -DWITH_EP=OFF -DUSE_CUDA=OFF -DUSE_ETCD=OFF \
  -DUSE_REDIS=OFF -DUSE_HTTP=OFF -DUSE_TENT=OFF -DWITH_METRICS=OFF -DBUILD_UNIT_TESTS=OFF -DBUILD_BENCHMARK=OFF >/dev/null
ninja -C "$OUT/.build" engine
mkdir -p "$OUT/mooncake"
cp "$(find "$OUT/.build" -name 'engine.cpython*.so' | head -1)" "$OUT/mooncake/"
cp "$(find "$OUT/.build" -name 'libasio.so' | head -1)" "$OUT/"
echo "# Mooncake's engine, built by ferry's scripts/mooncake-build.sh" > "$OUT/mooncake/__init__.py"
echo "built: $OUT (PYTHONPATH=$OUT LD_LIBRARY_PATH=$OUT python3 -c 'from mooncake.engine import TransferEngine')"
