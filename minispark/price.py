"""Allocation of the batch-wide verification budget: pure tensor functions, no model.

A chain's survival `a_j = prod_{i<=j} c_i` is the estimated chance that its draft token j is
accepted; verifying slot j is worth `a_j` expected tokens. The budget goes to the top pairs.
"""
from __future__ import annotations

import math
from statistics import NormalDist

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


def trusted(a: Tensor, trust: Tensor) -> Tensor:
    """Survival a [.., K] with every per-token estimate scaled by `trust` [..] (at most 1 each):
    a drafter whose tokens are accepted 0.9 times as often as it says is worth 0.9 less per
    token, compounding along its chain, not 0.9 less per chain."""
    return (per_token(a) * trust[..., None]).clamp(max=1.0).cumprod(-1)


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
    """Step time against verified tokens T, profiled on the running device, forced monotone,
    and the time of the Spark pass, which a step may run or skip (`spark` seconds); then
    corrected by the steps the engine times as it runs (`observe`).

    The profile interpolates linearly between measured sizes and goes on along the line through
    the first and last of them outside, never below proportional to T. Attention runs over a
    grid of R x (width + 1) queries however few are real, so a step's time also depends on its
    widest chain: each size was timed at some grid (`grids`), and a step over another grid
    costs `per_query` seconds a query more or less. (Without it one wide step, a single row
    copying 32 tokens among 16, taught the table that its size costs 2.5x what it costs at
    the usual width, and the next run kept to smaller budgets.)
    """

    LEARN = 0.3  # weight of each new timing in the running correction of its size

    def __init__(self, sizes: list[int], seconds: list[float], spark: float = 0.0,
                 grids: list[int] | None = None, per_query: float = 0.0):
        if len(sizes) != len(seconds) or not sizes or (grids is not None and len(grids) != len(sizes)):
            raise ValueError("CostModel needs one time (and one grid, if any) per size")
        self.spark, self.per_query = spark, per_query
        order = sorted(range(len(sizes)), key=sizes.__getitem__)
        self.sizes = [sizes[i] for i in order]
        self.times = monotone([seconds[i] for i in order])
        self.grids = None if grids is None else [grids[i] for i in order]
        self.drift: dict[tuple[int, bool], float] = {}  # (T, spark pass) -> log(measured / profiled)

    def seconds(self, T: int, spark_pass: bool = False, queries: int | None = None) -> float:
        """Expected time of a step verifying T tokens over a grid of `queries` (None: the grid
        the profile timed at T), with or without the Spark pass."""
        return self.profiled(T, spark_pass, queries) * math.exp(self.correction(T, spark_pass))

    def profiled(self, T: int, spark_pass: bool = False, queries: int | None = None) -> float:
        grid = 0.0
        if queries is not None and self.grids is not None:
            grid = self.per_query * (queries - self.grid(T))
        # Floored so that a slope timed on a noisy machine never makes a narrow step look free.
        return max(self.curve(T) + grid, 0.5 * self.curve(T)) + (self.spark if spark_pass else 0.0)

    def grid(self, T: int) -> float:
        """The query grid the profile timed at T (interpolated; the nearest end outside)."""
        s, g = self.sizes, self.grids
        for (s0, g0), (s1, g1) in zip(zip(s, g), zip(s[1:], g[1:])):
            if s0 <= T <= s1:
                return g0 + (g1 - g0) * (T - s0) / max(s1 - s0, 1)
        return g[0] if T < s[0] else g[-1]

    def curve(self, T: int) -> float:
        """The profiled step time without the Spark pass."""
        s, t = self.sizes, self.times
        if s[0] <= T <= s[-1]:
            for (s0, t0), (s1, t1) in zip(zip(s, t), zip(s[1:], t[1:])):
                if T <= s1:
                    return t0 + (t1 - t0) * (T - s0) / max(s1 - s0, 1)
            return t[-1]
        # Fewer rows than the profile's (T < s[0]) cost less; a flat t[0] there would make
        # their first drafts look free.
        slope = (t[-1] - t[0]) / (s[-1] - s[0]) if len(s) > 1 else 0.0
        edge = 0 if T < s[0] else -1
        return max(t[edge] + slope * (T - s[edge]), t[edge] * T / s[edge])

    def correction(self, T: int, spark_pass: bool) -> float:
        """log(measured / profiled) at this size, or at the nearest size timed (the same kind of
        step first, the larger size on a tie): the profile runs idle rows over a fixed cache
        prefix, and real steps differ from it by much the same factor at neighbouring sizes."""
        if not self.drift:
            return 0.0
        key = min(self.drift, key=lambda k: (k[1] != spark_pass, abs(k[0] - T), -k[0]))
        return self.drift[key]

    def observe(self, T: int, spark_pass: bool, seconds: float, queries: int | None = None) -> None:
        """Fold in the measured time of a step verifying T tokens over a grid of `queries`. A
        size's first timing starts from its neighbours' correction, so one outlier moves the
        table by LEARN of its error."""
        if not seconds > 0:
            return
        x = math.log(seconds / self.profiled(T, spark_pass, queries))
        prior = self.correction(T, spark_pass)
        self.drift[T, spark_pass] = prior + self.LEARN * (x - prior)

    def relax(self, spark_pass: bool, rate: float) -> None:
        """Move the corrections of one kind of step, not timed lately, by `rate` toward the other
        kind's at the nearest size (or toward the profile where that kind is not timed either):
        an old timing stands for a device and a load that may have changed since."""
        other_timed = any(k[1] != spark_pass for k in self.drift)
        for key in [k for k in self.drift if k[1] == spark_pass]:
            target = self.correction(key[0], not spark_pass) if other_timed else 0.0
            self.drift[key] += rate * (target - self.drift[key])


def monotone(times: list[float]) -> list[float]:
    """The nearest non-decreasing sequence in least squares (pool adjacent violators): a
    larger verify batch never costs less. A running maximum would lift every later size to one
    slow, noisy timing, and the flat it leaves would make the drafts along it look free."""
    blocks: list[list[float]] = []  # [mean, count]
    for t in times:
        blocks.append([t, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, n1), (m2, n2) = blocks.pop(-2), blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    return [m for m, n in blocks for _ in range(int(n))]


def best_budget(n_rows: int, n_active: int, a_sorted: list[float], budgets: list[int], cost: CostModel,
                spark_pass: bool = False, grids: list[int] | None = None) -> tuple[int, float]:
    """DSpark's adaptive verification on the host: the budget B (from `budgets`) maximising
    expected tokens per second, (active + sum of the top-B survivals) / cost(rows + B), with
    the Spark pass's time added when the step runs it and, where given, each budget's query
    grid (`grids`, one per budget). Returns B and that rate.

    `a_sorted` are survivals the host already holds, largest first: it never waits for a
    step's Spark drafts, and B is fixed before they are sampled (which keeps sampling lossless;
    n-gram proposals are a function of the history alone)."""
    best, best_rate = 0, -1.0
    cum = [0.0]
    for a in a_sorted:
        cum.append(cum[-1] + a)
    for i, B in enumerate(budgets):
        seconds = cost.seconds(n_rows + B, spark_pass, grids[i] if grids else None)
        rate = (n_active + cum[min(B, len(cum) - 1)]) / seconds
        if rate > best_rate + 1e-12:
            best, best_rate = B, rate
    return best, best_rate


def slowest_share(gain: list[float], worth: list[float], spread: list[float] | None = None) -> float:
    """The share of its rows' mean expected gain per step by which a run with no queue ends
    sooner. Such a run ends with its slowest row, so a step moves the end by what that row
    gains, and rows gain at different rates for long stretches (one keeps copying, another
    writes new text). Each row is taken to end the run with chance its worth (see
    LLM._worth), independently: the expected gain of the slowest is the worth-weighted
    minimum, rows ranked from the least gain up.

    Luck, too: rows that expect the same gain still draw different ones, and the row that ends
    the run is the one whose drafts fared worst. `spread` is each row's standard deviation of
    its mean gain per step over the steps left (`luck_spread`); the least of n rows that
    may end last falls below its expectation by about the largest of n standard normals,
    times that spread. A run that drafts nothing has no luck in it: every row makes one token
    a step."""
    spread = spread or [0.0] * len(gain)
    n = sum(w > 0 for w in worth)
    z = NormalDist().inv_cdf((n - 0.375) / (n + 0.25)) if n > 1 else 0.0  # Blom's expected maximum
    unlucky = [max(0.0, g - z * s) for g, s in zip(gain, spread)]
    rows = sorted((g, w) for g, w in zip(unlucky, worth) if w > 0)
    if not rows:
        return 1.0
    mean = sum(g * w for g, w in zip(gain, worth) if w > 0) / sum(w for _, w in rows)
    least, still = 0.0, 1.0  # still: the chance no lower-ranked row ends the run
    for g, w in rows:
        least += still * w * g
        still *= 1.0 - w
    least /= 1.0 - still  # given that some row ends the run
    return least / mean if mean > 0 else 1.0


def luck_spread(a: Tensor, steps: float) -> Tensor:
    """[..] the standard deviation of a row's mean accepted tokens per step over `steps` steps,
    each verifying a chain of survival a [.., K] drafted afresh. Its accepted length A counts
    the positions j whose tokens 1..j were all accepted: E[A] = sum_j a_j and
    E[A^2] = sum_j (2j - 1) a_j."""
    j = torch.arange(1, a.shape[-1] + 1, dtype=a.dtype, device=a.device)
    mean = a.sum(-1)
    var = ((2 * j - 1) * a).sum(-1) - mean ** 2
    return (var.clamp(min=0) / max(steps, 1.0)).sqrt()


def ranked(chains: list[list[float]]) -> tuple[list[float], list[int]]:
    """The survivals of every (row, position) pair of `chains` (ragged lists), largest first,
    and `reach[B]`, the longest chain that admitting the first B of them takes: the widest
    chain of a top-B admission, by `admit_top`'s rule (ties to the earlier position, zeros
    never admitted), for every B at once (a B past the last pair reads the last entry)."""
    pairs = sorted((-x, j) for chain in chains for j, x in enumerate(chain))
    reach, longest = [0], 0
    for x, j in pairs:
        longest = max(longest, j + 1) if x < 0 else longest
        reach.append(longest)
    return [-x for x, _ in pairs], reach


# ----------------------------------------------------------------------------- the price
# The Hybrid Spark paper's rule: a price `lam` per verified slot, each row taking the chain of
# larger net value. The step solves the same choice exactly (`choose_chains`, a knapsack) and
# calls none of the three below; they stay as the rule to read it against, and the tests check
# the knapsack by them.


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


def choose_chains(a_ngram: Tensor, a_spark: Tensor, budget: int) -> tuple[Tensor, Tensor]:
    """Each row takes its n-gram or its Spark chain (survivals [R, W]) so that the top-`budget`
    admission over the chosen chains expects the most accepted tokens; returns use_spark [R] and
    the chosen survival [R, W].

    Survival never increases along a chain, so the admission takes a prefix of each row, and the
    best choice is the best split of the budget into row lengths l_r, a row worth the larger of
    its chains' prefix sums at l_r: a knapsack over rows, solved exactly (a price threshold
    misses optima where two rows must switch together) in O(R * B * W), with fixed shapes.

    Why sampling stays lossless: both inputs are known before any draft token is sampled. The
    n-gram survival reads the history and how earlier proposals fared; Spark's is taken along
    its greedy path, which depends on the context alone (at temperature 0 the two paths are the
    same). So the chain chosen and the admitted length are independent of this step's sampled
    tokens, and each verified token then goes through rejection sampling against the target,
    which leaves every emitted token distributed exactly as the target's."""
    R, W = a_ngram.shape
    B = min(max(budget, 0), R * W)  # slots past the last pair buy nothing
    zero = a_ngram.new_zeros(R, 1)
    s_ng = torch.cat([zero, a_ngram.cumsum(-1)], -1)  # [R, W+1], s[:, l]: the first l tokens
    s_sp = torch.cat([zero, a_spark.cumsum(-1)], -1)  # [R, W+1]
    # B is static: a step that verifies no drafts skips the search (0.4 ms at R = 16 on a CPU)
    length = best_lengths(torch.maximum(s_ng, s_sp), B) if B else zero[:, 0].long()
    sp, ng = s_sp.gather(1, length[:, None])[:, 0], s_ng.gather(1, length[:, None])[:, 0]  # [R]
    # Ties (and rows given nothing) go to the chain with the likelier first token ([:, :1] also
    # holds for empty chains).
    use_spark = (sp > ng) | ((sp == ng) & (a_spark[:, :1].sum(-1) >= a_ngram[:, :1].sum(-1)))
    return use_spark, torch.where(use_spark[:, None], a_spark, a_ngram)


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


# ----------------------------------------------------------------------------- n-gram calibration

# The table's first index: how the slot's previous n-gram proposal fared against the tokens the
# step then emitted. A copy that agreed with everything is likely right again (code edits); one
# that was wrong from its first token is likely wrong again (free text).
NO_PROPOSAL, WRONG, PARTIAL, RIGHT = 0, 1, 2, 3


def leading_agreement(proposal: Tensor, valid: Tensor, out: Tensor, n_out: Tensor) -> tuple[Tensor, Tensor]:
    """Positions [R, W] where both the proposal (first `valid`) and the emitted tokens (first
    `n_out`) exist, and how many leading ones agree [R]."""
    W = min(proposal.shape[1], out.shape[1])
    col = torch.arange(W, device=out.device)[None, :]
    covered = torch.minimum(n_out, valid)[:, None] > col
    return covered, ((proposal[:, :W] == out[:, :W]) & covered).long().cumprod(-1).sum(-1)


def ngram_outcome(proposal: Tensor, valid: Tensor, out: Tensor, n_out: Tensor, last: Tensor) -> Tensor:
    """The new state [R] of each row: NO_PROPOSAL; WRONG when the proposal's first token is not
    the first token emitted; RIGHT when it agrees with every emitted token it covers; PARTIAL
    between. Rows that emitted nothing keep `last`."""
    _, agree = leading_agreement(proposal, valid, out, n_out)
    state = torch.where(agree == 0, WRONG, torch.where(agree >= torch.minimum(n_out, valid), RIGHT, PARTIAL))
    state = torch.where(valid > 0, state, NO_PROPOSAL)
    return torch.where(n_out > 0, state, last)


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


def default_ngram_table(n_max: int, k: int) -> Tensor:
    """[4, n_max + 1, k] guesses for models without a fitted table: the first copied token is
    uncertain, later ones (after an accepted one) mostly right, more so after a right copy."""
    first = torch.tensor([0.3, 0.15, 0.5, 0.7])[:, None, None]
    rest = torch.tensor([0.75, 0.6, 0.8, 0.9])[:, None, None]
    col = torch.arange(k)[None, None, :]
    return torch.where(col == 0, first, rest).expand(4, n_max + 1, k).clone()


def fit_table_width(table: Tensor, k: int) -> Tensor:
    """The table cut or extended (repeating its last position) to chains of k tokens."""
    if table.shape[-1] >= k:
        return table[..., :k].contiguous()
    return torch.cat([table, table[..., -1:].expand(*table.shape[:-1], k - table.shape[-1])], -1)
