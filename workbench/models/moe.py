"""Mixture-of-experts feed-forward: a router sends each token to its top-k SwiGLU experts (dropless).

No parallel code lives here. Expert parallelism (``workbench.parallel.expert``) wraps ``GroupedExperts``
from the outside: it moves the expert-sorted tokens to the rank that owns their expert and back.

For token x with router probabilities p = softmax(W_r x) over E experts::

    S(x)  = top-k indices of p,          g_e = p_e / sum_{j in S(x)} p_j     (gates renormalised)
    y     = sum_{e in S(x)} g_e * Expert_e(x),   Expert_e(x) = W2_e (silu(W1_e x) * W3_e x)

Every token keeps all k of its slots: there is no capacity limit, so no token is ever dropped. The
Switch-Transformer load-balancing loss over the N tokens of a batch (N*k routed token-slots) is::

    aux = E * sum_e f_e * P_e,    f_e = (slots routed to e) / (N*k),    P_e = mean_tokens p_e

It is 1 when routing is uniform and grows as it concentrates. ``f`` comes from a top-k and carries no
gradient; ``P`` does. After each forward the module keeps ``aux_loss``, the pieces it is built from
(``router_prob_mean``, ``tokens_per_expert``), so a trainer can log them or recompute ``f`` over a
larger batch than this process sees.

Predicting memory (``workbench.prediction``), the step runs on fake tensors, whose routing has no values.
Each layer then splits its token-slots evenly over the experts, unless :func:`simulated_routing` gives it
the numbers: ``route(layer_id, slots, n_experts) -> slots per expert`` on this rank, e.g. a measured run's
counts scaled to this job's tokens (``workbench.prediction.routing``).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from workbench import compat
from workbench.config import ModelConfig

__all__ = ["GroupedExperts", "MoEFeedForward", "grouped_swiglu", "expert_counts", "split_sizes",
           "simulated_routing", "simulated_split"]

# route(layer_id, slots, n_experts) -> token-slots per expert on this rank (none active: balanced).
Route = Callable[[int | None, int, int], list[int]]
# A process-wide stack, not a ContextVar: autograd may run a checkpointed block's recomputation on its own
# thread (CUDA's device threads), and it must route as the forward did.
_ROUTES: list[Route] = []
_SPLIT_ATTR = "_workbench_simulated_split"


@contextmanager
def simulated_routing(route: Route) -> Iterator[None]:
    """On fake tensors, route each MoE layer's token-slots as ``route(layer_id, slots, n_experts)`` says
    (a list of ``n_experts`` non-negative ints summing to ``slots``) instead of evenly.

    Under expert parallelism every rank must see the same numbers for the same layer (each rank's send
    sizes are its peers' receive sizes), so ``route`` should come from one global table per layer, as
    ``workbench.prediction.routing`` makes it. Real tensors are never affected.
    """
    _ROUTES.append(route)
    depth = len(_ROUTES)
    try:
        yield
    finally:
        del _ROUTES[depth - 1:]


def simulated_split(counts: torch.Tensor) -> list[int] | None:
    """The per-expert split :func:`simulated_routing` gave ``counts`` (fake tensors only), else None."""
    return getattr(counts, _SPLIT_ATTR, None) if compat.is_fake(counts) else None


def expert_counts(slot_expert: torch.Tensor, n_experts: int, layer_id: int | None = None) -> torch.Tensor:
    """Token-slots routed to each expert: ``(E,)`` int64.

    Under FakeTensorMode (``workbench.memory`` predicting memory) the routing has no values to count;
    the result is then a tensor of the right shape, and :func:`split_sizes` supplies the sizes: even,
    or what an active :func:`simulated_routing` says for layer ``layer_id``.
    """
    if compat.is_fake(slot_expert):
        counts = slot_expert.new_zeros(n_experts)
        if _ROUTES:
            route = _ROUTES[-1]
            slots = slot_expert.numel()
            split = [int(c) for c in route(layer_id, slots, n_experts)]
            if len(split) != n_experts or sum(split) != slots or min(split, default=0) < 0:
                raise ValueError(f"simulated routing of layer {layer_id} gave {split}: it must be {n_experts} "
                                 f"non-negative counts summing to {slots}")
            setattr(counts, _SPLIT_ATTR, split)
        return counts
    return torch.bincount(slot_expert, minlength=n_experts)


def split_sizes(counts: torch.Tensor, total: int) -> list[int]:
    """``counts.tolist()`` for a 1-D tensor of row counts (per expert, or per rank) that sum to ``total``.

    Under FakeTensorMode the counts have no values: the split :func:`simulated_routing` attached to them
    (:func:`simulated_split`) when there is one, else balanced routing: ``total`` rows spread evenly,
    the first entries taking one more where they do not divide.
    """
    if not compat.is_fake(counts):
        return counts.tolist()
    split = simulated_split(counts)
    if split is not None and sum(split) == total and len(split) == counts.numel():
        return list(split)
    base, extra = divmod(total, counts.numel())
    return [base + (i < extra) for i in range(counts.numel())]


def grouped_swiglu(x: torch.Tensor, counts: list[int], w1: torch.Tensor, w2: torch.Tensor,
                   w3: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` sorted by expert, ``counts[e]`` of them for expert e -> each row through its expert.

    ``w1, w3: (E, ffn, dim)``, ``w2: (E, dim, ffn)``. An expert with zero rows contributes an empty
    matmul: its output is empty and its weight gradient is exactly zero (no NaN, no special case).
    """
    outs = [
        (F.silu(xe @ w1[e].t()) * (xe @ w3[e].t())) @ w2[e].t()
        for e, xe in enumerate(torch.split(x, counts))
    ]
    return torch.cat(outs) if outs else x.new_empty((0, w2.shape[1]))


class GroupedExperts(nn.Module):
    """E SwiGLU experts as three stacked weights, each indexed by expert along dim 0."""

    def __init__(self, dim: int, hidden: int, n_experts: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for w in (self.w1, self.w2, self.w3):
            nn.init.normal_(w, std=0.02)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x: (T, dim) token-slots sorted by expert; counts: (E,) slots per expert. -> (T, dim), same order."""
        return grouped_swiglu(x, split_sizes(counts, x.shape[0]), self.w1, self.w2, self.w3)


class MoEFeedForward(nn.Module):
    """Router + dropless top-k dispatch over ``GroupedExperts``. Input and output: (batch, seq, dim)."""

    def __init__(self, cfg: ModelConfig, layer_id: int | None = None):
        super().__init__()
        self.layer_id = layer_id  # which transformer block: names the layer to a simulated routing
        self.n_experts, self.top_k = cfg.n_experts, cfg.top_k
        self.router = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        self.experts = GroupedExperts(cfg.dim, cfg.ffn_hidden, cfg.n_experts)
        self.aux_loss: torch.Tensor | None = None
        self.router_prob_mean: torch.Tensor | None = None
        self.tokens_per_expert: torch.Tensor | None = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: (N, dim) -> router probabilities (N, E) in float32, renormalised gates (N, k), experts (N, k)."""
        probs = self.router(x).float().softmax(dim=-1)
        gates, experts = probs.topk(self.top_k, dim=-1)
        return probs, gates / gates.sum(dim=-1, keepdim=True), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        n, k = x.shape[0], self.top_k
        probs, gates, experts = self.route(x)
        slot_expert = experts.flatten()  # slot j belongs to token j // k
        counts = expert_counts(slot_expert, self.n_experts, self.layer_id)
        order = slot_expert.argsort(stable=True)  # slots grouped by expert, token order kept within
        routed = self.experts(x[order // k], counts)
        slots = routed[order.argsort()].view(n, k, shape[-1])
        y = (slots * gates.unsqueeze(-1).to(slots.dtype)).sum(dim=1)

        frac = counts.float() / max(n * k, 1)
        self.router_prob_mean = probs.mean(dim=0) if n else probs.sum(dim=0)
        self.tokens_per_expert = counts.detach()
        self.aux_loss = self.n_experts * (frac * self.router_prob_mean).sum()
        return y.view(shape)
