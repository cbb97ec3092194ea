#!/usr/bin/env bash
# Runs on the GPU machine (carry: .carry, filled by prepare_sources.sh) before compare.py: builds the
# issue-34 peers against the image's torch under /tmp/megamoe_peers_build and prints one line per
# peer, "<peer>: built ..." or "<peer>: FAILED ...: <exact error>". compare.py's adapters find them
# there (peer_deepgemm.py DG_MEGA_ROOT, peer_flashinfer.py FI_ROOT); a peer not built reports why.
# marlin-mxfp4 has nothing to build here (its library is built on the development machine by
# build_marlin.sh and carried): its line says whether the carried .so loads and sees the GPU.
#   env: FI_BUILD_TIMEOUT (s, default 420), DG_BUILD_TIMEOUT (s, default 420), SKIP_FI=1, SKIP_DG=1
set -uo pipefail
cd "$(dirname "$0")/../.."
carry=$PWD/.carry/peers
root=/tmp/megamoe_peers_build
site=$root/site
mkdir -p "$root"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
export MAX_JOBS=${MAX_JOBS:-15}
if ls "$carry"/wheels/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
    "$carry"/wheels/*.whl || echo "build_peers: pip install of $carry/wheels failed"
fi
t0=$(date +%s)

if [ "${SKIP_DG:-0}" != 1 ]; then
  if [ -x "$carry/deepgemm/build_deepgemm.sh" ] && [ -f "$carry/deepgemm/src.tar.xz" ]; then
    bash "$carry/deepgemm/build_deepgemm.sh" "$carry" "$root/deepgemm" "$site" > "$root/deepgemm.line" 2>&1 &
    dg_pid=$!
  else
    echo "deepgemm-sm90-mega: FAILED: $carry/deepgemm/ (source + build_deepgemm.sh) not carried" > "$root/deepgemm.line"
  fi
fi

if [ "${SKIP_FI:-0}" != 1 ]; then
  if [ -f "$carry/flashinfer-sm90-moe.tar.xz" ]; then
    rm -rf "$root/flashinfer" && mkdir -p "$root/flashinfer/pkg" "$root/flashinfer/ws"
    tar -C "$root/flashinfer/pkg" -xJf "$carry/flashinfer-sm90-moe.tar.xz"
    (
      fs=$(date +%s)
      FLASHINFER_WORKSPACE_BASE=$root/flashinfer/ws PYTHONPATH=$root/flashinfer/pkg:$site${PYTHONPATH:+:$PYTHONPATH} \
        timeout "${FI_BUILD_TIMEOUT:-420}" python3 -c "
import time, torch
t = time.time()
import flashinfer.fused_moe as fm
from flashinfer.fused_moe.core import get_cutlass_fused_moe_module
print('import ok', round(time.time() - t, 1), 's', flush=True)
get_cutlass_fused_moe_module('90')
print('module fused_moe_90 built', flush=True)
" > "$root/flashinfer.log" 2>&1
      rc=$?
      dt=$(( $(date +%s) - fs ))
      nobj=$(find "$root/flashinfer/ws" -name '*.o' 2>/dev/null | wc -l)
      ncu=$(find "$root/flashinfer/ws" -name '*.generated.cu' 2>/dev/null | wc -l)
      if [ $rc -eq 0 ]; then
        echo "flashinfer-sm90-mxfp4: built fused_moe_90 in ${dt} s ($nobj objects)"
      elif [ $rc -eq 124 ]; then
        echo "flashinfer-sm90-mxfp4: FAILED: JIT build of fused_moe_90 not finished in ${FI_BUILD_TIMEOUT:-420} s ($nobj objects of $ncu generated kernel files + 27 fixed sources compiled, MAX_JOBS=$MAX_JOBS)"
      else
        err=$(grep -E "Error|error:|No module|undefined" "$root/flashinfer.log" | head -4 | cut -c1-300 | tr '\n' ' ')
        echo "flashinfer-sm90-mxfp4: FAILED (rc=$rc after ${dt} s): ${err:-$(tail -3 "$root/flashinfer.log" | tr '\n' ' ')}"
      fi
    ) > "$root/flashinfer.line" 2>&1 &
    fi_pid=$!
  else
    echo "flashinfer-sm90-mxfp4: FAILED: $carry/flashinfer-sm90-moe.tar.xz not carried (bench/peers/prepare_sources.sh)" > "$root/flashinfer.line"
  fi
else
  echo "flashinfer-sm90-mxfp4: not built (SKIP_FI=1): its SM90 fused-MoE JIT module (247 objects) does not build within one device call (bench/results/build_peers_bd7f5ec.log)" > "$root/flashinfer.line"
fi
# Marlin: load the carried library through peer_marlin.py's loader and query the device through it.
so=$carry/marlin/libmegamoe_marlin_peer.so
if [ ! -f "$so" ]; then
  echo "marlin-mxfp4: FAILED: $so not carried (bench/peers/prepare_marlin.sh + build_marlin.sh)" > "$root/marlin.line"
else
  line=$(MARLIN_PEER_SO=$so python3 - <<'PY' 2>&1 | tail -1
import sys
sys.path.insert(0, 'bench/peers')
import peer_marlin as pm
try:
    lib = pm.load_library()
    ws = lib.mmp_moe_workspace_ints()
    if ws <= 0:
        raise RuntimeError('the library sees no CUDA device (workspace size %d)' % ws)
    print('ok', lib.mmp_build_info().decode(), '| locks', ws)
except Exception as exc:
    print('error', f'{type(exc).__name__}: {exc}'[:400])
PY
)
  case "$line" in
    ok*) echo "marlin-mxfp4: ready ($so, ${line#ok })" > "$root/marlin.line" ;;
    *) echo "marlin-mxfp4: FAILED: ${line#error }" > "$root/marlin.line" ;;
  esac
fi
wait
echo "build_peers: $(( $(date +%s) - t0 )) s"
cat "$root"/*.line 2>/dev/null
