"""The host planner: the static sizes of each step, from what the host already knows.

DSpark's adaptive verification picks the verify budget B that maximises expected tokens per
second, (rows + sum of the top-B survivals) / step_time(rows + B), from a cost table profiled on
this device, over estimates of finished steps (so B is fixed before a step's drafts exist). The
same search decides whether each costly drafter's pass (Spark's) pays for its time. Each
refinement beyond that rule is a named piece of `Pieces`, switchable for the ablation in
docs/planner.md (`python -m minispark.bench --ablate`).
"""
from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, fields
from statistics import NormalDist
from typing import NamedTuple, Sequence

import torch
from torch import Tensor

from .model import KV_BLOCK
from .price import per_token

BUDGETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
WIDTHS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256)
ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
TRUST_PRIOR, TRUST_DECAY = 4.0, 0.98  # expected tokens of prior agreement; decay per observed chain
GAIN_DECAY = 0.9  # per step: a row's gain remembers its last ten or so chains
TYPICAL_DECAY = 0.9  # per pass: a drafter's typical chain remembers its last ten or so passes
PATIENCE, RELAX = 32, 0.02  # steps without a costly pass, then per step back toward the prior
WORTH_HORIZON = 8  # tokens of margin over which a row that will be done in time loses its worth


@dataclass(frozen=True)
class Pieces:
    """The planner's refinements beyond DSpark's rule, each switchable on its own."""
    # Estimates are calibrated on training text; a workload unlike it makes them optimistic or
    # pessimistic. Each drafter's per-token estimates are scaled by accepted / expected lately.
    trust: bool = True
    # Only a pass renews a costly drafter's trust: after PATIENCE steps without one, trust and
    # the cost correction drift back toward the prior, so a drafter written off is tried again.
    relax: bool = True
    # With no queue the run ends with its slowest row: a token of a row sure to be done in time
    # only idles that row sooner, while its drafts cost every row's step.
    worth: bool = True
    # With no queue a drafted token shortens the run by the share the slowest row gains, luck
    # included (the row whose drafts fare worst ends the run).
    slowest: bool = True
    # A skipped pass leaves a slot's estimates from a context that has moved on; planning on the
    # drafter's typical chain instead keeps one low estimate from skipping every later pass.
    typical: bool = True
    # Attention runs over an R x (width + 1) query grid however few queries are real: a step
    # costs its grid too, not only its tokens.
    grid: bool = True
    # The profile times idle rows over a fixed prefix; real steps differ by a factor that the
    # table learns from the steps it times.
    drift: bool = True

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


class Plan(NamedTuple):
    """The static sizes of one step."""
    budget: int  # draft tokens verified, batch-wide
    width: int  # the longest chain
    ctx: int  # attended cache prefix
    runs: tuple[bool, ...]  # which drafters draft


class Row(NamedTuple):
    """What the planner knows of a live row's request."""
    left: int  # tokens it may still write
    pace: float  # tokens per step so far
    known: int  # tokens the host has seen (prompt and output)


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def bucket(x: int, sizes: Sequence[int]) -> int:
    """The smallest size >= x (the last size when none is)."""
    return next((s for s in sizes if s >= x), sizes[-1])


def chain_width(K: int, budget: int, n_live: int) -> int:
    """The longest chain of a step: twice a fair share of the budget (at least 8), rounded up to
    a width bucket, so that attention over the R x (width + 1) grid does not grow as R x budget."""
    return min(K, bucket(min(budget, max(8, 2 * budget // max(n_live, 1))), WIDTHS))


# ----------------------------------------------------------------------------- the cost table


class CostModel:
    """Step time against verified tokens T, profiled on the running device and forced monotone,
    plus each costly drafter's pass (`passes`, seconds by drafter name); corrected by the steps
    the engine times as it runs (`observe`). Between measured sizes it interpolates, outside it
    goes on along the line through the first and last, never below proportional to T. Each size
    was timed at a query grid (`grids`); another grid costs `per_query` seconds a query."""

    LEARN = 0.3  # weight of each new timing in the running correction of its size

    def __init__(self, sizes: list[int], seconds: list[float], passes: dict[str, float] | None = None,
                 grids: list[int] | None = None, per_query: float = 0.0):
        if len(sizes) != len(seconds) or not sizes or (grids is not None and len(grids) != len(sizes)):
            raise ValueError("CostModel needs one time (and one grid, if any) per size")
        self.passes, self.per_query = dict(passes or {}), per_query
        order = sorted(range(len(sizes)), key=sizes.__getitem__)
        self.sizes = [sizes[i] for i in order]
        self.times = monotone([seconds[i] for i in order])
        self.grids = None if grids is None else [grids[i] for i in order]
        self.drift: dict[tuple[int, tuple[str, ...]], float] = {}  # (T, passes run) -> log(measured / profiled)

    def seconds(self, T: int, passes: tuple[str, ...] = (), queries: int | None = None) -> float:
        """Expected time of a step verifying T tokens over `queries` grid cells (None: the grid the
        profile timed at T), running the passes of the drafters named."""
        return self.profiled(T, passes, queries) * math.exp(self.correction(T, passes))

    def profiled(self, T: int, passes: tuple[str, ...] = (), queries: int | None = None) -> float:
        grid = 0.0
        if queries is not None and self.grids is not None:
            grid = self.per_query * (queries - interpolate(T, self.sizes, self.grids))
        # Floored so that a slope timed on a noisy machine never makes a narrow step look free.
        return max(self.curve(T) + grid, 0.5 * self.curve(T)) + sum(self.passes.get(p, 0.0) for p in passes)

    def curve(self, T: int) -> float:
        """The profiled step time without a costly pass."""
        s, t = self.sizes, self.times
        if s[0] <= T <= s[-1]:
            return interpolate(T, s, t)
        # Fewer rows than the profile's cost less: a flat t[0] would make their drafts look free.
        slope = (t[-1] - t[0]) / (s[-1] - s[0]) if len(s) > 1 else 0.0
        edge = 0 if T < s[0] else -1
        return max(t[edge] + slope * (T - s[edge]), t[edge] * T / s[edge])

    def correction(self, T: int, passes: tuple[str, ...]) -> float:
        """log(measured / profiled) at the nearest size timed, the same kind of step first."""
        if not self.drift:
            return 0.0
        key = min(self.drift, key=lambda k: (k[1] != passes, abs(k[0] - T), -k[0]))
        return self.drift[key]

    def observe(self, T: int, passes: tuple[str, ...], seconds: float, queries: int | None = None) -> None:
        """Fold in a timed step; a size's first timing starts from its neighbours' correction,
        so one outlier moves the table by LEARN of its error."""
        if not seconds > 0:
            return
        x = math.log(seconds / self.profiled(T, passes, queries))
        prior = self.correction(T, passes)
        self.drift[T, passes] = prior + self.LEARN * (x - prior)

    def relax(self, passes: tuple[str, ...], rate: float) -> None:
        """Move the corrections of one kind of step, not timed lately, by `rate` toward the other
        kinds' at the nearest size (toward the profile where none is timed)."""
        others = [k for k in self.drift if k[1] != passes]
        for key in [k for k in self.drift if k[1] == passes]:
            target = self.drift[min(others, key=lambda k: (abs(k[0] - key[0]), -k[0]))] if others else 0.0
            self.drift[key] += rate * (target - self.drift[key])


def interpolate(x: float, xs: list[int], ys: list[float]) -> float:
    """Piecewise linear through (xs, ys), flat outside."""
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x0 <= x <= x1:
            return y0 + (y1 - y0) * (x - x0) / max(x1 - x0, 1)
    return ys[0] if x < xs[0] else ys[-1]


def monotone(times: list[float]) -> list[float]:
    """The nearest non-decreasing sequence in least squares (pool adjacent violators): a larger
    verify batch never costs less, and one slow timing lifts only its neighbourhood."""
    blocks: list[list[float]] = []  # [mean, count]
    for t in times:
        blocks.append([t, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, n1), (m2, n2) = blocks.pop(-2), blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    return [m for m, n in blocks for _ in range(int(n))]


@torch.no_grad()
def profile(engine, budgets: Sequence[int], repeats: int = 5) -> CostModel:
    """Time whole steps of all S rows, every slot idle (all tokens padding): each budget with no
    costly pass, each costly drafter's pass alone, and the largest budget over the narrowest
    and widest query grid. All rows take part, as in a full batch: attention over the grid
    grows with the rows."""
    from .weights import progress

    S, K, drafters = engine.S, engine.K, engine.drafters
    cheap = tuple(not d.costly for d in drafters)
    active = engine.active.clone()
    engine.active.zero_()

    def width(B: int) -> int:
        return min(chain_width(K, B, S), B)  # as `Engine.step` clamps it

    def seconds(B: int, extra: int, W: int) -> float:
        runs = tuple(c or i == extra for i, c in enumerate(cheap))
        start = time.perf_counter()
        engine.step(S, B, W, min(engine.L, 512), False, runs).n.cpu()
        return time.perf_counter() - start  # .cpu() waits for the device

    top, costly = max(budgets), [i for i, d in enumerate(drafters) if d.costly]
    widest = min(K, top)
    kinds = ([(B, -1, width(B)) for B in budgets] + [(0, i, 0) for i in costly]
             + ([(top, -1, 1), (top, -1, widest)] if top > 1 else []))
    try:
        best = dict.fromkeys(kinds, float("inf"))
        for kind in best:
            seconds(*kind)  # warm-up
        # Rounds over all kinds, the fastest of each kept: a slow spell falls on one round of
        # every size rather than on every round of one.
        for _ in progress(range(repeats), "timing steps for the cost table"):
            for kind in best:
                best[kind] = min(best[kind], seconds(*kind))
    finally:
        engine.active.copy_(active)
    passes = {drafters[i].name: max(best[0, i, 0] - best[0, -1, 0], 0.0) for i in costly}
    per_query = 0.0
    if widest > 1:
        per_query = max(best[top, -1, widest] - best[top, -1, 1], 0.0) / (S * (widest - 1))
    return CostModel([S + B for B in budgets], [best[B, -1, width(B)] for B in budgets], passes=passes,
                     grids=[S * (width(B) + 1) for B in budgets], per_query=per_query)


# ----------------------------------------------------------------------------- pure pieces


def best_budget(n_rows: int, n_active: float, a_sorted: list[float], budgets: list[int], cost: CostModel,
                passes: tuple[str, ...] = (), grids: list[int] | None = None) -> tuple[int, float]:
    """DSpark's adaptive verification: the budget B maximising (active + the top-B survivals) /
    cost(rows + B), each budget over its query grid where `grids` gives one. Returns B and the rate."""
    best, best_rate = 0, -1.0
    cum = [0.0, *itertools.accumulate(a_sorted)]
    for i, B in enumerate(budgets):
        rate = (n_active + cum[min(B, len(cum) - 1)]) / cost.seconds(n_rows + B, passes, grids[i] if grids else None)
        if rate > best_rate + 1e-12:
            best, best_rate = B, rate
    return best, best_rate


def ranked(chains: list[list[float]]) -> tuple[list[float], list[int]]:
    """Every (row, position) survival of `chains`, largest first, and reach[B]: the longest chain
    admitting the first B takes, by `admit_top`'s rule (ties to the earlier position, zeros never)."""
    pairs = sorted((-x, j) for chain in chains for j, x in enumerate(chain))
    reach, longest = [0], 0
    for x, j in pairs:
        longest = max(longest, j + 1) if x < 0 else longest
        reach.append(longest)
    return [-x for x, _ in pairs], reach


def trusted(a: Tensor, trust: Tensor) -> Tensor:
    """Survival a [.., K] with every per-token estimate scaled by `trust` [..]: an error
    compounds along a chain as it does in the chain's survival."""
    return (per_token(a) * trust[..., None]).clamp(max=1.0).cumprod(-1)


def slowest_share(gain: list[float], worth: list[float], spread: list[float] | None = None) -> float:
    """The share of its rows' mean gain per step by which a run with no queue ends sooner: the
    worth-weighted expected gain of the slowest row, each row taken to end the run with chance
    its worth, and the least of n rows below its mean by about the largest of n standard
    normals times its `spread` (`luck_spread`)."""
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
    """[..] standard deviation of a row's mean accepted tokens per step over `steps` steps of
    chains of survival a [.., K]: E[A] = sum_j a_j and E[A^2] = sum_j (2j - 1) a_j."""
    j = torch.arange(1, a.shape[-1] + 1, dtype=a.dtype, device=a.device)
    mean = a.sum(-1)
    var = ((2 * j - 1) * a).sum(-1) - mean ** 2
    return (var.clamp(min=0) / max(steps, 1.0)).sqrt()


# ----------------------------------------------------------------------------- the planner


class Planner:
    """Per-slot estimates and per-drafter trust, kept on the host from finished steps."""

    def __init__(self, names: list[str], costly: list[bool], K: int, S: int, L: int, budgets: list[int],
                 cost: CostModel | None, learn: bool, adaptive: bool = True, pieces: Pieces = Pieces()):
        self.names, self.costly, self.K, self.S, self.L = names, costly, K, S, L
        self.budgets, self.cost, self.learn, self.adaptive, self.pieces = budgets, cost, learn, adaptive, pieces
        self.est: list[list[list[float]]] = [[[] for _ in names] for _ in range(S)]  # per slot, per drafter
        self.gain: list[float | None] = [None] * S  # per slot: decayed promise of its best chains
        self.seen = [[TRUST_PRIOR, TRUST_PRIOR] for _ in names]  # per drafter: decayed expected, accepted
        self.typical: list[list[float] | None] = [None for _ in names]  # per costly drafter
        self.quiet = [0 for _ in names]  # steps since each costly drafter's last pass

    def reset(self, slot: int) -> None:
        self.gain[slot] = None

    def move(self, src: int, dst: int) -> None:
        self.est[dst], self.est[src] = self.est[src], [[] for _ in self.names]
        self.gain[dst], self.gain[src] = self.gain[src], None

    def trust(self, i: int) -> float:
        """Accepted over expected tokens of drafter i's recent chains, at the positions they
        reached; it reads finished steps only, so like the budget it is fixed before a step's
        drafts exist."""
        expected, accepted = self.seen[i]
        return accepted / expected if self.pieces.trust else 1.0

    def plan(self, R: int, slots: list[int], rows: list[Row], queued: bool, unseen: int = 0) -> Plan:
        """Whether each costly drafter drafts, the budget, the longest chain and the attended
        prefix of the next step over rows [0, R), live `slots` holding requests `rows`."""
        N, K = len(self.names), self.K
        worth = [1.0] * len(slots)
        if not K:
            budget, width, runs = 0, 0, ()
        elif not self.adaptive:  # the fixed baseline: every row verifies its whole chain
            budget, width, runs = R * K, K, (True,) * N
        else:
            worth = self.worth(rows, queued)
            budget, width, runs = self.search(R, slots, rows, worth, queued)
        by_slot = dict(zip(slots, worth))
        self.worths = [by_slot.get(i, 0.0) for i in range(R)]
        # A step writes up to what the host knows, plus a step in flight, plus the chain: every
        # row's attention reads the whole prefix, so it is no longer than that.
        ctx = min(self.L, round_up(max(r.known for r in rows) + unseen + width + 1, KV_BLOCK))
        return Plan(budget, width, ctx, runs)

    def search(self, R: int, slots: list[int], rows: list[Row], worth: list[float],
               queued: bool) -> tuple[int, int, tuple[bool, ...]]:
        """DSpark's rule for every choice of costly passes: each row offers its best chain among
        the drafters that run, scaled by trust, worth and the slowest row's share."""
        N, K = len(self.names), self.K
        est = torch.tensor([[e if len(e) == K else [0.0] * K for e in self.est[s]] for s in slots])  # [n, N, K]
        a = trusted(est, torch.tensor([self.trust(i) for i in range(N)]))
        best = a[torch.arange(len(slots)), a.sum(-1).argmax(-1)]  # [n, K]
        share = self.slowest_share(slots, rows, best, worth, queued)
        scaled = (a * (torch.tensor(worth) * share)[:, None, None]).tolist()
        costly = [i for i in range(N) if self.costly[i]]
        plan, rate = (0, 0, tuple(not c for c in self.costly)), -1.0
        for on in itertools.product((False, True), repeat=len(costly)):
            runs = tuple(not self.costly[i] or on[costly.index(i)] for i in range(N))
            passes = tuple(self.names[i] for i in costly if runs[i])
            drafting = [i for i in range(N) if runs[i]]
            for W, group in itertools.groupby(self.budgets, lambda B: chain_width(K, B, len(slots))):
                # A budget is worth the pairs within the step's widest chain only.
                chains = [max((c[i][:W] for i in drafting), key=sum) if drafting else [] for c in scaled]
                a_sorted, reach = ranked(chains)
                group = list(group)
                widths = [min(W, B, bucket(reach[min(B, len(reach) - 1)], WIDTHS)) for B in group]
                grids = [R * (w + 1) for w in widths] if self.pieces.grid else None
                B, r = best_budget(R, sum(worth), a_sorted, group, self.cost, passes, grids)
                if r > rate:
                    plan, rate = (B, widths[group.index(B)], runs), r
        budget, width, runs = plan
        return (budget if width else 0), width, runs

    def worth(self, rows: list[Row], queued: bool) -> list[float]:
        """What one more token of each row is worth, in [0, 1]: 1 while requests wait (a slot
        that finishes early takes the next one); with none waiting, falling from 1 to 0 as a row's
        margin of being done in time anyway (at one token per step) grows to WORTH_HORIZON."""
        if queued or not self.pieces.worth:
            return [1.0] * len(rows)
        steps = self.steps_left(rows)
        return [min(1.0, max(0.0, 1.0 - (steps - r.left) / WORTH_HORIZON)) for r in rows]

    @staticmethod
    def steps_left(rows: list[Row]) -> float:
        """The steps the run is expected to take: every row at its pace so far."""
        return max((r.left / max(r.pace, 1.0) for r in rows), default=0.0)

    def slowest_share(self, slots: list[int], rows: list[Row], best: Tensor, worth: list[float],
                      queued: bool) -> float:
        """How much of a drafted token shortens the run (`slowest_share`): a row's gain is what
        its best chains promised lately (decayed over GAIN_DECAY steps): a row copying code pauses
        at each edit and resumes; a row writing new text seldom copies at all."""
        for s, g in zip(slots, best.sum(-1).tolist()):
            last = self.gain[s]
            self.gain[s] = g if last is None else GAIN_DECAY * last + (1 - GAIN_DECAY) * g
        if queued or not self.pieces.slowest:
            return 1.0
        spread = luck_spread(best, self.steps_left(rows)).tolist()
        return slowest_share([self.gain[s] for s in slots], worth, spread)

    def observe(self, out, where: list[int | None], runs: tuple[bool, ...], counted: bool = True) -> None:
        """Read a finished step (host copies of its StepOut): each slot's estimates for the next
        plan, and how far each drafter's estimates were borne out. `where`: the slot each row's
        request holds now (None: no request); `counted`: False for a prefill's guesses."""
        n, n_draft, source, length = (out.n.tolist(), out.n_draft.tolist(), out.source.tolist(),
                                      out.length.tolist())
        est, seen, per_tok = out.est.tolist(), out.seen.tolist(), per_token(out.survival).tolist()
        live = [i for i, s in enumerate(where) if s is not None]
        for j, costly in enumerate(self.costly):
            if not (counted and costly):
                continue
            if runs[j] and live:
                mean = torch.tensor([est[i][j] for i in live]).mean(0).tolist()
                last = self.typical[j]
                self.typical[j] = mean if last is None else [TYPICAL_DECAY * x + (1 - TYPICAL_DECAY) * y
                                                             for x, y in zip(last, mean)]
            self.relax(j, runs[j])
        for i in live:
            s = where[i]
            for j in range(len(self.names)):
                if runs[j] or not self.costly[j]:
                    self.est[s][j] = est[i][j]
                elif self.pieces.typical and self.typical[j] is not None:
                    self.est[s][j] = self.typical[j]
            if not counted or n[i] == 0:
                continue
            verified = source[i] if length[i] > 0 else None
            if verified is not None:  # the positions reached: the accepted ones and the first rejected
                self.record(verified, sum(per_tok[i][: min(n_draft[i] + 1, length[i])]), n_draft[i])
            for j in range(len(self.names)):
                if j != verified and seen[i][j][0] > 0:  # a chain not verified, checked for free
                    self.record(j, *seen[i][j])

    def record(self, i: int, expected: float, accepted: float) -> None:
        seen = self.seen[i]
        seen[0] = TRUST_DECAY * seen[0] + expected
        seen[1] = TRUST_DECAY * seen[1] + accepted

    def relax(self, i: int, ran: bool) -> None:
        """After PATIENCE steps without drafter i's pass, move its trust and the cost correction
        of steps with its pass back toward where the run started, by RELAX a step."""
        self.quiet[i] = 0 if ran else self.quiet[i] + 1
        if self.quiet[i] <= PATIENCE or not self.pieces.relax:
            return
        self.seen[i] = [x + RELAX * (TRUST_PRIOR - x) for x in self.seen[i]]
        if self.learn and self.pieces.drift:
            self.cost.relax((self.names[i],), RELAX)

    def timed(self, R: int, plan: Plan, seconds: float) -> None:
        """Teach the cost table a step's measured time."""
        if self.learn and self.pieces.drift:
            passes = tuple(nm for nm, c, r in zip(self.names, self.costly, plan.runs) if c and r)
            self.cost.observe(R + plan.budget, passes, seconds, R * (plan.width + 1))
