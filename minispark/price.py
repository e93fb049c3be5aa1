"""Allocation of the batch-wide verification budget: pure tensor functions, no model.

A chain's survival `a_j = prod_{i<=j} c_i` is the estimated chance that its draft token j is
accepted; verifying slot j is worth `a_j` expected tokens. Each row takes one drafter's chain,
and the budget goes to the pairs (row, slot) worth most.

Why sampling stays lossless. A decision to verify slot j may depend on the sampled draft tokens
only up to slot j - 1. Here every input is known before any draft token is sampled: the budget
is the host's, from finished steps; model-free survival reads the history and how earlier
proposals fared; a sampling drafter's conf is taken along its greedy path, which depends on
the context alone (at temperature 0 the two paths are the same). So the chain chosen and the
admitted length are independent of this step's sampled tokens, and each verified token then
goes through rejection sampling against the target (`verify`), which leaves every emitted token
distributed exactly as the target's. Survival never increases along a chain (c <= 1) and ties
go to the earlier position, so what a row admits is a prefix of its chain.
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


def per_token(a: Tensor) -> Tensor:
    """The per-token estimates c [.., K] behind survival a = cumprod(c): c_j = a_j / a_{j-1},
    0 past the chain's end."""
    prev = torch.cat([torch.ones_like(a[..., :1]), a[..., :-1]], dim=-1)
    return torch.where(prev > 0, a / torch.where(prev > 0, prev, 1.0), 0.0)


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


def choose_chains(a: Tensor, budget: int) -> Tensor:
    """The drafter [R] whose chain each row takes, among survivals a [R, N, W] of N drafters,
    so that the top-`budget` admission over the chosen chains expects the most accepted tokens.

    The admission takes a prefix of each row, so the best choice is the best split of the
    budget into row lengths l_r, a row worth the largest of its chains' prefix sums at l_r: a
    knapsack over rows, solved exactly (a price threshold misses optima where two rows must
    switch together) in O(R * B * W), with fixed shapes. Ties (and rows given nothing) go to the
    chain with the likelier first token, then to the later drafter."""
    R, N, W = a.shape
    B = min(max(budget, 0), R * W)  # slots past the last pair buy nothing
    s = torch.cat([a.new_zeros(R, N, 1), a.cumsum(-1)], -1)  # [R, N, W+1], s[..., l]: the first l tokens
    # B is static: a step that verifies no drafts skips the search
    length = best_lengths(s.amax(1), B) if B else torch.zeros(R, dtype=torch.long, device=a.device)
    at = s.gather(2, length[:, None, None].expand(R, N, 1))[..., 0]  # [R, N]
    first = torch.where(at == at.amax(1, keepdim=True), a[..., :1].sum(-1), -1.0)  # [:1]: empty chains too
    return N - 1 - first.flip(1).argmax(1)  # the last of the maxima


def best_lengths(worth: Tensor, budget: int) -> Tensor:
    """Row lengths [R] within `budget` that maximise sum_r worth[r, l_r], worth [R, W+1] being
    each row's value for its first l tokens: a DP over rows with fixed shapes, walked back on
    the device."""
    R, W = worth.shape[0], worth.shape[1] - 1
    dev = worth.device
    worth = worth.flip(-1)  # column k: a row given W - k slots
    best = worth.new_zeros(budget + 1)  # [B+1]: the rows so far within b slots (l = 0 always fits)
    pad = worth.new_full((W,), float("-inf"))  # b - l < 0 slots left: infeasible
    take = []  # R x [B+1]: each row's best length for each budget left to it
    for r in range(R):  # R is static: the loop unrolls into the graph
        # window b, column k holds best[b - W + k], what the earlier rows make of b - l slots
        value = torch.cat([pad, best]).unfold(0, W + 1, 1) + worth[r]  # [B+1, W+1]
        # amax and argmax, not max(-1): on CPU max(dim) goes parallel however small, ms on busy cores
        best = value.amax(-1)  # [B+1]
        take.append(W - value.argmax(-1))  # [B+1]
    # Walk back from the last row with the whole budget; gathers keep it on the device.
    length = torch.zeros(R, dtype=torch.long, device=dev)  # [R]
    left = torch.full((1,), budget, dtype=torch.long, device=dev)  # [1]
    for r in reversed(range(R)):
        length[r:r + 1] = take[r].gather(0, left)
        left = left - length[r:r + 1]
    return length


def leading_agreement(proposal: Tensor, valid: Tensor, out: Tensor, n_out: Tensor) -> tuple[Tensor, Tensor]:
    """Positions [R, W] where both the proposal (first `valid`) and the emitted tokens (first
    `n_out`) exist, and how many leading ones agree [R]."""
    W = min(proposal.shape[1], out.shape[1])
    col = torch.arange(W, device=out.device)[None, :]
    covered = torch.minimum(n_out, valid)[:, None] > col
    return covered, ((proposal[:, :W] == out[:, :W]) & covered).long().cumprod(-1).sum(-1)


def proposal_outcome(proposal: Tensor, a: Tensor, valid: Tensor, out: Tensor, n_out: Tensor) -> Tensor:
    """[R, 2] for each row's proposal (survival a [R, K]), over the positions the emitted tokens
    out [R, Q] (first n_out valid) reach (cover, every earlier one agreeing): the sum of their
    per-token estimates and how many agreed. Emitted tokens check a copy whether or not it was
    verified (an n-gram token is accepted exactly when it equals the target's token)."""
    covered, agree = leading_agreement(proposal, valid, out, n_out)
    col = torch.arange(covered.shape[1], device=out.device)[None, :]
    reached = covered & (col <= agree[:, None])
    expected = torch.where(reached, per_token(a)[:, : covered.shape[1]], 0.0).sum(-1)
    return torch.stack([expected, agree.to(expected.dtype)], dim=-1)


# ----------------------------------------------------------------------------- the price
# The Hybrid Spark paper's rule: a price `lam` per verified slot, each row taking the chain of
# larger net value. `choose_chains` solves the same choice exactly; these three are the rule
# to read it against, and the tests check the knapsack by them.


def price_of(a: Tensor, budget: int) -> Tensor:
    """lam: the survival of the last pair the top-`budget` admission takes (0 when fewer pairs
    than that have any chance): the goodput one more verified slot earns elsewhere."""
    if budget <= 0:
        return a.new_tensor(float("inf"))
    flat = a.flatten()
    if budget > flat.numel():
        return a.new_tensor(0.0)
    return flat.topk(budget).values[-1]


def net_value(a: Tensor, lam: Tensor) -> Tensor:
    """max_l sum_{j<=l} (a_j - lam) per row [R]: survival never increases along a chain, so the
    best l stops where a_j falls below the price."""
    return (a - lam).clamp(min=0).sum(-1)


def admitted_value(a: Tensor, budget: int) -> Tensor:
    """Expected accepted draft tokens of the top-`budget` admission over chains a [R, W]."""
    flat = a.flatten()
    return flat.topk(min(max(budget, 0), flat.numel())).values.sum()
