#!/usr/bin/env python3
"""CPU self-test of the peer harness (no GPU, no peer wheels needed):

  - reference.py's quantizers on hand-made blocks (numerics.md sections 2 and 5);
  - contract_forward against ideal_forward: diff in the FP8 x MXFP4 range of numerics.md section 8;
  - the torch BF16 chain against the FP64 ideal;
  - reference.py against megamoe's CPU reference, bit for bit, where `import megamoe` works;
  - the DeepGEMM chain's dispatch / padding / combine glue (masked and contiguous layouts), with the
    two DeepGEMM GEMMs replaced by a torch model of their documented semantics, so an indexing
    mistake in the glue fails here rather than on the GPU;
  - the Marlin MoE peer's torch side (peer_marlin.py): the scale permutation, the GPTQ packing fed to
    the repack kernel, moe_align_block_size's layout (against a loop and vLLM's documented example),
    the block-size rule, the whole chain with the Marlin GEMM replaced by a torch model of its
    semantics, and, where the library is built, its C entry points' argument checks (no GPU needed).

    python3 bench/peers/selftest.py      # exits non-zero on the first failed check
"""
from __future__ import annotations

import dataclasses
import os
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import common  # noqa: E402
import reference  # noqa: E402

FAILURES = []


def check(cond: bool, what: str):
    print(('ok   ' if cond else 'FAIL ') + what)
    if not cond:
        FAILURES.append(what)


def test_quantizers():
    x = torch.tensor([[1.0] * 31 + [1792.0]], dtype=torch.bfloat16)
    q, sf, deq = reference.quantize_input(x)
    check(int(sf[0, 0]) == 129, 'input scale byte: amax 1792 -> 2^2 -> 129')
    check(float(deq[0, -1]) == 1792.0 and float(deq[0, 0]) == 1.0, 'input block dequantizes exactly')
    tiny = torch.zeros((1, 32), dtype=torch.bfloat16)
    _, sf, deq = reference.quantize_input(tiny)
    # amax floor 1e-4: 2^ceil(log2(1e-4 / 448)) = 2^-22, byte 105
    check(int(sf[0, 0]) == 127 - 22 and bool((deq == 0).all()), 'zero input: amax floor 1e-4 gives byte 105, zero codes')
    v = torch.zeros((1, 64))
    v[0, 32:] = torch.linspace(-3, 3, 32)
    _, sf, deq = reference.requantize_intermediate(v)
    check(int(sf[0, 0]) == 0 and bool((deq[0, :32] == 0).all()), 'zero intermediate block: byte 0, zero codes')
    check(int(sf[0, 1]) == 127 - 7, 'intermediate amax 3 -> 2^ceil(log2(3/448)) = 2^-7')
    big = torch.tensor([[1e30] + [0.0] * 31])
    q, sf, _ = reference.requantize_intermediate(big)
    check(float(q.float().abs().max()) <= common.E4M3_MAX, 'requantized codes saturate at 448')


def small_shape(activation: str, bias: bool = False) -> common.Shape:
    base = common.SHAPES['gpt-oss-120b' if bias else 'small']
    return dataclasses.replace(base, hidden=256, intermediate=256, bench_experts=8, top_k=3, activation=activation)


def test_reference_and_torch_chain():
    from peer_torch import TorchBf16Chain
    for act, bias in (('swiglu', False), ('situ', False), ('swiglu_oai', True)):
        shape = small_shape(act, bias)
        w = common.synthetic_weights(shape, 3, 'cpu')
        inp = common.make_inputs(shape, 37, 5, 'cpu')
        ideal = reference.ideal_forward(shape, w, inp.x, inp.topk_idx, inp.topk_weights)
        con = reference.contract_forward(shape, w, inp.x, inp.topk_idx, inp.topk_weights)
        c = common.compare(con, ideal, inp.topk_idx)
        check(1e-5 < c['diff'] < 1e-2 and c['worst_row_diff'] < 3e-2,
              f'{act}: contract vs FP64 ideal diff {c["diff"]:.2e} (worst row {c["worst_row_diff"]:.2e})')
        y = TorchBf16Chain(shape, w).build(inp)()
        c = common.compare(y, ideal, inp.topk_idx)
        check(c['diff'] < 1e-4, f'{act}: torch BF16 chain vs FP64 ideal diff {c["diff"]:.2e}')
        wrong = common.compare(y, ideal.roll(1, 0), inp.topk_idx)
        check(wrong['diff'] > 0.1, f'{act}: the metric catches swapped rows (diff {wrong["diff"]:.2f})')


def _fake_deep_gemm():
    """Torch model of the two DeepGEMM calls the chain uses (SM90 recipe: 1x128 A, 128x128 B)."""
    blk = 128

    def deq_a(a, sf):
        return a.float() * sf.repeat_interleave(blk, -1)

    def deq_b(b, sf):
        return b.float() * sf.repeat_interleave(blk, -2).repeat_interleave(blk, -1)

    def masked(a, b, d, masked_m, expected_m):
        (a, a_sf), (b, b_sf) = a, b
        d.fill_(float('nan'))     # rows past masked_m are garbage for the kernel too
        for g in range(a.shape[0]):
            m = int(masked_m[g])
            d[g, :m] = (deq_a(a[g, :m], a_sf[g, :m]) @ deq_b(b[g], b_sf[g]).T).to(d.dtype)

    def contiguous(a, b, d, layout):
        (a, a_sf), (b, b_sf) = a, b
        assert a.shape[0] % blk == 0
        d.fill_(float('nan'))
        for start in range(0, a.shape[0], blk):
            g = int(layout[start])
            rows = slice(start, start + blk)
            if g < 0:
                continue
            check_block = layout[rows]
            assert bool(((check_block == g) | (check_block == -1)).all()), 'an M block mixes experts'
            d[rows] = (deq_a(a[rows], a_sf[rows]) @ deq_b(b[g], b_sf[g]).T).to(d.dtype)

    return types.SimpleNamespace(m_grouped_fp8_gemm_nt_masked=masked,
                                 m_grouped_fp8_gemm_nt_contiguous=contiguous,
                                 get_mk_alignment_for_contiguous_layout=lambda: blk)


def test_deepgemm_glue():
    import peer_deepgemm
    peer_deepgemm._import_deep_gemm = _fake_deep_gemm
    shape = small_shape('situ')
    w = common.synthetic_weights(shape, 4, 'cpu')
    peer = peer_deepgemm.DeepGemmFp8Chain(shape, w)
    for t in (1, 5, 64, 200):
        inp = common.make_inputs(shape, t, 6 + t, 'cpu')
        ideal = reference.ideal_forward(shape, w, inp.x, inp.topk_idx, inp.topk_weights)
        run = peer.build(inp)
        y = run()
        d2 = run.gemms_only()      # the GEMMs again on the buffers run() left: must not fail
        check(bool(torch.isfinite(d2.float()).any()), f'deepgemm glue T={t}: gemms_only() runs on the filled buffers')
        c = common.compare(y, ideal, inp.topk_idx)
        check(not c['nan'] and c['diff'] < 1e-2,
              f'deepgemm glue ({peer.layout_for(t)}, T={t}) vs FP64 ideal diff {c["diff"]:.2e}')


def _marlin_scales_vllm_form(sf: torch.Tensor) -> torch.Tensor:
    """vLLM's steps as vLLM writes them (per expert: s.T, marlin_permute_scales, then
    mxfp4_marlin_process_scales), on any dtype, for comparison with the batched version."""
    perm = [i + 8 * j for i in range(8) for j in range(8)]
    out = []
    for e in range(sf.shape[0]):
        s = sf[e].T
        n = s.shape[1]
        s = s.reshape((-1, len(perm)))[:, perm].reshape((-1, n)).contiguous()
        s = s.reshape(-1, 4)[:, [0, 2, 1, 3]].reshape(s.shape[0], -1)
        out.append(s)
    return torch.stack(out)


def _align_by_loop(topk_idx: torch.Tensor, block: int, num_experts: int):
    flat = topk_idx.flatten().tolist()
    ids, experts = [], []
    for e in range(num_experts):
        slots = [s for s, x in enumerate(flat) if x == e]
        if not slots:
            continue
        pad = -len(slots) % block
        ids += slots + [len(flat)] * pad
        experts += [e] * ((len(slots) + pad) // block)
    return ids, experts


def _fake_marlin_gemm(dequant: dict):
    """Torch model of moe_wna16_marlin_gemm (vLLM's kernel semantics): for each moe block below
    num_tokens_post_padded, rows r = sorted_token_ids of the block with r < size_m * top_k:
    C[r] = A[r // top_k] @ W[expert]^T (x topk_weights[r], BF16, if mul_topk_weights)."""
    def gemm(a, c, c_tmp, w, s, routing, block, top_k, mul_topk, size_m, size_n, size_k, topk_w):
        sorted_ids, expert_ids, num_post = routing
        wt = dequant[w]
        for b in range(int(num_post[0]) // block):
            rows = sorted_ids[b * block:(b + 1) * block].long()
            rows = rows[rows < size_m * top_k]
            acc = a[rows // top_k].float() @ wt[int(expert_ids[b])].float().T
            out = acc.to(torch.bfloat16)
            if mul_topk:
                out = out * topk_w.flatten()[rows].to(torch.bfloat16).unsqueeze(1)
            c[rows] = out
    return gemm


def test_marlin_glue():
    import peer_marlin as pm
    gen = torch.Generator().manual_seed(11)
    # scales: a permutation of each expert's bytes, equal to vLLM's per-expert form
    sf = torch.randint(0, 1 << 30, (3, 128, 256 // 32), generator=gen, dtype=torch.int64)
    mine = pm.marlin_mxfp4_scales(sf)
    check(mine.shape == (3, 8, 128) and torch.equal(mine.flatten(1).sort(1).values, sf.flatten(1).sort(1).values),
          'marlin scales: a permutation of each expert\'s scale bytes, [E, K/32, N]')
    check(torch.equal(mine, _marlin_scales_vllm_form(sf)), 'marlin scales: equal to vLLM\'s per-expert steps')
    # GPTQ packing: code k of row n at bits 4 (k % 8) of word [k / 8, n]
    codes = torch.randint(0, 256, (2, 64, 48), generator=gen, dtype=torch.uint8)
    words = pm.gptq_pack_for_repack(codes)
    nib = torch.stack([(words >> (4 * j)) & 0xF for j in range(8)], dim=2)       # [E, K/8, 8, N]
    vals = nib.flatten(1, 2).transpose(1, 2)                                       # [E, N, K]
    ref = torch.stack([codes & 0xF, codes >> 4], dim=-1).flatten(-2).to(vals.dtype)
    check(words.shape == (2, 12, 64) and torch.equal(vals, ref), 'marlin GPTQ packing: [E, K/8, N] int32, low nibble first')
    # moe_align_block_size layout: vLLM's docstring example (block 4), then random routings
    idx = torch.tensor([[2, 3, 4], [1, 2, 4], [1, 3, 4], [1, 2, 3]], dtype=torch.int32)
    ids, experts, npost = pm.align_block_size(idx, 4, 5)
    check(ids[:16].tolist() == [3, 6, 9, 12, 0, 4, 10, 12, 1, 7, 11, 12, 2, 5, 8, 12] and int(npost) == 16
          and experts[:4].tolist() == [1, 2, 3, 4], 'marlin align: vLLM\'s documented example')
    ok = True
    for t, e, k, block in ((1, 8, 3, 8), (3, 32, 4, 16), (17, 8, 3, 48), (200, 32, 4, 64), (64, 256, 8, 8)):
        topk_idx, _ = common.uniform_routing(t, e, k, gen, 'cpu')
        ids, experts, npost = pm.align_block_size(topk_idx, block, e)
        want_ids, want_experts = _align_by_loop(topk_idx, block, e)
        n = int(npost)
        ok &= (n == len(want_ids) and ids[:n].tolist() == want_ids and ids.numel() == pm.sorted_len_for(t * k, e, block)
               and bool((ids[n:] == t * k).all()) and experts[:n // block].tolist() == want_experts
               and experts.numel() == -(-ids.numel() // block))
    check(ok, 'marlin align: sorted ids, expert ids, padded count equal a loop over experts (5 routings)')
    check([pm.block_size_for(t, 8, 256) for t in (1, 8, 64, 512, 4096, 8192)] == [8, 8, 8, 32, 64, 64]
          and pm.block_size_for(64, 16, 112) == 16, 'marlin block size: vLLM fused_marlin_moe\'s rule')
    # the whole chain with the GEMM modelled
    for act in ('swiglu', 'situ'):
        shape = small_shape(act)
        w = common.synthetic_weights(shape, 5, 'cpu')
        peer = pm.MarlinMxfp4W4A16.__new__(pm.MarlinMxfp4W4A16)
        peer.shape, peer.num_experts = shape, w.num_experts
        peer.lib = types.SimpleNamespace(mmp_moe_c_tmp_floats=lambda *a: 1)
        peer.w13, peer.w2, peer.s13, peer.s2 = 'w13', 'w2', None, None
        w13, w2 = common.dequant_weights(w, torch.bfloat16)
        peer._gemm = _fake_marlin_gemm({'w13': w13, 'w2': w2})
        for t in (1, 6, 70):
            inp = common.make_inputs(shape, t, 40 + t, 'cpu')
            y = peer.build(inp)()
            ideal = reference.ideal_forward(shape, w, inp.x, inp.topk_idx, inp.topk_weights)
            c = common.compare(y, ideal, inp.topk_idx)
            check(not c['nan'] and c['diff'] < 1e-4,
                  f'marlin glue ({act}, {peer.layout_for(t)}, T={t}) vs FP64 ideal diff {c["diff"]:.2e}')
    # the library's C entry points (argument checks run before any CUDA call)
    if not os.path.isfile(pm.LIB_PATH):
        print(f'skip marlin library checks: {pm.LIB_PATH} not built (prepare_marlin.sh, build_marlin.sh)')
        return
    lib = pm.load_library()
    def err(bs, n, k):
        rc = lib.mmp_moe_mxfp4_gemm(None, None, None, 0, None, None, None, None, 64, None, None, None, None, 0,
                                    bs, 8, 2, 1, 4, n, k, 1, -1, -1, -1, None)
        return rc, lib.mmp_last_error().decode()
    r = [err(12, 128, 64), err(16, 128, 33), err(16, 100, 64)]
    check(all(rc == 1 for rc, _ in r) and 'moe_block_size=12' in r[0][1] and 'size_k = 33' in r[1][1]
          and 'size_n = 100' in r[2][1], 'marlin library: C entry point reports bad block size / K / N by name')
    check(lib.mmp_gptq_repack_4bit(None, None, 1, 64, 65, None) == 1 and 'size_n = 65' in lib.mmp_last_error().decode(),
          'marlin library: repack entry point checks N')
    print('marlin library:', lib.mmp_build_info().decode())


def test_against_megamoe_cpu_reference():
    """reference.py must equal megamoe's CPU reference bit for bit (fast_math = false), when the
    megamoe Python package is importable (PYTHONPATH=<build>/python)."""
    try:
        import megamoe
        import numpy as np
    except Exception as exc:
        print(f'skip megamoe CPU reference cross-check: {type(exc).__name__}: {exc}')
        return
    for name in ('small', 'kimi-k3', 'gpt-oss-120b'):
        cfg = megamoe.LayerConfig(name)
        cfg.fast_math = False
        shape = dataclasses.replace(common.SHAPES[name], hidden=256, intermediate=128, num_experts=8,
                                    bench_experts=8, top_k=4)
        cfg.shape = megamoe.LayerShape(shape.hidden, shape.intermediate, shape.num_experts, shape.top_k)
        w = common.synthetic_weights(shape, 7, 'cpu')
        inp = common.make_inputs(shape, 19, 3, 'cpu')
        bias = lambda b: None if b is None else b.view(torch.uint16).numpy()
        mw = megamoe.MoeWeights.from_arrays(w.w13.numpy(), w.w13_sf.numpy(), w.w2.numpy(), w.w2_sf.numpy(), 0,
                                            bias(w.w13_bias), bias(w.w2_bias))
        y_core = np.asarray(megamoe.reference_forward(cfg, mw, inp.x.view(torch.uint16).numpy(),
                                                      inp.topk_idx.numpy(), inp.topk_weights.numpy()))
        y_core = torch.from_numpy(y_core.view(np.int16)).view(torch.bfloat16)
        y_mine = reference.contract_forward(shape, w, inp.x, inp.topk_idx, inp.topk_weights)
        check(torch.equal(y_core, y_mine), f'{name} ({shape.activation}): reference.py == megamoe CPU reference, bit for bit')


def test_megamoe_adapter_on_cpu():
    """The megamoe-py adapter's use of the Python API, on megamoe's CPU backend."""
    try:
        import megamoe  # noqa: F401
    except Exception as exc:
        print(f'skip megamoe-py adapter check: {type(exc).__name__}: {exc}')
        return
    from peer_megamoe import MegamoePython
    MegamoePython.backend = 'cpu'
    shape = common.SHAPES['small']
    w = common.synthetic_weights(shape, 3, 'cpu')
    inp = common.make_inputs(shape, 9, 2, 'cpu')
    y = MegamoePython(shape, w).build(inp)()
    con = reference.contract_forward(shape, w, inp.x, inp.topk_idx, inp.topk_weights)
    c = common.compare(y, con, inp.topk_idx)
    check(c['diff'] < 1e-6, f'megamoe-py adapter (cpu backend) vs contract diff {c["diff"]:.1e}')


def main() -> int:
    torch.manual_seed(0)
    test_quantizers()
    test_reference_and_torch_chain()
    test_deepgemm_glue()
    test_marlin_glue()
    test_against_megamoe_cpu_reference()
    test_megamoe_adapter_on_cpu()
    print(f'{len(FAILURES)} failed' if FAILURES else 'all passed')
    return 1 if FAILURES else 0


if __name__ == '__main__':
    sys.exit(main())
