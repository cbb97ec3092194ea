#!/usr/bin/env bash
# Builds, on the development machine (no GPU needed; nvcc only), the Marlin MoE peer's library
#   .carry/peers/marlin/libmegamoe_marlin_peer.so
# from the vLLM sources prepare_marlin.sh staged in .carry/peers/marlin/src and our shim
# (marlin_shim/): vLLM's Marlin MoE GEMM for BF16 x MXFP4 (15 kernel instantiations, one arch) and
# its gptq_marlin_repack kernel behind a C ABI (raw device pointers, sizes, a cudaStream_t), with
# no torch in it (the GPU machine's torch 2.11 cannot load vLLM's own extensions, built for 2.14),
# linked against the static CUDA runtime only. The GPU machine only loads it (peer_marlin.py).
# What is changed in vLLM's files, in copies under the build folder (the staged files stay as
# they are):
#   ops.cu:                cut before its torch wrapper `moe_wna16_marlin_gemm(torch::stable::Tensor&...`
#                          and torch includes dropped: marlin_mm (the launcher) is what the shim calls
#   gptq_marlin_repack.cu: cut before its torch launcher (`#define CALL_IF`), torch includes dropped
#   <torch/headeronly/util/Exception.h>: replaced by marlin_shim/include's stand-in (STD_TORCH_CHECK)
#   kernel_selector.h and the kernel instantiation files: written by marlin_shim/gen_instances.py
#     (vLLM generates them with csrc/quantization/marlin/generate_kernels.py; only MXFP4 W4A16 here)
#   env: MARLIN_ARCH (default 90a), JOBS (parallel nvcc, default 1), MARLIN_BUILD_DIR
#        (objects, default /tmp/megamoe_marlin_build)
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
carry=$root/.carry/peers/marlin
src=$carry/src/csrc
shim=$root/bench/peers/marlin_shim
bld=${MARLIN_BUILD_DIR:-/tmp/megamoe_marlin_build}
arch=${MARLIN_ARCH:-90a}
jobs=${JOBS:-1}
out=$carry/libmegamoe_marlin_peer.so
[ -f "$src/moe/marlin_moe_wna16/ops.cu" ] || { echo "build_marlin: $src not staged (bash bench/peers/prepare_marlin.sh)" >&2; exit 1; }
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
vllm_version=$(sed -n '1s/^vllm==\([^ ]*\) .*/\1/p' "$carry/SOURCE")
t0=$(date +%s)
rm -rf "$bld" && mkdir -p "$bld/gen"

ops=$src/moe/marlin_moe_wna16/ops.cu
cut=$(grep -n '^torch::stable::Tensor moe_wna16_marlin_gemm(' "$ops" | head -1 | cut -d: -f1)
[ -n "$cut" ] || { echo "build_marlin: the torch wrapper of ops.cu was not found (vLLM changed?)" >&2; exit 1; }
head -n $((cut - 1)) "$ops" | sed -e '/#include <torch\//d' -e '/#include "torch_utils.h"/d' > "$bld/gen/marlin_moe_ops_core.cu"
rep=$src/quantization/marlin/gptq_marlin_repack.cu
cut=$(grep -n '^#define CALL_IF' "$rep" | head -1 | cut -d: -f1)
[ -n "$cut" ] || { echo "build_marlin: the torch launcher of gptq_marlin_repack.cu was not found" >&2; exit 1; }
head -n $((cut - 1)) "$rep" | sed -e '/#include <torch\//d' -e '/#include "torch_utils.h"/d' \
  -e 's|#include "marlin.cuh"|#include "quantization/marlin/marlin.cuh"|' > "$bld/gen/marlin_repack_core.cuh"
if grep -n 'torch::' "$bld/gen/marlin_moe_ops_core.cu" "$bld/gen/marlin_repack_core.cuh"; then
  echo "build_marlin: torch code left in the cut sources (above)" >&2; exit 1
fi
python3 "$shim/gen_instances.py" "$bld/gen"

# vLLM's flags for these files (CMakeLists.txt / torch's COMMON_NVCC_FLAGS, CUDA >= 12: half
# operators allowed), C++20; -static-global-template-stub=false because the kernels are
# instantiated in other translation units than the launcher's (vLLM sets it for CUDA >= 12.8).
FLAGS=(-std=c++20 -O3 -DNDEBUG -DENABLE_FP8 --expt-relaxed-constexpr -Xcompiler=-fPIC
       -gencode=arch=compute_$arch,code=sm_$arch -static-global-template-stub=false
       "-DMMP_VLLM_VERSION=\"$vllm_version\"" "-DMMP_ARCH=\"sm_$arch\""
       -I"$bld/gen" -I"$shim" -I"$shim/include" -I"$src/moe/marlin_moe_wna16" -I"$src")
units=("$shim/moe_shim.cu" "$shim/repack_shim.cu" "$bld"/gen/kernels_m*.cu)
echo "build_marlin: nvcc $("$NVCC" --version | tail -1), sm_$arch, ${#units[@]} units, $jobs at a time"
pids=()
for u in "${units[@]}"; do
  o=$bld/$(basename "${u%.cu}").o
  ( s=$(date +%s); "$NVCC" "${FLAGS[@]}" -c "$u" -o "$o" > "$o.log" 2>&1 \
      && echo "  $(basename "$u"): $(( $(date +%s) - s )) s" \
      || { echo "  $(basename "$u"): FAILED"; cat "$o.log"; exit 1; } ) &
  pids+=($!)
  while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do sleep 1; done
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
[ $rc = 0 ] || { echo "build_marlin: FAILED (compile)" >&2; exit 1; }
# Exported: the mmp_* C functions only (marlin_shim/exports.map); static cudart: the .so needs no
# libcudart on the target.
"$NVCC" -shared -cudart static -gencode=arch=compute_$arch,code=sm_$arch -o "$out.partial" "$bld"/*.o \
  -Xlinker --version-script="$shim/exports.map" -Xlinker --no-undefined
mv "$out.partial" "$out"
echo "build_marlin: $out, $(stat -c %s "$out") bytes, built in $(( $(date +%s) - t0 )) s"
echo "  needs: $(readelf -d "$out" | sed -n 's/.*Shared library: \[\(.*\)\]/\1/p' | tr '\n' ' ')"
echo "  exports: $(nm -D --defined-only "$out" | awk '$2 == "T" {print $3}' | tr '\n' ' ')"
