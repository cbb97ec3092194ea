"""Train kimi_mini on the synthetic arithmetic task, evaluate it, export the megamoe checkpoint.

    python3 examples/kimi_mini/train.py --out DIR [--steps N | --time-budget SECONDS] [--tiny]

Reproducible: every training batch b is generated from random.Random(seed * 1_000_003 + b), the
model from torch.manual_seed(seed). With --steps auto the step count is chosen from the measured
speed of the first steps so training fits --time-budget; the chosen number is written to
DIR/train_log.json, and `--steps <that number>` reproduces the run (up to GPU non-determinism).

Outputs in DIR: model.safetensors (Kimi-K3 tensor names; routed experts MXFP4), config.json
(model, tokenizer, quantization), train_log.json (loss curve, accuracies BF16 vs MXFP4 experts).
"""
from __future__ import annotations

import argparse
import collections
import json
import math
import multiprocessing as mp
import os
import random
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import model as M  # noqa: E402
import task  # noqa: E402

kBatchSeedStride = 1_000_003
kRouterBiasStep = 1e-3     # aux-loss-free balancing: bias += step * sign(mean load - load)
kWarmupSteps = 100
kMinLrFraction = 0.05
kHardStopFactor = 1.15   # training stops at this multiple of --time-budget whatever the plan
kPrefetch = 32           # batches generated ahead of the training loop
kMaxNewTokens = 80         # longest answer is about 60 characters


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------
_HELDOUT_QUESTIONS: set[str] = set()


def _init_worker(heldout_questions):
    global _HELDOUT_QUESTIONS
    _HELDOUT_QUESTIONS = heldout_questions


def make_batch(args):
    """(seed, batch index, batch size) -> (ids int64 [B, T], loss mask bool [B, T-1]) as numpy
    arrays (workers never touch torch: they are spawned, and torch stays out of their path)."""
    seed, b, batch_size = args
    rng = random.Random(seed * kBatchSeedStride + b)
    seqs, starts = [], []
    while len(seqs) < batch_size:
        p = task.generate(rng)
        if p.question in _HELDOUT_QUESTIONS:   # disjoint from the held-out set by construction
            continue
        seqs.append(task.encode(p.text()))
        starts.append(len(p.prompt()))
    T = max(len(s) for s in seqs)
    ids = np.zeros((batch_size, T), dtype=np.int64)
    mask = np.zeros((batch_size, T - 1), dtype=np.bool_)
    for i, (s, a) in enumerate(zip(seqs, starts)):
        ids[i, :len(s)] = s
        mask[i, a - 1:len(s) - 1] = True   # predict the answer characters and the final newline
    return ids, mask


# ---------------------------------------------------------------------------------------------
# Evaluation: batched greedy decoding with left padding
# ---------------------------------------------------------------------------------------------
@torch.no_grad()
def greedy_answers(model, problems, device, batch_size=200):
    model.eval()
    outs = []
    nl = task.encode("\n")[0]
    for i in range(0, len(problems), batch_size):
        chunk = problems[i:i + batch_size]
        prompts = [task.encode(p.prompt()) for p in chunk]
        P = max(len(p) for p in prompts)
        B = len(chunk)
        ids = torch.zeros(B, P, dtype=torch.int64)
        pad = torch.ones(B, P, dtype=torch.bool)
        for j, p in enumerate(prompts):
            ids[j, P - len(p):] = torch.tensor(p)
            pad[j, P - len(p):] = False
        ids, pad = ids.to(device), pad.to(device)
        done = torch.zeros(B, dtype=torch.bool, device=device)
        gen = []
        for _ in range(kMaxNewTokens):
            positions = ((~pad).long().cumsum(1) - 1).clamp_min(0)
            logits = model(ids, positions=positions, key_pad=pad)[:, -1]
            nxt = logits.argmax(-1)
            nxt = torch.where(done, torch.zeros_like(nxt), nxt)
            gen.append(nxt)
            done |= nxt == nl
            ids = torch.cat([ids, nxt[:, None]], 1)
            pad = torch.cat([pad, torch.zeros_like(done)[:, None]], 1)
            if bool(done.all()):
                break
        gen = torch.stack(gen, 1).cpu().tolist()
        for row in gen:
            text = task.decode(row)
            outs.append(text.split("\n")[0])
    model.train()
    return outs


def accuracy(model, problems, device):
    answers = greedy_answers(model, problems, device)
    correct = [task.final_answer(a) == p.final for a, p in zip(answers, problems)]
    return sum(correct) / len(problems), answers


def served_copy(model, expert_quant):
    """The served model: dense weights rounded to BF16, experts MXFP4 or BF16, FP32 compute."""
    cfg = M.Config(**{**model.cfg.to_dict(), "expert_quant": expert_quant})
    m = M.KimiMini(cfg).to(next(model.parameters()).device)
    m.load_state_dict(model.state_dict())
    with torch.no_grad():
        for name, p in m.named_parameters():
            if not name.endswith(("experts.w13", "experts.w2")):
                p.copy_(M.bf16_round(p))
    return m


# ---------------------------------------------------------------------------------------------
# Export (Kimi-K3 tensor names, weights.md section 1)
# ---------------------------------------------------------------------------------------------
def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """codes int [N, K] -> bytes uint8 [N, K/2], low nibble = even k."""
    c = codes.to(torch.uint8)
    return (c[:, 0::2] | (c[:, 1::2] << 4)).contiguous()


def export_tensors(model) -> dict[str, torch.Tensor]:
    cfg = model.cfg
    bf = lambda t: t.detach().to(torch.bfloat16).contiguous().cpu()  # noqa: E731
    out = {"language_model.model.embed_tokens.weight": bf(model.embed_tokens.weight),
           "language_model.model.norm.weight": bf(model.norm.weight),
           "language_model.lm_head.weight": bf(model.lm_head.weight)}
    I = cfg.expert_intermediate
    for L, layer in enumerate(model.layers):
        pre = f"language_model.model.layers.{L}"
        out[f"{pre}.input_layernorm.weight"] = bf(layer.input_layernorm.weight)
        out[f"{pre}.post_attention_layernorm.weight"] = bf(layer.post_attention_layernorm.weight)
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out[f"{pre}.self_attn.{n}.weight"] = bf(getattr(layer.self_attn, n).weight)
        moe = layer.block_sparse_moe
        mp_ = f"{pre}.block_sparse_moe"
        out[f"{mp_}.gate.weight"] = bf(moe.gate.weight)
        out[f"{mp_}.gate.e_score_correction_bias"] = (
            moe.gate.e_score_correction_bias.detach().float().contiguous().cpu())
        out[f"{mp_}.routed_expert_down_proj.weight"] = bf(moe.routed_expert_down_proj.weight)
        out[f"{mp_}.routed_expert_norm.weight"] = bf(moe.routed_expert_norm.weight)
        out[f"{mp_}.routed_expert_up_proj.weight"] = bf(moe.routed_expert_up_proj.weight)
        for n in ("gate_proj", "up_proj", "down_proj"):
            out[f"{mp_}.shared_experts.{n}.weight"] = bf(getattr(moe.shared_experts, n).weight)
        w13c, w13s = M.mxfp4_quantize(moe.experts.w13.detach().float().cpu())
        w2c, w2s = M.mxfp4_quantize(moe.experts.w2.detach().float().cpu())
        for e in range(cfg.num_experts):
            ep = f"{mp_}.experts.{e}"
            parts = {"w1": (w13c[e, :I], w13s[e, :I]), "w3": (w13c[e, I:], w13s[e, I:]),
                     "w2": (w2c[e], w2s[e])}
            for w, (c, s) in parts.items():
                out[f"{ep}.{w}.weight_packed"] = pack_e2m1(c)
                out[f"{ep}.{w}.weight_scale"] = s.contiguous()
    return out


def export_config(cfg: M.Config) -> dict:
    return {
        "model_type": "kimi_mini",
        "architecture": "decoder-only; causal MHA + RoPE; Kimi-K3 MoE block (latent routed "
                        "experts, SiTU, sigmoid router with score-correction bias, shared expert)",
        **{k: v for k, v in cfg.to_dict().items() if k != "expert_quant"},
        "hidden_act": "situ",
        "tensor_prefix": "language_model.model",
        "quantization_config": {"quant_method": "compressed-tensors",
                                "format": "mxfp4-pack-quantized", "group_size": 32,
                                "targets": "block_sparse_moe.experts.*.w{1,2,3}"},
        "tokenizer": {"type": "char", "pad_id": task.kPadId, "vocab": task.VOCAB,
                      "prompt_format": "Q: {question}\\nA:", "stop": "\n"},
    }


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------
def lr_at(step, total, base):
    if step < kWarmupSteps:
        return base * (step + 1) / kWarmupSteps
    t = min(1.0, (step - kWarmupSteps) / max(1, total - kWarmupSteps))
    return base * (kMinLrFraction + (1 - kMinLrFraction) * 0.5 * (1 + math.cos(math.pi * t)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", default="auto", help="number of steps, or 'auto' (fit the budget)")
    ap.add_argument("--time-budget", type=float, default=180.0, help="seconds of training")
    ap.add_argument("--batch-size", type=int, default=384)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--tiny", action="store_true", help="small config for CPU debugging")
    ap.add_argument("--eval-limit", type=int, default=task.kHeldoutSize)
    ap.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1))
    args = ap.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(args.seed)
    here = os.path.dirname(os.path.abspath(__file__))
    heldout = task.load_jsonl(os.path.join(here, "heldout.jsonl"))
    heldout_q = {p.question for p in heldout}

    cfg = M.Config(vocab_size=len(task.VOCAB))
    if args.tiny:
        cfg = M.Config(vocab_size=len(task.VOCAB), d_model=64, n_layers=2, n_heads=4,
                       num_experts=8, top_k=2, latent_dim=32, expert_intermediate=32,
                       shared_intermediate=64)
    model = M.KimiMini(cfg).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"device {device}, params {n_params / 1e6:.2f} M, config {cfg.to_dict()}", flush=True)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    pool = mp.get_context("spawn").Pool(args.workers, initializer=_init_worker, initargs=(heldout_q,)) \
        if args.workers > 1 else None
    if pool is None:
        _init_worker(heldout_q)

    def batches():
        """Training batches in order, kPrefetch of them generated ahead by the worker pool."""
        b = 0
        if pool is None:
            while True:
                yield make_batch((args.seed, b, args.batch_size))
                b += 1
        pending = collections.deque()
        while True:
            while len(pending) < kPrefetch:
                pending.append(pool.apply_async(make_batch, ((args.seed, b, args.batch_size),)))
                b += 1
            yield pending.popleft().get()

    total = None if args.steps == "auto" else int(args.steps)
    log = {"loss": [], "steps": None}
    t0 = time.time()
    t_measure = None
    step = 0
    for ids, mask in batches():
        if total is not None and step >= total:
            break
        if step == 20:
            t_measure = time.time()
        if step == 60 and total is None:
            per_step = (time.time() - t_measure) / 40
            total = max(60, int(args.time_budget / per_step))
            print(f"{per_step * 1e3:.1f} ms/step -> {total} steps", flush=True)
        lr = lr_at(step, total or 10**9, args.lr)
        for g in opt.param_groups:
            g["lr"] = lr
        ids = torch.from_numpy(ids).to(device, non_blocking=True)
        mask = torch.from_numpy(mask).to(device, non_blocking=True)
        with amp:
            logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.float()[mask], ids[:, 1:][mask])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            for moe in model.moe_layers():
                load = moe.last_load.float()
                moe.gate.e_score_correction_bias += kRouterBiasStep * torch.sign(load.mean() - load)
        step += 1
        if step % 50 == 0 or step == 1:
            lv = loss.item()
            log["loss"].append((step, round(lv, 5)))
            print(f"step {step}/{total} loss {lv:.4f} lr {lr:.2e} t {time.time() - t0:.0f}s",
                  flush=True)
        if time.time() - t0 > kHardStopFactor * args.time_budget:  # never overrun the lease
            print(f"time budget exceeded at step {step}: stopping", flush=True)
            break
    if pool is not None:
        pool.terminate()
    log["steps"] = step
    log["train_seconds"] = round(time.time() - t0, 1)
    log["batch_size"] = args.batch_size
    log["seed"] = args.seed

    os.makedirs(args.out, exist_ok=True)
    from safetensors.torch import save_file
    tensors = export_tensors(model)
    save_file(tensors, os.path.join(args.out, "model.safetensors"),
              metadata={"format": "pt", "producer": "megamoe examples/kimi_mini/train.py"})
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(export_config(cfg), f, indent=1)
    # ---- evaluation on the held-out set: served MXFP4 experts and unquantized BF16 experts ----
    probs = heldout[:args.eval_limit]
    loads = [m.gate.e_score_correction_bias.abs().max().item() for m in model.moe_layers()]
    print(f"max |router bias| per layer {['%.3f' % v for v in loads]}")
    results = {}
    for q in ("mxfp4", "bf16"):
        t1 = time.time()
        acc, answers = accuracy(served_copy(model, q), probs, device)
        results[q] = acc
        print(f"held-out accuracy ({q} experts, {len(probs)} problems): {acc:.3f} "
              f"[{time.time() - t1:.1f}s]", flush=True)
        if q == "mxfp4":
            for p, a in list(zip(probs, answers))[:3]:
                print(f"  Q: {p.question}\n  model:{a}\n  expected:{p.answer}")
            wrong = [(p.question, a, p.final) for p, a in zip(probs, answers)
                     if task.final_answer(a) != p.final]
            log["mxfp4_wrong"] = wrong[:20]
            log["mxfp4_answers"] = answers
    log["heldout_accuracy"] = results

    with open(os.path.join(args.out, "train_log.json"), "w") as f:
        json.dump(log, f, indent=1)
    size = os.path.getsize(os.path.join(args.out, "model.safetensors"))
    print(f"wrote {args.out}/model.safetensors ({size / 2**20:.2f} MiB, {len(tensors)} tensors)")


if __name__ == "__main__":
    main()
