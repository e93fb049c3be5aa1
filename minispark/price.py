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
