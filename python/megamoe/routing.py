"""Routing: the Kimi-K3 style sigmoid top-k router and the synthetic workloads of the benchmark
protocol (all on the host, deterministic in their seed)."""

from . import _arrays
from . import _megamoe as _C

__all__ = ["route_sigmoid_topk", "make_routing", "synthetic_activations", "ROUTING_KINDS"]

ROUTING_KINDS = ("uniform", "skewed", "adversarial")


def route_sigmoid_topk(logits, top_k, correction_bias=None, routed_scaling_factor=1.0,
                       topk_idx=None, topk_weights=None):
    """The router of numerics.md section 7, from gate logits (x W_g^T, computed by the caller).

    logits:          float32 [T, E] (numpy or CPU torch)
    correction_bias: optional float32 [E], added for the selection only
    Returns (topk_idx int32 [T, K], topk_weights float32 [T, K]):
        s = sigmoid(logits); idx = top-k of s + bias (descending; ties: lower expert id first);
        w = s[idx] / sum(s[idx]) * routed_scaling_factor.
    Non-finite logits or bias raise InvalidArgumentError naming token and expert.
    """
    logits = _arrays.host_input(logits, "logits")
    t = int(logits.shape[0]) if len(logits.shape) else 0
    idx = _arrays.output(topk_idx, logits, (t, int(top_k)), "int32")
    w = _arrays.output(topk_weights, logits, (t, int(top_k)), "float32")
    bias = None
    if correction_bias is not None:
        bias = _arrays.host_input(correction_bias, "correction_bias")
    _C.route_sigmoid_topk(logits, bias, float(routed_scaling_factor), idx, w)
    return idx, w


def make_routing(kind, num_tokens, num_experts, top_k, seed):
    """A synthetic routing (numpy): (topk_idx int32 [T, K], topk_weights float32 [T, K]).

    kind: "uniform" (k distinct experts uniformly), "skewed" (Zipf popularity p(i) ~ 1/i^1.2
    over a seeded expert permutation) or "adversarial" (every token picks the same k experts).
    Weights are positive and sum to 1 per token; no expert repeats within a token.
    """
    return _C.make_routing(kind, num_tokens, num_experts, top_k, seed)


def synthetic_activations(num_tokens, hidden, seed):
    """Standard-normal token activations as BF16 bits: numpy uint16 [T, H]. Token t does not
    depend on num_tokens."""
    return _C.synthetic_activations(num_tokens, hidden, seed)
