"""Peer: vLLM's Marlin MoE (`moe_wna16_marlin_gemm`, the kernel vLLM falls back on for MXFP4 MoE
on GPUs without native FP4, Hopper included) with MXFP4 weights and BF16 activations (W4A16).

marlin-mxfp4-w4a16: two Marlin MoE GEMMs (L1 [gate; up], L2 with the routing weight applied in its
  epilogue) over vLLM's moe_align_block_size layout, the shape's activation and the top-k sum in
  torch between and after them, one CUDA graph.

Where it comes from: vLLM's own extension (`_moe_C_stable_libtorch.abi3.so`, built for torch 2.14)
does not load with the GPU image's torch 2.11, so the kernels are compiled on the development
machine from vLLM 0.33.0's source distribution (prepare_marlin.sh stages the files, build_marlin.sh
builds them) into a torch-free library with a C ABI, .carry/peers/marlin/libmegamoe_marlin_peer.so
(marlin_shim/: the launcher marlin_mm and the gptq_marlin_repack kernel behind extern "C"
functions). This file loads it with ctypes and does the rest in torch:

  weights   our E2M1 bytes [E, N, K/2] viewed as int32 [E, N, K/8] (8 codes along K per word, low
            nibble first: GPTQ's packing), transposed to [E, K/8, N] and repacked by vLLM's
            gptq_marlin_repack kernel into [E, K/16, 2N] (as vLLM's prepare_moe_fp4_layer_for_marlin
            does per expert). L1 keeps our row order [gate; up] (vLLM's silu_and_mul order).
  scales    our UE8M0 bytes [E, N, K/32], unchanged in value, transposed to [E, K/32, N] and
            permuted like vLLM's marlin_permute_scales (64-wide group permutation, for
            group_size < K) then mxfp4_marlin_process_scales (pairs of columns swapped in each 4:
            [0, 2, 1, 3]). vLLM goes through the activation dtype and back to float8_e8m0fnu on the
            way, which is exact for powers of two: here the bytes are permuted directly.
  routing   moe_align_block_size's layout (sorted_token_ids padded per expert to the block size
            with the pad value T*K, expert_ids per block, num_tokens_post_padded), computed in
            torch without host syncs (stable sort: deterministic, unlike vLLM's atomics); the block
            size follows vLLM's fused_marlin_moe choice (8, 16, 32, 48, 64 by T*K/E).
  L1        size_m = T, top_k = K: row T*K-slot s of the output is x[s // K] @ W13[e]^T.
  act       the shape's activation (reference.activation, FP32) on BF16 L1 outputs -> BF16.
  L2        size_m = T*K, top_k = 1, mul_topk_weights: slot rows x routing weight (BF16 multiply).
  combine   FP32 sum over the K slots of each token, rounded to BF16 once.

The W4A8 variant (FP8 activations x MXFP4) exists in vLLM's Marlin but is built and allowed only
for SM89 and SM12x (vLLM's marlin_mm refuses SM90: the FP8 MMA it uses is not native there):
not run. gpt-oss-120b (H = 2880) needs vLLM's tile padding of the hidden size (H % 128): not done.
"""
from __future__ import annotations

import ctypes
import os
from typing import Callable, Optional

import torch

from common import Inputs, MxWeights, Shape
from reference import activation

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
LIB_PATH = os.environ.get('MARLIN_PEER_SO', os.path.join(REPO, '.carry', 'peers', 'marlin', 'libmegamoe_marlin_peer.so'))
MX_GROUP = 32
REPACK_CHUNK_EXPERTS = 16          # experts transposed + repacked at a time (bounds the temporaries)
BLOCK_SIZES = (8, 16, 32, 48, 64)  # vLLM fused_marlin_moe's moe block sizes


# --- layouts (pure torch, CPU-testable: selftest.py) -------------------------------------------
def _scale_perm64() -> list[int]:
    """vLLM marlin_utils.get_scale_perms()[0]: the permutation of each run of 64 scales."""
    return [i + 8 * j for i in range(8) for j in range(8)]


def marlin_mxfp4_scales(sf: torch.Tensor) -> torch.Tensor:
    """UE8M0 bytes [E, N, K/32] -> Marlin's [E, K/32, N] order (a permutation of the bytes)."""
    e, n, groups = sf.shape
    if (groups * n) % 64 or n % 4:
        raise ValueError(f'scales [{e}, {n}, {groups}]: N x K/32 must be a multiple of 64')
    s = sf.transpose(1, 2).contiguous()                                   # [E, G, N]
    s = s.reshape(e, -1, 64)[:, :, _scale_perm64()]                       # marlin_permute_scales
    s = s.reshape(e, -1, 4)[:, :, [0, 2, 1, 3]]                           # mxfp4_marlin_process_scales
    return s.reshape(e, groups, n).contiguous()


def gptq_pack_for_repack(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 bytes [E, N, K/2] -> int32 [E, K/8, N], the input of gptq_marlin_repack."""
    return codes.contiguous().view(torch.int32).transpose(1, 2).contiguous()


def block_size_for(num_tokens: int, top_k: int, num_experts: int) -> int:
    """vLLM fused_marlin_moe: the first block size b with T*K/E/b < 0.9, else 64."""
    for b in BLOCK_SIZES:
        if num_tokens * top_k / num_experts / b < 0.9:
            return b
    return BLOCK_SIZES[-1]


def sorted_len_for(num_slots: int, num_experts: int, block: int) -> int:
    """Length of sorted_token_ids (vLLM moe_align_block_size's max_num_tokens_padded)."""
    n = num_slots + num_experts * (block - 1)
    if num_slots < num_experts:
        n = min(num_slots * block, n)
    return n


def align_block_size(topk_idx: torch.Tensor, block: int, num_experts: int):
    """moe_align_block_size semantics, no host sync (CUDA-graph safe), deterministic.

    Returns sorted_token_ids int32 [L] (slot ids t*K+k grouped by expert, each expert's run padded
    to a multiple of `block` with the pad value T*K, valid slots first), expert_ids int32
    [ceil(L / block)] (the expert of each block; blocks past num_tokens_post_padded are never read)
    and num_tokens_post_padded int32 [1]."""
    flat = topk_idx.reshape(-1).long()
    s = flat.numel()
    dev = flat.device
    length = sorted_len_for(s, num_experts, block)
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block - 1) // block * block
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    order = torch.argsort(flat, stable=True)                              # slots by expert
    sorted_e = flat[order]
    first = torch.cumsum(counts, 0) - counts                               # first sorted slot per expert
    pos = starts[sorted_e] + torch.arange(s, device=dev) - first[sorted_e]
    sorted_ids = torch.full((length,), s, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, pos, order.to(torch.int32))
    n_blocks = (length + block - 1) // block
    block_start = torch.arange(n_blocks, device=dev) * block
    expert_ids = torch.searchsorted(ends, block_start, right=True).clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_ids, expert_ids, ends[-1:].to(torch.int32)


# --- the library -------------------------------------------------------------------------------
_LIB = None


def load_library():
    global _LIB
    if _LIB is None:
        if not os.path.isfile(LIB_PATH):
            raise OSError(f'{LIB_PATH} missing (bench/peers/prepare_marlin.sh + build_marlin.sh on the '
                          'development machine, carried in .carry)')
        lib = ctypes.CDLL(LIB_PATH)
        vp, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
        lib.mmp_last_error.restype = ctypes.c_char_p
        lib.mmp_build_info.restype = ctypes.c_char_p
        lib.mmp_moe_c_tmp_floats.restype = i64
        lib.mmp_moe_c_tmp_floats.argtypes = [i32, i64, i32]
        lib.mmp_moe_workspace_ints.restype = i32
        lib.mmp_gptq_repack_4bit.restype = i32
        lib.mmp_gptq_repack_4bit.argtypes = [vp, vp, i32, i32, i32, vp]
        lib.mmp_moe_mxfp4_gemm.restype = i32
        lib.mmp_moe_mxfp4_gemm.argtypes = [vp, vp, vp, i64, vp, vp, vp, vp, i64, vp, vp, vp, vp, i32, i32,
                                           i32, i32, i32, i32, i32, i32, i32, i32, i32, i32, vp]
        _LIB = lib
    return _LIB


def _check(rc: int, what: str):
    if rc != 0:
        raise RuntimeError(f'{what}: {_LIB.mmp_last_error().decode(errors="replace")}')


def _ptr(t: Optional[torch.Tensor]):
    return None if t is None else ctypes.c_void_p(t.data_ptr())


def _stream():
    return ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)


def repack_weights(lib, codes: torch.Tensor) -> torch.Tensor:
    """E2M1 bytes [E, N, K/2] (on the GPU) -> Marlin int32 [E, K/16, 2N] via gptq_marlin_repack."""
    e, n, k2 = codes.shape
    k = 2 * k2
    out = torch.empty((e, k // 16, 2 * n), dtype=torch.int32, device=codes.device)
    for start in range(0, e, REPACK_CHUNK_EXPERTS):
        sl = slice(start, min(e, start + REPACK_CHUNK_EXPERTS))
        packed = gptq_pack_for_repack(codes[sl])
        _check(lib.mmp_gptq_repack_4bit(_ptr(packed), _ptr(out[sl]), packed.shape[0], k, n, _stream()),
               'gptq_marlin_repack')
    torch.cuda.synchronize()
    return out


class MarlinMxfp4W4A16:
    name = 'marlin-mxfp4-w4a16'
    description = ('vLLM 0.33.0 Marlin MoE (moe_wna16_marlin_gemm), MXFP4 weights x BF16 activations, built '
                   'torch-free for sm_90a; alignment, activation and top-k sum in torch')
    graphable = True

    def __init__(self, shape: Shape, weights: MxWeights):
        self.lib = load_library()
        self.shape = shape
        self.num_experts = weights.num_experts
        if weights.w13_bias is not None or weights.w2_bias is not None:
            raise ValueError('expert biases are not wired (see unsupported())')
        self.w13 = repack_weights(self.lib, weights.w13)
        self.w2 = repack_weights(self.lib, weights.w2)
        self.s13 = marlin_mxfp4_scales(weights.w13_sf)
        self.s2 = marlin_mxfp4_scales(weights.w2_sf)
        dev = weights.w13.device
        self.workspace = torch.zeros(self.lib.mmp_moe_workspace_ints(), dtype=torch.int32, device=dev)

    @staticmethod
    def unsupported(shape: Shape) -> Optional[str]:
        if shape.has_bias:
            return 'expert biases (gpt-oss) are not wired'
        if shape.hidden % 128:
            return (f'hidden = {shape.hidden}: Marlin MoE needs H % 128 == 0 without vLLM\'s tile padding '
                    '(not done here)')
        if shape.intermediate % 64:
            return f'intermediate = {shape.intermediate}: Marlin MoE needs I % 64 == 0'
        try:
            lib = load_library()
        except OSError as exc:
            return f'library not loadable: {exc}'[:600]
        if torch.cuda.is_available() and torch.cuda.get_device_capability() < (9, 0):
            return f'the library is built for sm_90a only ({lib.mmp_build_info().decode()})'
        return None

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.w13, self.w2, self.s13, self.s2))

    def layout_for(self, num_tokens: int) -> str:
        return f'moe block {block_size_for(num_tokens, self.shape.top_k, self.num_experts)}'

    def _gemm(self, a, c, c_tmp, w, s, routing, block, top_k, mul_topk, size_m, size_n, size_k, topk_w):
        sorted_ids, expert_ids, num_post = routing
        _check(self.lib.mmp_moe_mxfp4_gemm(
            _ptr(a), _ptr(c), _ptr(c_tmp), c_tmp.numel(), _ptr(w), _ptr(s), None, _ptr(sorted_ids),
            sorted_ids.numel(), _ptr(expert_ids), _ptr(num_post), _ptr(topk_w), _ptr(self.workspace),
            self.workspace.numel(), block, self.num_experts, top_k, int(mul_topk), size_m, size_n, size_k,
            1, -1, -1, -1, _stream()), 'moe_wna16_marlin_gemm')

    def build(self, inp: Inputs) -> Callable[[], torch.Tensor]:
        shape = self.shape
        t_count, top_k = inp.topk_idx.shape
        s_count = t_count * top_k
        h, i = shape.hidden, shape.intermediate
        dev = inp.x.device
        block = block_size_for(t_count, top_k, self.num_experts)
        length = sorted_len_for(s_count, self.num_experts, block)
        x = inp.x.contiguous()
        topk_w = inp.topk_weights.to(torch.float32).contiguous()
        # Outputs the kernels write into are NaN-poisoned once: a slot row they skip stays NaN.
        c1 = torch.full((s_count, 2 * i), float('nan'), dtype=torch.bfloat16, device=dev)
        c2 = torch.full((s_count, h), float('nan'), dtype=torch.bfloat16, device=dev)
        tmp_floats = max(self.lib.mmp_moe_c_tmp_floats(2 * i, length, block),
                         self.lib.mmp_moe_c_tmp_floats(h, length, block))
        c_tmp = torch.empty(tmp_floats, dtype=torch.float32, device=dev)
        state = {}

        def l1(routing):
            self._gemm(x, c1, c_tmp, self.w13, self.s13, routing, block, top_k, False, t_count, 2 * i, h, topk_w)

        def l2(v, routing):
            self._gemm(v, c2, c_tmp, self.w2, self.s2, routing, block, 1, True, s_count, h, i, topk_w)

        def run() -> torch.Tensor:
            routing = align_block_size(inp.topk_idx, block, self.num_experts)
            l1(routing)
            v = activation(shape, c1[:, :i].float(), c1[:, i:].float()).to(torch.bfloat16)
            l2(v, routing)
            state.update(routing=routing, v=v)
            return c2.view(t_count, top_k, h).sum(1, dtype=torch.float32).to(torch.bfloat16)

        def gemms_only() -> torch.Tensor:
            """The two Marlin GEMMs alone, on the routing and intermediate of the last eager run()."""
            l1(state['routing'])
            l2(state['v'], state['routing'])
            return c2

        run.gemms_only = gemms_only
        run.buffers = {'l1': c1, 'l2': c2}      # marlin_check.py reads the L1 output
        return run
