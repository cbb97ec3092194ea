"""Expert parallelism: R ranks, each owning E / R experts, exchange tokens and results inside one
MoE layer call (include/megamoe/ep.hpp; docs/design.md, "Expert parallelism").

One process per GPU, with torch.distributed (NCCL; the GPUs must be load/store reachable, one
NVLink domain):

    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    r, R = dist.get_rank(), dist.get_world_size()
    config = megamoe.LayerConfig("kimi-k3", ep_size=R, ep_rank=r, max_tokens_per_rank=4096)
    group = megamoe.ep.nccl_group_from_torch(config)             # collective
    layer = megamoe.MoELayer(config, rank_weights, group=group)  # this rank's experts
    y = layer(x, topk_idx, topk_weights)                         # every rank calls, T may be 0

R virtual ranks in one process on one GPU (tests, one-GPU experiments): the same kernels and
protocol, each rank's call on its own stream:

    groups = megamoe.ep.virtual_group(R, config)
    layers = [megamoe.MoELayer(config_r, weights_r, group=g) for ...]  # config_r: ep_rank = r
    streams = [torch.cuda.Stream() for _ in range(R)]
    for r in range(R):
        with torch.cuda.stream(streams[r]):
            ys[r] = layers[r](xs[r], idxs[r], ws[r])

Rules:

* Every rank must call forward() for every layer call, in the same order, T = 0 included: the
  other ranks wait for it on the device. A forward() never blocks the host, so virtual ranks can
  be called one after the other from one thread; all ranks' calls of one layer call must be in
  flight together (calling one rank's forward and waiting for its stream before calling the
  others times out).
* Layers that share a group share its window: one stream order per rank for all of them.
* The group's timeout_s bounds every wait on another rank. Errors found on the device are
  raised by MoELayer.check_errors() (which waits for the stream) and at the next forward():
      OutOfRangeError  a rank was called with T > max_tokens_per_rank (that rank raises at once
                       from forward(); it took part with no tokens, the others raise naming it),
                       or a rank received more rows than the group's max_recv_rows; that call's
                       output is invalid on every rank
      TimeoutError     a peer did not arrive within timeout_s (the message names this rank, the
                       stage, the peer and the call); the group is broken: every later forward()
                       raises TimeoutError, make a new group (and new layers)
"""

from . import _megamoe as _C

EpGroup = _C.EpGroup
EpOptions = _C.EpOptions

__all__ = ["EpGroup", "EpOptions", "virtual_group", "nccl_group", "nccl_group_from_torch",
           "nccl_unique_id", "nccl_available", "nccl_version"]

_DEFAULTS = EpOptions()


def virtual_group(size, config, timeout_s=_DEFAULTS.timeout_s,
                  max_recv_rows=_DEFAULTS.max_recv_rows):
    """`size` virtual ranks on the current CUDA device: a list whose element r is rank r's
    EpGroup. The group's window is sized for `config` (shape and max_tokens_per_rank; its
    ep_size/ep_rank are ignored here): every layer built on it must fit that. Each rank's layer
    needs config.ep_size = size and ep_rank = r and runs its calls on its own stream.

    timeout_s: every wait on another rank gives up after this long (TimeoutError).
    max_recv_rows: rows (token, expert slot) one rank may receive per call; 0 = the worst case
    size * max_tokens_per_rank * min(top_k, E / size), which never overflows.
    Raises UnsupportedError without CUDA or a GPU, InvalidArgumentError for a size that does not
    divide E or a bad option."""
    return _C.ep_virtual_group(size, config, timeout_s, max_recv_rows)


def nccl_group(config, unique_id, size, rank, timeout_s=_DEFAULTS.timeout_s,
               max_recv_rows=_DEFAULTS.max_recv_rows):
    """This process's rank of an NCCL group of `size` ranks, on the current CUDA device.
    Collective: every rank calls it with the same `unique_id` (the 128 bytes nccl_unique_id()
    made on one rank; any transport will do to hand them over) and returns once all have joined.
    Options as for virtual_group().

    Raises InvalidArgumentError for an id that is not 128 bytes (checked first, in every build),
    UnsupportedError in a build without NCCL."""
    if isinstance(unique_id, (bytearray, memoryview)):
        unique_id = bytes(unique_id)
    return _C.ep_nccl_group(unique_id, size, rank, config, timeout_s, max_recv_rows)


def nccl_group_from_torch(config, process_group=None, timeout_s=_DEFAULTS.timeout_s,
                          max_recv_rows=_DEFAULTS.max_recv_rows):
    """nccl_group() over the ranks of a torch.distributed process group (default: the world):
    rank 0 of it makes the id, broadcast_object_list hands it to the others, and the group takes
    torch.distributed's rank and world size. Collective over `process_group`; set each process's
    CUDA device first (torch.cuda.set_device), the group is made on it. The config's ep_size and
    ep_rank must be that world size and rank for the layers built on the group."""
    import torch.distributed as dist

    rank = dist.get_rank(process_group)
    size = dist.get_world_size(process_group)
    # broadcast_object_list names its source by global rank.
    src = 0 if process_group is None else dist.get_global_rank(process_group, 0)
    box = [nccl_unique_id() if rank == 0 else None]
    dist.broadcast_object_list(box, src=src, group=process_group)
    return nccl_group(config, box[0], size, rank, timeout_s, max_recv_rows)


def nccl_unique_id():
    """A fresh NCCL unique id (bytes, 128) for nccl_group(). UnsupportedError without NCCL."""
    return _C.nccl_unique_id()


def nccl_available():
    """Whether NCCL groups can be made here: megamoe was built with CUDA and NCCL headers, and a
    libnccl.so.2 at least as new as those headers loads (it is loaded at run time)."""
    return _C.nccl_available()


def nccl_version():
    """The loaded libnccl's version code, e.g. 22703 for 2.27.3; 0 when none loads, when it is
    older than the headers megamoe was built with, or in a build without CUDA."""
    return _C.nccl_version()
