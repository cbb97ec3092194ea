#!/usr/bin/env bash
# One device call that checks the peers without megamoe: runs every peer on a reduced set of points
# in parallel children (correctness, JIT compiles; the times of a parallel run are marked invalid),
# and bundles logs and the compile caches into $OUT:
#   peers_check.tgz (table, JSON lines, plot, per-peer logs), dg_jit_cache.tgz, triton_cache.tgz
# Unpack the two caches into .whl/dg_jit_cache and .whl/triton_cache to let later runs skip compiles.
#   carry: [".whl"]   env: TOKENS (default 1,512), SHAPES, PEERS, CHECK_TIMEOUT (s for all peers, default 150)
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?OUT must name the folder whose files come back}"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
echo "nvcc: $(command -v nvcc) $(nvcc --version 2>/dev/null | tail -1); c++: $(c++ --version | head -1)"
python3 bench/peers/compare.py --skip-megamoe --shapes "${SHAPES:-kimi-k3,deepseek-v3}" --tokens "${TOKENS:-1,512}" \
  --peers "${PEERS:-megamoe-py,torch-bf16,deepgemm-fp8,deepgemm-mega,triton-mxfp4}" \
  --parallel 4 --peer-timeout 140 --total-timeout "${CHECK_TIMEOUT:-150}" --out /tmp/peers_check
echo "compare.py rc=$?"
tar czf "$OUT/peers_check.tgz" -C /tmp peers_check
for d in megamoe_peers_dg_jit_cache megamoe_peers_triton_cache; do
  [ -d "/tmp/$d" ] && tar czf "$OUT/${d#megamoe_peers_}.tgz" -C /tmp "$d"
done
ls -la "$OUT"
