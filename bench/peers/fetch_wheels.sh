#!/usr/bin/env bash
# Fetches, on the development machine (the GPU machine has no network), the peers the GPU image
# lacks, into .whl/ (ignored by git; a device call names it in `carry`). Both come out of vLLM's
# wheel (vllm==0.33.0, 336 MB, downloaded to a temporary folder and deleted):
#   .whl/pylib/triton_kernels     OpenAI triton_kernels as vendored by vLLM (pure Python, ~0.3 MB)
#   .whl/deep_gemm_vllm.tar.xz    DeepGEMM as vendored by vLLM (vllm/third_party/deep_gemm: its
#                                 _C_extension.abi3.so loads with the image's torch 2.11, and the
#                                 CUTLASS headers its JIT compiles against; 57 MB, 6 MB packed);
#                                 compare.py unpacks it to /tmp and puts it first on PYTHONPATH.
# Why not the `sgl-deep-gemm` wheels (the first choice): every version from 0.1.7 to 0.2.5 is built
# against a newer torch than 2.11 and fails to load there (README.md, "could not run").
set -euo pipefail
cd "$(dirname "$0")/../.."

VLLM_VERSION=${VLLM_VERSION:-0.33.0}
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
           --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64)

mkdir -p .whl
git check-ignore -q .whl || { echo ".whl is not ignored by git; refusing to fill it" >&2; exit 1; }

if [ ! -f .whl/pylib/triton_kernels/matmul_ogs.py ] || [ ! -f .whl/deep_gemm_vllm.tar.xz ]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d "$tmp" "vllm==${VLLM_VERSION}"
  python3 - "$tmp" <<'PY'
import glob, sys, zipfile
tmp = sys.argv[1]
prefixes = ('vllm/third_party/triton_kernels/', 'vllm/third_party/deep_gemm/')
with zipfile.ZipFile(glob.glob(f'{tmp}/vllm-*.whl')[0]) as z:
    z.extractall(f'{tmp}/extracted', [n for n in z.namelist() if n.startswith(prefixes)])
PY
  src="$tmp/extracted/vllm/third_party"
  mkdir -p .whl/pylib
  rm -rf .whl/pylib/triton_kernels
  cp -r "$src/triton_kernels" .whl/pylib/triton_kernels
  echo "vllm==${VLLM_VERSION} vllm/third_party/triton_kernels" > .whl/pylib/triton_kernels/SOURCE
  echo "vllm==${VLLM_VERSION} vllm/third_party/deep_gemm" > "$src/deep_gemm/SOURCE"
  tar -C "$src" -cJf .whl/deep_gemm_vllm.tar.xz deep_gemm
fi
du -sh .whl
