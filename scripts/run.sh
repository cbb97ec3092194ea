#!/usr/bin/env bash
# The main job on a fresh machine: install what is missing, build the `megamoe` program
# (Release), and run `megamoe run`: with no arguments the example model (examples/kimi_mini)
# answers the held-out problems; arguments are passed through and select one synthetic MoE layer,
# e.g. `scripts/run.sh --shape kimi-k3 --tokens 8 --ep-size 8`.
#
# CUDA: built when nvcc is present AND a GPU answers nvidia-smi (without a GPU the CPU backend
# runs and compiling the kernels would only cost time). MEGAMOE_ENABLE_CUDA=ON/OFF overrides.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/install-deps.sh
if [ -z "${MEGAMOE_ENABLE_CUDA:-}" ]; then
  MEGAMOE_ENABLE_CUDA=OFF
  if nvidia-smi -L >/dev/null 2>&1; then MEGAMOE_ENABLE_CUDA=ON; fi
fi
BUILD_DIR="${MEGAMOE_BUILD_DIR:-build}"
mkdir -p "$BUILD_DIR"
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DMEGAMOE_ENABLE_CUDA="$MEGAMOE_ENABLE_CUDA" >"$BUILD_DIR/configure.log" 2>&1 \
  || { cat "$BUILD_DIR/configure.log"; exit 1; }
cmake --build "$BUILD_DIR" --target megamoe_cli -j "$(nproc)"
exec "$BUILD_DIR/megamoe" run "$@"
