#!/usr/bin/env bash
# Copies the header-only and source dependencies the GPU machine lacks (it cannot install
# anything) into .carry/deps, an ignored folder that a device call names in `carry`.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .carry/deps/include
for d in /usr/include/nlohmann /usr/include/CLI; do
  [ -d "$d" ] || { echo "missing $d: apt-get install nlohmann-json3-dev libcli11-dev" >&2; exit 1; }
  cp -r "$d" .carry/deps/include/
done
[ -d /usr/src/googletest ] || { echo "missing /usr/src/googletest: apt-get install googletest" >&2; exit 1; }
rm -rf .carry/deps/googletest && cp -r /usr/src/googletest .carry/deps/googletest
du -sh .carry
# NCCL's headers of this toolkit: the Python extension built on the GPU machine compiles the EP
# transport against them, to match the libnccl of torch's wheel it loads there (the machine's own
# headers are of another version; src/ep/ep_nccl.cu).
NCCL_INC=$(dirname "$(readlink -f /usr/local/cuda/include/nccl.h)")
rm -rf .carry/deps/nccl && mkdir -p .carry/deps/nccl/include
cp -r "$NCCL_INC/nccl.h" "$NCCL_INC/nccl_device.h" "$NCCL_INC/nccl_device" .carry/deps/nccl/include/
