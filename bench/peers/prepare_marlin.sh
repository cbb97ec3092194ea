#!/usr/bin/env bash
# Stages, on the development machine, the vLLM sources of the Marlin MoE peer (issue 34) into
# .carry/peers/marlin/src (ignored by git; never committed). They come from vLLM's source
# distribution on PyPI (vllm==0.33.0, the version fetch_wheels.sh takes triton_kernels and DeepGEMM
# from), downloaded with pip into a cache outside the repository and checked against its sha256;
# only the files the Marlin MoE GEMM and the weight repack kernel need are kept (about 150 KB):
#   csrc/core/scalar_type.hpp
#   csrc/quantization/marlin/{marlin.cuh, marlin_dtypes.cuh, dequant.h, marlin_mma.h, gptq_marlin_repack.cu}
#   csrc/moe/marlin_moe_wna16/{kernel.h, marlin_template.h, ops.cu}
#   LICENSE (Apache-2.0)
# build_marlin.sh then compiles them, with our shim (marlin_shim/), into the torch-free
# .carry/peers/marlin/libmegamoe_marlin_peer.so.
#
# pip prepares an sdist's metadata before saving it, and vLLM's setup.py imports torch,
# setuptools_scm and setuptools_rust to do so: PY must name a Python with torch (any version: only
# the metadata step imports it); the two setuptools plugins are installed into a temporary folder.
#   env: PY (default: python3 if it imports torch, else /tmp/tv/bin/python), MARLIN_SDIST_DIR
#        (download cache, default /tmp/megamoe_vllm_sdist)
set -euo pipefail
cd "$(dirname "$0")/../.."
VLLM_VERSION=0.33.0
VLLM_SDIST_SHA256=f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112
out=.carry/peers/marlin
cache=${MARLIN_SDIST_DIR:-/tmp/megamoe_vllm_sdist}
sdist=$cache/vllm-$VLLM_VERSION.tar.gz
FILES=(LICENSE
       csrc/core/scalar_type.hpp
       csrc/quantization/marlin/marlin.cuh csrc/quantization/marlin/marlin_dtypes.cuh
       csrc/quantization/marlin/dequant.h csrc/quantization/marlin/marlin_mma.h
       csrc/quantization/marlin/gptq_marlin_repack.cu
       csrc/moe/marlin_moe_wna16/kernel.h csrc/moe/marlin_moe_wna16/marlin_template.h
       csrc/moe/marlin_moe_wna16/ops.cu)

mkdir -p "$out" "$cache"
git check-ignore -q "$out" || { echo "$out is not ignored by git; refusing to fill it" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

if [ ! -f "$sdist" ]; then
  if [ -z "${PY:-}" ]; then
    if python3 -c 'import torch' 2>/dev/null; then PY=python3; else PY=/tmp/tv/bin/python; fi
  fi
  "$PY" -c 'import torch' || { echo "PY=$PY cannot import torch (needed by vLLM's setup.py for pip's metadata step)" >&2; exit 1; }
  "$PY" -m pip install -q --target "$tmp/tools" setuptools-scm setuptools-rust
  PYTHONPATH="$tmp/tools" VLLM_TARGET_DEVICE=empty VLLM_SKIP_VERSION_SUFFIX=1 \
    "$PY" -m pip download -q --no-deps --no-binary :all: --no-build-isolation -d "$cache" "vllm==$VLLM_VERSION"
fi
echo "$VLLM_SDIST_SHA256  $sdist" | sha256sum -c --quiet - || { echo "sha256 mismatch: $sdist" >&2; exit 1; }

tar -xzf "$sdist" -C "$tmp" "${FILES[@]/#/vllm-$VLLM_VERSION/}"
rm -rf "$out/src"
mkdir -p "$out/src"
(cd "$tmp/vllm-$VLLM_VERSION" && cp --parents "${FILES[@]}" "$OLDPWD/$out/src/")
{
  echo "vllm==$VLLM_VERSION source distribution from PyPI (vllm-$VLLM_VERSION.tar.gz, sha256 $VLLM_SDIST_SHA256)"
  echo "staged by bench/peers/prepare_marlin.sh; files:"
  (cd "$out/src" && sha256sum "${FILES[@]}")
} > "$out/SOURCE"
du -sh "$out/src"
cat "$out/SOURCE"
