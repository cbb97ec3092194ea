"""DeepGEMM's Mega MoE Python API, served by megamoe (Hopper and the CPU reference).

Serving engines (SGLang, vLLM, ...) run DeepSeek, Kimi-K3 and GPT-OSS MoE layers through
DeepGEMM's public Mega MoE API (``deep_gemm/mega/__init__.py``), which has kernels for Blackwell
(SM100) only. This module takes the same calls with the same argument conventions, so that an
engine's Mega MoE code path runs on an H200 by changing the module it calls:

    import megamoe.deep_gemm_compat as mega        # instead of `import deep_gemm as mega`

    # load time, per layer (tensors as DeepGEMM's transform takes them)
    w13_sf = mega.transform_sf_into_required_layout(w13_sf_fp32, 2 * I, H, (1, 32), E_l)
    w2_sf = mega.transform_sf_into_required_layout(w2_sf_fp32, H, I, (1, 32), E_l)
    l1, l2 = mega.transform_weights_for_mega_moe((w13_int8, w13_sf), (w2_int8, w2_sf))
    buffer = mega.get_symm_buffer_for_mega_moe(group, E, max_tokens_per_rank, K, H, I)

    # every call
    buffer.x[:T].copy_(x_fp8); buffer.x_sf[:T].copy_(x_sf_packed)
    buffer.topk_idx[:T].copy_(topk_idx); buffer.topk_weights[:T].copy_(topk_weights)
    mega.fp8_fp4_mega_moe(y, l1, l2, buffer, activation="situ", situ_beta=4.0,
                          situ_linear_beta=25.0)                      # Kimi-K3
    mega.fp8_fp4_mega_moe(y, l1, l2, buffer, activation_clamp=10.0)   # DeepSeek (swiglu)

README.md, "For engine authors", maps every DeepGEMM function and argument onto megamoe and
lists what is not supported. In short:

* get_symm_buffer_for_mega_moe(group, num_experts, num_max_tokens_per_rank, num_topk, hidden,
  intermediate_hidden, use_fp8_dispatch=None, mma_type='fp8xfp4', activation='swiglu') returns a
  SymmBuffer with DeepGEMM's input views (x, x_sf, topk_idx, topk_weights, same dtypes and
  shapes). A group of one rank (or None) gives a plain layer; a larger torch.distributed group
  gives an expert-parallel layer over NCCL (megamoe.ep.nccl_group_from_torch).
  get_symm_buffers_for_virtual_ranks(R, ...) gives R ranks on one GPU (megamoe.ep.virtual_group).
* transform_weights_for_mega_moe((w13, w13_sf), (w2, w2_sf), activation) takes the FP4 weights
  and UE8M0 scale factors in the forms DeepGEMM's transform takes (packed int32 MN-major scale
  factors from transform_sf_into_required_layout, or float32 / uint8 per-32 scales), or, with
  transformed=True, DeepGEMM's transformed tensors (the "blackwell-interop" layout of
  docs/layouts.md). It returns (l1, l2) pairs that refer to megamoe-owned weights in megamoe's
  canonical form: pass them to fp8_fp4_mega_moe as DeepGEMM's transformed pairs are passed.
* fp8_fp4_mega_moe(y, l1_weights, l2_weights, sym_buffer, cumulative_local_expert_recv_stats,
  recipe, activation, activation_clamp, fast_math, ..., situ_beta, situ_linear_beta) reads
  buffer.x[:T] etc. (T = y.shape[0]) and writes y. It is the custom op
  ``torch.ops.megamoe.fp8_fp4_mega_moe`` underneath, so it traces under torch.compile
  (fullgraph) and is captured by CUDA graphs.

**Inputs are dequantized, exactly.** megamoe's layer takes BF16 activations and quantizes them
by the contract (per 32 channels, UE8M0 scale 2^ceil(log2(amax / 448)), amax floored at 1e-4).
DeepGEMM's buffer holds FP8 E4M3 codes and packed UE8M0 scales, so each call first forms
x = e4m3 * 2^(sf - 127) in BF16. That is exact for every scale byte in [3, 246] (an E4M3 value
has 4 significant bits, BF16 has 8), and the layer's quantizer gives back the same values:
for every group whose scale byte is in [105, 246], which includes everything a quantizer with
the same 1e-4 amax floor produces (DeepGEMM's per_token_cast_to_fp8 with use_ue8m0), megamoe's
scale byte is the same or smaller and every value stays exactly representable. The layer's
products are products of values, so y is bit for bit what the layer computes on the FP8 input
(tests/python/test_deep_gemm_compat.py compares it with the CPU reference fed the FP8 codes and
scales directly). The codes and scale bytes themselves may differ when a group's codes did not
reach the top binade (a smaller scale with larger codes, the same values).

Binding: megamoe fixes a layer's activation and fast_math when it builds the layer, DeepGEMM
takes them with every call. The first call (or prepare_mega_moe_layer, which does it ahead) binds
the transformed weights to the buffer: it builds the MoELayer with the call's activation and
fast_math and moves the weights into it; later calls must pass the same ones
(InvalidArgumentError otherwise). Binding allocates and copies, so it cannot happen inside CUDA
graph capture (UnsupportedError: call once before capturing, as engines' warm-up runs do), and
virtual ranks must all be bound with prepare_mega_moe_layer before their first call, since a
rank's binding waits for the device while another rank's call is waiting for it there.

Errors are megamoe errors (docs/reliability.md): InvalidArgumentError (a ValueError) for a wrong
argument, naming it; DTypeError (a TypeError) for a wrong dtype; OutOfRangeError for T above the
buffer's capacity; UnsupportedError (a RuntimeError) for what megamoe does not implement (BF16
experts, NVFP4, shared experts fused into the call, BF16 dispatch, another recipe, receive
statistics under expert parallelism).
"""

import contextlib
import itertools
import math
import operator
import weakref
from typing import Optional

import torch

from . import _megamoe as _C
from . import ep as _ep
from . import torch_ops as _ops
from . import layer as _layer

__all__ = [
    "SymmBuffer", "get_symm_buffer_for_mega_moe", "get_symm_buffers_for_virtual_ranks",
    "transform_sf_into_required_layout", "transform_weights_for_mega_moe", "fp8_fp4_mega_moe",
    "bf16_mega_moe", "prepare_mega_moe_layer", "get_layer", "WeightRef",
]

_SCALE_BLOCK = 32          # UE8M0 scale per 32 values along K (recipe (1, 1, 32))
_GROUPS_PER_INT = 4        # DeepGEMM packs 4 UE8M0 bytes per int32, group 4j in the low byte
_INTERLEAVE = 8            # gate/up rows alternate in groups of 8 (transformed L1)
_UTCCP_BLOCK = 128         # scale rows transposed within 128-row blocks (transformed SF)
_SITU_DEFAULTS = (4.0, 25.0)  # Kimi-K3's beta and linear_beta
_TWO_POW_MINUS_127 = 2.0 ** -127  # UE8M0 byte 0

# NOTES: plain numbers, not an EpOptions instance: this module's functions are registered with
# torch.library, which keeps its globals alive past nanobind's leak check at exit.
_DEFAULT_TIMEOUT_S = float(_ep.EpOptions().timeout_s)
_DEFAULT_MAX_RECV_ROWS = int(_ep.EpOptions().max_recv_rows)


def _invalid(msg):
    return _C.InvalidArgumentError(msg)


def _unsupported(msg):
    return _C.UnsupportedError(msg)


# ------------------------------------------------------------------------------------------------
# The symmetric buffer
# ------------------------------------------------------------------------------------------------
_BUFFERS = weakref.WeakValueDictionary()  # handle -> SymmBuffer (for the op)
_NEXT_HANDLE = itertools.count(1)


class SymmBuffer:
    """What get_symm_buffer_for_mega_moe returns: one rank's inputs of a Mega MoE layer call and
    its megamoe expert-parallel group.

    DeepGEMM's attributes (the engine copies a call's inputs into the first T rows):
        x             float8_e4m3fn [num_max_tokens_per_rank, hidden]    E4M3 codes
        x_sf          int32 [num_max_tokens_per_rank, ceil(hidden / 128)] UE8M0 scales of 32
                      channels each, 4 per int32, channel group 4j in the low byte (DeepGEMM's
                      per_token_cast_to_fp8(..., use_ue8m0=True, gran_k=32, use_packed_ue8m0=True))
        topk_idx      int64 [num_max_tokens_per_rank, num_topk]   global expert ids, -1 = none
        topk_weights  float32 [num_max_tokens_per_rank, num_topk]
        group, num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate_hidden
    megamoe's:
        rank, num_ranks   this rank and the group's size
        ep_group          the megamoe.ep.EpGroup (None for one rank)
        backend, device   the layer's backend ("cpu" or "sm90") and where the views live
        layer_options     extra LayerConfig options of the layers bound to it

    These are ordinary device tensors, not symmetric memory: megamoe's EpGroup owns its own
    exchange window (docs/design.md, "Expert parallelism"). DeepGEMM's internal views (l1_acts,
    l2_acts, their scales) and its raw `buffer` have no counterpart.
    """

    def __init__(self, group, num_experts, num_max_tokens_per_rank, num_topk, hidden,
                 intermediate_hidden, activation, rank, num_ranks, ep_group, backend,
                 layer_options):
        self.group = group
        self.num_experts = num_experts
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.num_topk = num_topk
        self.hidden = hidden
        self.intermediate_hidden = intermediate_hidden
        self.activation = activation
        self.rank = rank
        self.num_ranks = num_ranks
        self.ep_group = ep_group
        self.backend = backend
        self.layer_options = dict(layer_options or {})
        self.virtual = False  # set by get_symm_buffers_for_virtual_ranks
        self.config("swiglu", True)  # a wrong layer option is reported here, not at the call
        if backend == "sm90":
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        t, h, k = num_max_tokens_per_rank, hidden, num_topk
        packed = -(-(h // _SCALE_BLOCK) // _GROUPS_PER_INT)
        self.x = torch.zeros((t, h), dtype=torch.float8_e4m3fn, device=self.device)
        self.x_sf = torch.zeros((t, packed), dtype=torch.int32, device=self.device)
        self.topk_idx = torch.full((t, k), -1, dtype=torch.int64, device=self.device)
        self.topk_weights = torch.zeros((t, k), dtype=torch.float32, device=self.device)
        self.handle = next(_NEXT_HANDLE)
        _BUFFERS[self.handle] = self

    @property
    def num_local_experts(self):
        return self.num_experts // self.num_ranks

    def config(self, activation, fast_math):
        """The LayerConfig of a layer on this rank with this activation spec and fast_math."""
        shape = _C.LayerShape(self.hidden, self.intermediate_hidden, self.num_experts,
                              self.num_topk)
        return _C.LayerConfig(shape, activation=activation, ep_size=self.num_ranks,
                              ep_rank=self.rank,
                              max_tokens_per_rank=self.num_max_tokens_per_rank,
                              fast_math=fast_math, **self.layer_options)

    def destroy(self):
        """Releases the views and the group (as DeepGEMM's destroy()); layers already bound keep
        their own reference to the group."""
        _BUFFERS.pop(self.handle, None)
        self.x = self.x_sf = self.topk_idx = self.topk_weights = None
        self.group = self.ep_group = None

    def __repr__(self):
        return (f"SymmBuffer(rank={self.rank}/{self.num_ranks}, num_experts={self.num_experts}, "
                f"num_max_tokens_per_rank={self.num_max_tokens_per_rank}, "
                f"num_topk={self.num_topk}, hidden={self.hidden}, "
                f"intermediate_hidden={self.intermediate_hidden}, backend='{self.backend}')")


def _positive_int(value):
    try:
        value = operator.index(value)
    except TypeError:
        return None
    return value if value > 0 else None


def _check_shape_args(num_experts, num_max_tokens_per_rank, num_topk, hidden,
                      intermediate_hidden, num_ranks):
    """The five sizes as ints, checked: positive, E divisible by the ranks, a valid shape."""
    values = []
    for name, value in (("num_experts", num_experts),
                        ("num_max_tokens_per_rank", num_max_tokens_per_rank),
                        ("num_topk", num_topk), ("hidden", hidden),
                        ("intermediate_hidden", intermediate_hidden)):
        checked = _positive_int(value)
        if checked is None:
            raise _invalid(f"{name}: expected a positive int, got {value!r}")
        values.append(checked)
    e, t, k, h, i = values
    if e % num_ranks:
        raise _invalid(f"num_experts: {e} experts do not divide over {num_ranks} ranks")
    # H and I multiples of 32, K <= E: the shape's own validation names the problem.
    _C.LayerShape(h, i, e, k)
    return e, t, k, h, i


def _check_buffer_kind(use_fp8_dispatch, mma_type, activation, num_shared_experts):
    if mma_type != "fp8xfp4":
        raise _unsupported(f"mma_type: megamoe serves FP8 activations x MXFP4 expert weights "
                           f"('fp8xfp4'), got {mma_type!r}")
    if use_fp8_dispatch is not None and not use_fp8_dispatch:
        raise _unsupported("use_fp8_dispatch: megamoe dispatches FP8 activations; "
                           "use_fp8_dispatch=False (BF16 dispatch) is not supported")
    if num_shared_experts:
        raise _unsupported(f"num_shared_experts: shared experts fused into the call are not "
                           f"supported (got {num_shared_experts}); run them beside the layer")
    _activation_kind(activation, "activation")


def _resolve_backend(backend, num_ranks):
    have = _layer.available_backends()
    if backend == "auto":
        backend = "sm90" if "sm90" in have and torch.cuda.is_available() else "cpu"
    if backend not in ("cpu", "sm90"):
        raise _invalid(f"backend: expected 'auto', 'cpu' or 'sm90', got {backend!r}")
    if backend not in have:
        raise _unsupported(f"backend: '{backend}' is not available here (backends: {have})")
    if backend == "sm90" and not torch.cuda.is_available():
        raise _unsupported("backend: 'sm90' needs a CUDA device that torch can see")
    if num_ranks > 1 and backend != "sm90":
        raise _unsupported(f"expert parallelism ({num_ranks} ranks) needs the sm90 backend "
                           f"(backends here: {have})")
    return backend


def get_symm_buffer_for_mega_moe(group, num_experts, num_max_tokens_per_rank, num_topk, hidden,
                                 intermediate_hidden, use_fp8_dispatch=None, mma_type="fp8xfp4",
                                 activation="swiglu", *, num_shared_experts=0, backend="auto",
                                 timeout_s=_DEFAULT_TIMEOUT_S,
                                 max_recv_rows=_DEFAULT_MAX_RECV_ROWS, layer_options=None):
    """DeepGEMM's get_symm_buffer_for_mega_moe: this rank's SymmBuffer for a layer of
    `num_experts` experts (E / world size per rank), top-`num_topk`, hidden `hidden`,
    intermediate `intermediate_hidden`, at most `num_max_tokens_per_rank` tokens per call.

    group: a torch.distributed ProcessGroup (anything with size() and rank()). Size 1, or None
        (a megamoe extension: no torch.distributed at all), gives a layer on this process's
        device; a larger group gives an expert-parallel layer over NCCL, made collectively over
        `group` (megamoe.ep.nccl_group_from_torch; set each process's CUDA device first).
    use_fp8_dispatch, mma_type: only FP8 x FP4 (None/True, 'fp8xfp4'); others UnsupportedError.
    activation: the activation's name ('swiglu', 'situ'; megamoe also takes 'swiglu_oai'); the
        parameters come with each call.
    num_shared_experts (keyword; DeepGEMM's newer API): 0 only.
    megamoe's keywords: backend ('auto': sm90 on a Hopper GPU, else cpu), timeout_s and
        max_recv_rows of the EP group (megamoe.ep), layer_options (extra LayerConfig keywords of
        the layer, e.g. {'gemm_tile': ...}).

    Unlike DeepGEMM, num_max_tokens_per_rank is kept as given (no alignment to a block size).
    """
    _check_buffer_kind(use_fp8_dispatch, mma_type, activation, num_shared_experts)
    if group is None:
        rank, num_ranks = 0, 1
    else:
        try:
            rank, num_ranks = int(group.rank()), int(group.size())
        except AttributeError:
            raise _invalid(f"group: expected a torch.distributed ProcessGroup or None, got "
                           f"{type(group).__name__}") from None
    num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate_hidden = \
        _check_shape_args(num_experts, num_max_tokens_per_rank, num_topk, hidden,
                          intermediate_hidden, num_ranks)
    backend = _resolve_backend(backend, num_ranks)
    ep_group = None
    buffer = SymmBuffer(group, num_experts, num_max_tokens_per_rank, num_topk, hidden,
                        intermediate_hidden, activation, rank, num_ranks, None, backend,
                        layer_options)
    if num_ranks > 1:
        ep_group = _ep.nccl_group_from_torch(buffer.config("swiglu", True), process_group=group,
                                             timeout_s=timeout_s, max_recv_rows=max_recv_rows)
        buffer.ep_group = ep_group
    return buffer


def get_symm_buffers_for_virtual_ranks(num_ranks, num_experts, num_max_tokens_per_rank,
                                       num_topk, hidden, intermediate_hidden, mma_type="fp8xfp4",
                                       activation="swiglu", *, timeout_s=_DEFAULT_TIMEOUT_S,
                                       max_recv_rows=_DEFAULT_MAX_RECV_ROWS,
                                       layer_options=None):
    """megamoe's extension: `num_ranks` virtual ranks of one expert-parallel layer on the current
    CUDA device (megamoe.ep.virtual_group), as a list whose element r is rank r's SymmBuffer.
    Each rank's calls go on its own stream, all ranks' calls of one layer call in flight before
    anything waits (megamoe.ep), and every rank's weights must be bound with
    prepare_mega_moe_layer before the first call. Needs the sm90 backend."""
    _check_buffer_kind(None, mma_type, activation, 0)
    if not isinstance(num_ranks, int) or num_ranks <= 0:
        raise _invalid(f"num_ranks: expected a positive int, got {num_ranks!r}")
    num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate_hidden = \
        _check_shape_args(num_experts, num_max_tokens_per_rank, num_topk, hidden,
                          intermediate_hidden, num_ranks)
    backend = _resolve_backend("sm90", num_ranks)
    buffers = [SymmBuffer(None, num_experts, num_max_tokens_per_rank, num_topk, hidden,
                          intermediate_hidden, activation, r, num_ranks, None, backend,
                          layer_options) for r in range(num_ranks)]
    groups = _ep.virtual_group(num_ranks, buffers[0].config("swiglu", True), timeout_s=timeout_s,
                               max_recv_rows=max_recv_rows)
    for b, g in zip(buffers, groups):
        b.ep_group = g
        b.virtual = True
    return buffers


# ------------------------------------------------------------------------------------------------
# Scale factors and weights
# ------------------------------------------------------------------------------------------------
def _ceil_div(a, b):
    return -(-a // b)


def _ue8m0_from_float(sf, arg):
    """uint8 UE8M0 bytes of float32 scale factors, which must be powers of two 2^(b - 127),
    b in [0, 254] (DeepGEMM keeps the exponent bits and drops any mantissa; megamoe refuses a
    scale it cannot represent exactly). Synchronises (the check reads the result)."""
    bits = sf.contiguous().view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    normal = ((bits & 0x807FFFFF) == 0) & (exponent >= 1) & (exponent <= 254)
    byte0 = bits == 0x00400000  # 2^-127, a float32 subnormal
    ok = normal | byte0
    if not bool(ok.all()):
        bad = (~ok).nonzero()[0].tolist()
        value = sf[tuple(bad)].item()
        raise _invalid(f"{arg}: scale factors must be powers of two 2^(b - 127) with b in "
                       f"[0, 254] (UE8M0), got {value!r} at index {tuple(bad)}")
    return torch.where(byte0, 0, exponent).to(torch.uint8)


def _unpack_int32_sf(sf, groups):
    """uint8 [..., groups] from DeepGEMM's packed int32 [..., ceil(groups / 4)] (any strides).
    Scalar shifts only: a tensor of shifts would be a host-to-device copy, which a CUDA graph
    cannot capture."""
    b = torch.stack([(sf >> shift) & 0xFF for shift in (0, 8, 16, 24)], dim=-1)
    return b.reshape(*sf.shape[:-1], sf.shape[-1] * _GROUPS_PER_INT)[..., :groups].to(torch.uint8)


def _sf_to_bytes(sf, n, k, experts, arg):
    """Canonical uint8 UE8M0 scales [E, n, k / 32] (contiguous) of a weight's scale factors in
    any form transform_weights_for_mega_moe takes (see there)."""
    if not isinstance(sf, torch.Tensor):
        raise _C.DTypeError(f"{arg}: expected a torch.Tensor, got {type(sf).__name__}")
    e8m0 = getattr(torch, "float8_e8m0fnu", None)
    if sf.dtype not in (torch.int32, torch.uint8, torch.float32) and (e8m0 is None
                                                                        or sf.dtype != e8m0):
        raise _C.DTypeError(f"{arg}: expected int32 (packed UE8M0), float32, uint8 or "
                            f"float8_e8m0fnu scale factors, got {sf.dtype}")
    groups = k // _SCALE_BLOCK
    if sf.dtype == torch.int32:
        want = (experts, n, _ceil_div(groups, _GROUPS_PER_INT))
    else:
        want = (experts, n, groups)
    if tuple(sf.shape) != want:
        raise _invalid(f"{arg}: expected shape {list(want)} for {sf.dtype} scale factors of "
                       f"[{experts}, {n}, {k}] weights, got {list(sf.shape)}")
    if sf.dtype == torch.int32:
        return _unpack_int32_sf(sf, groups).contiguous()
    if sf.dtype == torch.float32:
        return _ue8m0_from_float(sf, arg).contiguous()
    return sf.contiguous().view(torch.uint8)


def transform_sf_into_required_layout(sf, mn, k, recipe, num_groups=None, is_sfa=None,
                                      disable_ue8m0_cast=False):
    """DeepGEMM's transform_sf_into_required_layout for MXFP4 weights, as it behaves on SM100
    (on SM90 DeepGEMM has no transformation for this recipe): float32 scale factors
    [num_groups, mn, k / 32] (or 2-D without num_groups) become packed UE8M0, int32
    [num_groups, mn, ceil(k / 128)] with MN-major, TMA-aligned strides
    (ceil(k / 128) * align(mn, 4), 1, align(mn, 4)); 4 groups per int32, group 4j in the low
    byte, missing groups zero. int32 input (already packed) is returned as it is.

    recipe: (1, 32), or (1, 1, 32) with is_sfa; anything else UnsupportedError, as is
    disable_ue8m0_cast=True (the FP32 scales of DeepGEMM's FP8 SM90 path). Float scales must be
    powers of two (InvalidArgumentError otherwise; DeepGEMM would drop the mantissa)."""
    if len(recipe) == 3:
        if is_sfa is None:
            raise _invalid("is_sfa: a 3-element recipe needs is_sfa (as in DeepGEMM)")
        gran_mn, gran_k = (recipe[0] if is_sfa else recipe[1]), recipe[2]
    elif len(recipe) == 2:
        if is_sfa is not None:
            raise _invalid("is_sfa: only with a 3-element recipe")
        gran_mn, gran_k = recipe
    else:
        raise _invalid(f"recipe: expected 2 or 3 elements, got {recipe!r}")
    if (gran_mn, gran_k) != (1, _SCALE_BLOCK) or disable_ue8m0_cast:
        raise _unsupported(f"recipe: megamoe's weights are MXFP4, one UE8M0 scale per 32 values "
                           f"(recipe (1, 32)); got granularity ({gran_mn}, {gran_k}) with "
                           f"disable_ue8m0_cast={disable_ue8m0_cast}")
    if k % _SCALE_BLOCK:
        raise _invalid(f"k: expected a multiple of {_SCALE_BLOCK}, got {k}")
    squeeze = sf.dim() == 2
    batched = sf.unsqueeze(0) if squeeze else sf
    if batched.dim() != 3 or (num_groups is not None and batched.shape[0] != num_groups):
        raise _invalid(f"sf: expected [num_groups={num_groups}, {mn}, ...] scale factors, got "
                       f"{list(sf.shape)}")
    experts = batched.shape[0]
    if sf.dtype == torch.int32:
        _sf_to_bytes(batched, mn, k, experts, "sf")  # checks the shape
        return sf
    b = _sf_to_bytes(batched, mn, k, experts, "sf")  # uint8 [E, mn, G]
    groups = k // _SCALE_BLOCK
    packed = _ceil_div(groups, _GROUPS_PER_INT)
    aligned_mn = _ceil_div(mn, 4) * 4
    padded = torch.zeros((experts, aligned_mn, packed * _GROUPS_PER_INT), dtype=torch.uint8,
                         device=sf.device)
    padded[:, :mn, :groups] = b
    words = padded.view(torch.int32)  # [E, aligned_mn, packed], little-endian: group 4j low
    out = torch.empty_strided((experts, aligned_mn, packed), (aligned_mn * packed, 1, aligned_mn),
                              dtype=torch.int32, device=sf.device)
    out.copy_(words)
    out = out[:, :mn]
    return out.squeeze(0) if squeeze else out


def _deinterleave_rows(t):
    """Inverse of DeepGEMM's L1 interleave: rows [g0..g7 u0..u7 g8..g15 ...] -> [gate | up]."""
    e, n = t.shape[0], t.shape[1]
    rest = tuple(t.shape[2:])
    pairs = t.reshape(e, n // (2 * _INTERLEAVE), 2, _INTERLEAVE, *rest)
    gate = pairs[:, :, 0].reshape(e, n // 2, *rest)
    up = pairs[:, :, 1].reshape(e, n // 2, *rest)
    return torch.cat([gate, up], dim=1)


def _untranspose_utccp(sf):
    """Inverse of DeepGEMM's _transpose_sf_for_utccp: within each 128-row block, prepared row
    4b + a holds canonical row 32a + b."""
    e, n, p = sf.shape
    return sf.reshape(e, n // _UTCCP_BLOCK, 32, 4, p).transpose(2, 3).reshape(e, n, p)


def _weight_bytes(w, arg):
    if not isinstance(w, torch.Tensor):
        raise _C.DTypeError(f"{arg}: expected a torch.Tensor, got {type(w).__name__}")
    if w.dtype not in (torch.int8, torch.uint8):
        raise _C.DTypeError(f"{arg}: expected int8 or uint8 packed E2M1 pairs, got {w.dtype}")
    if w.dim() != 3:
        raise _invalid(f"{arg}: expected [num_local_experts, N, K / 2], got {list(w.shape)}")
    return w.contiguous().view(torch.uint8)


def _pair(p, arg):
    if not isinstance(p, (tuple, list)) or len(p) != 2:
        if isinstance(p, torch.Tensor):
            raise _unsupported(f"{arg}: BF16 expert weights (a single tensor) are not supported; "
                               f"megamoe serves MXFP4 experts, given as a (weight, scale factor) "
                               f"pair")
        raise _invalid(f"{arg}: expected a (weight, scale factor) pair, got "
                       f"{type(p).__name__}")
    return p


class _ExpertWeights:
    """One layer's transformed experts on one rank: canonical tensors until bound, then the
    MoELayer they were moved into."""

    def __init__(self, w13, w13_sf, w2, w2_sf, activation):
        self.num_local_experts = int(w13.shape[0])
        self.intermediate = int(w13.shape[1]) // 2
        self.hidden = int(w13.shape[2]) * 2
        self.activation = activation
        self.arrays = (w13, w13_sf, w2, w2_sf)
        self.layer = None
        self.buffer_handle = None
        self.bound = None  # (activation spec, fast_math) of the layer
        self.handle = next(_NEXT_HANDLE)
        _WEIGHTS[self.handle] = self

    def bind(self, buffer, spec, fast_math):
        """The MoELayer of these weights on `buffer` with activation `spec`, built on first use."""
        if self.layer is not None:
            if self.buffer_handle != buffer.handle:
                raise _invalid("l1_weights: these transformed weights are already bound to "
                               "another SymmBuffer; transform them again for a second buffer")
            if self.bound != (spec, fast_math):
                raise _invalid(
                    f"activation: this layer was built with activation '{self.bound[0]}' and "
                    f"fast_math={self.bound[1]} at its first call; megamoe fixes both per layer, "
                    f"got '{spec}' and fast_math={fast_math}")
            return self.layer
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise _unsupported("fp8_fp4_mega_moe: the first call builds the megamoe layer "
                               "(allocations and copies), which cannot be captured in a CUDA "
                               "graph; call it once before capturing, or use "
                               "prepare_mega_moe_layer")
        kind = _activation_kind(spec, "activation")
        for what, name in (("the weights were transformed", self.activation),
                           ("the buffer was made", buffer.activation)):
            if kind != _activation_kind(name, "activation"):
                raise _invalid(f"activation: {what} for '{name}', the call asks for '{spec}'")
        if (self.hidden, self.intermediate) != (buffer.hidden, buffer.intermediate_hidden):
            raise _invalid(f"l1_weights: experts of hidden {self.hidden} and intermediate "
                           f"{self.intermediate} do not match the buffer's "
                           f"({buffer.hidden}, {buffer.intermediate_hidden})")
        if self.num_local_experts != buffer.num_local_experts:
            raise _invalid(f"l1_weights: {self.num_local_experts} local experts, the buffer's "
                           f"rank holds {buffer.num_local_experts} "
                           f"({buffer.num_experts} over {buffer.num_ranks} ranks)")
        config = buffer.config(spec, fast_math)
        w13, w13_sf, w2, w2_sf = self.arrays
        first = buffer.rank * self.num_local_experts
        weights = _layer.MoeWeights.from_arrays(w13, w13_sf, w2, w2_sf, first_expert=first)
        on_device = (torch.cuda.device(buffer.device) if buffer.device.type == "cuda"
                     else contextlib.nullcontext())
        with on_device:  # a GPU layer is built on the current device
            layer = _layer.MoELayer(config, weights, backend=buffer.backend,
                                    group=buffer.ep_group)
        self.layer, self.buffer_handle, self.bound = layer, buffer.handle, (spec, fast_math)
        self.arrays = None  # the layer holds the only copy now
        return layer


_WEIGHTS = weakref.WeakValueDictionary()  # handle -> _ExpertWeights (for the op)


class WeightRef:
    """One element of a pair transform_weights_for_mega_moe returns: a reference to a buffer
    ("w13", "w13_sf", "w2" or "w2_sf") of megamoe-owned expert weights, standing where DeepGEMM
    returns a tensor. Pass the pairs (or pairs rebuilt from their elements) to fp8_fp4_mega_moe;
    they are not tensors. `handle` is the int the custom op takes."""

    __slots__ = ("owner", "name", "handle")

    def __init__(self, owner, name):
        self.owner = owner
        self.name = name
        self.handle = owner.handle

    def __repr__(self):
        o = self.owner
        return (f"WeightRef('{self.name}', experts={o.num_local_experts}, hidden={o.hidden}, "
                f"intermediate={o.intermediate}, bound={o.layer is not None})")


def transform_weights_for_mega_moe(l1_weights, l2_weights, activation="swiglu", *,
                                   transformed=False):
    """DeepGEMM's transform_weights_for_mega_moe: one rank's expert weights for fp8_fp4_mega_moe.

    l1_weights: (w13, w13_sf), w13 int8/uint8 [E_l, 2I, H/2] packed E2M1 pairs (low nibble = even
        column), rows [0, I) gate (w1) and [I, 2I) up (w3), as DeepGEMM's transform takes them.
    l2_weights: (w2, w2_sf), w2 int8/uint8 [E_l, H, I/2].
    The scale factors, per 32 values along K (UE8M0, 2^(b - 127)), in any of these forms:
        int32 [E_l, N, ceil(K/128)]  packed, 4 per int32, group 4j in the low byte, any strides
                                     (what transform_sf_into_required_layout returns on SM100:
                                     the Blackwell layout engines hand DeepGEMM's transform)
        float32 [E_l, N, K/32]       powers of two (per_token_cast_to_fp4(use_ue8m0=True))
        uint8 or float8_e8m0fnu [E_l, N, K/32]   the bytes (e.g. a checkpoint's weight_scale)
    activation: 'swiglu' or 'situ' (DeepGEMM's names; megamoe also takes 'swiglu_oai'): the
        calls must use an activation of this kind.
    transformed (keyword, megamoe's): the pairs are DeepGEMM's *output* instead, the tensors an
        engine kept from deep_gemm.transform_weights_for_mega_moe (gate/up rows interleaved in
        groups of 8, int32 scale rows transposed within 128-row blocks: docs/layouts.md,
        "blackwell-interop"); N must be a multiple of 128, as DeepGEMM requires.

    Returns (l1, l2): pairs of WeightRef that refer to the weights in megamoe's canonical form
    (on the weights' device). Like DeepGEMM's, the result goes to fp8_fp4_mega_moe. Until the
    first call (or prepare_mega_moe_layer) binds them, the canonical tensors are kept: the
    scales converted, the weights themselves as they are when already canonical (as DeepGEMM's
    transform returns the L2 weight tensor itself), so do not overwrite them before that. The
    binding copies them into the MoELayer and drops these references. Synchronises when the
    scales are float32 (they are checked on the host).
    """
    _activation_kind(activation, "activation")
    w13, w13_sf = _pair(l1_weights, "l1_weights")
    w2, w2_sf = _pair(l2_weights, "l2_weights")
    w13 = _weight_bytes(w13, "l1_weights[0]")
    w2 = _weight_bytes(w2, "l2_weights[0]")
    experts, two_i, h_half = (int(s) for s in w13.shape)
    hidden, intermediate = 2 * h_half, two_i // 2
    if two_i % 2 or hidden % _SCALE_BLOCK or intermediate % _SCALE_BLOCK:
        raise _invalid(f"l1_weights[0]: expected [E_l, 2I, H/2] with H and I multiples of 32, got "
                       f"{list(w13.shape)}")
    if tuple(w2.shape) != (experts, hidden, intermediate // 2):
        raise _invalid(f"l2_weights[0]: expected [{experts}, {hidden}, {intermediate // 2}] "
                       f"(from l1_weights[0] {list(w13.shape)}), got {list(w2.shape)}")
    if w13.device != w2.device:
        raise _invalid(f"l2_weights[0]: expected a tensor on {w13.device} (the device of "
                       f"l1_weights[0]), got {w2.device}")
    for arg, sf in (("l1_weights[1]", w13_sf), ("l2_weights[1]", w2_sf)):
        if isinstance(sf, torch.Tensor) and sf.device != w13.device:
            raise _invalid(f"{arg}: expected a tensor on {w13.device}, got {sf.device}")
    if transformed:
        for arg, sf, n in (("l1_weights[1]", w13_sf, two_i), ("l2_weights[1]", w2_sf, hidden)):
            if not isinstance(sf, torch.Tensor) or sf.dtype != torch.int32:
                raise _C.DTypeError(f"{arg}: transformed scale factors are packed int32, got "
                                    f"{getattr(sf, 'dtype', type(sf).__name__)}")
            if n % _UTCCP_BLOCK:
                raise _invalid(f"{arg}: transformed scale factors need N % 128 == 0 "
                               f"(DeepGEMM's requirement), got N = {n}")
        if intermediate % _INTERLEAVE:
            raise _invalid(f"l1_weights[0]: I = {intermediate} is not a multiple of 8")
        w13 = _deinterleave_rows(w13).contiguous()
        w13_sf = _deinterleave_rows(_untranspose_utccp(_check_sf_shape(
            w13_sf, (experts, two_i, _ceil_div(hidden // _SCALE_BLOCK, 4)), "l1_weights[1]")))
        w2_sf = _untranspose_utccp(_check_sf_shape(
            w2_sf, (experts, hidden, _ceil_div(intermediate // _SCALE_BLOCK, 4)),
            "l2_weights[1]"))
    b13 = _sf_to_bytes(w13_sf, two_i, hidden, experts, "l1_weights[1]")
    b2 = _sf_to_bytes(w2_sf, hidden, intermediate, experts, "l2_weights[1]")
    owner = _ExpertWeights(w13, b13, w2, b2, activation)
    return ((WeightRef(owner, "w13"), WeightRef(owner, "w13_sf")),
            (WeightRef(owner, "w2"), WeightRef(owner, "w2_sf")))


def _check_sf_shape(sf, want, arg):
    if tuple(sf.shape) != want:
        raise _invalid(f"{arg}: expected shape {list(want)}, got {list(sf.shape)}")
    return sf


# ------------------------------------------------------------------------------------------------
# The layer call
# ------------------------------------------------------------------------------------------------
def _activation_kind(activation, arg):
    if not isinstance(activation, str) or not activation:
        raise _invalid(f"{arg}: expected an activation name such as 'swiglu' or 'situ', got "
                       f"{activation!r}")
    kind = activation.split(":", 1)[0]
    if kind not in ("swiglu", "situ", "swiglu_oai"):
        raise _unsupported(f"{arg}: megamoe implements 'swiglu' (with activation_clamp), 'situ' "
                           f"(situ_beta, situ_linear_beta) and 'swiglu_oai'; got {activation!r}")
    return kind


def _fmt(value):
    return repr(float(value))


def activation_spec(activation="swiglu", activation_clamp=None, situ_beta=None,
                    situ_linear_beta=None):
    """megamoe's activation spec (megamoe.Activation.parse) for DeepGEMM's activation arguments:

        'swiglu', activation_clamp None or inf   -> 'swiglu'
        'swiglu', activation_clamp L (>= 0)      -> 'swiglu:clamp=L' (gate min L, up in [-L, L],
                                                    on BF16 values, as DeepGEMM's kernel clamps)
        'situ', situ_beta b, situ_linear_beta l  -> 'situ:beta=b,linear_beta=l'; None gives
                                                    Kimi-K3's 4 and 25; a clamp is an error
        'swiglu_oai', activation_clamp L         -> 'swiglu_oai:clamp=L' (GPT-OSS; alpha 1.702)
    A full megamoe spec ('situ:beta=4,linear_beta=25') is taken as it is, with the keywords None.
    """
    kind = _activation_kind(activation, "activation")
    if ":" in activation:
        if activation_clamp is not None or situ_beta is not None or situ_linear_beta is not None:
            raise _invalid(f"activation: '{activation}' already carries its parameters; leave "
                           f"activation_clamp, situ_beta and situ_linear_beta None")
        return activation
    if kind == "situ":
        if activation_clamp is not None:
            raise _invalid(f"activation_clamp: SiTU takes no clamp (its tanh bounds it), got "
                           f"{activation_clamp!r}")
        beta = _SITU_DEFAULTS[0] if situ_beta is None else situ_beta
        lbeta = _SITU_DEFAULTS[1] if situ_linear_beta is None else situ_linear_beta
        return f"situ:beta={_fmt(beta)},linear_beta={_fmt(lbeta)}"
    if situ_beta is not None or situ_linear_beta is not None:
        raise _invalid(f"situ_beta: only for activation='situ', got activation={activation!r}")
    if activation_clamp is not None:
        clamp = float(activation_clamp)
        if math.isnan(clamp) or clamp < 0:
            raise _invalid(f"activation_clamp: expected a value >= 0 (or None), got "
                           f"{activation_clamp!r}")
        if kind == "swiglu" and math.isinf(clamp):
            return "swiglu"  # DeepGEMM: no clamp is a clamp at infinity
        return f"{kind}:clamp={_fmt(clamp)}"
    return kind


def _refs(pair, names, arg):
    if isinstance(pair, torch.Tensor):
        raise _unsupported(f"{arg}: BF16 expert weights (a single tensor) are not supported; "
                           f"pass the pair transform_weights_for_mega_moe returned")
    if (not isinstance(pair, (tuple, list)) or len(pair) != 2
            or not all(isinstance(r, WeightRef) for r in pair)):
        raise _invalid(f"{arg}: expected the pair megamoe.deep_gemm_compat."
                       f"transform_weights_for_mega_moe returned (megamoe keeps the weights in "
                       f"its own memory: tensors transformed by DeepGEMM go through "
                       f"transform_weights_for_mega_moe(..., transformed=True) first)")
    if (pair[0].name, pair[1].name) != names or pair[0].owner is not pair[1].owner:
        raise _invalid(f"{arg}: expected the ({names[0]}, {names[1]}) pair of one "
                       f"transform_weights_for_mega_moe result, got ({pair[0].name}, "
                       f"{pair[1].name})")
    return pair[0].owner


def _weights_of(l1_weights, l2_weights):
    owner = _refs(l1_weights, ("w13", "w13_sf"), "l1_weights")
    if _refs(l2_weights, ("w2", "w2_sf"), "l2_weights") is not owner:
        raise _invalid("l2_weights: from another transform_weights_for_mega_moe call than "
                       "l1_weights")
    return owner


def _check_buffer(sym_buffer):
    if not isinstance(sym_buffer, SymmBuffer):
        raise _invalid(f"sym_buffer: expected the SymmBuffer of megamoe.deep_gemm_compat."
                       f"get_symm_buffer_for_mega_moe, got {type(sym_buffer).__name__}")
    if sym_buffer.x is None:
        raise _invalid("sym_buffer: destroyed")


def prepare_mega_moe_layer(l1_weights, l2_weights, sym_buffer, activation="swiglu",
                           activation_clamp=None, fast_math=True, situ_beta=None,
                           situ_linear_beta=None):
    """megamoe's extension: binds the transformed weights to `sym_buffer` now, with the
    activation and fast_math the calls will pass (the first fp8_fp4_mega_moe call does it
    otherwise). Needed for virtual ranks (every rank before the first call), useful everywhere
    (load time instead of the first call). Returns the MoELayer (check_errors(), expert_rows())."""
    owner = _weights_of(l1_weights, l2_weights)
    _check_buffer(sym_buffer)
    spec = activation_spec(activation, activation_clamp, situ_beta, situ_linear_beta)
    return owner.bind(sym_buffer, spec, bool(fast_math))


def get_layer(l1_weights):
    """The MoELayer a transformed pair is bound to, or None before its first call."""
    return _refs(l1_weights, ("w13", "w13_sf"), "l1_weights").layer


def fp8_fp4_mega_moe(y, l1_weights, l2_weights, sym_buffer, cumulative_local_expert_recv_stats=None,
                     recipe=(1, 1, 32), activation="swiglu", activation_clamp=None,
                     fast_math=True, *, shared_l1_weights=None, shared_l2_weights=None,
                     situ_beta=None, situ_linear_beta=None):
    """DeepGEMM's fp8_fp4_mega_moe: y = MoE of the first T = y.shape[0] rows of sym_buffer's
    x / x_sf / topk_idx / topk_weights, with the weights of transform_weights_for_mega_moe.

    y: bf16 [T, hidden], contiguous, on the buffer's device; written in full (T may be 0; T above
        num_max_tokens_per_rank is OutOfRangeError). Under expert parallelism every rank calls,
        each with its own T.
    l1_weights, l2_weights: the pairs transform_weights_for_mega_moe returned (InvalidArgumentError
        for anything else; a single BF16 tensor is UnsupportedError).
    sym_buffer: this rank's SymmBuffer.
    cumulative_local_expert_recv_stats: optional int32 [E_l]; each call adds the rows
        (token, slot) each local expert received. One rank only (UnsupportedError under expert
        parallelism, where megamoe counts on the device but reports to the host).
    recipe: (1, 1, 32) only.
    activation, activation_clamp, situ_beta, situ_linear_beta: see activation_spec(); fixed by
        the first call (see the module docstring).
    fast_math: megamoe's fast_math (__expf and an approximate reciprocal in the activation, as
        DeepGEMM's); fixed by the first call.
    shared_l1_weights, shared_l2_weights (keywords; DeepGEMM's newer API): None only.

    Runs torch.ops.megamoe.fp8_fp4_mega_moe (traces under torch.compile, capturable once bound).
    """
    if shared_l1_weights is not None or shared_l2_weights is not None:
        raise _unsupported("shared_l1_weights: shared experts fused into the call are not "
                           "supported; run them beside the layer")
    if tuple(recipe) != (1, 1, 32):
        raise _unsupported(f"recipe: only (1, 1, 32) (MXFP4 weights, per-32 FP8 scales), got "
                           f"{tuple(recipe)!r}")
    owner = _weights_of(l1_weights, l2_weights)
    _check_buffer(sym_buffer)
    if not isinstance(y, torch.Tensor):
        raise _C.DTypeError(f"y: expected a torch.Tensor, got {type(y).__name__}")
    if y.dtype != torch.bfloat16:
        raise _C.DTypeError(f"y: expected bfloat16, got {y.dtype}")
    if y.dim() != 2 or y.shape[1] != sym_buffer.hidden:
        raise _invalid(f"y: expected [T, {sym_buffer.hidden}], got {list(y.shape)}")
    if y.shape[0] > sym_buffer.num_max_tokens_per_rank:
        raise _C.OutOfRangeError(f"y: T = {y.shape[0]} tokens exceed the buffer's "
                                 f"num_max_tokens_per_rank = {sym_buffer.num_max_tokens_per_rank}")
    if y.device != sym_buffer.device:
        raise _invalid(f"y: expected a tensor on {sym_buffer.device}, got {y.device}")
    stats = cumulative_local_expert_recv_stats
    if stats is not None:
        if sym_buffer.num_ranks > 1:
            raise _unsupported("cumulative_local_expert_recv_stats: not supported under expert "
                               "parallelism (MoELayer.expert_rows() gives the last call's rows)")
        if stats.dtype != torch.int32:
            raise _C.DTypeError(f"cumulative_local_expert_recv_stats: expected int32, got "
                                f"{stats.dtype}")
        if stats.numel() != sym_buffer.num_local_experts or not stats.is_contiguous():
            raise _invalid(f"cumulative_local_expert_recv_stats: expected a contiguous tensor of "
                           f"{sym_buffer.num_local_experts} elements, got {list(stats.shape)}")
        if stats.device != sym_buffer.device:
            raise _invalid(f"cumulative_local_expert_recv_stats: expected a tensor on "
                           f"{sym_buffer.device}, got {stats.device}")
    torch.ops.megamoe.fp8_fp4_mega_moe(
        y, sym_buffer.x, sym_buffer.x_sf, sym_buffer.topk_idx, sym_buffer.topk_weights, stats,
        owner.handle, sym_buffer.handle, activation, activation_clamp, situ_beta,
        situ_linear_beta, bool(fast_math))


def bf16_mega_moe(y, l1_weights, l2_weights, sym_buffer, *args, **kwargs):
    """DeepGEMM's bf16_mega_moe (BF16 experts): not supported, megamoe serves MXFP4 experts."""
    raise _unsupported("bf16_mega_moe: BF16 expert weights are not supported; megamoe serves "
                       "MXFP4 experts with FP8 activations (fp8_fp4_mega_moe)")


def dequantize_x(x, x_sf, hidden):
    """BF16 [T, hidden] of FP8 codes x (float8_e4m3fn [T, hidden]) and packed UE8M0 scales x_sf
    (int32 [T, ceil(hidden / 128)]): x * 2^(sf - 127), exact for scale bytes in [3, 246] (module
    docstring). On the device, without host synchronisation."""
    t = x.shape[0]
    groups = hidden // _SCALE_BLOCK
    b = _unpack_int32_sf(x_sf, groups).to(torch.int32)                 # [T, G]
    scale = torch.where(b == 0, _TWO_POW_MINUS_127, (b << 23).view(torch.float32))
    values = x.float().reshape(t, groups, _SCALE_BLOCK) * scale.unsqueeze(-1)
    return values.reshape(t, hidden).to(torch.bfloat16)


def _add_recv_stats(stats, topk_idx, num_local):
    """stats[e] += rows routed to local expert e (one rank: all experts are local). scatter_add
    into a scratch with one extra slot for invalid ids: no host synchronisation (bincount would
    read the maximum on the host)."""
    ids = topk_idx.reshape(-1)
    valid = (ids >= 0) & (ids < num_local)
    slot = torch.where(valid, ids, num_local)
    counts = torch.zeros(num_local + 1, dtype=torch.int32, device=stats.device)
    counts.scatter_add_(0, slot, torch.ones_like(slot, dtype=torch.int32))
    stats.view(-1).add_(counts[:num_local])


def _lookup(registry, handle, arg):
    found = registry.get(int(handle))
    if found is None:
        raise _invalid(f"{arg}: handle {int(handle)} refers to nothing (released or destroyed)")
    return found


@torch.library.custom_op("megamoe::fp8_fp4_mega_moe",
                         mutates_args=("y", "cumulative_local_expert_recv_stats"))
def _fp8_fp4_mega_moe_op(y: torch.Tensor, x: torch.Tensor, x_sf: torch.Tensor,
                         topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                         cumulative_local_expert_recv_stats: Optional[torch.Tensor], weights: int,
                         buffer: int, activation: str, activation_clamp: Optional[float],
                         situ_beta: Optional[float], situ_linear_beta: Optional[float],
                         fast_math: bool) -> None:
    owner = _lookup(_WEIGHTS, weights, "l1_weights")
    buf = _lookup(_BUFFERS, buffer, "sym_buffer")
    if owner.layer is None and buf.virtual:
        raise _invalid("l1_weights: virtual ranks must all be bound with prepare_mega_moe_layer "
                       "before the first call (a rank's binding waits for the device, where "
                       "another rank's call waits for it)")
    spec = activation_spec(activation, activation_clamp, situ_beta, situ_linear_beta)
    layer = owner.bind(buf, spec, fast_math)
    t = y.shape[0]
    xb = dequantize_x(x[:t], x_sf[:t], buf.hidden)
    idx = _ops.ids_as_int32(topk_idx[:t], buf.num_experts)
    w = topk_weights[:t].contiguous()
    if y.is_contiguous():
        layer.forward(xb, idx.contiguous(), w, out=y)
    else:
        y.copy_(layer.forward(xb, idx.contiguous(), w))
    if cumulative_local_expert_recv_stats is not None:
        _add_recv_stats(cumulative_local_expert_recv_stats, topk_idx[:t], buf.num_local_experts)


@_fp8_fp4_mega_moe_op.register_fake
def _fp8_fp4_mega_moe_fake(y, x, x_sf, topk_idx, topk_weights, cumulative_local_expert_recv_stats,
                           weights, buffer, activation, activation_clamp, situ_beta,
                           situ_linear_beta, fast_math):
    return None
