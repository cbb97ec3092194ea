"""Shared fixtures of the megamoe Python tests.

Run from the repository root after building the extension:
    pip install . && python -m pytest tests/python -q -rs
or, from a CMake build configured with -DMEGAMOE_BUILD_PYTHON=ON:
    PYTHONPATH=build/python python -m pytest tests/python -q -rs
"""

import glob
import os
import shutil

import numpy as np
import pytest

import megamoe

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


try:
    import torch
except ImportError:  # the CPU CI machine may not have torch
    torch = None


def sm90_torch_skip_reason():
    """Why the torch + sm90 GPU tests cannot run here, or None when they can (CI without a GPU
    skips them with this reason; on an H200 they run and fail loudly)."""
    if torch is None:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device"
    if "sm90" not in megamoe.available_backends():
        return (f"the sm90 backend is not available (extension built with CUDA: "
                f"{megamoe.WITH_CUDA}; backends here: {megamoe.available_backends()})")
    return None


def routed_block(layer, cfg, seed, scale, device="cpu"):
    """A torch module around a megamoe layer, for the custom-op tests: a sigmoid top-k router
    (a fixed random gate of `seed` and `scale`), megamoe.torch_ops.MoEModule for the experts and a
    residual, all of it one graph under torch.compile."""
    import megamoe.torch_ops as ops

    class RoutedBlock(torch.nn.Module):
        def __init__(self):
            super().__init__()
            g = torch.Generator().manual_seed(seed)
            gate = torch.randn(cfg.shape.num_experts, cfg.shape.hidden, generator=g) * scale
            self.register_buffer("gate", gate.to(device))
            self.k = cfg.shape.top_k
            self.experts = ops.MoEModule(layer)

        def forward(self, x):
            s = torch.sigmoid(x.float() @ self.gate.t())
            w, idx = s.topk(self.k, dim=-1)
            w = w / w.sum(-1, keepdim=True)
            return (x.float() + self.experts(x, idx, w).float()).to(torch.bfloat16)

    return RoutedBlock()


def find_cli():
    """The `megamoe` program for cross-checks: $MEGAMOE_CLI, else `megamoe` on PATH, else the
    newest build*/megamoe of this repository; None when there is none."""
    env = os.environ.get("MEGAMOE_CLI")
    if env:
        return env
    found = shutil.which("megamoe")
    if found:
        return found
    candidates = [p for p in glob.glob(os.path.join(REPO_ROOT, "build*", "megamoe"))
                  if os.path.isfile(p) and os.access(p, os.X_OK)]
    return max(candidates, key=os.path.getmtime) if candidates else None


def tiny_config(activation="swiglu", fast_math=False, max_tokens=64, ep_size=1, ep_rank=0):
    """A layer small enough for numpy models: H=128, I=64, E=8, K=3."""
    shape = megamoe.LayerShape(hidden=128, intermediate=64, num_experts=8, top_k=3)
    return megamoe.LayerConfig(shape, activation=activation, fast_math=fast_math,
                               max_tokens_per_rank=max_tokens, ep_size=ep_size, ep_rank=ep_rank)


def make_inputs(config, num_tokens, seed, empty_slots=True):
    """(x bf16 bits uint16 [T, H], topk_idx int32 [T, K], topk_weights float32 [T, K]); with
    empty_slots some slots are -1 (and one token, when T > 2, has no valid slot)."""
    rng = np.random.default_rng(seed)
    h, e, k = config.shape.hidden, config.shape.num_experts, config.shape.top_k
    x = megamoe.bf16_from_f32(rng.standard_normal((num_tokens, h)).astype(np.float32))
    idx = np.stack([rng.permutation(e)[:k] for _ in range(num_tokens)]).astype(np.int32)
    idx = idx.reshape(num_tokens, k)
    w = rng.uniform(0.05, 1.0, (num_tokens, k)).astype(np.float32)
    if empty_slots and num_tokens > 2:
        idx[1, -1] = -1
        idx[2, :] = -1
    return x, idx, w


@pytest.fixture
def rng():
    return np.random.default_rng(20261130)
