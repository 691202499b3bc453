"""How the server combines the workers' feedback into the incoming gradient of the generated batches.

The paper (Algorithm 1) averages: the gradient for batch j is the sum of the feedbacks of the
workers that got X^(j) as X_g, divided by the number of workers that answered. A worker that sends
wrong feedback (a bug, a poisoned shard, an attacker) moves that average as far as it likes. The
robust rules replace each batch's sum by (workers in the group) x (a robust estimate over them), per
sample, so the scale matches the mean's and only the estimate changes:

- median: the coordinate-wise median over the group (the mean of the two middle values for an even
  count);
- trimmed-mean: per coordinate, the lowest and highest floor(trim_fraction * n) values dropped,
  the rest averaged (at least one value is kept);
- norm-clip: every worker's feedback for a sample scaled down to L2 norm <= clip_norm (clip_norm 0:
  the median of the group's norms for that sample), then averaged. It bounds how far one worker
  moves a sample, but a sign-flipped feedback has the same norm: it does not stop sign-flip.

Groups are the workers that got the same X_g (with kappa = 1 all of them); summation is always in
rank order, so every rule is bit-for-bit repeatable.
"""

from __future__ import annotations

import math

import torch

from mdgan.config import AGGREGATIONS


def median(stack: torch.Tensor) -> torch.Tensor:
    """(n, b, *shape) -> (b, *shape): the coordinate-wise median over the n workers."""
    n = stack.shape[0]
    ordered = stack.sort(dim=0).values
    if n % 2:
        return ordered[n // 2]
    return (ordered[n // 2 - 1] + ordered[n // 2]) / 2


def trimmed_mean(stack: torch.Tensor, trim_fraction: float) -> torch.Tensor:
    """(n, b, *shape) -> (b, *shape): per coordinate, drop k = floor(trim_fraction * n) at each end."""
    n = stack.shape[0]
    k = min(math.floor(trim_fraction * n), (n - 1) // 2)
    ordered = stack.sort(dim=0).values
    return ordered[k:n - k].mean(dim=0)


def norm_clipped_mean(stack: torch.Tensor, clip_norm: float) -> torch.Tensor:
    """(n, b, *shape) -> (b, *shape): each worker's per-sample feedback clipped to L2 norm <= bound."""
    n, b = stack.shape[:2]
    norms = stack.reshape(n, b, -1).norm(dim=2)  # (n, b)
    bound = median(norms) if clip_norm == 0 else norms.new_full((b,), float(clip_norm))  # (b,)
    factor = torch.where(norms > bound, bound / norms.clamp_min(torch.finfo(norms.dtype).tiny),
                         torch.ones_like(norms))  # (n, b)
    return (stack * factor.view(n, b, *([1] * (stack.dim() - 2)))).mean(dim=0)


def robust_estimate(stack: torch.Tensor, rule: str, trim_fraction: float = 0.2, clip_norm: float = 0.0) -> torch.Tensor:
    if rule == "median":
        return median(stack)
    if rule == "trimmed-mean":
        return trimmed_mean(stack, trim_fraction)
    if rule == "norm-clip":
        return norm_clipped_mean(stack, clip_norm)
    raise ValueError(f"unknown aggregation {rule!r}; choose from {AGGREGATIONS}")


def combine(samples: torch.Tensor, feedback: list[tuple[int, torch.Tensor]], rule: str = "mean",
            trim_fraction: float = 0.2, clip_norm: float = 0.0) -> torch.Tensor:
    """The incoming gradient of the generated batches `samples` (kappa, b, *shape).

    feedback: [(index of X_g, F_n (b, *shape))] in worker-rank order. mean: (1/N) sum_n F_n, placed
    at each F_n's batch (the paper's rule, and this code's arithmetic before robust rules existed).
    """
    if not feedback:
        raise ValueError("no feedback to combine")
    incoming = torch.zeros_like(samples)  # (kappa, b, *sample_shape)
    if rule == "mean":
        for index, gradient in feedback:
            incoming[index] += gradient.to(samples.device)
        incoming /= len(feedback)
        return incoming
    groups: dict[int, list[torch.Tensor]] = {}
    for index, gradient in feedback:  # rank order within each group
        groups.setdefault(index, []).append(gradient.to(samples.device))
    for index, members in groups.items():
        incoming[index] = robust_estimate(torch.stack(members), rule, trim_fraction, clip_norm) * len(members)
    incoming /= len(feedback)
    return incoming


def fedavg(states: list[dict[str, torch.Tensor]], weights: list[float]) -> dict[str, torch.Tensor]:
    """The weighted average of state dicts (floating tensors; others are taken from the first).

    Written as s_0 + sum_i (w_i / W) (s_i - s_0): the same average, but exactly the identity when
    every state is the same (no rounding from scaling and summing equal terms).
    """
    total = sum(weights)
    averaged = {}
    for name, first in states[0].items():
        if first.is_floating_point():
            acc = first.clone()
            for state, w in zip(states[1:], weights[1:]):  # fixed order: repeatable
                acc += (state[name] - first) * (w / total)
            averaged[name] = acc
        else:
            averaged[name] = first.clone()
    return averaged
