"""kimi_mini: a small decoder-only model whose MoE block follows Kimi-K3.

Per layer (pre-norm residual):
    h = x + Attention(RMSNorm(x))                       plain causal MHA with RoPE (see below)
    x = h + MoE(RMSNorm(h))

MoE block (Kimi-K3 structure, megamoe numerics for the routed experts):
    router:   s = sigmoid(h W_g^T) in FP32; choice = s + e_score_correction_bias (selection only);
              idx = top-k(choice); w = s[idx] / sum(s[idx]) * routed_scaling_factor
    routed:   z = routed_expert_down_proj(h)                   d_model -> latent, rounded to BF16
              y = megamoe MoE layer on z (FP8 x MXFP4, SiTU, numerics.md sections 2-6)
              r = routed_expert_up_proj(routed_expert_norm(y)) RMSNorm on the latent, latent -> d
    shared:   s_out = down(situ(gate(h), up(h)))               BF16 SiTU shared expert
    MoE(h) = r + s_out

Kimi-K3 itself uses KDA (Kimi Delta Attention) and MLA layers; kimi_mini uses plain causal
multi-head attention with rotary position embeddings (the half-split "rotate_half" form), since
the point of this model is the MoE path megamoe serves.

Quantization-aware training: the routed experts see exactly what megamoe computes, with
straight-through gradients:
    expert weights  -> MXFP4 (E2M1 codes, UE8M0 scale 2^ceil(log2(amax/6)) per 32 along K)
    expert input z  -> BF16 -> FP8 E4M3 with UE8M0 per 32 (amax floor 1e-4)
    L1 accumulators -> BF16 (g, u), SiTU in FP32, times the routing weight
    intermediate    -> FP8 E4M3 with UE8M0 per 32 (no floor)
    L2 outputs      -> BF16 per slot, combined in FP32, rounded to BF16
so the exported MXFP4 checkpoint is the model that was trained, not an afterthought.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

kScaleBlock = 32
kE4M3Max = 448.0
kE2M1Max = 6.0
kInputAmaxFloor = 1e-4
kUe8m0Bias = 127


@dataclass
class Config:
    vocab_size: int = 74
    d_model: int = 256
    n_layers: int = 6
    n_heads: int = 8
    max_seq_len: int = 384
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    # MoE (Kimi-K3 structure)
    num_experts: int = 32
    top_k: int = 4
    latent_dim: int = 128            # H of the routed experts (multiple of 32)
    expert_intermediate: int = 128   # I of the routed experts (multiple of 32)
    shared_intermediate: int = 256
    routed_scaling_factor: float = 1.0
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0
    # quantization of the routed experts: "mxfp4" (served form) or "bf16" (unquantized reference)
    expert_quant: str = "mxfp4"

    def to_dict(self):
        return asdict(self)


# ---------------------------------------------------------------------------------------------
# Fake quantization (straight-through), bit-exact with include/megamoe/{formats,quantize}.hpp
# ---------------------------------------------------------------------------------------------
def ste(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Forward q, backward identity to x."""
    return x + (q - x).detach()


def ceil_exponent(r: torch.Tensor) -> torch.Tensor:
    """Biased exponent of 2^ceil(log2(r)) for fp32 r >= 0, in bit form (numerics.md section 2)."""
    bits = r.float().contiguous().view(torch.int32)
    return ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)


def pow2_biased(b: torch.Tensor) -> torch.Tensor:
    """2^(b - 127) as fp32, exact (b in [0, 254])."""
    return torch.ldexp(torch.ones_like(b, dtype=torch.float32), (b - kUe8m0Bias))


def bf16_round(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(torch.float32)


def fp8_quant_dequant(x: torch.Tensor, amax_floor: float | None) -> torch.Tensor:
    """E4M3 x UE8M0-per-32 along the last dim: sections 2 (with floor) and 5 (floor None)."""
    shape = x.shape
    g = x.float().reshape(*shape[:-1], shape[-1] // kScaleBlock, kScaleBlock)
    amax = g.abs().amax(dim=-1, keepdim=True)
    if amax_floor is not None:
        amax = amax.clamp_min(amax_floor)
        b = ceil_exponent(amax / kE4M3Max).clamp(1, 254)
    else:
        b = ceil_exponent(amax / kE4M3Max).clamp(0, 254)
    scale = pow2_biased(b)
    q = (g / scale).to(torch.float8_e4m3fn).to(torch.float32) * scale
    return q.reshape(shape)


def e2m1_codes(r: torch.Tensor) -> torch.Tensor:
    """Magnitude codes 0..7 of |r| (already divided by the block scale), ties to even code."""
    a = r.abs()
    m = torch.full_like(a, 7, dtype=torch.int32)
    for bound, code, inclusive in ((5.0, 6, True), (3.5, 5, False), (2.5, 4, True),
                                   (1.75, 3, False), (1.25, 2, True), (0.75, 1, False),
                                   (0.25, 0, True)):
        hit = (a <= bound) if inclusive else (a < bound)
        m = torch.where(hit, torch.full_like(m, code), m)
    return m


kE2M1Values = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def mxfp4_quantize(w: torch.Tensor):
    """w fp32 [..., N, K] -> (codes int32 [..., N, K] with sign bit 3, scale bytes [..., N, K/32])."""
    shape = w.shape
    g = w.float().reshape(*shape[:-1], shape[-1] // kScaleBlock, kScaleBlock)
    amax = g.abs().amax(dim=-1, keepdim=True)
    b = ceil_exponent(amax / kE2M1Max).clamp(0, 254)
    mag = e2m1_codes(g / pow2_biased(b))
    codes = mag | ((g < 0) & (mag != 0)).to(torch.int32) << 3
    return codes.reshape(shape), b.squeeze(-1).to(torch.uint8)


def mxfp4_dequantize(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    table = torch.tensor(kE2M1Values, dtype=torch.float32, device=codes.device)
    vals = table[codes & 7] * torch.where((codes & 8) != 0, -1.0, 1.0)
    shape = codes.shape
    g = vals.reshape(*shape[:-1], shape[-1] // kScaleBlock, kScaleBlock)
    return (g * pow2_biased(scales.to(torch.int32)).unsqueeze(-1)).reshape(shape)


def mxfp4_fake(w: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        q = mxfp4_dequantize(*mxfp4_quantize(w))
    return ste(w, q)


def situ(g: torch.Tensor, u: torch.Tensor, beta: float, lbeta: float) -> torch.Tensor:
    return (beta * torch.tanh(g / beta) * torch.sigmoid(g)) * (lbeta * torch.tanh(u / lbeta))


# ---------------------------------------------------------------------------------------------
# Modules
# ---------------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float):
    """positions int64 [B, T] -> cos, sin fp32 [B, 1, T, head_dim/2]."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device,
                                        dtype=torch.float32) / head_dim))
    ang = positions.float().unsqueeze(-1) * inv
    return ang.cos().unsqueeze(1), ang.sin().unsqueeze(1)


def apply_rope(x, cos, sin):
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        d = cfg.d_model
        self.n_heads = cfg.n_heads
        self.head_dim = d // cfg.n_heads
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)

    def forward(self, x, cos, sin, attn_mask):
        B, T, D = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if attn_mask is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, D))


class SharedExpert(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.d_model, cfg.shared_intermediate, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.shared_intermediate, bias=False)
        self.down_proj = nn.Linear(cfg.shared_intermediate, cfg.d_model, bias=False)
        self.beta, self.lbeta = cfg.situ_beta, cfg.situ_linear_beta

    def forward(self, x):
        g = self.gate_proj(x).float()
        u = self.up_proj(x).float()
        return self.down_proj(situ(g, u, self.beta, self.lbeta).to(x.dtype))


class Experts(nn.Module):
    """E routed experts on the latent: w13 [E, 2I, H] (gate rows first), w2 [E, H, I]."""

    def __init__(self, cfg: Config):
        super().__init__()
        E, H, I = cfg.num_experts, cfg.latent_dim, cfg.expert_intermediate
        self.w13 = nn.Parameter(torch.randn(E, 2 * I, H) / math.sqrt(H))
        self.w2 = nn.Parameter(torch.randn(E, H, I) / math.sqrt(I) * 0.5)
        self.cfg = cfg

    def quantized_weights(self):
        if not self.training and not torch.is_grad_enabled():
            # inference: quantize once and reuse (the weights do not change)
            key = (self.w13._version, self.w2._version, self.cfg.expert_quant)
            if getattr(self, "_cache_key", None) != key:
                with torch.no_grad():
                    self._cache = tuple(t.detach() for t in self._quantize())
                self._cache_key = key
            return self._cache
        return self._quantize()

    def _quantize(self):
        if self.cfg.expert_quant == "mxfp4":
            return mxfp4_fake(self.w13), mxfp4_fake(self.w2)
        if self.cfg.expert_quant == "bf16":
            return ste(self.w13, bf16_round(self.w13)), ste(self.w2, bf16_round(self.w2))
        raise ValueError(f"expert_quant: expected 'mxfp4' or 'bf16', got {self.cfg.expert_quant!r}")

    def forward(self, z, idx, weights):
        """z [T, H] fp32 (BF16 values), idx int64 [T, K], weights fp32 [T, K] -> y [T, H] fp32.

        Tokens are grouped by expert into a padded [E, C, H] batch (C = the largest expert load,
        so nothing is ever dropped) and run with two batched matmuls.
        """
        cfg = self.cfg
        E, I = cfg.num_experts, cfg.expert_intermediate
        T, K = idx.shape
        H = z.shape[-1]
        quant = cfg.expert_quant == "mxfp4"
        w13, w2 = self.quantized_weights()
        zq = ste(z, fp8_quant_dequant(z, kInputAmaxFloor)) if quant else z

        slot_expert = idx.reshape(-1)                                   # [S]
        slot_token = torch.arange(T, device=z.device).repeat_interleave(K)
        # rank of each slot within its expert, from a stable sort (NOTES: a cumsum over a
        # one-hot [S, E] along S runs one sequential scan per column on CUDA: 0.1 s per layer)
        order = torch.argsort(slot_expert, stable=True)
        load = torch.bincount(slot_expert, minlength=E)                 # [E]
        first = load.cumsum(0) - load                                   # first sorted row
        pos = torch.empty_like(slot_expert)
        pos[order] = torch.arange(slot_expert.numel(), device=z.device) - first[slot_expert[order]]
        cap = int(load.max().item())
        xin = z.new_zeros(E, cap, H)
        xin = xin.index_put((slot_expert, pos), zq[slot_token])
        wts = z.new_zeros(E, cap, 1).index_put((slot_expert, pos),
                                               weights.reshape(-1, 1).float())
        # NOTES: every operand is exact in BF16 (FP8 / MXFP4 / BF16 values), so on the GPU the
        # products run as BF16 GEMMs with FP32 accumulation and a BF16-rounded output: the same
        # rounding megamoe's epilogue applies (numerics.md sections 3, 4 and 6).
        mm = torch.bfloat16 if z.is_cuda else torch.float32
        acc = torch.bmm(xin.to(mm), w13.transpose(1, 2).to(mm)).float()  # [E, C, 2I]
        acc = ste(acc, bf16_round(acc))
        g, u = acc[..., :I], acc[..., I:]
        v = situ(g, u, cfg.situ_beta, cfg.situ_linear_beta) * wts
        if quant:
            v = ste(v, fp8_quant_dequant(v, None))
        o = torch.bmm(v.to(mm), w2.transpose(1, 2).to(mm)).float()       # [E, C, H]
        o = ste(o, bf16_round(o))
        y = o[slot_expert, pos].view(T, K, H).sum(1)                    # combine, k ascending
        return ste(y, bf16_round(y)), load


class MoE(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        d, E = cfg.d_model, cfg.num_experts
        self.cfg = cfg
        self.gate = nn.Linear(d, E, bias=False)
        self.gate.register_buffer("e_score_correction_bias", torch.zeros(E))
        self.routed_expert_down_proj = nn.Linear(d, cfg.latent_dim, bias=False)
        self.routed_expert_norm = RMSNorm(cfg.latent_dim, cfg.rms_norm_eps)
        self.routed_expert_up_proj = nn.Linear(cfg.latent_dim, d, bias=False)
        self.experts = Experts(cfg)
        self.shared_experts = SharedExpert(cfg)
        self.last_load = None   # tokens per expert of the last forward (for the bias update)

    def route(self, h):
        """h [T, d] -> idx int64 [T, K], weights fp32 [T, K] (numerics.md section 7)."""
        with torch.autocast(h.device.type, enabled=False):
            s = torch.sigmoid(F.linear(h.float(), self.gate.weight.float()))
        choice = s + self.gate.e_score_correction_bias
        idx = choice.topk(self.cfg.top_k, dim=-1).indices
        sel = s.gather(-1, idx)
        w = sel / sel.sum(-1, keepdim=True) * self.cfg.routed_scaling_factor
        return idx, w

    def forward(self, x):
        B, T, D = x.shape
        h = x.reshape(B * T, D)
        idx, w = self.route(h)
        with torch.autocast(h.device.type, enabled=False):
            z = bf16_round(self.routed_expert_down_proj(h.float()))
            y, load = self.experts(z, idx, w)
            r = self.routed_expert_up_proj(self.routed_expert_norm(y))
        self.last_load = load.detach()
        out = r.to(x.dtype) + self.shared_experts(h)
        return out.view(B, T, D)


class Block(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.rms_norm_eps)
        self.block_sparse_moe = MoE(cfg)

    def forward(self, x, cos, sin, attn_mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn_mask)
        return x + self.block_sparse_moe(self.post_attention_layernorm(x))


class KimiMini(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layers)])
        self.norm = RMSNorm(cfg.d_model, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, ids, positions=None, key_pad=None):
        """ids [B, T]; positions [B, T] (default 0..T-1); key_pad bool [B, T] True = padding."""
        B, T = ids.shape
        if positions is None:
            positions = torch.arange(T, device=ids.device).expand(B, T)
        cos, sin = rope_cos_sin(positions, self.cfg.d_model // self.cfg.n_heads,
                                self.cfg.rope_theta)
        attn_mask = None
        if key_pad is not None:
            causal = torch.ones(T, T, dtype=torch.bool, device=ids.device).tril()
            attn_mask = (causal.unsqueeze(0) & ~key_pad.unsqueeze(1)).unsqueeze(1)
            # a padded query row would see no key: let it see itself (its output is unused)
            attn_mask = attn_mask | torch.eye(T, dtype=torch.bool, device=ids.device)
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x, cos, sin, attn_mask)
        return self.lm_head(self.norm(x))

    def moe_layers(self):
        return [layer.block_sparse_moe for layer in self.layers]
