"""The engine on tiny random models: greedy equality across modes and batch shapes, sampling
that keeps the target distribution, stop rules, stats, and bad input."""
from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import tiny_llm
from minispark import verify
from minispark.engine import LLM, SPARK_PATIENCE, TRUST_PRIOR, SamplingParams
from minispark.model import Batch
from minispark.price import CostModel

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


def reference_greedy(llm: LLM, prompt: list[int], n: int, eos: int | None = None) -> list[int]:
    """Greedy decoding by full recomputation: one prefill forward per generated token."""
    model, out, seq = llm.engine.model, [], list(prompt)
    for _ in range(n):
        T = len(seq)
        b = Batch(torch.tensor(seq), torch.zeros(T, dtype=torch.long), torch.arange(T), torch.arange(T),
                  torch.tensor([0]), T, T)
        with torch.no_grad():
            logits, _ = model(b, logits_at=torch.tensor([T - 1]))
        tok = int(logits.argmax())
        out.append(tok)
        seq.append(tok)
        if tok == eos:
            break
    return out


def random_prompts(rng: random.Random, n: int, vocab: int) -> list[list[int]]:
    """Half random, half built from repeated fragments, so the n-gram drafter finds matches."""
    prompts = []
    for i in range(n):
        if i % 2:
            frag = [rng.randrange(3, vocab) for _ in range(rng.randrange(2, 6))]
            p = (frag * 8)[: rng.randrange(2, 30)]
        else:
            p = [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 30))]
        prompts.append(p)
    return prompts


@pytest.mark.parametrize("spec", ["off", "ngram", "spark", "hybrid"])
def test_greedy_equals_recomputation(spec):
    llm = tiny_llm(spec, initializer_range=0.3, vocab_size=16, max_batch_size=3)
    prompts = random_prompts(random.Random(1), 6, 16)
    outs = llm.generate(prompts, GREEDY)
    for p, o in zip(prompts, outs):
        assert o.token_ids == reference_greedy(llm, p, 24)
        assert o.finish_reason == "length"


@pytest.mark.parametrize("spec", ["ngram", "spark", "hybrid"])
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), batch=st.integers(1, 8), init=st.sampled_from([0.02, 0.1, 0.3]),
       vocab=st.sampled_from([12, 40]))
def test_speculative_greedy_equals_off(spec, seed, batch, init, vocab):
    """Mixed prompt lengths and max_tokens, an EOS, fewer slots than requests: every request of
    each speculative mode gets exactly the tokens of spec="off" decoding it alone."""
    rng = random.Random(seed)
    prompts = random_prompts(rng, rng.randrange(1, 7), vocab)
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randrange(1, 20)) for _ in prompts]
    off = tiny_llm("off", seed=seed % 7, eos=2, initializer_range=init, vocab_size=vocab, max_batch_size=1)
    spec_llm = tiny_llm(spec, seed=seed % 7, eos=2, initializer_range=init, vocab_size=vocab, max_batch_size=batch)
    alone = [off.generate([p], sp)[0] for p, sp in zip(prompts, params)]
    together = spec_llm.generate(prompts, params)
    for a, b in zip(alone, together):
        assert b.token_ids == a.token_ids
        assert b.finish_reason == a.finish_reason


@pytest.mark.parametrize("spec", ["ngram", "hybrid"])
def test_reading_each_step_a_step_late_as_on_a_gpu_changes_no_token(spec):
    """On a GPU the host reads step t-1 while step t runs; on a CPU it reads each step at once.
    Only the plan's estimates differ (a step older), never a request's tokens: greedy and
    sampled requests, stops and lengths mid-batch, more requests than slots."""
    rng = random.Random(5)
    prompts = random_prompts(rng, 7, 40)
    params = [SamplingParams(temperature=0.8 if i % 2 else 0.0, max_tokens=rng.randrange(1, 25), seed=i)
              for i in range(7)]
    now, late = (tiny_llm(spec, eos=2, initializer_range=0.1, vocab_size=40, max_batch_size=3) for _ in range(2))
    late._overlap = True
    a, b = now.generate(prompts, params), late.generate(prompts, params)
    assert [(o.token_ids, o.finish_reason) for o in a] == [(o.token_ids, o.finish_reason) for o in b]
    assert sum(o.accepted["ngram"] + o.accepted["spark"] for o in b) > 0


def test_a_step_read_late_leaves_the_estimates_of_a_slot_given_to_a_new_request_alone():
    """On a GPU a slot may be handed to a new request (its prefill writing that request's
    estimates) while a step launched for the old one is still to be read: reading it must not
    overwrite the new request's estimates with the old one's."""
    rng = random.Random(3)
    prompts = random_prompts(rng, 9, 30)
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randrange(2, 12)) for _ in prompts]
    llm = tiny_llm("ngram", initializer_range=0.1, vocab_size=40, max_batch_size=2)
    llm._overlap = True
    absorb, handed_over = llm._absorb, []

    def checked_absorb(out, owners, spark_pass, est, count_step=True):
        before = list(est)
        yield from absorb(out, owners, spark_pass, est, count_step)
        if not count_step:  # a prefill's owners are the slots just admitted, not rows 0..R-1
            return
        for slot, req in enumerate(owners):
            if llm._slots[slot] is not None and llm._slots[slot] is not req:  # handed over since launch
                handed_over.append(est[slot] is before[slot])

    llm._absorb = checked_absorb
    llm.generate(prompts, params)
    assert handed_over and all(handed_over)


@pytest.mark.parametrize("spec,overlap", [("ngram", False), ("ngram", True), ("hybrid", False), ("hybrid", True)])
def test_long_copies_across_attended_prefix_buckets_keep_every_token(spec, overlap):
    """The attended prefix `ctx` grows in buckets of 256 with what the host knows; long copied
    chains cross a bucket's end within one step, and on a GPU a step in flight adds tokens the
    host has not yet seen. Either way the step must attend to every position it writes."""
    rng = random.Random(11)
    frag = [rng.randrange(3, 40) for _ in range(9)]
    prompts = [(frag * 40)[:n] for n in range(190, 256, 6)] + [[rng.randrange(3, 40) for _ in range(240)]]
    params = SamplingParams(temperature=0.0, max_tokens=90)
    off = tiny_llm("off", initializer_range=0.1, vocab_size=40, max_batch_size=1, max_seq_len=700)
    llm = tiny_llm(spec, initializer_range=0.1, vocab_size=40, max_batch_size=4, max_seq_len=700)
    llm._overlap = overlap
    eng, step, tight = llm.engine, llm.engine.step, []

    def checked_step(R, budget, width, ctx, *args):
        last = torch.where(eng.active[:R], eng.lens[:R] + width, -1).max().item()  # the last it may write
        assert last < ctx, f"positions up to {last} written, {ctx} attended"
        tight.append(ctx - last <= 2 * width + 2)
        return step(R, budget, width, ctx, *args)

    eng.step = checked_step
    outs = llm.generate(prompts, params)
    assert any(tight)  # some steps came close to the prefix's end
    for p, o in zip(prompts, outs):
        assert o.token_ids == off.generate([p], params)[0].token_ids
    assert max(o.accepted["ngram"] / o.num_steps for o in outs) > 4  # chains long enough to cross


def test_the_host_plans_with_the_estimates_of_the_copies_the_next_step_verifies():
    """n-gram proposals are drafted as soon as a step has committed: the estimates a step hands
    the host are those of the proposals the next step verifies, not of its own."""
    llm = tiny_llm("ngram", initializer_range=0.02, vocab_size=32, max_batch_size=2)
    eng, told, drafted = llm.engine, [], []
    draft, step = eng.draft, eng.step

    def spy_draft(*args, **kw):
        d = draft(*args, **kw)
        drafted.append(d.ngram_a.clone())
        return d

    def spy_step(*args, **kw):
        out = step(*args, **kw)
        told.append(out.ngram_a.clone())
        return out

    eng.draft, eng.step = spy_draft, spy_step
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
    expected, accepted = llm._seen["ngram"]
    assert expected > TRUST_PRIOR + 1 and llm._trust("ngram") != 1.0


def test_ngram_accepts_copies_and_counts_sources():
    llm = tiny_llm("ngram", initializer_range=0.02, vocab_size=32)
    out = llm.generate([[5, 6, 7, 8, 9] * 4], SamplingParams(temperature=0, max_tokens=40))[0]
    assert out.accepted["ngram"] > len(out.token_ids) // 3  # a model that repeats itself is copied, many tokens a step
    assert sum(out.accepted.values()) == len(out.token_ids)
    assert out.num_steps < 0.6 * len(out.token_ids)
    s = llm.stats()
    assert s["tokens"] == len(out.token_ids) and s["ngram"] == out.accepted["ngram"]


def test_sampling_is_reproducible_across_batch_positions_and_modes():
    """A seeded request samples the same tokens in any batch, slot or order, with or without
    speculation: copies are verified against the target's own sample at each position."""
    prompts = random_prompts(random.Random(3), 5, 40)
    params = [SamplingParams(temperature=0.9, top_p=0.9, top_k=20, max_tokens=12, seed=100 + i) for i in range(5)]
    a = tiny_llm("ngram", initializer_range=0.1, vocab_size=40, max_batch_size=4).generate(prompts, params)
    b = tiny_llm("ngram", initializer_range=0.1, vocab_size=40, max_batch_size=2).generate(prompts[::-1], params[::-1])
    off = tiny_llm("off", initializer_range=0.1, vocab_size=40, max_batch_size=3).generate(prompts, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b[::-1]] == [o.token_ids for o in off]
    assert sum(o.accepted["ngram"] for o in a) > 0
    c = tiny_llm("ngram", initializer_range=0.1, vocab_size=40).generate(prompts, [
        SamplingParams(temperature=0.9, top_p=0.9, top_k=20, max_tokens=12, seed=200 + i) for i in range(5)])
    assert [o.token_ids for o in a] != [o.token_ids for o in c]


def exact_sequence_probs(llm: LLM, prompt: list[int], n: int, temperature: float, top_k: int, top_p: float):
    """P(first n generated tokens) for every sequence, by enumeration through the model."""
    V = llm.engine.model.args.vocab_size
    seqs = [[]]
    probs = torch.ones(1, dtype=torch.float64)
    for _ in range(n):
        rows = []
        for s in seqs:
            full = prompt + s
            T = len(full)
            b = Batch(torch.tensor(full), torch.zeros(T, dtype=torch.long), torch.arange(T), torch.arange(T),
                      torch.tensor([0]), T, T)
            with torch.no_grad():
                logits, _ = llm.engine.model(b, logits_at=torch.tensor([T - 1]))
            rows.append(verify.target_probs(logits, torch.tensor([temperature]), torch.tensor([top_k]),
                                            torch.tensor([top_p]))[0].double())
        probs = (probs[:, None] * torch.stack(rows)).flatten()
        seqs = [s + [v] for s in seqs for v in range(V)]
    return seqs, probs


@pytest.mark.parametrize("spec,top_k,top_p", [("ngram", 0, 1.0), ("ngram", 5, 0.9), ("spark", 0, 1.0),
                                               ("spark", 4, 0.8), ("hybrid", 0, 1.0)])
def test_sampling_keeps_the_target_distribution(spec, top_k, top_p):
    """Chi-square over the joint law of three generated tokens: the first from prefill, the next
    two through drafts (n-gram copies, Spark tokens with their own q, or the price's choice of
    either) that are sometimes accepted and sometimes rejected."""
    V, n, draws = 6, 3, 6000
    # Drafts cost nothing here, so the plan verifies some on every step, however poor they are.
    llm = tiny_llm(spec, seed=5, initializer_range=0.25, vocab_size=V, max_batch_size=64,
                   cost=CostModel([1, 1025], [1.0, 1.0]))
    if llm.engine.ngram:
        llm.engine.ngram.n_min = 1  # a short alphabet: match on one token so drafts exist every step
    prompt = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2]
    seqs, p = exact_sequence_probs(llm, prompt, n, 1.0, top_k, top_p)
    params = [SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p, max_tokens=n, seed=i) for i in range(draws)]
    outs = llm.generate([prompt] * draws, params)
    stats = llm.stats()
    assert stats["ngram"] + stats["spark"] > draws * 0.02  # the test exercises accepted drafts
    if spec == "hybrid":
        assert min(stats["ngram"], stats["spark"]) > 0
    index = {tuple(s): i for i, s in enumerate(seqs)}
    counts = torch.zeros(len(seqs), dtype=torch.float64)
    for o in outs:
        counts[index[tuple(o.token_ids)]] += 1
    expected = p * draws
    assert counts[expected == 0].sum() == 0, "sampled a sequence the target gives probability 0"
    # Pool rare cells so the chi-square approximation holds.
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    chi2 = (((obs - exp) ** 2) / exp)[keep].sum().item()
    dof = int(keep.sum()) - 1
    # Wilson-Hilferty: the 0.999 quantile of chi-square(dof).
    z = 3.09
    crit = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    assert chi2 < crit, f"chi2={chi2:.1f} over {dof} dof exceeds {crit:.1f}"


def test_stop_rules():
    llm = tiny_llm("ngram", initializer_range=0.02, vocab_size=128)
    prompt = [104, 105, 106, 107] * 3  # bytes "hijk" repeated; the model then repeats one byte
    free = llm.generate([prompt], GREEDY)[0]
    target = free.token_ids[3]
    by_id = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[target]))[0]
    assert by_id.token_ids == free.token_ids[: free.token_ids.index(target) + 1]
    assert by_id.finish_reason == "stop"
    text = free.text
    stop = text[5:7]
    by_str = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, stop=stop))[0]
    assert by_str.finish_reason == "stop" and by_str.text == text[: text.index(stop)]
    one = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))[0]
    assert one.token_ids == free.token_ids[:1] and one.finish_reason == "length"


def test_too_many_stop_ids_are_refused_saying_where_they_came_from():
    llm = tiny_llm("off", eos=3, vocab_size=64)
    many = SamplingParams(temperature=0, max_tokens=4, stop_token_ids=list(range(10, 18)))
    with pytest.raises(ValueError, match=r"got 9: 8 in stop_token_ids, with the tokenizer's 1 end-of-turn ids "
                                         r"\(ignore_eos=True leaves those out\)"):
        llm.generate([[5, 6]], many)
    assert len(llm.generate([[5, 6]], SamplingParams(**{**vars(many), "ignore_eos": True}))[0].token_ids) == 4


def test_a_token_that_completes_several_stop_strings_ends_the_text_at_the_earliest():
    from conftest import FLAT_COST, ByteTokenizer, tiny_pair

    class Digits(ByteTokenizer):  # every token writes three characters: its id, zero-padded
        def decode_bytes(self, ids: list[int]) -> bytes:
            return "".join(f"{i:03d}" for i in ids if i < 256).encode()

    llm = LLM.from_model(tiny_pair(initializer_range=0.02, vocab_size=128)[1], Digits(), spec="off",
                         max_batch_size=1, max_seq_len=64, cost=FLAT_COST)
    prompt = [104, 105, 106, 107] * 3
    text = llm.generate([prompt], GREEDY)[0].text
    # one token's three characters "xyz", neither "yz" nor "xy" seen before it: both complete
    # with that token, and "xy", listed second, starts first
    at = next(i for i in range(0, len(text), 3) if text[i + 1: i + 3] not in text[: i + 2]
              and text[i: i + 2] not in text[: i + 1])
    stops = [text[at + 1: at + 3], text[at: at + 2]]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, stop=stops))[0]
    assert out.finish_reason == "stop" and out.text == text[:at]


def test_eos_as_first_token_and_cache_end():
    llm = tiny_llm("ngram", initializer_range=0.02, vocab_size=64, max_seq_len=40)
    prompt = [7, 8, 9] * 3
    first = llm.generate([prompt], GREEDY)[0].token_ids[0]
    eos_llm = tiny_llm("ngram", eos=first, initializer_range=0.02, vocab_size=64, max_seq_len=40)
    out = eos_llm.generate([prompt, [3, 4]], SamplingParams(temperature=0, max_tokens=60))
    assert out[0].token_ids == [first] and out[0].finish_reason == "stop"
    long = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=100))[0]
    assert long.finish_reason == "length" and len(prompt) + len(long.token_ids) == 40


def test_stream_deltas_add_up_to_text():
    llm = tiny_llm("ngram", initializer_range=0.3, vocab_size=128)
    prompts = [[104, 101, 108, 108, 111] * 3, [97, 98]]
    params = SamplingParams(temperature=0, max_tokens=20, stop="zz")
    pieces: dict[int, str] = {}
    finals = {}
    for out, delta, _ in llm.stream(prompts, params):
        pieces[out.request_id] = pieces.get(out.request_id, "") + delta
        finals[out.request_id] = out
    assert all(out.finished for out in finals.values())
    assert all(pieces[rid] == out.text for rid, out in finals.items())


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(stop=[""]), "stop"),
])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("prompt,match", [
    ("", "empty"),
    ([], "empty"),
    ([1, 999], "outside the vocabulary"),
    ([1] * 300, "max_seq_len"),
    (3.5, "string or a list"),
])
def test_bad_prompts_are_rejected_before_anything_runs(prompt, match):
    llm = tiny_llm("ngram")
    with pytest.raises(ValueError, match=match):
        llm.generate([[1, 2, 3], prompt], GREEDY)
    assert llm.stats()["requests"] == 0
    assert llm.generate([[1, 2, 3]], GREEDY)[0].finish_reason == "length"  # the engine still serves


def test_unknown_spec():
    with pytest.raises(ValueError, match="unknown spec"):
        tiny_llm("nonsense")


@pytest.mark.parametrize("kwargs,match", [
    (dict(draft_budget=-1), "draft_budget must be an int >= 1"),
    (dict(draft_budget=2.5), "draft_budget must be an int >= 1"),
    (dict(ngram_k=0), "ngram_k must be an int >= 1"),
])
def test_bad_engine_sizes_are_named(kwargs, match):
    from conftest import ByteTokenizer, tiny_pair

    with pytest.raises(ValueError, match=match):
        LLM.from_model(tiny_pair()[1], ByteTokenizer(), spec="ngram", max_batch_size=2, max_seq_len=64, **kwargs)


def test_a_spark_engine_without_a_drafter_says_so():
    from conftest import tiny_pair
    from minispark.engine import Engine

    with pytest.raises(ValueError, match="needs a Spark drafter"):
        Engine(tiny_pair()[1], "spark", 2, 64, spark=None)


def test_more_slots_than_the_largest_row_bucket_all_finish():
    # Rows are stepped in buckets up to 512; a batch beyond it must still step its last rows.
    llm = tiny_llm("off", max_batch_size=513, max_seq_len=16)
    outs = llm.generate([[5, 6]] * 513, SamplingParams(temperature=0, max_tokens=3))
    assert [len(o.token_ids) for o in outs] == [3] * 513
    assert len({tuple(o.token_ids) for o in outs}) == 1  # the same prompt, the same answer in every row


@pytest.mark.parametrize("spec,overlap", [("off", False), ("ngram", True), ("spark", False), ("hybrid", False),
                                          ("hybrid", True)])
def test_requests_left_in_high_slots_move_down_and_keep_every_token(spec, overlap):
    """When early requests finish and none wait, the last ones move into the lowest slots, so
    steps run over 2 rows instead of 8; their tokens, greedy or sampled, are those of each
    request decoded alone (on a GPU, while a step launched before the move is still to be read).
    Sampled rows too where no Spark token is verified: its acceptance draws depend on the chain
    lengths the batch grants, so there only the distribution is kept (chi-square tests)."""
    rng = random.Random(7)
    prompts = random_prompts(rng, 8, 40)
    long = {3, 6}  # the requests that outlive the others (the rest stop within 4 tokens)
    hot = 0.8 if spec in ("off", "ngram") else 0.0
    params = [SamplingParams(temperature=hot if i % 2 else 0.0, max_tokens=40 if i in long else 1 + i % 4,
                             seed=i, ignore_eos=True) for i in range(8)]
    alone_llm = tiny_llm(spec, initializer_range=0.1, vocab_size=40, max_batch_size=1)
    alone = [alone_llm.generate([p], sp)[0].token_ids for p, sp in zip(prompts, params)]
    llm = tiny_llm(spec, initializer_range=0.1, vocab_size=40, max_batch_size=8)
    llm._overlap = overlap
    step, rows = llm.engine.step, []

    def counted_step(R, *args):
        rows.append(R)
        return step(R, *args)

    llm.engine.step = counted_step
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == alone
    small = next(i for i, R in enumerate(rows) if R <= 2)  # once the short requests are done
    assert rows[0] == 8 and max(rows[small:]) <= 2 and len(rows) - small >= 5
    assert llm._slots == [None] * 8 and not llm.engine.active.any()


def test_a_stream_stopped_early_frees_its_slots():
    llm = tiny_llm("ngram", initializer_range=0.3, vocab_size=128, max_batch_size=2)
    params = SamplingParams(temperature=0, max_tokens=30)
    expected = llm.generate([[100, 101, 102]], params)[0].token_ids
    stream = llm.stream([[104, 105], [106, 107], [108, 109]], params)
    first = next(stream)
    stream.close()
    assert first.output.finish_reason == "cancelled"
    assert llm.generate([[100, 101, 102]], params)[0].token_ids == expected  # nothing left running


@pytest.mark.parametrize("spec", ["ngram", "hybrid"])
def test_one_request_of_a_stream_is_cancelled_and_the_others_go_on(spec):
    llm = tiny_llm(spec, initializer_range=0.3, vocab_size=128, max_batch_size=2)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    prompts = [[104, 105], [106, 107], [108, 109], [110, 111]]
    alone = [llm.generate([p], params)[0].token_ids for p in prompts]
    outs = {}
    for delta in llm.stream(prompts, params):
        o = delta.output
        outs[o.request_id] = o
        if len(o.token_ids) >= 3 and o.prompt_token_ids == prompts[1] and not o.finished:
            llm.cancel(o.request_id)  # a running request
            llm.cancel(o.request_id + 2)  # one still waiting for a slot (the fourth prompt)
    by_prompt = {tuple(o.prompt_token_ids): o for o in outs.values()}
    b, d = by_prompt[tuple(prompts[1])], by_prompt[tuple(prompts[3])]
    assert b.finish_reason == "cancelled" and 3 <= len(b.token_ids) < 30
    assert b.token_ids == alone[1][: len(b.token_ids)]
    assert d.finish_reason == "cancelled" and d.token_ids == []
    for i in (0, 2):  # the others, one of them in the freed slot, are unchanged
        assert by_prompt[tuple(prompts[i])].token_ids == alone[i]
        assert by_prompt[tuple(prompts[i])].finish_reason == "length"


def test_trace_accounts_for_every_decoded_token(tmp_path):
    import json

    from conftest import FLAT_COST, ByteTokenizer, tiny_pair

    _, net = tiny_pair(0, initializer_range=0.02, vocab_size=64)
    path = tmp_path / "trace.jsonl"
    llm = LLM.from_model(net, ByteTokenizer(), spec="ngram", max_batch_size=2, max_seq_len=128,
                         cost=FLAT_COST, trace=str(path))
    outs = llm.generate([[5, 6, 7, 8] * 3, [9, 10, 11]], SamplingParams(temperature=0, max_tokens=30))
    steps = [json.loads(line) for line in path.read_text().splitlines()]
    for o in outs:
        mine = [s for step in steps for s in step["slots"] if s["request"] == o.request_id]
        assert len(mine) == o.num_steps
        assert sum(s["emitted"] for s in mine) == len(o.token_ids) - 1  # the first comes from prefill
        assert sum(s["accepted"] for s in mine) == o.accepted["ngram"]
        assert all(s["accepted"] <= s["verified"] <= step["width"] for step in steps for s in step["slots"])
    assert all(step["ms"] > 0 for step in steps)  # every step's own time, as the cost table saw it


def test_a_spec_switch_keeps_the_model_settings_and_the_trace(tmp_path):
    from conftest import FLAT_COST, ByteTokenizer, tiny_pair

    _, net = tiny_pair(0, initializer_range=0.02, vocab_size=64)
    path = tmp_path / "trace.jsonl"
    table = torch.full((4, 9, 8), 0.7)  # [last proposal, m, j]
    llm = LLM.from_model(net, ByteTokenizer(), spec="off", max_batch_size=2, max_seq_len=128, cost=FLAT_COST,
                         trace=str(path), seed=7, ngram_k=8, draft_budget=16, ngram_table=table)
    params = SamplingParams(temperature=0, max_tokens=12)
    before = llm.generate([[5, 6, 7, 8] * 3], params)[0]
    lines = len(path.read_text().splitlines())
    ngram = llm.with_spec("ngram")
    assert (ngram.engine.spec, ngram.engine.S, ngram.engine.L, ngram.seed) == ("ngram", 2, 128, 7)
    assert (ngram.engine.K, ngram.engine.draft_budget, ngram.cost) == (8, 16, FLAT_COST)
    assert torch.equal(ngram.engine.ng_table.cpu(), table)
    after = ngram.generate([[5, 6, 7, 8] * 3], params)[0]
    assert after.token_ids == before.token_ids  # lossless across the switch
    assert len(path.read_text().splitlines()) == lines + after.num_steps  # the trace goes on


def test_closing_an_llm_closes_its_trace_and_it_goes_on_without_one(tmp_path):
    from conftest import FLAT_COST, ByteTokenizer, tiny_pair

    _, net = tiny_pair(0, initializer_range=0.02, vocab_size=64)
    path = tmp_path / "trace.jsonl"
    params = SamplingParams(temperature=0, max_tokens=12)
    with LLM.from_model(net, ByteTokenizer(), spec="ngram", max_batch_size=2, max_seq_len=128, cost=FLAT_COST,
                        trace=str(path)) as llm:
        first = llm.generate([[5, 6, 7, 8] * 3], params)[0]
        trace = llm._trace
    assert trace.closed and len(path.read_text().splitlines()) == first.num_steps
    assert llm.generate([[5, 6, 7, 8] * 3], params)[0].token_ids == first.token_ids
    assert len(path.read_text().splitlines()) == first.num_steps  # nothing written after close
    llm.close()  # twice is fine


def test_non_finite_logits_stop_only_the_affected_request():
    """A NaN in one token's embedding breaks only the requests that read that token: they end
    with finish_reason "error" and a message; the others are unaffected."""
    kw = dict(initializer_range=0.3, vocab_size=64, tie_word_embeddings=False)  # the head stays finite
    clean = tiny_llm("ngram", **kw)
    expected = clean.generate([[5, 6, 7, 5, 6]], GREEDY)[0].token_ids
    poison = next(t for t in range(3, 64) if t not in expected + [5, 6, 7])
    ok_prompt, bad_prompt = [5, 6, 7, 5, 6], [8, poison, 10]
    llm = tiny_llm("ngram", max_batch_size=2, **kw)
    with torch.no_grad():
        llm.engine.model.tok_embeddings.weight[poison] = float("nan")
    ok, bad = llm.generate([ok_prompt, bad_prompt], GREEDY)
    assert bad.finish_reason == "error" and "NaN" in bad.error and bad.token_ids == []
    assert ok.token_ids == expected and ok.finish_reason == "length"
    # The broken request's cache rows do not outlive it: with the embedding mended, a shorter
    # prompt in the same slot (its cache past the prompt still masked, not overwritten) is clean.
    with torch.no_grad():
        llm.engine.model.tok_embeddings.weight[poison] = clean.engine.model.tok_embeddings.weight[poison]
    short = [5, 6]
    again = llm.generate([[9] * 6, short], GREEDY)[1]
    assert again.finish_reason == "length" and again.token_ids == clean.generate([short], GREEDY)[0].token_ids


def test_an_ngram_table_without_every_match_length_is_refused_up_front():
    from conftest import FLAT_COST, ByteTokenizer, tiny_pair

    _, net = tiny_pair(0, vocab_size=64)
    with pytest.raises(ValueError, match="a row for every match length m up to 8"):
        LLM.from_model(net, ByteTokenizer(), spec="ngram", cost=FLAT_COST, ngram_table=torch.full((4, 3, 32), 0.5))


def test_a_cache_that_cannot_fit_is_refused_up_front():
    with pytest.raises(ValueError, match="lower max_seq_len or max_batch_size"):
        tiny_llm("off", max_batch_size=64, max_seq_len=50_000_000)


def test_the_memory_check_steps_aside_where_the_os_cannot_say(monkeypatch):
    from minispark import engine

    assert engine.available_memory() > 0  # Linux: MemAvailable
    monkeypatch.setattr(engine, "available_memory", lambda: None)  # an OS without either count
    assert tiny_llm("off", max_batch_size=2).generate([[5, 6]], GREEDY)[0].finish_reason == "length"


def test_an_idle_slot_longer_than_the_attended_prefix_is_harmless():
    # Slot 0 finishes a long prompt early and stays idle while slot 1 runs on: the step then
    # attends a prefix shorter than slot 0's stale history, which the drafter must not index.
    llm = tiny_llm("ngram", max_batch_size=2, max_seq_len=1024)
    params = [SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)]
    outs = llm.generate(["x" * 700, "abcab"], params)
    alone = tiny_llm("off", max_seq_len=1024).generate("abcab", params[1])[0]
    assert [o.finish_reason for o in outs] == ["length", "length"]
    assert outs[1].token_ids == alone.token_ids


@pytest.mark.parametrize("spec", ["spark", "hybrid"])
def test_the_spark_pass_runs_only_where_it_pays(tmp_path, spec):
    """The host skips Spark's pass on steps where its expected tokens do not pay for its
    time (a cost table says how long it takes); the output stays the greedy one either way."""
    import json

    from conftest import ByteTokenizer, bigram_drafter, tiny_pair
    from minispark.price import CostModel

    prompts = random_prompts(random.Random(3), 4, 16)
    seen = {}
    for spark_s in (0.0, 1e3):
        _, net = tiny_pair(0, initializer_range=0.3, vocab_size=16)
        path = tmp_path / f"{spark_s}.jsonl"
        llm = LLM.from_model(net, ByteTokenizer(), spec=spec, max_batch_size=2, max_seq_len=128,
                             cost=CostModel([1, 1025], [1.0, 1.5], spark=spark_s), drafter=bigram_drafter(net),
                             trace=str(path))
        outs = llm.generate(prompts, GREEDY)
        for p, o in zip(prompts, outs):
            assert o.token_ids == reference_greedy(llm, p, 24)
        passes = [json.loads(line)["spark_pass"] for line in path.read_text().splitlines()]
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
    from minispark.price import CostModel

    net, d = certain_but_wrong_drafter()
    path = tmp_path / "trace.jsonl"
    llm = LLM.from_model(net, ByteTokenizer(), spec="spark", max_batch_size=1, max_seq_len=128,
                         cost=CostModel([1, 1025], [1.0, 1.5], spark=0.5), drafter=d, trace=str(path))
    prompt = [5, 9, 17, 33, 4]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=48))[0]
    assert out.token_ids == reference_greedy(llm, prompt, 48)
    passes = [json.loads(line)["spark_pass"] for line in path.read_text().splitlines()]
    assert all(passes[:3]) and not any(passes[10:10 + SPARK_PATIENCE])
    # Each rejected chain reached one token, estimated certain: trust per token falls from 1.
    assert llm._trust("spark") < 0.5


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
                         cost=CostModel([1, 1025], [1.0, 1.5], spark=0.5), drafter=d, trace=str(path))
    llm.generate([[5, 9, 17, 33, 4]], SamplingParams(temperature=0, max_tokens=120))
    wrong = [json.loads(line)["spark_pass"] for line in path.read_text().splitlines()]
    assert all(wrong[:3]) and 1 <= sum(wrong[10:]) <= len(wrong[10:]) // SPARK_PATIENCE + 1
    prompt = [7, 7, 8, 11, 2]
    want = reference_greedy(llm, prompt, 200)
    with torch.no_grad():
        d.markov_out.weight.zero_()
        for x, y in zip(prompt + want, want):
            d.markov_out.weight[y, x] = 1e3
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=200))[0]
    assert out.token_ids == want
    assert out.accepted["spark"] >= 100 and llm._trust("spark") > 0.8


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
                         cost=CostModel([1, 1025], [1.0, 1.5], spark=0.05), drafter=d, trace=str(path))
    X = reference_greedy(llm, second, 1)[0]
    assert reference_greedy(llm, first, 1)[0] != X
    with torch.no_grad():
        d.conf.weight.zero_()
        d.conf.bias.fill_(3.0)
        d.conf.weight[0, dim + X] = -30.0  # the Markov input of the token before is one-hot
    outs = llm.generate([first, second], GREEDY)
    assert [o.token_ids for o in outs] == [reference_greedy(llm, p, 24) for p in (first, second)]
    steps = [json.loads(line) for line in path.read_text().splitlines()]
    of_second = [s["spark_pass"] for s in steps if s["slots"] and s["slots"][0]["request"] == outs[1].request_id]
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
                         cost=CostModel([1, 1025], [1.0, 1.5], spark=0.5), drafter=d, trace=str(path),
                         adaptive=False)
    prompts = [[5, 9, 17, 33, 4], [7, 7, 8]]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24))
    assert [o.token_ids for o in outs] == [reference_greedy(llm, p, 24) for p in prompts]
    steps = [json.loads(line) for line in path.read_text().splitlines()]
    slots = [slot for s in steps for slot in s["slots"]]
    assert all(s["spark_pass"] for s in steps) and len(slots) >= 2 * 20
    assert all(slot["verified"] == d.args.block for slot in slots)


def test_auto_dtype_follows_the_hardware(monkeypatch):
    from minispark import model

    cpu = torch.device("cpu")
    monkeypatch.setattr(model, "CPU_HAS_BF16", True)
    assert model.resolve_dtype("auto", cpu) == torch.bfloat16
    monkeypatch.setattr(model, "CPU_HAS_BF16", False)
    assert model.resolve_dtype("auto", cpu) == torch.float32
    assert model.resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert model.resolve_dtype("float16", cpu) == torch.float16
    with pytest.raises(ValueError, match="dtype must be 'auto'"):
        model.resolve_dtype("int8", cpu)


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
    assert llm.cost.drift == {}
    outs = llm.generate(prompts, GREEDY)
    steps = llm.stats()["steps"]
    # One entry per kind of step that ran: R rows (a bucket of at most 4) plus its budget.
    assert llm.cost.drift and all(1 <= T <= 4 + llm.engine.draft_budget for T, _ in llm.cost.drift)
    assert len(llm.cost.drift) <= steps
    given = tiny_llm("hybrid")
    assert [o.token_ids for o in given.generate(prompts, GREEDY)] == [o.token_ids for o in outs]
    assert given.cost.drift == {}  # a table passed in is the caller's, and stays as given


def test_the_plan_values_a_budget_only_by_the_pairs_its_step_can_verify(monkeypatch):
    """Each budget's step caps its chains at `chain_width`; the host must price it with the
    survivals of those positions only (not all K of every chain), as the device admits them."""
    from minispark import engine as E

    llm = tiny_llm("ngram", max_batch_size=16, initializer_range=0.02, vocab_size=32)
    seen, live = [], []
    real_worth, real_best = llm._worth, E.price.best_budget

    def worth(rows, queued):
        live.append(len(rows))
        return real_worth(rows, queued)

    def best_budget(n_rows, n_active, a, budgets, cost, spark_pass=False, grids=None):
        seen.append((live[-1], len(a), list(budgets), n_rows, grids))
        return real_best(n_rows, n_active, a, budgets, cost, spark_pass, grids)

    monkeypatch.setattr(llm, "_worth", worth)
    monkeypatch.setattr(E.price, "best_budget", best_budget)
    llm.generate([[5, 6, 7, 8, 9] * 4] * 16, SamplingParams(temperature=0, max_tokens=12))
    K = llm.engine.K
    assert any(0 < pairs < n * K for n, pairs, *_ in seen)  # some steps cut chains short
    for n, pairs, budgets, R, grids in seen:
        widths = {E.chain_width(K, B, n) for B in budgets}
        W = widths.pop()
        assert not widths and pairs <= n * W
        # Each budget is priced at the grid of its own widest admitted chain, within the cap.
        assert all(R <= g <= R * (min(W, B) + 1) for B, g in zip(budgets, grids))
    assert any(g < R * (min(E.chain_width(K, B, n), B) + 1) for n, _, budgets, R, grids in seen
               for B, g in zip(budgets, grids))  # and some grids are narrower than the cap


def test_with_no_request_waiting_luck_over_the_steps_left_holds_back_drafts(monkeypatch):
    """Sixteen rows expect the same gain, but each chain is all or nothing, and the run ends with
    the row whose chains fared worst: over many steps left, luck evens out and the plan drafts;
    over one, the unluckiest of 16 rows gains nothing, so it drafts nothing."""
    from types import SimpleNamespace

    llm = tiny_llm("ngram", max_batch_size=16)
    K = llm.engine.K
    llm._slots = [SimpleNamespace(known_len=10) for _ in range(16)]
    monkeypatch.setattr(llm, "_worth", lambda rows, queued: [1.0] * 16)
    chain = ([0.5] * 4 + [0.0] * (K - 4), [0.0] * K)  # four tokens, all kept half the time
    for steps_left, drafts in ((1000.0, True), (1.0, False)):
        monkeypatch.setattr(llm, "_left", lambda rows, s=steps_left: ([int(s)] * 16, s))
        llm._gain = [None] * 16
        assert (llm._plan(16, [chain] * 16, queued=False).budget > 0) == drafts
        assert llm._plan(16, [chain] * 16, queued=True).budget > 0  # a queue takes every token


def test_with_no_request_waiting_a_row_that_never_copies_holds_back_every_rows_drafts(monkeypatch):
    """With nothing queued the run ends with its slowest row: while one row's chains promise
    nothing, copies for the others only idle them sooner, so the plan verifies none. With a
    request waiting every copied token counts, and when both rows copy both gain."""
    from types import SimpleNamespace

    llm = tiny_llm("ngram", max_batch_size=2)
    K = llm.engine.K
    llm._slots = [SimpleNamespace(known_len=10), SimpleNamespace(known_len=10)]
    monkeypatch.setattr(llm, "_worth", lambda rows, queued: [1.0, 1.0])
    monkeypatch.setattr(llm, "_left", lambda rows: ([50, 50], 50.0))
    copy, novel = ([0.9] * K, [0.0] * K), ([0.0] * K, [0.0] * K)
    assert llm._plan(2, [copy, novel], queued=False).budget == 0
    assert llm._plan(2, [copy, novel], queued=True).budget > 0
    llm._gain = [None, None]  # both rows' requests start anew
    assert llm._plan(2, [copy, copy], queued=False).budget > 0
