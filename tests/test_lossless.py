"""Losslessness on tiny random models: every mode writes plain greedy decoding's tokens, and
sampling keeps the target's distribution, across batch shapes, slots, compaction and overlap."""
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
from minispark.drafters import NgramDrafter
from minispark.model import Batch
from minispark.planner import PATIENCE, TRUST_PRIOR, CostModel

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


@pytest.mark.parametrize("spec", ["off", "ngram", "spark", "hybrid"])
def test_greedy_equals_recomputation(spec):
    llm = tiny_llm(spec, initializer_range=0.3, vocab_size=16, max_batch_size=3)
    prompts = random_prompts(random.Random(1), 6, 16)
    outs = llm.generate(prompts, GREEDY)
    for p, o in zip(prompts, outs):
        assert o.token_ids == reference_greedy(llm, p, 24)
        assert o.finish_reason == "length"


@pytest.mark.parametrize("spec", ["ngram", "spark", "hybrid", "three"])
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
    assert sum(n for o in b for k, n in o.accepted.items() if k != "target") > 0


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
                                               ("spark", 4, 0.8), ("hybrid", 0, 1.0),
                                               ("three", 0, 1.0)])
def test_sampling_keeps_the_target_distribution(spec, top_k, top_p):
    """Chi-square over the joint law of three generated tokens: the first from prefill, the next
    two through drafts (n-gram copies, Spark tokens with their own q, or the price's choice of
    either) that are sometimes accepted and sometimes rejected."""
    V, n, draws = 6, 3, 6000
    # Drafts cost nothing here, so the plan verifies some on every step, however poor they are.
    llm = tiny_llm(spec, seed=5, initializer_range=0.25, vocab_size=V, max_batch_size=64,
                   cost=CostModel([1, 1025], [1.0, 1.0]))
    for d in llm.engine.drafters:
        if isinstance(d, NgramDrafter):
            d.n_min = 1  # a short alphabet: match on one token so drafts exist every step
    prompt = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2]
    seqs, p = exact_sequence_probs(llm, prompt, n, 1.0, top_k, top_p)
    params = [SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p, max_tokens=n, seed=i) for i in range(draws)]
    outs = llm.generate([prompt] * draws, params)
    stats = llm.stats()
    assert stats["tokens"] - stats["target"] > draws * 0.02  # the test exercises accepted drafts
    if spec == "hybrid":  # both drafters' tokens were accepted, and so took part
        assert min(stats["ngram"], stats["spark"]) > 0
    if spec == "three":  # the plug-in's tokens, and another drafter's, were accepted
        assert stats["bigram"] > 0 and stats["ngram"] + stats["spark"] > 0
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


def test_more_slots_than_the_largest_row_bucket_all_finish():
    # Rows are stepped in buckets up to 512; a batch beyond it must still step its last rows.
    llm = tiny_llm("off", max_batch_size=513, max_seq_len=16)
    outs = llm.generate([[5, 6]] * 513, SamplingParams(temperature=0, max_tokens=3))
    assert [len(o.token_ids) for o in outs] == [3] * 513
    assert len({tuple(o.token_ids) for o in outs}) == 1  # the same prompt, the same answer in every row
