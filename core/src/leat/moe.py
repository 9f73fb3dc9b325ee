"""Mixture-of-experts feed-forward blocks, as llama.cpp's ``build_moe_ffn`` computes them.

A router (``ffn_gate_inp``, [experts, d], optionally with a bias) scores every expert per token; the
top ``experts_used`` are selected and weighted; each selected expert is a gated MLP whose three
projections are stored stacked, one 3-D tensor each (``ffn_gate_exps`` and ``ffn_up_exps``
[experts, ffn, d], ``ffn_down_exps`` [experts, d, ffn], optional biases [experts, ffn] / [experts, d]).
The layer's output is the weighted sum of the selected experts' outputs.

The whole block is one backend op, :meth:`leat.backend.Backend.moe`, so a device backend can fuse
routing and expert dispatch; :class:`MoESpec` is its complete description.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np

from leat.blocks import layer_tensor

T = gguf.MODEL_TENSOR

#: ``gating`` values. "softmax": probabilities are the softmax of the router logits over all experts,
#: the top-k probabilities are the weights (Qwen2/3-MoE, Mixtral). "softmax_selected": the top-k
#: *logits* are selected and their softmax (over those k) is the weights (gpt-oss; llama.cpp's
#: LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT). "sigmoid": each expert's probability is the sigmoid of its
#: logit, the top-k probabilities are the weights (DeepSeek V3).
GATINGS = ("softmax", "softmax_selected", "sigmoid")
#: ``activation`` values. "silu": silu(g) * u. "swiglu_oai": gpt-oss's clamped SwiGLU,
#: x = min(g, limit), y = clip(u, -limit, limit), out = x * sigmoid(alpha * x) * (y + 1).
ACTIVATIONS = ("silu", "swiglu_oai")
#: llama.cpp clamps the sum of the selected weights to the smallest normal f16 before dividing by it.
MIN_WEIGHT_SUM = 6.103515625e-5


@dataclass(frozen=True)
class MoESpec:
    """How one MoE layer routes and activates; see :data:`GATINGS` and :data:`ACTIVATIONS`.

    After gating, ``normalize`` divides the k weights by their sum (clamped at :data:`MIN_WEIGHT_SUM`)
    and ``scale`` multiplies them (llama.cpp's ``expert_weights_scale``; 0 and 1 both mean none).
    ``alpha`` and ``limit`` are the constants of "swiglu_oai" (llama.cpp hard-codes 1.702 and 7.0).

    ``groups`` > 1 limits routing to groups (DeepSeek V3's ``n_group`` / ``topk_group``): the experts are
    ``groups`` consecutive groups, each scored by the sum of its two highest selection scores, and the
    top ``experts_used`` experts are chosen only within the ``groups_used`` best groups.
    """

    experts: int
    experts_used: int
    gating: str = "softmax"
    normalize: bool = False
    scale: float = 1.0
    activation: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0
    groups: int = 0
    groups_used: int = 0

    def __post_init__(self) -> None:
        if self.gating not in GATINGS:
            raise ValueError(f"MoE gating must be one of {GATINGS}, not {self.gating!r}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"MoE activation must be one of {ACTIVATIONS}, not {self.activation!r}")
        if not 0 < self.experts_used <= self.experts:
            raise ValueError(f"MoE selects {self.experts_used} of {self.experts} experts; need 0 < used <= experts")
        if self.groups > 1 and (self.experts % self.groups or not 0 < self.groups_used <= self.groups):
            raise ValueError(
                f"MoE routes within {self.groups_used} of {self.groups} groups of {self.experts} experts; need "
                "groups dividing experts and 0 < groups_used <= groups"
            )


@dataclass
class MoEWeights:
    """Backend handles of one MoE layer (biases None where the file has none)."""

    router: Any
    gate: Any
    up: Any
    down: Any
    router_bias: Any = None
    gate_bias: Any = None
    up_bias: Any = None
    down_bias: Any = None
    selection_bias: Any = None  # [experts], added to the scores for selection only (``exp_probs_b``)


def load_moe(
    weights: Any,
    layer: int,
    width: int = 0,
    ffn: int = 0,
    experts: int = 0,
    biases: bool | None = None,
    selection_bias: bool | None = None,
) -> MoEWeights:
    """The router and stacked experts of ``layer`` by their GGUF names, with their shapes when ``width`` is given;
    ``biases`` / ``selection_bias``: whether the file has them (None: whatever it has)."""

    def bias(kind: gguf.MODEL_TENSOR, shape: tuple[int, ...], present: bool | None) -> Any:
        if present is False:
            return None
        return weights(layer_tensor(kind, layer, "bias"), shape if width else None, optional=present is None)

    shape = (lambda *dims: dims) if width else (lambda *dims: None)
    return MoEWeights(
        router=weights(layer_tensor(T.FFN_GATE_INP, layer), shape(experts, width)),
        gate=weights(layer_tensor(T.FFN_GATE_EXP, layer), shape(experts, ffn, width)),
        up=weights(layer_tensor(T.FFN_UP_EXP, layer), shape(experts, ffn, width)),
        down=weights(layer_tensor(T.FFN_DOWN_EXP, layer), shape(experts, width, ffn)),
        router_bias=bias(T.FFN_GATE_INP, (experts,), biases),
        gate_bias=bias(T.FFN_GATE_EXP, (experts, ffn), biases),
        up_bias=bias(T.FFN_UP_EXP, (experts, ffn), biases),
        down_bias=bias(T.FFN_DOWN_EXP, (experts, width), biases),
        selection_bias=bias(T.FFN_EXP_PROBS_B, (experts,), selection_bias),
    )


def route(logits: np.ndarray, spec: MoESpec, selection_bias: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Router logits [n, experts] -> (selected expert ids [n, k], their weights [n, k]), in logits' dtype.

    The reference the CPU backend runs; ids are ordered by descending selection score (ties: lower id
    first). The selection score is the gating's score plus ``selection_bias``, masked to the best groups
    when ``spec.groups`` > 1; the weights come from the unbiased scores.
    """
    k = spec.experts_used
    if spec.gating == "softmax":
        scores = _softmax(logits)
    elif spec.gating == "sigmoid":
        scores = _sigmoid(logits)
    else:
        scores = logits
    selection, _ = _selection(scores, spec, selection_bias)
    ids = np.argsort(-selection, axis=-1, kind="stable")[:, :k]
    weights = np.take_along_axis(scores, ids, axis=-1)
    if spec.gating == "softmax_selected":
        weights = _softmax(weights)
    if spec.normalize:
        weights = weights / np.maximum(weights.sum(axis=-1, keepdims=True), MIN_WEIGHT_SUM)
    if spec.scale not in (0.0, 1.0):
        weights = weights * spec.scale
    return ids, weights


def router_margin(logits: np.ndarray, experts_used: int) -> np.ndarray:
    """Per token, how far the expert choice is from a tie: the k-th minus the (k+1)-th largest router logit.

    Both gatings select by logit order, so below a margin of about 1e-3 two engines' rounding may pick
    different experts, both correct; like a near-tie of the top-2 output logits, such tokens are where
    comparisons stop being meaningful. ``inf`` when every expert is used.
    """
    if experts_used >= logits.shape[-1]:
        return np.full(logits.shape[:-1], np.inf)
    top = -np.sort(-np.asarray(logits, dtype=np.float64), axis=-1)
    return top[..., experts_used - 1] - top[..., experts_used]


def activate(gate: np.ndarray, up: np.ndarray, spec: MoESpec) -> np.ndarray:
    """The experts' gated activation of gate and up projections (the reference the CPU backend runs)."""
    with np.errstate(over="ignore"):  # exp overflow for very negative gates gives the right limit, 0
        if spec.activation == "silu":
            return gate / (1.0 + np.exp(-gate)) * up
        x = np.minimum(gate, spec.limit)
        y = np.clip(up, -spec.limit, spec.limit)
        return x / (1.0 + np.exp(-spec.alpha * x)) * (y + 1.0)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # exp overflow for very negative logits gives the right limit, 0
        return 1.0 / (1.0 + np.exp(-x))


def _selection(
    scores: np.ndarray, spec: MoESpec, selection_bias: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray | None]:
    """Selection scores [n, experts] (biased, other groups -inf) and, with groups, each group's score."""
    selection = scores if selection_bias is None else scores + selection_bias
    if spec.groups <= 1:
        return selection, None
    grouped = selection.reshape(len(selection), spec.groups, -1)
    group_scores = -np.sort(-grouped, axis=-1)[..., :2].sum(axis=-1)
    best = np.argsort(-group_scores, axis=-1, kind="stable")[:, : spec.groups_used]
    keep = np.zeros(group_scores.shape, dtype=bool)
    np.put_along_axis(keep, best, True, axis=-1)
    return np.where(keep[..., None], grouped, -np.inf).reshape(selection.shape), group_scores


def selection_margin(logits: np.ndarray, spec: MoESpec, selection_bias: np.ndarray | None = None) -> np.ndarray:
    """Per token, how far :func:`route`'s choice is from a tie on the scores it selects by ([n], float64).

    The smaller of the k-th minus (k+1)-th selection score and, with groups, the ``groups_used``-th minus
    the next group score; ``inf`` when nothing is left out. Like :func:`router_margin`, but after gating,
    selection bias and group limits (DeepSeek V3), where those decide.
    """
    x = np.asarray(logits, dtype=np.float64)
    if spec.gating == "softmax" and selection_bias is None and spec.groups <= 1:
        # softmax keeps the logits' order, and a peaked softmax puts every unselected probability
        # within 1e-10 of the next: the distance from a tie is the logits' gap
        return router_margin(x, spec.experts_used)
    scores = _softmax(x) if spec.gating == "softmax" else _sigmoid(x) if spec.gating == "sigmoid" else x
    bias = None if selection_bias is None else np.asarray(selection_bias, dtype=np.float64)
    selection, group_scores = _selection(scores, spec, bias)
    margin = router_margin(selection, spec.experts_used)
    if group_scores is not None:
        margin = np.minimum(margin, router_margin(group_scores, spec.groups_used))
    return margin
