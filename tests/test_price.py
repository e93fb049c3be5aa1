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

from minispark.drafters import ngram_outcome  # noqa: E402
from minispark.price import admitted_value, net_value, price_of  # noqa: E402
from minispark.price import choose_chains as choose_among  # noqa: E402


def choose_chains(ngram: torch.Tensor, spark: torch.Tensor, budget: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The choice between two drafters' chains [R, W]: use_spark [R] and the chosen survival."""
    use_spark = choose_among(torch.stack([ngram, spark], 1), budget) == 1
    return use_spark, torch.where(use_spark[:, None], spark, ngram)


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
    assert use_spark.shape == (R,)
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


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_the_choice_among_any_number_of_drafters_equals_brute_force(data):
    """With N drafters each row takes one drafter's chain; the knapsack stays exact (N^R choices)."""
    R, N, W = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 4)), data.draw(st.integers(1, 4))
    budget = data.draw(st.integers(0, R * W + 2))
    conf = torch.tensor(data.draw(st.lists(st.lists(st.lists(CONF, min_size=W, max_size=W), min_size=N, max_size=N),
                                           min_size=R, max_size=R)))  # [R, N, W]
    valid = torch.tensor(data.draw(st.lists(st.integers(0, W), min_size=R * N, max_size=R * N)))
    a = survival(conf.flatten(0, 1), valid).view(R, N, W)
    pick = choose_among(a, budget)
    assert pick.shape == (R,) and bool(((pick >= 0) & (pick < N)).all())
    chosen = a[torch.arange(R), pick]
    best = max(admitted_value(torch.stack([a[r, c] for r, c in enumerate(choice)]), budget)
               for choice in itertools.product(range(N), repeat=R))
    assert torch.isclose(admitted_value(chosen, budget), best, atol=1e-5)
