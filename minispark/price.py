"""Allocation of the batch-wide verification budget: pure tensor functions, no model.

A chain's survival `a_j = prod_{i<=j} c_i` is the estimated chance that its draft token j is
accepted; verifying slot j is worth `a_j` expected tokens. The budget goes to the top pairs.
"""
from __future__ import annotations

import torch
from torch import Tensor


def survival(conf: Tensor, valid: Tensor) -> Tensor:
    """a [R, K] = cumprod of per-token acceptance estimates c [R, K], 0 past each valid length.
    Estimates are clamped to [0, 1] so survival never increases along a chain."""
    K = conf.shape[1]
    col = torch.arange(K, device=conf.device)[None, :]
    return torch.where(col < valid[:, None], conf.clamp(0, 1).cumprod(-1), 0.0)


def admit_top(a: Tensor, budget: int) -> Tensor:
    """Chain lengths [R] that admit the `budget` (row, position) pairs of largest survival.

    Ties go to the earlier position (then the lower row), and survival never increases along a
    chain, so what a row admits is always a prefix of its chain, and admitting position j
    depends on values up to j only. Pairs with zero survival are never admitted.
    """
    R, K = a.shape
    if budget <= 0:
        return torch.zeros(R, dtype=torch.long, device=a.device)
    flat = a.t().reshape(-1)  # position-major, so a stable sort breaks ties by position
    order = flat.sort(descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(0, order, torch.arange(R * K, device=a.device))
    admitted = (rank < budget) & (flat > 0)
    return admitted.view(K, R).sum(0)


class CostModel:
    """Step time against verified tokens T, profiled on the running device, forced monotone.

    `seconds(T)` interpolates linearly between measured sizes; beyond the last one it grows
    in proportion to T.
    """

    def __init__(self, sizes: list[int], seconds: list[float]):
        if len(sizes) != len(seconds) or not sizes:
            raise ValueError("CostModel needs one time per size")
        order = sorted(range(len(sizes)), key=sizes.__getitem__)
        self.sizes = [sizes[i] for i in order]
        # A larger verify batch never costs less: take the running maximum of noisy timings.
        self.times = [max(seconds[j] for j in order[: k + 1]) for k in range(len(order))]

    def seconds(self, T: int) -> float:
        s, t = self.sizes, self.times
        if T <= s[0]:
            return t[0]
        for (s0, t0), (s1, t1) in zip(zip(s, t), zip(s[1:], t[1:])):
            if T <= s1:
                return t0 + (t1 - t0) * (T - s0) / (s1 - s0)
        return t[-1] * T / s[-1]


def best_budget(n_rows: int, n_active: int, a_sorted: list[float], budgets: list[int], cost: CostModel) -> int:
    """DSpark's adaptive verification on the host: the budget B (from `budgets`) maximising
    expected tokens per second, (active + sum of the top-B survivals) / cost(rows + B).

    `a_sorted` are survivals from a step or two ago, largest first: the host never waits for
    this step's drafts, and B is fixed before they exist (which keeps sampling lossless)."""
    best, best_rate = 0, -1.0
    cum = [0.0]
    for a in a_sorted:
        cum.append(cum[-1] + a)
    for B in budgets:
        rate = (n_active + cum[min(B, len(cum) - 1)]) / cost.seconds(n_rows + B)
        if rate > best_rate + 1e-12:
            best, best_rate = B, rate
    return best
