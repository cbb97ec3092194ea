"""Swap kimi_mini's PyTorch routed experts for megamoe, as a serving engine would, and check that
the model's answers do not change.

    PYTHONPATH=build/python python3 examples/kimi_mini/engine_swap.py [--api op|deep_gemm|both]
        [--limit N] [--device auto|cpu|cuda] [--compile]

1. Loads config.json and model.safetensors into model.KimiMini, the PyTorch model the checkpoint
   was trained as (dense weights BF16 values, FP32 compute; the routed experts get the MXFP4
   values of the checkpoint, which model.Experts reproduces exactly with the contract's
   numerics). A small safetensors reader is below: no package beyond torch is needed.
2. Reference: greedy answers to the first N held-out problems, and each layer's routed-expert
   inputs (z, topk_idx, topk_weights) and output on the first prompt batch.
3. Swaps every layer's `experts` module (forward(z, idx, weights) -> (y, load)) for one that
   calls megamoe, through either API:
     op         megamoe.load_moe_layer(checkpoint, L) -> MoELayer -> megamoe.torch_ops.MoEModule
                (the custom op torch.ops.megamoe.moe_forward on BF16 activations)
     deep_gemm  the call sequence of an engine's DeepGEMM Mega MoE path, on
                megamoe.deep_gemm_compat: FP8 quantization of the activations with packed UE8M0
                scales, transform_sf_into_required_layout, transform_weights_for_mega_moe,
                get_symm_buffer_for_mega_moe, copies into the buffer, fp8_fp4_mega_moe with
                activation="situ"
   With --compile the swapped model runs under torch.compile(fullgraph=True, dynamic=True): one
   graph for the whole model, every layer's megamoe call in it.
4. Checks: the greedy answers are the reference's, every one; prints, per layer, how the swapped
   experts' output on the reference's own inputs compares with the PyTorch block (diff metric,
   share of identical BF16 values: the two sum FP32 products in different orders, so a value
   may differ by a BF16 ulp now and then).

Exit status 0 when every answer is unchanged, 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import model as M  # noqa: E402
import task  # noqa: E402
from train import greedy_answers, kMaxNewTokens  # noqa: E402

import megamoe  # noqa: E402
import megamoe.torch_ops  # noqa: E402  (registers torch.ops.megamoe)

kDtypes = {"BF16": torch.bfloat16, "F32": torch.float32, "U8": torch.uint8, "I32": torch.int32}


# ---------------------------------------------------------------------------------------------
# Checkpoint -> PyTorch model
# ---------------------------------------------------------------------------------------------
def read_safetensors(path: str) -> dict[str, torch.Tensor]:
    """name -> CPU tensor of a .safetensors file (8-byte header length, JSON header, data)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        lo, hi = info["data_offsets"]
        flat = torch.frombuffer(bytearray(data[lo:hi]), dtype=kDtypes[info["dtype"]])
        out[name] = flat.reshape(info["shape"])
    return out


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """bytes uint8 [..., K/2] -> codes int32 [..., K] (low nibble = even k)."""
    p = packed.to(torch.int32)
    return torch.stack([p & 0xF, p >> 4], dim=-1).reshape(*packed.shape[:-1], -1)


def expert_tensors(t: dict, prefix: str, e: int):
    """(w13 packed uint8 [2I, H/2], w13 scales uint8 [2I, H/32], w2 packed, w2 scales) of one
    expert: w1 (gate) rows then w3 (up) rows, as the canonical form and DeepGEMM take them."""
    ep = f"{prefix}.experts.{e}"
    w13 = torch.cat([t[f"{ep}.w1.weight_packed"], t[f"{ep}.w3.weight_packed"]])
    s13 = torch.cat([t[f"{ep}.w1.weight_scale"], t[f"{ep}.w3.weight_scale"]])
    return w13, s13, t[f"{ep}.w2.weight_packed"], t[f"{ep}.w2.weight_scale"]


def load_model(folder: str) -> tuple[M.KimiMini, dict]:
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    fields = set(M.Config.__dataclass_fields__)
    cfg = M.Config(**{k: v for k, v in config.items() if k in fields}, expert_quant="mxfp4")
    tensors = read_safetensors(os.path.join(folder, "model.safetensors"))
    m = M.KimiMini(cfg)
    root = config["tensor_prefix"]
    state = {"embed_tokens.weight": tensors[f"{root}.embed_tokens.weight"],
             "norm.weight": tensors[f"{root}.norm.weight"],
             "lm_head.weight": tensors["language_model.lm_head.weight"]}
    for L in range(cfg.n_layers):
        pre = f"{root}.layers.{L}"
        for name in ("input_layernorm.weight", "post_attention_layernorm.weight",
                     "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                     "self_attn.v_proj.weight", "self_attn.o_proj.weight"):
            state[f"layers.{L}.{name}"] = tensors[f"{pre}.{name}"]
        moe = f"{pre}.block_sparse_moe"
        for name in ("gate.weight", "gate.e_score_correction_bias",
                     "routed_expert_down_proj.weight", "routed_expert_norm.weight",
                     "routed_expert_up_proj.weight", "shared_experts.gate_proj.weight",
                     "shared_experts.up_proj.weight", "shared_experts.down_proj.weight"):
            state[f"layers.{L}.block_sparse_moe.{name}"] = tensors[f"{moe}.{name}"]
        parts = [expert_tensors(tensors, moe, e) for e in range(cfg.num_experts)]
        for i, name in ((0, "w13"), (2, "w2")):
            codes = torch.stack([unpack_e2m1(p[i]) for p in parts])
            scales = torch.stack([p[i + 1] for p in parts])
            state[f"layers.{L}.block_sparse_moe.experts.{name}"] = M.mxfp4_dequantize(codes,
                                                                                       scales)
    m.load_state_dict({k: v.float() for k, v in state.items()})
    return m.eval(), tensors


# ---------------------------------------------------------------------------------------------
# The swapped experts
# ---------------------------------------------------------------------------------------------
def slot_load(idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Rows per expert (model.Experts returns it for the router-bias update), with a static
    output shape (bincount's depends on the data, which torch.compile cannot trace)."""
    flat = idx.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.int64, device=idx.device).scatter_add_(
        0, flat, torch.ones_like(flat))


class OpExperts(torch.nn.Module):
    """megamoe's own API: the layer from the checkpoint, called through the custom op."""

    def __init__(self, ckpt_path: str, layer_index: int, cfg: M.Config, max_tokens: int,
                 device: torch.device):
        super().__init__()
        config = megamoe.LayerConfig(
            megamoe.LayerShape(cfg.latent_dim, cfg.expert_intermediate, cfg.num_experts,
                               cfg.top_k),
            activation=f"situ:beta={cfg.situ_beta},linear_beta={cfg.situ_linear_beta}",
            max_tokens_per_rank=max_tokens, fast_math=False)
        weights = megamoe.load_moe_layer(ckpt_path, layer_index)
        backend = "sm90" if device.type == "cuda" else "cpu"
        with torch.cuda.device(device) if device.type == "cuda" else _nothing():
            self.moe = megamoe.torch_ops.MoEModule(megamoe.MoELayer(config, weights, backend))
        self.num_experts = cfg.num_experts

    def forward(self, z, idx, weights):
        y = self.moe(z.to(torch.bfloat16), idx, weights.float())
        return y.float(), slot_load(idx, self.num_experts)


def per_token_cast_to_fp8(x: torch.Tensor):
    """What an engine hands DeepGEMM: E4M3 codes and UE8M0 scales per 32 channels, packed 4 per
    int32 (group 4j in the low byte); scale 2^ceil(log2(amax / 448)), amax floored at 1e-4, as
    DeepGEMM's per_token_cast_to_fp8(x, use_ue8m0=True, gran_k=32, use_packed_ue8m0=True)."""
    t, h = x.shape
    g = x.float().reshape(t, h // M.kScaleBlock, M.kScaleBlock)
    amax = g.abs().amax(dim=-1).clamp_min(M.kInputAmaxFloor)
    b = M.ceil_exponent(amax / M.kE4M3Max).clamp(1, 254)                  # [T, G] int32
    q = (g / M.pow2_biased(b).unsqueeze(-1)).to(torch.float8_e4m3fn).reshape(t, h)
    groups = b.shape[1]
    words = -(-groups // 4)
    padded = torch.zeros((t, words * 4), dtype=torch.int32, device=x.device)
    padded[:, :groups] = b
    four = padded.reshape(t, words, 4)
    packed = four[..., 0] | (four[..., 1] << 8) | (four[..., 2] << 16) | (four[..., 3] << 24)
    return q, packed


class DeepGemmStyleExperts(torch.nn.Module):
    """An engine's DeepGEMM Mega MoE code path, with megamoe.deep_gemm_compat in place of
    deep_gemm. In an engine `group` is the expert-parallel process group; here one process."""

    def __init__(self, tensors: dict, prefix: str, cfg: M.Config, max_tokens: int,
                 device: torch.device):
        super().__init__()
        from megamoe import deep_gemm_compat as mega

        self.mega = mega
        E, H, I, K = cfg.num_experts, cfg.latent_dim, cfg.expert_intermediate, cfg.top_k
        parts = [expert_tensors(tensors, prefix, e) for e in range(E)]
        w13 = torch.stack([p[0] for p in parts]).to(device)
        w2 = torch.stack([p[2] for p in parts]).to(device)

        def float_scales(i):  # the checkpoint's UE8M0 bytes as the FP32 scales engines hold
            b = torch.stack([p[i] for p in parts]).to(device)
            return M.pow2_biased(b.to(torch.int32))

        w13_sf = mega.transform_sf_into_required_layout(float_scales(1), 2 * I, H, (1, 32), E)
        w2_sf = mega.transform_sf_into_required_layout(float_scales(3), H, I, (1, 32), E)
        self.l1, self.l2 = mega.transform_weights_for_mega_moe(
            (w13.view(torch.int8), w13_sf), (w2.view(torch.int8), w2_sf), activation="situ")
        backend = "sm90" if device.type == "cuda" else "cpu"
        with torch.cuda.device(device) if device.type == "cuda" else _nothing():
            self.buffer = mega.get_symm_buffer_for_mega_moe(None, E, max_tokens, K, H, I,
                                                            activation="situ", backend=backend)
        self.hidden, self.num_experts = H, E
        self.beta, self.linear_beta = cfg.situ_beta, cfg.situ_linear_beta

    def forward(self, z, idx, weights):
        t = z.shape[0]
        x_fp8, x_sf = per_token_cast_to_fp8(z)
        self.buffer.x[:t].copy_(x_fp8)
        self.buffer.x_sf[:t].copy_(x_sf)
        self.buffer.topk_idx[:t].copy_(idx)
        self.buffer.topk_weights[:t].copy_(weights)
        y = torch.empty((t, self.hidden), dtype=torch.bfloat16, device=z.device)
        self.mega.fp8_fp4_mega_moe(y, self.l1, self.l2, self.buffer, activation="situ",
                                   situ_beta=self.beta, situ_linear_beta=self.linear_beta,
                                   fast_math=False)
        return y.float(), slot_load(idx, self.num_experts)


def _nothing():
    import contextlib

    return contextlib.nullcontext()


# ---------------------------------------------------------------------------------------------
# Run
# ---------------------------------------------------------------------------------------------
def record_expert_io(model, problems, device):
    """Each layer's experts (inputs, output) on the first forward of the prompt batch."""
    prompts = [task.encode(p.prompt()) for p in problems]
    P = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), P, dtype=torch.int64)
    for j, p in enumerate(prompts):
        ids[j, P - len(p):] = torch.tensor(p)
    pad = ids == task.kPadId
    positions = ((~pad).long().cumsum(1) - 1).clamp_min(0)
    records = []
    hooks = [moe.experts.register_forward_hook(
        lambda mod, args, out: records.append((tuple(a.detach() for a in args), out[0].detach())))
        for moe in model.moe_layers()]
    with torch.no_grad():
        model(ids.to(device), positions=positions.to(device), key_pad=pad.to(device))
    for h in hooks:
        h.remove()
    return records


def compare_blocks(records, swapped_experts):
    lines = []
    with torch.no_grad():
        for L, ((args, want), experts) in enumerate(zip(records, swapped_experts)):
            got = experts(*args)[0]
            a = got.double().cpu().numpy().ravel()
            b = want.double().cpu().numpy().ravel()
            same = float(np.mean(got.to(torch.bfloat16).view(torch.int16).cpu().numpy()
                                 == want.to(torch.bfloat16).view(torch.int16).cpu().numpy()))
            lines.append(f"    layer {L}: diff {megamoe.diff_metric(a, b):.2e} vs the PyTorch "
                         f"block, {100 * same:.2f} % of values identical, max |err| "
                         f"{np.max(np.abs(a - b)):.3g}")
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--api", choices=("op", "deep_gemm", "both"), default="both")
    ap.add_argument("--limit", type=int, default=16, help="held-out problems to answer")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--compile", action="store_true",
                    help="run the swapped model under torch.compile(fullgraph=True)")
    ap.add_argument("--model", default=HERE, help="folder with config.json, model.safetensors")
    args = ap.parse_args()

    if args.device == "auto":
        gpu = torch.cuda.is_available() and "sm90" in megamoe.available_backends()
        device = torch.device("cuda" if gpu else "cpu")
    else:
        device = torch.device(args.device)
    torch.manual_seed(0)
    model, tensors = load_model(args.model)
    model.to(device)
    cfg = model.cfg
    problems = task.load_jsonl(os.path.join(HERE, "heldout.jsonl"))[:args.limit]
    max_prompt = max(len(task.encode(p.prompt())) for p in problems)
    max_tokens = len(problems) * (max_prompt + kMaxNewTokens)  # tokens of the largest forward
    print(f"engine_swap: kimi_mini ({cfg.n_layers} MoE layers, E={cfg.num_experts}, "
          f"top-{cfg.top_k}, H={cfg.latent_dim}, I={cfg.expert_intermediate}, SiTU), "
          f"{len(problems)} held-out problems, device {device}, "
          f"megamoe backend {'sm90' if device.type == 'cuda' else 'cpu'}")

    start = time.time()
    want = greedy_answers(model, problems, device)
    records = record_expert_io(model, problems, device)
    correct = sum(task.final_answer(a) == p.final for a, p in zip(want, problems))
    print(f"  reference  PyTorch experts: {correct}/{len(problems)} correct "
          f"({time.time() - start:.1f} s)")

    ckpt = os.path.join(args.model, "model.safetensors")
    root = json.load(open(os.path.join(args.model, "config.json")))["tensor_prefix"]
    ok = True
    for api in (("op", "deep_gemm") if args.api == "both" else (args.api,)):
        swapped = []
        for L, moe in enumerate(model.moe_layers()):
            moe.reference_experts = moe.experts
            if api == "op":
                moe.experts = OpExperts(ckpt, L, cfg, max_tokens, device)
            else:
                moe.experts = DeepGemmStyleExperts(tensors, f"{root}.layers.{L}.block_sparse_moe",
                                                   cfg, max_tokens, device)
            swapped.append(moe.experts)
        runner = model
        if args.compile:
            torch._dynamo.reset()
            runner = torch.compile(model, fullgraph=True, dynamic=True)
        start = time.time()
        got = greedy_answers(runner, problems, device)
        same = sum(a == b for a, b in zip(got, want))
        correct = sum(task.final_answer(a) == p.final for a, p in zip(got, problems))
        label = f"{api}{' + compile' if args.compile else ''}"
        print(f"  {label:10} megamoe experts: {correct}/{len(problems)} correct, "
              f"{same}/{len(problems)} answers identical to the reference "
              f"({time.time() - start:.1f} s)")
        for line in compare_blocks(records, swapped):
            print(line)
        for a, b, p in zip(got, want, problems):
            if a != b:
                print(f"    changed: {p.question!r}\n      reference {b!r}\n      megamoe   {a!r}")
        ok &= same == len(problems)
        for moe in model.moe_layers():  # restore the PyTorch experts for the next API
            moe.experts = moe.reference_experts
            del moe.reference_experts
    print("engine_swap: PASS (every answer unchanged)" if ok else "engine_swap: FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
