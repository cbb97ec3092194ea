#!/usr/bin/env bash
# Fills .carry/peers/ (ignored by git; a device call names `.carry` in `carry`) on the development
# machine with what the GPU machine needs for the peers of issue 34 that no wheel there provides.
# Everything here comes from PyPI through pip (the GPU machine has no network):
#   .carry/peers/wheels/apache_tvm_ffi-0.1.11-*.whl  the FFI both DeepGEMM's sgl layout and FlashInfer
#                                                    bind with (2.7 MB; 0.1.11 satisfies both pins)
#   .carry/peers/cutlass-include.tar.xz              include/{cute,cutlass} of nvidia-cutlass 4.2.0.0
#                                                    (DeepGEMM's JIT pins CUTLASS 4.2.1; 4.2.1 has no
#                                                    PyPI release, 4.2.0's headers are the nearest)
#   .carry/peers/flashinfer-sm90-moe.tar.xz          flashinfer-python 0.7.2.post1 reduced to its
#                                                    Python package and the JIT sources/headers of the
#                                                    SM90 CUTLASS fused MoE (gen_cutlass_fused_moe_sm90
#                                                    _module): nv_internal, fused_moe/cutlass_backend,
#                                                    include, cutlass, cccl, spdlog
# DeepGEMM's SM90 Mega MoE source is not on PyPI (no sdist; the sgl-deep-gemm wheels' _C.so does not
# load with torch 2.11): it is staged separately into .carry/peers/deepgemm/ (README.md, "Mega MoE").
set -euo pipefail
cd "$(dirname "$0")/../.."
out=.carry/peers
mkdir -p "$out/wheels"
git check-ignore -q "$out" || { echo "$out is not ignored by git; refusing to fill it" >&2; exit 1; }
PLAT=(--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

ls "$out"/wheels/apache_tvm_ffi-0.1.11-*.whl >/dev/null 2>&1 || python3 -m pip download -q --no-deps \
  --only-binary=:all: "${PLAT[@]}" -d "$out/wheels" apache-tvm-ffi==0.1.11

if [ ! -f "$out/cutlass-include.tar.xz" ]; then
  python3 -m pip download -q --no-deps --only-binary=:all: -d "$tmp" nvidia-cutlass==4.2.0.0
  python3 - "$tmp" <<'PY'
import glob, sys, zipfile
tmp = sys.argv[1]
pre = 'cutlass_library/source/include/'
with zipfile.ZipFile(glob.glob(f'{tmp}/nvidia_cutlass-*.whl')[0]) as z:
    z.extractall(f'{tmp}/c', [n for n in z.namelist() if n.startswith(pre + 'cute/') or n.startswith(pre + 'cutlass/')])
PY
  tar -C "$tmp/c/cutlass_library/source/include" -cJf "$out/cutlass-include.tar.xz" cute cutlass
fi

if [ ! -f "$out/flashinfer-sm90-moe.tar.xz" ]; then
  python3 -m pip download -q --no-deps --only-binary=:all: -d "$tmp" flashinfer-python==0.7.2.post1
  python3 - "$tmp" <<'PY'
import glob, sys, zipfile
tmp = sys.argv[1]
D = 'flashinfer/data/'
keep_dirs = (D + 'csrc/nv_internal/', D + 'csrc/fused_moe/cutlass_backend/', D + 'include/',
             D + 'cutlass/include/', D + 'cutlass/tools/util/include/', D + 'cccl/cub/',
             D + 'cccl/libcudacxx/include/', D + 'cccl/thrust/', D + 'spdlog/include/')
def keep(n):
    if n.endswith('/'):
        return False
    if n.startswith(D):
        if n.startswith(keep_dirs):
            return True
        rest = n[len(D) + len('csrc/'):]
        return n.startswith(D + 'csrc/') and '/' not in rest and rest.endswith(('.h', '.cuh', '.hpp'))
    return n.startswith('flashinfer/') and n.endswith('.py') or n.startswith('flashinfer_python-')
with zipfile.ZipFile(glob.glob(f'{tmp}/flashinfer_python-*.whl')[0]) as z:
    names = [n for n in z.namelist() if keep(n)]
    z.extractall(f'{tmp}/fi', names)
print(f'flashinfer subset: {len(names)} files')
PY
  echo "flashinfer-python==0.7.2.post1 (PyPI), reduced by bench/peers/prepare_sources.sh" > "$tmp/fi/SOURCE"
  tar -C "$tmp/fi" -cJf "$out/flashinfer-sm90-moe.tar.xz" .
fi
[ -f "$out/deepgemm/src.tar.xz" ] || echo "note: $out/deepgemm/ (DeepGEMM SM90 Mega MoE source) is not staged: deepgemm-mega will report it"
du -sh "$out"; ls -la "$out" "$out/wheels"
