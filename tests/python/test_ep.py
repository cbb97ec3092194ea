"""Expert parallelism through Python, the parts every build can check: options, argument checks
that come before any CUDA or NCCL work, the errors of a build without CUDA, the exception class
of a timeout, and the weight slices the GPU tests (test_ep_gpu.py) rely on.

Where a check depends on the build (CUDA, an sm90 GPU, a usable libnccl), both outcomes are
spelled out: a GPU machine must make groups, a CPU build must refuse with UnsupportedError.
"""

import builtins

import numpy as np
import pytest

import megamoe
from conftest import tiny_config

SM90 = "sm90" in megamoe.available_backends()
WEIGHT_NAMES = ("w13", "w13_sf", "w2", "w2_sf")


def small_config(**kwargs):
    return megamoe.LayerConfig("small", max_tokens_per_rank=16, **kwargs)


def test_ep_options_defaults_and_fields():
    o = megamoe.EpOptions()
    assert o.timeout_s == 10.0 and o.max_recv_rows == 0
    o = megamoe.EpOptions(timeout_s=0.5, max_recv_rows=128)
    assert (o.timeout_s, o.max_recv_rows) == (0.5, 128)
    o.timeout_s = 2.0
    assert o.timeout_s == 2.0
    assert repr(megamoe.EpOptions()) == "EpOptions(timeout_s=10.0, max_recv_rows=0)"
    assert megamoe.ep.EpOptions is megamoe.EpOptions and megamoe.ep.EpGroup is megamoe.EpGroup


def test_timeout_error_is_builtin_timeout_error():
    cls = megamoe.TimeoutError
    assert issubclass(cls, megamoe.Error) and issubclass(cls, builtins.TimeoutError)
    assert cls is not builtins.TimeoutError
    assert cls.code == "timeout" and cls.__module__ == "megamoe"
    try:
        raise cls("EP rank 0 of 2: timed out")
    except builtins.TimeoutError as e:  # what a caller without megamoe in mind would catch
        assert isinstance(e, megamoe.Error) and str(e) == "EP rank 0 of 2: timed out"


def test_nccl_probes_without_cuda():
    assert isinstance(megamoe.ep.nccl_available(), bool)
    assert isinstance(megamoe.ep.nccl_version(), int)
    assert megamoe.ep.nccl_available() == (megamoe.ep.nccl_version() > 0)
    if not megamoe.WITH_CUDA:
        assert megamoe.ep.nccl_version() == 0 and not megamoe.ep.nccl_available()
        with pytest.raises(megamoe.UnsupportedError, match="built without CUDA"):
            megamoe.ep.nccl_unique_id()
    elif megamoe.ep.nccl_available():
        uid = megamoe.ep.nccl_unique_id()
        assert isinstance(uid, bytes) and len(uid) == 128


@pytest.mark.parametrize("length", [0, 127, 129])
def test_nccl_group_checks_the_id_length_first(length):
    # The length is checked before anything needs NCCL or CUDA, so the message is the same in
    # every build, and before the other arguments (size 0 and rank 5 are wrong too).
    with pytest.raises(megamoe.InvalidArgumentError,
                       match=f"unique_id: expected 128 bytes .*, got {length}"):
        megamoe.ep.nccl_group(small_config(), b"\0" * length, 0, 5)
    with pytest.raises(ValueError, match="unique_id: expected 128 bytes"):
        megamoe.ep.nccl_group(small_config(), bytearray(length), 2, 0)


def test_nccl_group_checks_arguments_before_nccl():
    cfg = small_config()
    with pytest.raises(megamoe.InvalidArgumentError, match="size 3 must divide the number of "
                       "experts 32"):
        megamoe.ep.nccl_group(cfg, b"\0" * 128, 3, 0)
    with pytest.raises(megamoe.InvalidArgumentError, match="timeout_s"):
        megamoe.ep.nccl_group(cfg, b"\0" * 128, 2, 0, timeout_s=0.0)
    if not megamoe.WITH_CUDA:
        # A well-formed request: only the build is missing. (With CUDA this would try to meet
        # peers at a made-up id, so it is not run there.)
        with pytest.raises(megamoe.UnsupportedError, match="built without CUDA"):
            megamoe.ep.nccl_group(cfg, b"\0" * 128, 2, 0)


def test_virtual_group_checks_arguments_in_every_build():
    cfg = small_config()
    with pytest.raises(megamoe.InvalidArgumentError, match="size 3 must divide"):
        megamoe.ep.virtual_group(3, cfg)
    with pytest.raises(megamoe.InvalidArgumentError, match="expected 1 <= size <= 64, got 0"):
        megamoe.ep.virtual_group(0, cfg)
    with pytest.raises(megamoe.InvalidArgumentError, match="timeout_s: expected a value in"):
        megamoe.ep.virtual_group(2, cfg, timeout_s=-1.0)
    with pytest.raises(megamoe.InvalidArgumentError, match="max_recv_rows: expected >= 0"):
        megamoe.ep.virtual_group(2, cfg, max_recv_rows=-1)


def test_virtual_group_needs_cuda():
    cfg = small_config()
    if not megamoe.WITH_CUDA:
        with pytest.raises(megamoe.UnsupportedError, match="built without CUDA"):
            megamoe.ep.virtual_group(2, cfg)
        return
    try:
        groups = megamoe.ep.virtual_group(4, cfg, timeout_s=3.0, max_recv_rows=100)
    except megamoe.UnsupportedError as e:
        # A CUDA build on a machine without a device; a machine with the sm90 backend must not
        # get here.
        assert not SM90, f"virtual_group failed on a machine with the sm90 backend: {e}"
        assert "needs a CUDA device" in str(e)
        return
    assert [g.rank for g in groups] == [0, 1, 2, 3]
    for g in groups:
        assert g.size == 4 and g.transport == "virtual" and not g.broken
        assert g.options.timeout_s == 3.0 and g.options.max_recv_rows == 100
        assert g.max_recv_rows == 100 and g.window_bytes > 0 and g.device == groups[0].device
        assert "transport='virtual'" in repr(g)


@pytest.mark.skipif(not SM90, reason="making a group and a GPU layer needs the sm90 backend")
def test_layer_checks_the_group_before_taking_the_weights():
    groups = megamoe.ep.virtual_group(2, small_config())
    cfg1 = small_config(ep_size=2, ep_rank=1)
    w = megamoe.synthetic_weights(cfg1, 3)
    with pytest.raises(megamoe.UnsupportedError, match="cpu backend has no expert-parallel"):
        megamoe.MoELayer(cfg1, w, backend="cpu", group=groups[1])
    assert not w.consumed
    with pytest.raises(megamoe.InvalidArgumentError,
                       match=r"must be the group's size/rank \(2/0\)"):
        megamoe.MoELayer(cfg1, w, group=groups[0])  # rank 1's weights on rank 0's handle
    assert not w.consumed
    big = megamoe.LayerConfig("small", max_tokens_per_rank=17, ep_size=2, ep_rank=1)
    with pytest.raises(megamoe.InvalidArgumentError, match="exceeds the group's window capacity"):
        megamoe.MoELayer(big, w, group=groups[1])
    assert not w.consumed
    layer = megamoe.MoELayer(cfg1, w, group=groups[1])
    assert w.consumed and layer.group is groups[1] and layer.backend == "sm90"
    assert "group=EpGroup(" in repr(layer)


def test_layer_without_group():
    cfg = tiny_config()
    layer = megamoe.MoELayer(cfg, megamoe.synthetic_weights(cfg, 1), backend="cpu", group=None)
    assert layer.group is None
    assert layer.expert_rows() == []  # the cpu backend keeps no row counts
    assert layer.last_call_kernels == "cpu"
    assert "group=" not in repr(layer)


@pytest.mark.parametrize("make_config,size", [(tiny_config, 2), (tiny_config, 4),
                                              (lambda **kw: small_config(**kw), 4)])
def test_synthetic_rank_weights_are_slices_of_the_global_ones(make_config, size):
    """What test_ep_gpu.py builds its ranks from: rank r's synthetic_weights are experts
    [r * E / R, (r + 1) * E / R) of the EP = 1 weights, byte for byte."""
    full = megamoe.synthetic_weights(make_config(), 7)
    e = full.num_local_experts
    for r in range(size):
        part = megamoe.synthetic_weights(make_config(ep_size=size, ep_rank=r), 7)
        lo, hi = r * e // size, (r + 1) * e // size
        assert part.first_expert == lo and part.num_local_experts == hi - lo
        for name in WEIGHT_NAMES:
            np.testing.assert_array_equal(part.array(name), full.array(name)[lo:hi],
                                          err_msg=f"{name}, rank {r} of {size}")


def test_nccl_group_from_torch_plumbing(tmp_path):
    """nccl_group_from_torch over a one-process gloo group: the id is made on rank 0 and
    broadcast; without a usable NCCL the id itself is refused (UnsupportedError)."""
    torch = pytest.importorskip("torch")
    dist = torch.distributed
    if not dist.is_available():
        pytest.skip(f"torch {torch.__version__} has no torch.distributed")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        cfg = small_config()
        if not megamoe.ep.nccl_available():
            with pytest.raises(megamoe.UnsupportedError):
                megamoe.ep.nccl_group_from_torch(cfg)
            return
        group = megamoe.ep.nccl_group_from_torch(cfg, timeout_s=5.0)
        assert (group.rank, group.size, group.transport) == (0, 1, "nccl")
        assert group.options.timeout_s == 5.0
    finally:
        dist.destroy_process_group()
