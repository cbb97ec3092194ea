"""The MoE layer, its weights, and the CPU reference of the contract.

Shapes (T tokens, H hidden, I intermediate, K top-k, E experts, E_l = E / ep_size local experts):

    x            bf16    [T, H]     numpy uint16 bits / ml_dtypes.bfloat16 / torch.bfloat16
    topk_idx     int32   [T, K]     global expert ids in [0, E), or -1 for an empty slot
    topk_weights float32 [T, K]     routing weights (ignored for empty slots)
    y            bf16    [T, H]     y[t] = bf16(sum over valid k, ascending, of o[t, k])
"""

from . import _arrays
from . import _megamoe as _C

MoeWeights = _C.MoeWeights
LayerConfig = _C.LayerConfig

__all__ = [
    "MoELayer", "MoeWeights", "synthetic_weights", "available_backends",
    "reference_forward", "reference_forward_quantized", "reference_l2_combine", "ideal_forward",
    "diff_metric", "compare_output",
]


class MoELayer:
    """One MoE layer on one EP rank, on the best backend available (or the one named).

    MoELayer(config, weights, backend="auto", group=None)
        config:  LayerConfig
        weights: MoeWeights for this rank (canonical form, e.g. synthetic_weights(),
                 MoeWeights.from_arrays() or load_moe_layer()). The layer takes them over and
                 prepares them in place for its backend: afterwards `weights.consumed` is True and
                 the weights object can no longer be used. A config/weights mismatch or an unknown
                 backend is detected before that and leaves the weights intact.
        backend: "auto" (sm90 when built with CUDA and an sm_90 GPU is present, else "cpu"),
                 "cpu" or "sm90". Unknown names raise InvalidArgumentError (ValueError); a known
                 backend this build or machine cannot run raises UnsupportedError (RuntimeError).
        group:   None, or this rank's EpGroup (megamoe.ep) for expert parallelism: `weights` are
                 then this rank's E / R experts (config.ep_size/ep_rank = the group's size/rank;
                 synthetic_weights(config, seed) makes that slice), and forward() exchanges tokens
                 and results with the other ranks. Needs the sm90 backend ("cpu" raises
                 UnsupportedError); a group that does not match the config (rank, shape, a
                 capacity above the group's, another device) raises InvalidArgumentError, a broken
                 group TimeoutError. All of this is checked before the weights are taken over.

    The layer lives on one device (`device`: "cpu" or "cuda:N"); its inputs must be there. A GPU
    layer is built on the current CUDA device (`with torch.cuda.device(i): MoELayer(...)`).
    A layer owns one workspace: do not call the same layer from several threads at once.

    Under expert parallelism (group given; megamoe.ep describes the rules) every rank must call
    forward() for every layer call, in the same order, T = 0 included, since the other ranks wait
    for it on the device. forward() never blocks the host. With virtual ranks (one GPU) the
    ranks' calls of one layer call must all be in flight together, each on its own torch stream:

        for r in range(R):
            with torch.cuda.stream(streams[r]):
                ys[r] = layers[r].forward(xs[r], idxs[r], ws[r])
    """

    def __init__(self, config, weights, backend="auto", group=None):
        self._layer = _C.MoeLayer(config, weights, backend, group)
        self._group = group  # the C++ layer holds its own reference

    @property
    def config(self):
        """A copy of the LayerConfig the layer was built with."""
        return self._layer.config

    @property
    def backend(self):
        """The backend that runs the layer: "cpu" or "sm90"."""
        return self._layer.backend

    @property
    def device(self):
        """"cpu" or "cuda:N"."""
        return self._layer.device

    @property
    def group(self):
        """The layer's EpGroup (the object passed as `group`), or None."""
        return self._group

    @property
    def weights_layout(self):
        """The layout the layer's weights were prepared into ("canonical" on the CPU)."""
        return self._layer.weights_layout

    @property
    def weights_bytes(self):
        """Bytes the layer's weights occupy."""
        return self._layer.weights_bytes

    def forward(self, x, topk_idx, topk_weights, out=None, stream=None):
        """y = MoE(x): quantize, L1, activation, routing weight, requantize, L2, combine.

        x:            bf16    [T, H]  on the layer's device, contiguous
        topk_idx:     int32   [T, K]  global expert ids in [0, E) or -1 (empty slot)
        topk_weights: float32 [T, K]
        out:          optional bf16 [T, H] to write into (same device); a new array otherwise,
                      in x's framework and BF16 representation.
        stream:       GPU layers: a CUDA stream (int handle or torch.cuda.Stream); default torch's
                      current stream on x's device. The call only enqueues work on it (no host
                      synchronisation, no allocation), so it can be captured in a CUDA graph.
                      CPU layers ignore it and return when y is written.
        Returns y (bf16 [T, H]); every row is written (zeros for tokens without a valid slot).

        T may be 0 and may not exceed config.max_tokens_per_rank (OutOfRangeError). Wrong dtypes
        raise DTypeError (TypeError); wrong shapes, devices or strides InvalidArgumentError
        (ValueError). An expert id outside [-1, E) raises OutOfRangeError (ValueError) on the
        cpu backend at once. The sm90 backend never reads with it: it treats the slot as empty,
        records it on the device and raises OutOfRangeError (naming the first bad token and slot)
        at the next forward() of this layer, or at check_errors(), without ever waiting in the
        call itself; with LayerConfig(sync_error_check=True) every call waits and raises at once.

        Under expert parallelism (a layer built with a group) the call still takes part above the
        capacity, with no tokens, before it raises OutOfRangeError, so the other ranks do not
        wait in vain; they raise OutOfRangeError naming this rank at their next check. Errors of
        the exchange (a rank above its capacity or its max_recv_rows, a peer that did not arrive
        within the group's timeout_s: TimeoutError) are found on the device and raised like
        invalid expert ids, at check_errors() or the next forward(). After a TimeoutError the
        group is unusable and every forward() raises TimeoutError.
        """
        _arrays.check_array(x, "x")
        y = _arrays.output(out, x, _arrays.shape_of(x), "bfloat16", bf16_like=x)
        handle = _arrays.cuda_stream(stream, x, y)
        with _arrays.cuda_device_of(x):
            self._layer.forward(_arrays.stream_input(x, "x"),
                                _arrays.stream_input(topk_idx, "topk_idx"),
                                _arrays.stream_input(topk_weights, "topk_weights"),
                                _arrays.stream_input(y, "out"), handle)
        return y

    __call__ = forward

    def check_errors(self, stream=None):
        """Waits for `stream` (default: torch's current stream on the layer's device) and raises
        OutOfRangeError if a call since the last check met invalid expert ids (the record is
        cleared). GPU layers detect those on the device and otherwise report them only at the next
        forward(); call this where you synchronize anyway, e.g. after replaying a CUDA graph. CPU
        layers raise from forward() itself, so this does nothing there.

        Under expert parallelism the errors of the exchange come first: OutOfRangeError when a
        rank was called above max_tokens_per_rank (naming it) or received more rows than
        max_recv_rows, TimeoutError when a peer did not arrive within the group's timeout_s (the
        group is unusable afterwards). Either makes the call's output invalid on every rank."""
        self._layer.check_errors(self._stream_handle(stream))

    def expert_rows(self, stream=None):
        """Rows (token, slot) each of this rank's experts received in the last call, as a list
        of E_l ints, after waiting for `stream` (default as for check_errors). Under expert
        parallelism these are the rows sent here by every rank. Empty for the cpu backend."""
        return self._layer.expert_rows(self._stream_handle(stream))

    @property
    def last_call_kernels(self):
        """Which kernels ran the expert GEMMs of the last call (host-side record, no wait): 'cpu';
        sm90: 'chain' (the GEMM launches) or 'mega' (the MegaMoE kernel), the latter with
        '+dispatch' when it gathered the received rows (LayerConfig(mega_dispatch=True)) and
        '+combine' when it also summed y (LayerConfig(mega_combine=True))."""
        return self._layer.last_call_kernels

    def _stream_handle(self, stream):
        # The stream a host-side wait uses: the one given, else torch's current stream on the
        # layer's device (there is no array to find it from).
        handle = _arrays.cuda_stream(stream)
        if stream is None and self.device.startswith("cuda") and _arrays._torch() is not None:
            handle = _arrays._torch().cuda.current_stream(self.device).cuda_stream
        return handle

    def __repr__(self):
        group = "" if self.group is None else f", group={self.group!r}"
        return (f"MoELayer(backend='{self.backend}', device='{self.device}', "
                f"config={self.config!r}{group})")


def available_backends():
    """Backends usable in this process, best first ("cpu" is always last)."""
    return _C.available_backends()


def synthetic_weights(config, seed, with_bias=False):
    """Deterministic synthetic MXFP4 weights (canonical form, host memory) for this rank of
    `config`: uniform random E2M1 codes, UE8M0 scales around 2^-round(log2(sqrt(K))). Each
    expert's bytes depend only on (seed, global expert id), so rank r of ep_size R gets exactly
    experts [r * E / R, (r + 1) * E / R) of the ep_size = 1 weights."""
    return _C.synthetic_weights(config, seed, with_bias)


def _weights_array(self, name):
    """A copy of buffer `name` ("w13", "w13_sf", "w2", "w2_sf", "w13_bias", "w2_bias") as a
    numpy array (host weights) or torch tensor (CUDA weights): canonical shape and dtype while
    the weights are canonical (uint8 [E_l, 2I, H/2], ..., bias bf16 [E_l, 2I] as uint16 bits),
    the raw bytes (uint8 [nbytes]) of a prepared layout otherwise.

    A copy, not a view: a MoELayer later takes the weights over and rewrites them in place."""
    shape, dtype = self.array_spec(name)
    if self.device == "cpu":
        import numpy as np

        out = np.empty(tuple(shape), dtype=_arrays._NUMPY_DTYPES[dtype])
    else:
        import torch

        out = torch.empty(tuple(shape), dtype=getattr(torch, _arrays._TORCH_DTYPES[dtype]),
                          device=self.device)
    self.copy_to(name, out)
    return out


def _weights_from_arrays(w13, w13_sf, w2, w2_sf, first_expert=0, w13_bias=None, w2_bias=None):
    """Canonical weights from arrays (copied into megamoe-owned memory on the arrays' device):

        w13    uint8 [E_l, 2I, H/2]   rows [0, I) gate (w1), [I, 2I) up (w3); E2M1 pairs
        w13_sf uint8 [E_l, 2I, H/32]  UE8M0
        w2     uint8 [E_l, H, I/2]
        w2_sf  uint8 [E_l, H, I/32]
        w13_bias bf16 [E_l, 2I], w2_bias bf16 [E_l, H]   optional, both or neither
        first_expert: global id of local expert 0 (= ep_rank * E_l)
    """
    h = _arrays.host_input
    return _C.MoeWeights._from_arrays(
        h(w13, "w13"), h(w13_sf, "w13_sf"), h(w2, "w2"), h(w2_sf, "w2_sf"), first_expert,
        None if w13_bias is None else h(w13_bias, "w13_bias"),
        None if w2_bias is None else h(w2_bias, "w2_bias"))


# NOTES: MoeWeights is the C++ class; these two helpers need numpy/torch for allocation, which the
# extension never imports, so they are attached here.
MoeWeights.array = _weights_array
MoeWeights.from_arrays = staticmethod(_weights_from_arrays)


# ------------------------------------------------------------------------------------------------
# The CPU reference (reference/): a second path to the contract, on host arrays
# ------------------------------------------------------------------------------------------------
def _tokens(a):
    return int(a.shape[0]) if len(a.shape) else 0


def reference_forward(config, weights, x, topk_idx, topk_weights, out=None, trace=False):
    """The contract computed by the CPU reference, from BF16 x (host arrays, canonical weights).

    Same arguments and result as MoELayer.forward; does not consume `weights`. With trace=True
    returns (y, trace) where trace holds the intermediates as numpy arrays (slot s = t * K + k;
    rows of invalid slots are zero):
        x_q uint8 [T, H], x_sf uint8 [T, H/32], l1_acc float32 [T*K, 2I],
        h_q uint8 [T*K, I], h_sf uint8 [T*K, I/32], o bf16-bits uint16 [T*K, H]
    """
    x = _arrays.host_input(x, "x")
    y = _arrays.output(out, x, _arrays.shape_of(x), "bfloat16", bf16_like=x)
    tr = _C.reference_forward(config, weights, x, _arrays.host_input(topk_idx, "topk_idx"),
                              _arrays.host_input(topk_weights, "topk_weights"), y, trace)
    return (y, tr) if trace else y


def reference_forward_quantized(config, weights, x_q, x_sf, topk_idx, topk_weights, out=None):
    """The reference from already quantized inputs: x_q uint8 [T, H] E4M3, x_sf uint8 [T, H/32].
    Returns y bf16 [T, H] (uint16 bits for numpy inputs)."""
    x_q = _arrays.host_input(x_q, "x_q")
    y = _arrays.output(out, x_q, (_tokens(x_q), config.shape.hidden), "bfloat16")
    h = _arrays.host_input
    _C.reference_forward_quantized(config, weights, x_q, h(x_sf, "x_sf"), h(topk_idx, "topk_idx"),
                                   h(topk_weights, "topk_weights"), y)
    return y


def reference_l2_combine(config, weights, h_q, h_sf, topk_idx, out=None):
    """L2 and combine from given intermediates h_q uint8 [T*K, I], h_sf uint8 [T*K, I/32]
    (e.g. a backend's own), for exact-mode checks. Returns y bf16 [T, H]."""
    topk_idx = _arrays.host_input(topk_idx, "topk_idx")
    y = _arrays.output(out, topk_idx, (_tokens(topk_idx), config.shape.hidden), "bfloat16")
    h = _arrays.host_input
    _C.reference_l2_combine(config, weights, h(h_q, "h_q"), h(h_sf, "h_sf"), topk_idx, y)
    return y


def ideal_forward(config, weights, x, topk_idx, topk_weights, out=None):
    """The unquantized FP64 MoE (BF16 x, dequantized weights, no intermediate quantization,
    exact activation). Returns float64 [T, H]."""
    x = _arrays.host_input(x, "x")
    y = _arrays.output(out, x, (_tokens(x), config.shape.hidden), "float64")
    _C.ideal_forward(config, weights, x, _arrays.host_input(topk_idx, "topk_idx"),
                     _arrays.host_input(topk_weights, "topk_weights"), y)
    return y


def diff_metric(a, b):
    """1 - 2<a,b> / (<a,a> + <b,b>) in FP64 over float64 arrays of one shape (0 when both are
    zero): numerics.md section 8."""
    return _C.diff_metric(_arrays.host_input(a, "a"), _arrays.host_input(b, "b"))


def compare_output(config, y, ref, topk_idx):
    """Compares y bf16 [T, H] with ref float64 [T, H] row by row and expert by expert.
    Returns a dict: diff, worst_row_diff, worst_row, worst_expert_diff, worst_expert,
    max_abs_err."""
    return _C.compare_output(config, _arrays.host_input(y, "y"), _arrays.host_input(ref, "ref"),
                             _arrays.host_input(topk_idx, "topk_idx"))
