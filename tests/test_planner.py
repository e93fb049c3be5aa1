"""The host planner's pure pieces: the cost table, DSpark's budget choice, trust, and the
slowest row's share."""
from __future__ import annotations

import math

import pytest
import torch

from minispark.planner import ranked
from minispark.price import admit_top, survival


def test_best_budget_pays_for_the_spark_pass():
    from minispark.planner import CostModel, best_budget

    cost = CostModel([1, 9], [1.0, 1.2], passes={"spark": 0.5})
    a = [0.9, 0.8, 0.01]
    B, rate = best_budget(1, 1, a, [0, 1, 2, 3, 8], cost)
    assert B == 2 and abs(rate - (1 + 1.7) / 1.05) < 1e-9  # the third slot costs more than it earns
    B2, rate2 = best_budget(1, 1, a, [0, 1, 2, 3, 8], cost, passes=("spark",))
    assert B2 == 2 and abs(rate2 - (1 + 1.7) / (1.05 + 0.5)) < 1e-9
    # Nothing worth verifying: no budget, and the pass only costs.
    assert best_budget(1, 1, [], [0, 1, 2], cost) == (0, 1.0)
    assert best_budget(1, 1, [], [0, 1, 2], cost, passes=("spark",))[1] < 1.0


def test_the_widest_chain_the_host_plans_for_matches_the_device_admission():
    def longest(chains, budget):  # the widest chain of a top-`budget` admission, by `ranked`
        reach = ranked(chains)[1]
        return reach[min(budget, len(reach) - 1)]

    torch.manual_seed(0)
    for _ in range(50):
        a = survival(torch.rand(5, 8), torch.randint(0, 9, (5,)))
        chains = a.tolist()
        values = ranked(chains)[0]
        assert values == sorted(a.flatten().tolist(), reverse=True)
        for budget in (0, 1, 3, 7, 40):
            assert longest(chains, budget) == int(admit_top(a, budget).max())
    # One likely token in each of four rows is a width of 1, whatever the budget's fair share.
    assert longest([[0.6, 0.1], [0.5, 0.1], [0.7, 0.2], [0.4, 0.05]], 4) == 1
    # The host's chains are ragged (a row without a chain has none); ties go to earlier positions.
    assert longest([[0.5, 0.5, 0.5], [], [0.5]], 3) == 2
    assert longest([[], []], 4) == 0 and longest([], 4) == 0 and ranked([]) == ([], [0])


def test_the_cost_table_pools_noisy_timings_into_a_monotone_one():
    from minispark.planner import CostModel, monotone

    # One slow timing at T=5 must not lift the larger sizes to it (a running maximum would
    # make T=5..12 cost the same, and the tokens along that flat look free).
    cost = CostModel([4, 5, 6, 8, 12], [80.0, 100.0, 84.0, 88.0, 96.0])
    t = cost.times
    assert all(x <= y for x, y in zip(t, t[1:]))
    assert t[-1] == 96.0 and t[-2] < t[-1] and t[0] < t[1]
    assert sum((a - b) ** 2 for a, b in zip(t, [80.0, 272 / 3, 272 / 3, 272 / 3, 96.0])) < 1e-9  # least squares
    assert monotone([3.0, 2.0, 1.0]) == [2.0, 2.0, 2.0]
    # Fewer rows than profiled cost less, along the line through the ends, never below T/s0.
    assert cost.seconds(2) < cost.seconds(3) < cost.seconds(4) == 80.0
    assert abs(cost.seconds(2) - (80.0 - 2 * 2.0)) < 1e-9
    assert cost.seconds(24) > cost.seconds(12) and abs(cost.seconds(24) - 192.0) < 1e-9
    assert abs(cost.seconds(7) - 272 / 3) < 1e-9  # interpolated, on the pooled stretch


def test_the_cost_table_learns_from_the_steps_it_times():
    from minispark.planner import CostModel, best_budget

    cost = CostModel([16, 17, 32], [1.0, 1.02, 1.5], passes={"spark": 0.5})
    assert cost.seconds(17) == cost.profiled(17)  # nothing timed yet
    # Real steps of 17 tokens take 1.5x the profile: repeated timings converge on it,
    # one timing moves the table by a fraction of its error, and neighbouring sizes follow.
    cost.observe(17, (), 1.53)
    assert abs(cost.seconds(17) - 1.02 * 1.5 ** CostModel.LEARN) < 1e-9
    for _ in range(30):
        cost.observe(17, (), 1.53)
    assert abs(cost.seconds(17) - 1.53) < 1e-3
    assert abs(cost.seconds(20) / cost.profiled(20) - 1.5) < 1e-3
    # A size timed apart keeps its own correction; steps with the Spark pass are their own kind.
    for _ in range(30):
        cost.observe(16, (), 1.0)
    assert abs(cost.seconds(16) - 1.0) < 1e-3 and abs(cost.seconds(17) - 1.53) < 1e-3
    assert cost.seconds(16, passes=("spark",)) == pytest.approx(1.5, abs=1e-3)  # no Spark step timed: the nearest kind
    cost.observe(16, ("spark",), 3.0)
    assert cost.seconds(16, passes=("spark",)) > 1.5 and cost.seconds(16) == pytest.approx(1.0, abs=1e-3)
    # The plan reads the learned table: a first draft token the profile called cheap (+2%)
    # but that costs +53% is no longer worth a 0.5 chance at 16 rows.
    fresh = CostModel([16, 17, 32], [1.0, 1.02, 1.5])
    assert best_budget(16, 16, [0.5], [0, 1], fresh)[0] == 1
    assert best_budget(16, 16, [0.5], [0, 1], cost)[0] == 0


def test_a_wide_step_teaches_the_table_its_grid_not_its_size():
    """Attention runs over R x (width + 1) queries: the table prices a step by its grid too, so
    that one wide step (a single row copying 32 tokens among 16) does not make its size look
    dear at the usual width for the rest of the run."""
    from minispark.planner import CostModel, best_budget

    cost = CostModel([16, 80], [1.0, 2.0], grids=[16, 144], per_query=0.002)
    assert cost.seconds(80) == cost.seconds(80, queries=144) == pytest.approx(2.0)
    assert cost.seconds(80, queries=528) == pytest.approx(2.0 + 0.002 * 384)
    assert cost.seconds(80, queries=80) == pytest.approx(2.0 - 0.002 * 64)  # narrower: cheaper
    assert cost.seconds(48, queries=80) == pytest.approx(1.5)  # the grid interpolates with the size
    assert cost.seconds(80, queries=0) >= 1.0  # a noisy slope never makes a step look free
    for _ in range(10):  # wide steps that take what their grid costs
        cost.observe(80, (), 2.768, queries=528)
    assert cost.seconds(80, queries=144) == pytest.approx(2.0, rel=1e-3)
    old = CostModel([16, 80], [1.0, 2.0])  # the table without grids learnt 1.38x for the size
    for _ in range(10):
        old.observe(80, (), 2.768)
    assert old.seconds(80) > 2.7
    # The plan weighs each budget's own grid: 64 tokens over a wide grid lose to 16 over a narrow one.
    a = [0.9] * 64
    assert best_budget(16, 16, a, [16, 64], cost, grids=[32, 144])[0] == 64
    assert best_budget(16, 16, a, [16, 64], cost, grids=[32, 1040])[0] == 16


def test_an_old_timing_relaxes_toward_the_steps_timed_since():
    from minispark.planner import CostModel

    cost = CostModel([16, 32], [1.0, 1.5], passes={"spark": 0.5})
    cost.relax(("spark",), 0.5)  # nothing timed: nothing to move
    assert cost.drift == {}
    cost.observe(16, ("spark",), 3.0)
    cost.relax(("spark",), 0.5)  # no step without the pass timed: toward the profile
    assert cost.correction(16, ("spark",)) == pytest.approx(0.5 * CostModel.LEARN * math.log(2.0))
    for _ in range(30):
        cost.observe(32, (), 1.5 * 1.2)
    for _ in range(60):
        cost.relax(("spark",), 0.1)  # Spark steps untimed for long: as the steps timed since say
    assert cost.correction(16, ("spark",)) == pytest.approx(math.log(1.2), abs=1e-3)
    assert cost.correction(32, ()) == pytest.approx(math.log(1.2), abs=1e-3)  # only one kind moves


def test_trust_scales_each_token_so_an_error_compounds_along_the_chain():
    from minispark.planner import trusted
    from minispark.price import per_token

    a = torch.tensor([[0.5, 0.25, 0.125, 0.0], [0.9, 0.81, 0.0, 0.0]])
    assert torch.allclose(per_token(a), torch.tensor([[0.5, 0.5, 0.5, 0.0], [0.9, 0.9, 0.0, 0.0]]))
    # trust 0.5 on the second row: each token half as likely, its second a quarter
    assert torch.allclose(trusted(a, torch.tensor([1.0, 0.5])), torch.tensor([[0.5, 0.25, 0.125, 0.0],
                                                                             [0.45, 0.2025, 0.0, 0.0]]))
    # a pessimistic estimate is raised, but no token beyond certain; chains still end where they did
    assert trusted(a, torch.tensor(4.0)).tolist() == [[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]]


def test_a_run_with_no_queue_moves_by_what_its_slowest_row_gains():
    from minispark.planner import slowest_share

    assert slowest_share([3.0, 3.0, 3.0], [1.0, 1.0, 1.0]) == 1.0  # every row gains alike
    assert slowest_share([4.0], [1.0]) == 1.0  # one row is its own slowest
    assert slowest_share([0.0, 4.0], [1.0, 1.0]) == 0.0  # one row never copies: copies elsewhere buy nothing
    assert slowest_share([0.0, 4.0], [0.0, 1.0]) == 1.0  # ... unless it will be done in time anyway
    # the row gaining 1 ends the run half the time, the one gaining 3 otherwise: 2 of a mean of 7/3
    assert slowest_share([1.0, 3.0], [0.5, 1.0]) == pytest.approx(2.0 / (3.5 / 1.5))
    assert slowest_share([0.0, 0.0], [1.0, 1.0]) == 1.0  # nothing promised: nothing to scale


def test_the_row_that_ends_a_run_is_the_one_whose_drafts_fared_worst():
    """Rows that expect the same gain draw different ones: of n rows that may end the run, the
    last falls below its expectation by about the largest of n standard normals times its spread."""
    from statistics import NormalDist

    from minispark.planner import slowest_share

    z16 = NormalDist().inv_cdf((16 - 0.375) / (16 + 0.25))  # about 1.77
    assert slowest_share([1.0] * 16, [1.0] * 16, [0.2] * 16) == pytest.approx(1 - z16 * 0.2)
    assert slowest_share([1.0] * 16, [1.0] * 16, [0.0] * 16) == 1.0  # certain gains: no luck to lose
    four, sixteen = (slowest_share([1.0] * n, [1.0] * n, [0.2] * n) for n in (4, 16))
    assert sixteen < four < 1.0  # more rivals, worse luck for the last of them
    assert slowest_share([1.0], [1.0], [0.5]) == 1.0  # a row alone has no rival to end the run
    assert slowest_share([1.0, 1.0], [1.0, 0.0], [0.3, 0.3]) == 1.0  # nor one whose rival is done in time
    assert slowest_share([1.0] * 4, [1.0] * 4, [10.0] * 4) == 0.0  # luck that wide: drafts buy nothing


@pytest.mark.parametrize("chain", [[0.9, 0.81, 0.729], [0.6, 0.3, 0.1, 0.0], [1.0, 1.0], [0.0, 0.0]])
def test_luck_spread_is_the_spread_of_the_accepted_length(chain):
    """Against the accepted length's own distribution: P(A = k) = a_k - a_{k+1}."""
    from minispark.planner import luck_spread

    a = [1.0] + chain + [0.0]
    p = [a[k] - a[k + 1] for k in range(len(chain) + 1)]
    mean = sum(k * pk for k, pk in enumerate(p))
    var = sum(k * k * pk for k, pk in enumerate(p)) - mean ** 2
    got = luck_spread(torch.tensor([chain, chain]), 1.0)
    assert got.tolist() == pytest.approx([var ** 0.5] * 2, abs=1e-6)
    assert luck_spread(torch.tensor(chain), 25.0).item() == pytest.approx(var ** 0.5 / 5, abs=1e-6)  # over 25 steps
