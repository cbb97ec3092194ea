"""examples/kimi_mini/engine_swap.py runs and passes: kimi_mini's PyTorch routed experts swapped for
megamoe (the custom op, and the DeepGEMM-style path of megamoe.deep_gemm_compat) leave the greedy
answers unchanged. On the CPU backend here, on sm90 where a GPU is (the script picks the device).
Skipped where torch is missing."""

import os
import subprocess
import sys

import pytest

import megamoe
from conftest import REPO_ROOT

pytest.importorskip("torch", reason="the example runs the PyTorch model")

SCRIPT = os.path.join(REPO_ROOT, "examples", "kimi_mini", "engine_swap.py")


def _run(*args):
    env = dict(os.environ)
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(megamoe.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    done = subprocess.run([sys.executable, SCRIPT, *args], env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, f"engine_swap.py {' '.join(args)}:\n{done.stdout}{done.stderr}"
    return done.stdout


def test_both_apis_leave_the_answers_unchanged():
    out = _run("--limit", "3")
    assert "engine_swap: PASS" in out
    for api in ("op", "deep_gemm"):
        assert f"  {api:10} megamoe experts: " in out and "3/3 answers identical" in out, out


def test_compiled_model_leaves_the_answers_unchanged():
    out = _run("--limit", "1", "--api", "deep_gemm", "--compile")
    assert "deep_gemm + compile megamoe experts" in out and "1/1 answers identical" in out, out
