"""price.py: survival and top-B admission, against brute force on small cases."""
from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from minispark.price import admit_top, survival

# A few exact values so that ties (and zeros, and ones) are common.
CONF = st.sampled_from([0.0, 0.25, 0.5, 0.9, 1.0]) | st.floats(0.0, 1.0)


# -- survival -------------------------------------------------------------------------------

def test_survival_hand_made():
    conf = torch.tensor([[0.5, 0.5, 0.5], [1.0, 0.2, 1.0], [0.9, 0.9, 0.9]])
    a = survival(conf, torch.tensor([3, 2, 0]))
    torch.testing.assert_close(a, torch.tensor([[0.5, 0.25, 0.125], [1.0, 0.2, 0.0], [0.0, 0.0, 0.0]]))
    # Out-of-range estimates are clamped, so survival stays in [0, 1] and never increases.
    a = survival(torch.tensor([[1.5, -0.2, 0.5], [2.0, 3.0, 0.5]]), torch.tensor([3, 3]))
    torch.testing.assert_close(a, torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 0.5]]))


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_survival_properties(data):
    R, K = data.draw(st.integers(1, 5)), data.draw(st.integers(1, 8))
    wide = st.floats(-2.0, 3.0, allow_nan=False) | CONF
    conf = torch.tensor([[data.draw(wide) for _ in range(K)] for _ in range(R)])
    valid = torch.tensor([data.draw(st.integers(0, K + 2)) for _ in range(R)])
    a = survival(conf, valid)
    assert a.shape == (R, K)
    assert ((a >= 0) & (a <= 1)).all()
    assert (a[:, 1:] <= a[:, :-1]).all()  # non-increasing along each chain
    for r in range(R):
        prod = 1.0
        for j in range(K):
            prod *= min(max(conf[r, j].item(), 0.0), 1.0)
            want = prod if j < valid[r] else 0.0
            assert abs(a[r, j].item() - want) <= 1e-6


# -- admit_top ------------------------------------------------------------------------------

def brute_force(a: torch.Tensor, budget: int) -> float:
    R, K = a.shape
    best = 0.0
    for lengths in itertools.product(range(K + 1), repeat=R):
        if sum(lengths) <= budget:
            best = max(best, sum(a[r, :l].sum().item() for r, l in enumerate(lengths)))
    return best


def check_admission(a: torch.Tensor, budget: int) -> torch.Tensor:
    R, K = a.shape
    lengths = admit_top(a, budget)
    assert lengths.shape == (R,) and lengths.dtype == torch.long
    assert ((lengths >= 0) & (lengths <= K)).all()
    positive = int((a > 0).sum())
    assert int(lengths.sum()) == min(max(budget, 0), positive)
    for r in range(R):  # zero survival is never admitted (a prefix ends at the last positive)
        l = int(lengths[r])
        assert l == 0 or a[r, l - 1] > 0
    got = sum(a[r, :l].sum().item() for r, l in enumerate(lengths.tolist()))
    assert abs(got - brute_force(a, budget)) <= 1e-5
    # Ties go to the earlier position (then the lower row): the admitted set is exactly the
    # first `budget` positive pairs in the order (value desc, position, row).
    order = sorted(((-a[r, j].item(), j, r) for r in range(R) for j in range(K) if a[r, j] > 0))
    want = torch.zeros(R, dtype=torch.long)
    for _, j, r in order[:max(budget, 0)]:
        want[r] += 1
    assert torch.equal(lengths, want)
    return lengths


@st.composite
def small_survival(draw):
    R, K = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    conf = torch.tensor([[draw(CONF) for _ in range(K)] for _ in range(R)])
    valid = torch.tensor([draw(st.integers(0, K)) for _ in range(R)])
    return survival(conf, valid), draw(st.integers(0, R * K + 2))


@settings(max_examples=300, deadline=None)
@given(small_survival())
def test_admit_top_is_optimal(case):
    a, budget = case
    check_admission(a, budget)


def test_ties_spread_breadth_first():
    a = torch.full((3, 4), 0.9)
    assert admit_top(a, 5).tolist() == [2, 2, 1]
    assert admit_top(a, 3).tolist() == [1, 1, 1]
    assert admit_top(a, 12).tolist() == [4, 4, 4]
    assert admit_top(a, 100).tolist() == [4, 4, 4]
    a = survival(torch.full((3, 4), 0.9), torch.tensor([4, 1, 4]))
    assert admit_top(a, 5).tolist() == [2, 1, 2]


def test_budget_zero_and_zero_survival():
    a = torch.tensor([[0.9, 0.5, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    assert admit_top(a, 0).tolist() == [0, 0, 0]
    assert admit_top(a, -3).tolist() == [0, 0, 0]
    assert admit_top(a, 3).tolist() == [0, 0, 3]  # 1.0 beats 0.9
    assert admit_top(a, 4).tolist() == [1, 0, 3]
    assert admit_top(a, 9).tolist() == [2, 0, 3]  # zeros are never admitted
    assert admit_top(torch.zeros(2, 5), 4).tolist() == [0, 0]


def test_highest_survival_first():
    a = torch.tensor([[0.9, 0.2, 0.1], [0.8, 0.7, 0.6]])
    assert admit_top(a, 1).tolist() == [1, 0]
    assert admit_top(a, 3).tolist() == [1, 2]
    assert admit_top(a, 4).tolist() == [1, 3]
    assert admit_top(a, 5).tolist() == [2, 3]


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_admission_of_slot_j_ignores_later_slots_of_its_chain(data):
    # Losslessness: whether (r, j) is admitted may depend on its own chain's values up to j
    # only. Changing conf[r, j+1:] (survival stays non-increasing) must not change it.
    R, K = data.draw(st.integers(1, 4)), data.draw(st.integers(2, 6))
    conf = torch.tensor([[data.draw(CONF) for _ in range(K)] for _ in range(R)])
    valid = torch.tensor([data.draw(st.integers(0, K)) for _ in range(R)])
    budget = data.draw(st.integers(0, R * K))
    r, j = data.draw(st.integers(0, R - 1)), data.draw(st.integers(0, K - 2))
    conf2 = conf.clone()
    conf2[r, j + 1:] = torch.tensor([data.draw(CONF) for _ in range(K - j - 1)])
    valid2 = valid.clone()
    if valid[r] > j + 1:  # a later token may also stop existing or appear
        valid2[r] = data.draw(st.integers(j + 1, K))
    l1 = admit_top(survival(conf, valid), budget)[r]
    l2 = admit_top(survival(conf2, valid2), budget)[r]
    assert min(int(l1), j + 1) == min(int(l2), j + 1)  # slots 0..j: same decisions


# -- the price and the chain choice -----------------------------------------------------------

from minispark.price import admitted_value, choose_chains, net_value, ngram_outcome, price_of  # noqa: E402


def chains(*rows: list[float], width: int = 8) -> torch.Tensor:
    """Survival rows from per-token acceptance estimates, padded with zeros."""
    conf = torch.zeros(len(rows), width)
    for i, r in enumerate(rows):
        conf[i, : len(r)] = torch.tensor(r)
    return survival(conf, torch.tensor([len(r) for r in rows]))


def test_a_long_calibrated_copy_beats_a_short_spark_block():
    ngram = chains([0.8] + [0.97] * 7)  # a copy that has been right: long and likely
    spark = chains([0.7, 0.6, 0.5, 0.4])
    use_spark, a = choose_chains(ngram, spark, budget=8)
    assert not use_spark[0]
    assert admit_top(a, 8)[0] == 8


def test_on_novel_text_spark_wins():
    ngram = chains([0.1] + [0.6] * 7)  # a one-token match in free text: rarely right
    spark = chains([0.8, 0.6, 0.4, 0.3])
    use_spark, _ = choose_chains(ngram, spark, budget=8)
    assert use_spark[0]


def test_a_tight_budget_goes_to_the_likeliest_tokens():
    ngram = chains([0.95] * 6, [0.2] * 6, [0.0])
    spark = chains([0.5, 0.4], [0.7, 0.5, 0.3], [0.9, 0.8, 0.3])
    use_spark, a = choose_chains(ngram, spark, budget=4)
    assert use_spark.tolist() == [False, True, True]
    # Row 0's copy (0.95, 0.90, 0.86) and row 2's first token (0.9) take all four slots; row 1 waits.
    assert admit_top(a, 4).tolist() == [3, 0, 1]
    assert price_of(a, 4) == a[0, 2]
    assert price_of(torch.tensor([[0.9, 0.5]]), 4) == 0  # fewer pairs than the budget: the rest are worth 0
    # With room for more, row 1 joins.
    assert admit_top(choose_chains(ngram, spark, budget=16)[1], 16)[1] > 0


def test_net_value_stops_where_survival_falls_below_the_price():
    a = torch.tensor([[0.9, 0.5, 0.2, 0.0]])
    assert torch.isclose(net_value(a, torch.tensor(0.4)), torch.tensor(0.5 + 0.1))
    assert net_value(a, torch.tensor(0.95)) == 0


def best_choice(ngram: torch.Tensor, spark: torch.Tensor, budget: int) -> torch.Tensor:
    """The brute-force optimum: the admitted value of the best of all 2^R chain choices."""
    return max(admitted_value(torch.stack([spark[r] if c else ngram[r] for r, c in enumerate(choice)]), budget)
               for choice in itertools.product([0, 1], repeat=ngram.shape[0]))


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_chain_choice_equals_brute_force(data):
    R, W = data.draw(st.integers(1, 5)), data.draw(st.integers(1, 5))
    budget = data.draw(st.integers(0, R * W + 2))

    def chain():
        conf = torch.tensor(data.draw(st.lists(st.lists(CONF, min_size=W, max_size=W), min_size=R, max_size=R)))
        return survival(conf, torch.tensor(data.draw(st.lists(st.integers(0, W), min_size=R, max_size=R))))

    ngram, spark = chain(), chain()
    use_spark, a = choose_chains(ngram, spark, budget)
    assert use_spark.dtype == torch.bool and use_spark.shape == (R,)
    assert torch.isclose(admitted_value(a, budget), best_choice(ngram, spark, budget), atol=1e-5)
    assert torch.equal(a, torch.where(use_spark[:, None], spark, ngram))


def test_chain_choice_finds_an_optimum_that_needs_two_rows_to_switch():
    # Found by hypothesis against the old price threshold: all-Spark (2.105) beats every single
    # switch, but n-gram chains on rows 1 and 2 together admit 2.225.
    ngram = torch.tensor([[0.0, 0, 0, 0], [0.9, 0.45, 0, 0], [0.5, 0.125, 0, 0]])
    spark = torch.tensor([[0.25, 0, 0, 0], [0.5, 0.45, 0.405, 0], [0.5, 0, 0, 0]])
    assert torch.isclose(best_choice(ngram, spark, 5), torch.tensor(2.225))
    use_spark, a = choose_chains(ngram, spark, 5)
    assert torch.isclose(admitted_value(a, 5), torch.tensor(2.225))
    assert use_spark.tolist() == [True, False, False]


def test_chain_choice_with_no_budget_or_more_than_every_pair():
    ngram = torch.tensor([[0.9, 0.8], [0.3, 0.0], [0.0, 0.0]])
    spark = torch.tensor([[0.5, 0.5], [0.6, 0.5], [0.0, 0.0]])
    # Nothing admitted: each row takes the likelier first token (Spark on a tie, empty rows too).
    assert choose_chains(ngram, spark, 0)[0].tolist() == [False, True, True]
    # A budget past R * W admits every pair, so each row takes its larger chain sum.
    assert choose_chains(ngram, spark, 100)[0].tolist() == [False, True, True]
    assert choose_chains(ngram[:, :0], spark[:, :0], 4)[0].tolist() == [True] * 3  # no width at all


def test_ngram_outcome_states():
    proposal = torch.tensor([[5, 6, 7]] * 6)
    valid = torch.tensor([3, 3, 0, 3, 2, 3])
    out = torch.tensor([[5, 6, 9], [7, 0, 0], [5, 0, 0], [5, 0, 0], [5, 6, 1], [5, 6, 7]])
    n_out = torch.tensor([3, 1, 1, 0, 3, 2])
    last = torch.tensor([0, 0, 2, 1, 0, 0])
    # partly right; wrong; no proposal; emitted nothing (kept); all two copies then the bonus;
    # a chain cut by the budget whose next copy is the bonus
    assert ngram_outcome(proposal, valid, out, n_out, last).tolist() == [2, 1, 0, 1, 3, 3]


def test_a_proposal_is_checked_against_the_emitted_tokens_it_covers():
    from minispark.price import proposal_outcome

    proposal = torch.tensor([[5, 6, 7]] * 4)
    a = torch.tensor([[0.5, 0.25, 0.125]] * 4)
    valid = torch.tensor([3, 3, 1, 0])
    out = torch.tensor([[5, 6, 9], [5, 0, 0], [5, 6, 7], [5, 6, 7]])
    n_out = torch.tensor([3, 1, 3, 3])
    # three covered, two agree; one covered (an unverified copy meets the target's own token);
    # a one-token proposal; none
    assert proposal_outcome(proposal, a, valid, out, n_out).tolist() == [[1.5, 2], [0.5, 1], [0.5, 1], [0, 0]]


# -- the host's plan ---------------------------------------------------------------------------

def test_best_budget_pays_for_the_spark_pass():
    from minispark.price import CostModel, best_budget

    cost = CostModel([1, 9], [1.0, 1.2], spark=0.5)
    a = [0.9, 0.8, 0.01]
    B, rate = best_budget(1, 1, a, [0, 1, 2, 3, 8], cost)
    assert B == 2 and abs(rate - (1 + 1.7) / 1.05) < 1e-9  # the third slot costs more than it earns
    B2, rate2 = best_budget(1, 1, a, [0, 1, 2, 3, 8], cost, spark_pass=True)
    assert B2 == 2 and abs(rate2 - (1 + 1.7) / (1.05 + 0.5)) < 1e-9
    # Nothing worth verifying: no budget, and the pass only costs.
    assert best_budget(1, 1, [], [0, 1, 2], cost) == (0, 1.0)
    assert best_budget(1, 1, [], [0, 1, 2], cost, spark_pass=True)[1] < 1.0


def test_the_widest_chain_the_host_plans_for_matches_the_device_admission():
    from minispark.price import ranked

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
    from minispark.price import CostModel, monotone

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
    from minispark.price import CostModel, best_budget

    cost = CostModel([16, 17, 32], [1.0, 1.02, 1.5], spark=0.5)
    assert cost.seconds(17) == cost.profiled(17)  # nothing timed yet
    # Real steps of 17 tokens take 1.5x the profile: repeated timings converge on it,
    # one timing moves the table by a fraction of its error, and neighbouring sizes follow.
    cost.observe(17, False, 1.53)
    assert abs(cost.seconds(17) - 1.02 * 1.5 ** CostModel.LEARN) < 1e-9
    for _ in range(30):
        cost.observe(17, False, 1.53)
    assert abs(cost.seconds(17) - 1.53) < 1e-3
    assert abs(cost.seconds(20) / cost.profiled(20) - 1.5) < 1e-3
    # A size timed apart keeps its own correction; steps with the Spark pass are their own kind.
    for _ in range(30):
        cost.observe(16, False, 1.0)
    assert abs(cost.seconds(16) - 1.0) < 1e-3 and abs(cost.seconds(17) - 1.53) < 1e-3
    assert cost.seconds(16, spark_pass=True) == pytest.approx(1.5, abs=1e-3)  # no Spark step timed: the nearest kind
    cost.observe(16, True, 3.0)
    assert cost.seconds(16, spark_pass=True) > 1.5 and cost.seconds(16) == pytest.approx(1.0, abs=1e-3)
    # The plan reads the learned table: a first draft token the profile called cheap (+2%)
    # but that costs +53% is no longer worth a 0.5 chance at 16 rows.
    fresh = CostModel([16, 17, 32], [1.0, 1.02, 1.5])
    assert best_budget(16, 16, [0.5], [0, 1], fresh)[0] == 1
    assert best_budget(16, 16, [0.5], [0, 1], cost)[0] == 0


def test_a_wide_step_teaches_the_table_its_grid_not_its_size():
    """Attention runs over R x (width + 1) queries: the table prices a step by its grid too, so
    that one wide step (a single row copying 32 tokens among 16) does not make its size look
    dear at the usual width for the rest of the run."""
    from minispark.price import CostModel, best_budget

    cost = CostModel([16, 80], [1.0, 2.0], grids=[16, 144], per_query=0.002)
    assert cost.seconds(80) == cost.seconds(80, queries=144) == pytest.approx(2.0)
    assert cost.seconds(80, queries=528) == pytest.approx(2.0 + 0.002 * 384)
    assert cost.seconds(80, queries=80) == pytest.approx(2.0 - 0.002 * 64)  # narrower: cheaper
    assert cost.seconds(48, queries=80) == pytest.approx(1.5)  # the grid interpolates with the size
    assert cost.seconds(80, queries=0) >= 1.0  # a noisy slope never makes a step look free
    for _ in range(10):  # wide steps that take what their grid costs
        cost.observe(80, False, 2.768, queries=528)
    assert cost.seconds(80, queries=144) == pytest.approx(2.0, rel=1e-3)
    old = CostModel([16, 80], [1.0, 2.0])  # the table without grids learnt 1.38x for the size
    for _ in range(10):
        old.observe(80, False, 2.768)
    assert old.seconds(80) > 2.7
    # The plan weighs each budget's own grid: 64 tokens over a wide grid lose to 16 over a narrow one.
    a = [0.9] * 64
    assert best_budget(16, 16, a, [16, 64], cost, grids=[32, 144])[0] == 64
    assert best_budget(16, 16, a, [16, 64], cost, grids=[32, 1040])[0] == 16


def test_an_old_timing_relaxes_toward_the_steps_timed_since():
    from minispark.price import CostModel

    cost = CostModel([16, 32], [1.0, 1.5], spark=0.5)
    cost.relax(True, 0.5)  # nothing timed: nothing to move
    assert cost.drift == {}
    cost.observe(16, True, 3.0)
    cost.relax(True, 0.5)  # no step without the pass timed: toward the profile
    assert cost.correction(16, True) == pytest.approx(0.5 * CostModel.LEARN * math.log(2.0))
    for _ in range(30):
        cost.observe(32, False, 1.5 * 1.2)
    for _ in range(60):
        cost.relax(True, 0.1)  # Spark steps untimed for long: as the steps timed since say
    assert cost.correction(16, True) == pytest.approx(math.log(1.2), abs=1e-3)
    assert cost.correction(32, False) == pytest.approx(math.log(1.2), abs=1e-3)  # only one kind moves


def test_trust_scales_each_token_so_an_error_compounds_along_the_chain():
    from minispark.price import per_token, trusted

    a = torch.tensor([[0.5, 0.25, 0.125, 0.0], [0.9, 0.81, 0.0, 0.0]])
    assert torch.allclose(per_token(a), torch.tensor([[0.5, 0.5, 0.5, 0.0], [0.9, 0.9, 0.0, 0.0]]))
    # trust 0.5 on the second row: each token half as likely, its second a quarter
    assert torch.allclose(trusted(a, torch.tensor([1.0, 0.5])), torch.tensor([[0.5, 0.25, 0.125, 0.0],
                                                                             [0.45, 0.2025, 0.0, 0.0]]))
    # a pessimistic estimate is raised, but no token beyond certain; chains still end where they did
    assert trusted(a, torch.tensor(4.0)).tolist() == [[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]]


def test_a_run_with_no_queue_moves_by_what_its_slowest_row_gains():
    from minispark.price import slowest_share

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

    from minispark.price import slowest_share

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
    from minispark.price import luck_spread

    a = [1.0] + chain + [0.0]
    p = [a[k] - a[k + 1] for k in range(len(chain) + 1)]
    mean = sum(k * pk for k, pk in enumerate(p))
    var = sum(k * k * pk for k, pk in enumerate(p)) - mean ** 2
    got = luck_spread(torch.tensor([chain, chain]), 1.0)
    assert got.tolist() == pytest.approx([var ** 0.5] * 2, abs=1e-6)
    assert luck_spread(torch.tensor(chain), 25.0).item() == pytest.approx(var ** 0.5 / 5, abs=1e-6)  # over 25 steps
