"""The host planner in the running engine, through its public inputs: which chains it verifies,
when a costly drafter's pass runs, and what it learns from finished steps."""
from __future__ import annotations

import json
import math
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import FLAT_COST, ByteTokenizer, bigram_drafter, random_prompts, reference_greedy, tiny_llm, tiny_pair
from minispark import verify
from minispark.api import LLM, SamplingParams
from minispark.model import Batch
from minispark.planner import BUDGETS, PATIENCE, TRUST_PRIOR, CostModel, Pieces, Planner, Row, chain_width

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


def test_a_step_read_late_leaves_the_estimates_of_a_slot_given_to_a_new_request_alone():
    """On a GPU a slot may be handed to a new request (its prefill writing that request's
    estimates) while a step launched for the old one is still to be read: reading it must not
    overwrite the new request's estimates with the old one's."""
    rng = random.Random(3)
    prompts = random_prompts(rng, 9, 30)
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randrange(2, 12)) for _ in prompts]
    llm = tiny_llm("ngram", initializer_range=0.1, vocab_size=40, max_batch_size=2)
    llm._overlap = True
    planner, observe, handed_over = llm.planner, llm.planner.observe, []

    def checked_observe(out, where, runs, counted=True):
        before = [list(e) for e in planner.est]
        observe(out, where, runs, counted)
        if not counted:  # a prefill's rows are the slots just admitted
            return
        for row, slot in enumerate(where):
            if slot != row:  # the row's request has left it: the slot is another's now
                handed_over.append(planner.est[row] == before[row])

    planner.observe = checked_observe
    llm.generate(prompts, params)
    assert handed_over and all(handed_over)


def test_the_host_plans_with_the_estimates_of_the_copies_the_next_step_verifies():
    """n-gram proposals are drafted as soon as a step has committed: the estimates a step hands
    the host are those of the proposals the next step verifies, not of its own."""
    llm = tiny_llm("ngram", initializer_range=0.02, vocab_size=32, max_batch_size=2)
    eng, ngram, told, drafted = llm.engine, llm.engine.drafters[0], [], []
    draft, step = ngram.draft, eng.step

    def spy_draft(rows):
        chain = draft(rows)
        drafted.append(eng.survival(chain.conf, rows.slot))
        return chain

    def spy_step(*args, **kw):
        out = step(*args, **kw)
        told.append(out.est[:, 0].clone())
        return out

    ngram.draft, eng.step = spy_draft, spy_step
    llm.generate([[5, 6, 7, 8, 9] * 4, [3, 4, 5, 3, 4, 5, 3]], SamplingParams(temperature=0, max_tokens=30))
    assert len(drafted) > 5 and any(a.sum() > 0 for a in drafted)
    for before, now in zip(told, drafted[1:]):
        R = min(len(before), len(now))
        assert torch.equal(before[:R], now[:R])


def test_copies_never_verified_still_teach_the_plan_how_far_to_trust_them():
    """With drafts too dear to verify, each step's n-gram proposal is still checked against the
    token the target emitted, so the plan's trust in the table moves with what it sees."""
    llm = tiny_llm("ngram", initializer_range=0.3, vocab_size=40, cost=CostModel([1, 1025], [1.0, 1000.0]))
    llm.generate(random_prompts(random.Random(2), 4, 40), SamplingParams(temperature=0, max_tokens=20))
    assert llm.stats()["ngram_chains"] == 0
    expected, accepted = llm.planner.seen[0]
    assert expected > TRUST_PRIOR + 1 and llm.planner.trust(0) != 1.0


@pytest.mark.parametrize("spec", ["spark", "hybrid"])
def test_the_spark_pass_runs_only_where_it_pays(tmp_path, spec):
    """The host skips Spark's pass on steps where its expected tokens do not pay for its
    time (a cost table says how long it takes); the output stays the greedy one either way."""
    import json

    from conftest import ByteTokenizer, bigram_drafter, tiny_pair
    from minispark.planner import CostModel

    prompts = random_prompts(random.Random(3), 4, 16)
    seen = {}
    for spark_s in (0.0, 1e3):
        _, net = tiny_pair(0, initializer_range=0.3, vocab_size=16)
        path = tmp_path / f"{spark_s}.jsonl"
        llm = LLM.from_model(net, ByteTokenizer(), spec=spec, max_batch_size=2, max_seq_len=128,
                             cost=CostModel([1, 1025], [1.0, 1.5], passes={"spark": spark_s}), drafter=bigram_drafter(net),
                             trace=str(path))
        outs = llm.generate(prompts, GREEDY)
        for p, o in zip(prompts, outs):
            assert o.token_ids == reference_greedy(llm, p, 24)
        passes = ["spark" in json.loads(line)["runs"] for line in path.read_text().splitlines()]
        seen[spark_s] = (passes, sum(o.accepted["spark"] for o in outs))
    free, dear = seen[0.0], seen[1e3]
    assert any(free[0]) and free[1] > 0  # a free pass runs (where Spark offers more), drafts accepted
    assert not any(dear[0]) and dear[1] == 0  # a pass that costs 1000 steps never does


def certain_but_wrong_drafter():
    """A tiny target and a Spark drafter that claims certainty (c = 1) but always drafts token 0."""
    from conftest import bigram_drafter, tiny_pair

    _, net = tiny_pair(0, vocab_size=64)
    d = bigram_drafter(net)
    with torch.no_grad():
        d.conf.weight.zero_()
        d.conf.bias.fill_(20.0)
        d.markov_out.weight.zero_()
        d.markov_out.weight[0] = 1e3
    return net, d


def test_a_drafter_whose_estimates_are_not_borne_out_loses_its_pass(tmp_path):
    """A Spark drafter that claims certainty (c = 1) but always drafts token 0: the host's
    trust in its estimates falls with every rejected chain, and it soon stops paying for the
    pass. Output stays the greedy one."""
    import json

    from conftest import ByteTokenizer
    from minispark.planner import CostModel

    net, d = certain_but_wrong_drafter()
    path = tmp_path / "trace.jsonl"
    llm = LLM.from_model(net, ByteTokenizer(), spec="spark", max_batch_size=1, max_seq_len=128,
                         cost=CostModel([1, 1025], [1.0, 1.5], passes={"spark": 0.5}), drafter=d, trace=str(path))
    prompt = [5, 9, 17, 33, 4]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=48))[0]
    assert out.token_ids == reference_greedy(llm, prompt, 48)
    passes = ["spark" in json.loads(line)["runs"] for line in path.read_text().splitlines()]
    assert all(passes[:3]) and not any(passes[10:10 + PATIENCE])
    # Each rejected chain reached one token, estimated certain: trust per token falls from 1.
    assert llm.planner.trust(0) < 0.5


def test_a_drafter_written_off_is_tried_again(tmp_path):
    """Only a Spark pass renews the plan's trust in Spark. After the certain-but-wrong drafter
    has lost its pass, it is made right (its Markov head now follows the next answer's own
    token pairs): the plan tries it again after a quiet stretch, rarely while it is still
    wrong, and then drafts with it for good. Before, the pass never ran again."""
    import json

    from conftest import ByteTokenizer

    net, d = certain_but_wrong_drafter()
    path = tmp_path / "trace.jsonl"
    llm = LLM.from_model(net, ByteTokenizer(), spec="spark", max_batch_size=1, max_seq_len=512,
                         cost=CostModel([1, 1025], [1.0, 1.5], passes={"spark": 0.5}), drafter=d, trace=str(path))
    llm.generate([[5, 9, 17, 33, 4]], SamplingParams(temperature=0, max_tokens=120))
    wrong = ["spark" in json.loads(line)["runs"] for line in path.read_text().splitlines()]
    assert all(wrong[:3]) and 1 <= sum(wrong[10:]) <= len(wrong[10:]) // PATIENCE + 1
    prompt = [7, 7, 8, 11, 2]
    want = reference_greedy(llm, prompt, 200)
    with torch.no_grad():
        d.markov_out.weight.zero_()
        for x, y in zip(prompt + want, want):
            d.markov_out.weight[y, x] = 1e3
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=200))[0]
    assert out.token_ids == want
    assert out.accepted["spark"] >= 100 and llm.planner.trust(0) > 0.8


def test_a_skipped_spark_pass_is_not_skipped_for_good(tmp_path):
    """One low estimate skips a slot's next Spark pass; the pass after is planned on the chain
    Spark has typically drafted lately, not on that stale estimate, which only a pass could
    renew. The drafter's first-slot confidence is near 0 after one token X and 0.95 after any
    other; the second request's first token is X."""
    import json

    from conftest import ByteTokenizer, bigram_drafter, tiny_pair

    _, net = tiny_pair(0, initializer_range=0.3, vocab_size=16)
    d = bigram_drafter(net)
    dim = net.args.dim
    first, second = [5, 9, 3, 12], [7, 7, 8, 11, 2]
    path = tmp_path / "trace.jsonl"
    llm = LLM.from_model(net, ByteTokenizer(), spec="spark", max_batch_size=1, max_seq_len=128,
                         cost=CostModel([1, 1025], [1.0, 1.5], passes={"spark": 0.05}), drafter=d, trace=str(path))
    X = reference_greedy(llm, second, 1)[0]
    assert reference_greedy(llm, first, 1)[0] != X
    with torch.no_grad():
        d.conf.weight.zero_()
        d.conf.bias.fill_(3.0)
        d.conf.weight[0, dim + X] = -30.0  # the Markov input of the token before is one-hot
    outs = llm.generate([first, second], GREEDY)
    assert [o.token_ids for o in outs] == [reference_greedy(llm, p, 24) for p in (first, second)]
    steps = [json.loads(line) for line in path.read_text().splitlines()]
    of_second = ["spark" in s["runs"] for s in steps if s["slots"] and s["slots"][0]["request"] == outs[1].request_id]
    # The first step drafts after X (on the prefill's even-odds guess); its near-0 estimate
    # skips the second step's pass, and the steps after that plan on the typical chain.
    assert of_second[0] and not of_second[1]
    assert sum(of_second[2:]) >= len(of_second[2:]) // 2


def test_the_fixed_baseline_verifies_every_whole_block(tmp_path):
    """adaptive=False, the baseline adaptive verification is measured against: a drafter that is
    always wrong, which the adaptive plan stops paying for (above), still has its whole block
    verified for every row on every step, and the output is still the target's."""
    import json

    from conftest import ByteTokenizer

    net, d = certain_but_wrong_drafter()
    path = tmp_path / "trace.jsonl"
    llm = LLM.from_model(net, ByteTokenizer(), spec="spark", max_batch_size=2, max_seq_len=128,
                         cost=CostModel([1, 1025], [1.0, 1.5], passes={"spark": 0.5}), drafter=d, trace=str(path),
                         adaptive=False)
    prompts = [[5, 9, 17, 33, 4], [7, 7, 8]]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24))
    assert [o.token_ids for o in outs] == [reference_greedy(llm, p, 24) for p in prompts]
    steps = [json.loads(line) for line in path.read_text().splitlines()]
    slots = [slot for s in steps for slot in s["slots"]]
    assert all("spark" in s["runs"] for s in steps) and len(slots) >= 2 * 20
    assert all(slot["verified"] == d.args.block for slot in slots)


def test_with_no_request_waiting_drafts_go_to_the_rows_the_run_waits_for(tmp_path):
    """Two copies at batch 2, one asking for 8 tokens and one for 64: with nothing queued the
    run ends with the long one, so the short one's chains are never verified, even with drafts
    for free. A third request waiting changes that: every token counts while a slot can be
    refilled. Output stays the greedy one."""
    import json

    from conftest import FLAT_COST, ByteTokenizer, tiny_pair

    _, net = tiny_pair(0, initializer_range=0.02, vocab_size=64)
    prompts = [[5, 6, 7, 8] * 4, [9, 10, 11, 12] * 4, [13, 14, 15] * 4]
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (8, 64, 64)]

    def verified(n_requests: int) -> list[dict[int, int]]:
        path = tmp_path / f"{n_requests}.jsonl"
        llm = LLM.from_model(net, ByteTokenizer(), spec="ngram", max_batch_size=2, max_seq_len=128,
                             cost=FLAT_COST, trace=str(path))
        outs = llm.generate(prompts[:n_requests], params[:n_requests])
        for p, o in zip(prompts, outs):
            assert o.token_ids == reference_greedy(llm, p, len(o.token_ids))
        steps = [json.loads(line) for line in path.read_text().splitlines()]
        return [{s["request"] - outs[0].request_id: s["verified"] for s in step["slots"]} for step in steps]

    alone = verified(2)
    assert all(step.get(0, 0) == 0 for step in alone) and sum(step.get(1, 0) for step in alone) > 0
    queued = verified(3)
    assert sum(step.get(0, 0) for step in queued) > 0


def test_a_profiled_cost_table_learns_from_the_steps_it_runs_and_a_given_one_is_kept():
    rng = random.Random(3)
    prompts = random_prompts(rng, 6, 64)
    llm = tiny_llm("hybrid", cost=None)  # profiled at start-up
    assert llm.planner.cost.drift == {}
    outs = llm.generate(prompts, GREEDY)
    steps = llm.stats()["steps"]
    # One entry per kind of step that ran: R rows (a bucket of at most 4) plus its budget.
    assert llm.planner.cost.drift and all(1 <= T <= 4 + max(llm.planner.budgets) for T, _ in llm.planner.cost.drift)
    assert len(llm.planner.cost.drift) <= steps
    given = tiny_llm("hybrid")
    assert [o.token_ids for o in given.generate(prompts, GREEDY)] == [o.token_ids for o in outs]
    assert given.planner.cost.drift == {}  # a table passed in is the caller's, and stays as given


def planner_for(n: int, K: int = 32, **kw) -> Planner:
    """A planner for n live rows of a single drafter's chains of up to K tokens, on a flat cost."""
    return Planner(["ngram"], [False], K, n, 512, [b for b in BUDGETS if b <= 64], FLAT_COST, learn=False, **kw)


def test_the_plan_values_a_budget_only_by_the_pairs_its_step_can_verify():
    """Each budget's step caps its chains at `chain_width`, and a step costs its query grid: one
    likely token in each of 16 rows is a budget of 16 at width 1, and long likely chains fill the
    budget within the widths the step can verify."""
    planner, rows = planner_for(16), [Row(50, 1.0, 10)] * 16
    for s in range(16):
        planner.est[s] = [[0.9] + [0.0] * 31]
    plan = planner.plan(16, list(range(16)), rows, queued=True)
    assert (plan.budget, plan.width) == (16, 1)
    for s in range(16):
        planner.est[s] = [[0.95 ** (j + 1) for j in range(32)]]
    plan = planner.plan(16, list(range(16)), rows, queued=True)
    assert plan.budget == 64 and plan.width <= chain_width(32, 64, 16) and plan.budget <= 16 * plan.width


def test_with_no_request_waiting_luck_over_the_steps_left_holds_back_drafts():
    """Sixteen rows expect the same gain, but each chain is all or nothing, and the run ends with
    the row whose chains fared worst: over many steps left, luck evens out and the plan drafts;
    over one, the unluckiest of 16 rows gains nothing, so it drafts nothing."""
    chain = [[0.5] * 4 + [0.0] * 28]  # four tokens, all kept half the time
    for steps_left, drafts in ((1000, True), (1, False)):
        planner = planner_for(16)
        planner.est = [chain for _ in range(16)]
        rows = [Row(steps_left, 1.0, 10)] * 16
        assert (planner.plan(16, list(range(16)), rows, queued=False).budget > 0) == drafts
        assert planner.plan(16, list(range(16)), rows, queued=True).budget > 0  # a queue takes every token


def test_with_no_request_waiting_a_row_that_never_copies_holds_back_every_rows_drafts():
    """With nothing queued the run ends with its slowest row: while one row's chains promise
    nothing, copies for the others only idle them sooner, so the plan verifies none. With a
    request waiting every copied token counts, and when both rows copy both gain."""
    copy, novel, rows = [[0.9] * 32], [[0.0] * 32], [Row(50, 1.0, 10)] * 2
    planner = planner_for(2)
    planner.est = [copy, novel]
    assert planner.plan(2, [0, 1], rows, queued=False).budget == 0
    assert planner.plan(2, [0, 1], rows, queued=True).budget > 0
    planner = planner_for(2)  # both rows' requests start anew
    planner.est = [copy, copy]
    assert planner.plan(2, [0, 1], rows, queued=False).budget > 0


def test_each_piece_of_the_planner_switches_off_on_its_own():
    """Every refinement is a switch: with the slowest row's share off, a row that never copies no
    longer holds back the other's copies, and each other piece off keeps that rule."""
    copy, novel, rows = [[0.9] * 32], [[0.0] * 32], [Row(50, 1.0, 10)] * 2
    assert set(Pieces.names()) == {"trust", "relax", "worth", "slowest", "typical", "grid", "drift"}
    for name in Pieces.names():
        planner = planner_for(2, pieces=Pieces(**{name: False}))
        planner.est = [copy, novel]
        assert (planner.plan(2, [0, 1], rows, queued=False).budget > 0) == (name == "slowest"), name
    planner = planner_for(2, pieces=Pieces(trust=False))
    planner.seen[0] = [10.0, 1.0]  # estimates ten times too high: ignored without trust
    trusting = planner_for(2)
    trusting.seen[0] = [10.0, 1.0]
    assert planner.trust(0) == 1.0 and trusting.trust(0) == pytest.approx(0.1)