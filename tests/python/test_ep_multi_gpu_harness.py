"""The host-side parts of bench/ep_multi_gpu.py (the multi-GPU EP run of issue 30), on the CPU:
input generation and splitting, byte accounting, comparisons, table formatting, the parent's
verdicts, --help. The GPU part itself needs R GPUs; the last test runs the script end to end
only where torch sees at least two CUDA devices (skipped with the reason otherwise).
"""

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import megamoe

from conftest import REPO_ROOT

SCRIPT = os.path.join(REPO_ROOT, "bench", "ep_multi_gpu.py")


def _load():
    spec = importlib.util.spec_from_file_location("ep_multi_gpu", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


epm = _load()


@pytest.mark.parametrize("ranks", [1, 2, 8])
def test_split_then_assemble_is_identity(ranks):
    cfg = megamoe.LayerConfig("small")
    sh = cfg.shape
    for name, routing, counts, empty in epm.case_list(ranks, 16):
        assert len(counts) == ranks and all(0 <= c <= 16 for c in counts), name
        x, idx, w = epm.global_inputs(megamoe, sh.hidden, sh.num_experts, sh.top_k, counts,
                                      routing, empty_slots=empty)
        assert x.shape == (sum(counts), sh.hidden) and x.dtype == np.uint16
        assert idx.shape == w.shape == (sum(counts), sh.top_k)
        parts = epm.split_rows((x, idx, w), counts)
        assert [p[0].shape[0] for p in parts] == counts
        for a, b in zip(epm.assemble_rows(parts), (x, idx, w)):
            np.testing.assert_array_equal(a, b)
        # every rank generating the global inputs gets the same bits
        again = epm.global_inputs(megamoe, sh.hidden, sh.num_experts, sh.top_k, counts, routing,
                                  empty_slots=empty)
        for a, b in zip(again, (x, idx, w)):
            np.testing.assert_array_equal(a, b)


def test_cases_cover_the_issue():
    cases = epm.case_list(8, 64)
    names = [c[0] for c in cases]
    assert {"uniform_at_capacity", "skewed_at_capacity", "adversarial_at_capacity"} <= set(names)
    uneven = dict((c[0], c[2]) for c in cases)["uniform_uneven_zero_rank"]
    assert 0 in uneven and 64 in uneven and max(uneven) <= 64
    assert epm.case_list(2, 64)[-1][2] == [64, 0]


def test_split_rejects_wrong_counts():
    with pytest.raises(ValueError):
        epm.split_rows((np.zeros((5, 2)),), [2, 2])


def test_exchange_bytes_hand_count():
    # R = 2, E = 4 (E_l = 2: rank 0 owns experts 0, 1; rank 1 owns 2, 3), K = 2, H = 64.
    h, k, e = 64, 2, 4
    row, meta, ret = h + h // 32, k * 8, 2 * h
    idx0 = np.array([[0, 1],     # both on rank 0: local only
                     [0, 2],     # one slot on rank 1
                     [3, -1]])   # one slot on rank 1, one empty slot
    idx1 = np.array([[2, 3],     # local only
                     [1, 0]])    # both slots on rank 0
    b = epm.exchange_bytes([idx0, idx1], e, h, k)
    # rank 0 sends: FP8 rows of tokens 1, 2 to rank 1; ids+weights of its 3 tokens to rank 1;
    # returns rank 1's 2 slots on its experts.
    assert b[0]["sent_dispatch"] == 2 * row + 3 * meta
    assert b[0]["sent_return"] == 2 * ret
    assert b[0]["recv_dispatch"] == 1 * row + 2 * meta
    assert b[0]["recv_return"] == 2 * ret
    assert b[0]["local"] == 2 * row + 3 * meta + 3 * ret
    assert b[1]["sent_dispatch"] == 1 * row + 2 * meta
    assert b[1]["sent_return"] == 2 * ret
    assert b[1]["recv_dispatch"] == 2 * row + 3 * meta
    assert b[1]["recv_return"] == 2 * ret
    assert b[1]["local"] == 1 * row + 2 * meta + 2 * ret
    # what one rank sends the other receives
    assert b[0]["sent"] == b[1]["recv"] and b[1]["sent"] == b[0]["recv"]


def test_exchange_bytes_one_rank_is_all_local():
    idx, _ = megamoe.make_routing("uniform", 32, 16, 4, 1)
    (b,) = epm.exchange_bytes([idx], 16, 128, 4)
    assert b["sent"] == b["recv"] == 0
    assert b["local"] == 32 * (128 + 4) + 32 * 4 * 8 + 32 * 4 * 256


def test_exchange_bytes_balance_on_random_routing():
    idxs = [megamoe.make_routing("skewed", 40 + r, 64, 6, r)[0] for r in range(8)]
    b = epm.exchange_bytes(idxs, 64, 256, 6)
    assert sum(x["sent"] for x in b) == sum(x["recv"] for x in b)
    assert sum(x["sent_return"] for x in b) == sum(x["recv_return"] for x in b)


def test_comparisons():
    a = megamoe.bf16_from_f32(np.random.default_rng(1).standard_normal((4, 32)).astype(np.float32))
    b = a.copy()
    assert epm.bits_mismatch(a, b) == 0
    b[2, 3] ^= 1
    assert epm.bits_mismatch(a, b) == 1
    fa, fb = epm.bf16_bits_to_f64(a), epm.bf16_bits_to_f64(b)
    np.testing.assert_array_equal(fa, megamoe.bf16_to_f32(a).astype(np.float64))
    assert epm.diff_metric(fa, fa) == 0.0
    assert abs(epm.diff_metric(fa, fb) - megamoe.diff_metric(fa, fb)) < 1e-15
    assert epm.diff_metric(np.zeros(3), np.zeros(3)) == 0.0


def _perf_records():
    recs = [{"kind": "copy_ceiling", "rank": 0, "gbs": 400.0}]
    for r, (ep_us, base_us) in enumerate([(100.0, 92.0), (104.0, 90.0)]):
        recs.append({"kind": "perf", "rank": r, "shape": "kimi-k3", "tokens": 1, "ep_us": ep_us,
                     "base_us": base_us, "timing": "graph", "top_k": 16, "hidden": 3584,
                     "inter": 3072, "bytes": {"sent": 4_000_000, "recv": 2_000_000}})
    return recs


def test_merge_perf_and_table():
    rows, ceiling = epm.merge_perf(_perf_records(), 2)
    assert ceiling == 400.0 and len(rows) == 1
    row = rows[0]
    assert (row["ep_us"], row["base_us"], row["overhead_us"]) == (104.0, 92.0, 12.0)
    assert row["comm_us_at_ceiling"] == pytest.approx(10.0)  # 4 MB at 400 GB/s
    assert row["hidden"] == 0.0  # overhead 12 us > 10 us of communication
    assert row["ep_tflops"] == pytest.approx(6 * 16 * 3584 * 3072 / 104e-6 / 1e12)
    table = epm.format_table(rows, 2, ceiling)
    assert "| kimi-k3 | 1 | 104.0 | 92.0 | 12.0 | 4.00 | 2.00 | 10.0 | 0.00 |" in table
    assert "400.0 GB/s" in table and "DeepGEMM" not in table
    assert "DeepGEMM" in epm.format_table(rows, 8, ceiling)


def test_perf_derived_without_ceiling():
    d = epm.perf_derived(110.0, 100.0, 1e6, 1e6, None, 8, 8, 7168, 2048)
    assert d["comm_us_at_ceiling"] is None and d["hidden"] is None
    assert d["overhead_us"] == 10.0


def test_verdicts(tmp_path):
    recs = [{"kind": "check", "check": "graph/x", "rank": 0, "ok": True},
            {"kind": "check", "check": "graph/x", "rank": 1, "ok": True},
            {"kind": "check", "check": "cap/x", "rank": 0, "ok": True},   # rank 1 missing
            {"kind": "check", "check": "to", "rank": 0, "ok": True},
            {"kind": "check", "check": "to", "rank": 1, "ok": False, "detail": "no error"}]
    v = {x["check"]: x["ok"] for x in epm.summarize_checks(recs, [], 2, {0: True, 1: False})}
    assert v == {"graph/x": True, "cap/x": False, "to": False, "child/rank1": False}


def test_evaluate_cases(tmp_path):
    cfg = megamoe.LayerConfig("small")
    sh = cfg.shape
    counts = [3, 5]
    x, idx, w = epm.global_inputs(megamoe, sh.hidden, sh.num_experts, sh.top_k, counts, "uniform")
    want = x  # stands in for the EP = 1 output
    d = str(tmp_path)
    parts = epm.split_rows((want,), counts)
    rows = np.arange(sh.num_experts)
    for p in ("tile", "auto"):
        np.save(os.path.join(d, f"small_c_{p}_ref.npy"), want)
        for r in range(2):
            np.save(os.path.join(d, f"small_c_{p}_r{r}.npy"), parts[r][0])
    np.save(os.path.join(d, "small_c_rows_ref.npy"), rows)
    for r in range(2):
        np.save(os.path.join(d, f"small_c_rows_r{r}.npy"), rows[r * 16:(r + 1) * 16])
    np.save(os.path.join(d, "small_c_idx.npy"), idx)
    case = {"case": "c", "shape": "small", "counts": counts, "idx_file": "small_c_idx.npy"}
    checks = epm.evaluate_cases(megamoe, d, [case], 2)
    assert [c["ok"] for c in checks] == [True, True], checks
    assert checks[1]["diff"] == 0.0 and "compare_output" in checks[1]
    bad = parts[1][0].copy()
    bad[0, 0] ^= 0x10
    np.save(os.path.join(d, "small_c_tile_r1.npy"), bad)
    np.save(os.path.join(d, "small_c_rows_r0.npy"), rows[:16] + 1)
    checks = epm.evaluate_cases(megamoe, d, [case], 2)
    assert not checks[0]["ok"] and checks[0]["mismatches"] == 1
    assert checks[0]["expert_rows_differ_on_ranks"] == [0]


def test_child_env_sets_nccl():
    env = epm.child_env({"LD_LIBRARY_PATH": "/x"})
    assert env["NCCL_NVLS_ENABLE"] == "0"
    lib = epm.nccl_lib_dir()
    if lib is None:
        assert env["LD_LIBRARY_PATH"] == "/x"
        print("nvidia.nccl is not installed here: LD_LIBRARY_PATH left as it was")
    else:
        assert env["LD_LIBRARY_PATH"] == lib + ":/x"


def test_help_and_args():
    out = subprocess.run([sys.executable, SCRIPT, "--help"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    for opt in ("--gpus", "--shapes", "--tokens", "--steps", "--timeout-s", "--out"):
        assert opt in out.stdout
    a = epm.parse_args(["--tokens", "1,8", "--steps", "perf", "--shapes", "deepseek-v3"])
    assert a.tokens == [1, 8] and a.steps == ["perf"] and a.shapes == ["deepseek-v3"]
    assert a.precision == "exact" and epm.parse_args(["--precision", "fp8"]).precision == "fp8"
    assert not a.mega and epm.parse_args(["--mega"]).mega
    with pytest.raises(SystemExit):
        epm.parse_args(["--steps", "nonsense"])
    with pytest.raises(SystemExit):
        epm.parse_args(["--precision", "bf16"])


def _gpu_skip_reason():
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if torch.cuda.device_count() < 2:
        return f"torch {torch.__version__} sees {torch.cuda.device_count()} CUDA devices, needs 2"
    if "sm90" not in megamoe.available_backends():
        return "the sm90 backend is not available"
    if not megamoe.ep.nccl_available():
        return "no usable libnccl in this process (see bench/ep_multi_gpu.py)"
    return None


def test_end_to_end_on_two_gpus(tmp_path):
    reason = _gpu_skip_reason()
    if reason:
        print(f"skipped: {reason}")
        pytest.skip(reason)
    out = subprocess.run([sys.executable, SCRIPT, "--gpus", "2", "--shapes", "deepseek-v3",
                          "--tokens", "1,64", "--out", str(tmp_path), "--deadline-s", "300"],
                         capture_output=True, text=True, timeout=360)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    results = [json.loads(line) for line in open(tmp_path / "results.jsonl")]
    assert all(r["ok"] for r in results if r["kind"] == "verdict")
