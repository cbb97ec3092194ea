#!/usr/bin/env bash
# Fetches, on the development machine (the GPU machine has no network), what the peers need that the
# GPU image lacks, into .whl/ (ignored by git; a device call names it in `carry`):
#   .whl/sgl_deep_gemm-*.whl   DeepGEMM (SGLang's build: libtorch + CUDA 13, JIT with nvcc there)
#   .whl/pylib/triton_kernels  OpenAI triton_kernels as vendored in vLLM's wheel (pure Python);
#                              only that folder is kept, the rest of the 336 MB wheel is deleted.
# Versions are pinned so the comparison is reproducible; see bench/peers/README.md for why each.
set -euo pipefail
cd "$(dirname "$0")/../.."

DEEP_GEMM_VERSION=${DEEP_GEMM_VERSION:-0.2.5}
VLLM_VERSION=${VLLM_VERSION:-0.33.0}
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_31_x86_64
           --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64)
PIP=(python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}")

mkdir -p .whl
git check-ignore -q .whl || { echo ".whl is not ignored by git; refusing to fill it" >&2; exit 1; }

ls .whl/sgl_deep_gemm-"${DEEP_GEMM_VERSION}"-*.whl >/dev/null 2>&1 ||
  "${PIP[@]}" -d .whl "sgl-deep-gemm==${DEEP_GEMM_VERSION}"

if [ ! -f .whl/pylib/triton_kernels/matmul_ogs.py ]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  "${PIP[@]}" -d "$tmp" "vllm==${VLLM_VERSION}"
  python3 - "$tmp" <<'PY'
import glob, sys, zipfile
tmp = sys.argv[1]
with zipfile.ZipFile(glob.glob(f'{tmp}/vllm-*.whl')[0]) as z:
    z.extractall(f'{tmp}/extracted', [n for n in z.namelist() if n.startswith('vllm/third_party/triton_kernels/')])
PY
  mkdir -p .whl/pylib
  rm -rf .whl/pylib/triton_kernels
  cp -r "$tmp/extracted/vllm/third_party/triton_kernels" .whl/pylib/triton_kernels
  echo "vllm==${VLLM_VERSION} vllm/third_party/triton_kernels" > .whl/pylib/triton_kernels/SOURCE
fi
du -sh .whl
