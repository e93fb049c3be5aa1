"""The user API on tiny random models: stop rules, streaming, cancellation, the trace, stats,
and bad input refused with a clear error."""
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
from minispark.planner import PATIENCE, TRUST_PRIOR, CostModel

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


def test_ngram_accepts_copies_and_counts_sources():
    llm = tiny_llm("ngram", initializer_range=0.02, vocab_size=32)
    out = llm.generate([[5, 6, 7, 8, 9] * 4], SamplingParams(temperature=0, max_tokens=40))[0]
    assert out.accepted["ngram"] > len(out.token_ids) // 3  # a model that repeats itself is copied, many tokens a step
    assert sum(out.accepted.values()) == len(out.token_ids)
    assert out.num_steps < 0.6 * len(out.token_ids)
    s = llm.stats()
    assert s["tokens"] == len(out.token_ids) and s["ngram"] == out.accepted["ngram"]


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
    with pytest.raises(ValueError, match="needs a Spark drafter"):
        LLM.from_model(tiny_pair()[1], ByteTokenizer(), spec="spark", max_batch_size=2, max_seq_len=64)


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
    assert (ngram.spec, ngram.engine.S, ngram.engine.L, ngram.seed) == ("ngram", 2, 128, 7)
    assert (ngram.engine.K, max(ngram.planner.budgets), ngram.planner.cost) == (8, 16, FLAT_COST)
    assert torch.equal(ngram.engine.drafters[0].table.cpu(), table)
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


def test_auto_dtype_follows_the_hardware(monkeypatch):
    from minispark import cpu as cpu_kernels

    cpu = torch.device("cpu")
    monkeypatch.setattr(cpu_kernels, "CPU_HAS_BF16", True)
    assert cpu_kernels.resolve_dtype("auto", cpu) == torch.bfloat16
    monkeypatch.setattr(cpu_kernels, "CPU_HAS_BF16", False)
    assert cpu_kernels.resolve_dtype("auto", cpu) == torch.float32
    assert cpu_kernels.resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert cpu_kernels.resolve_dtype("float16", cpu) == torch.float16
    with pytest.raises(ValueError, match="dtype must be 'auto'"):
        cpu_kernels.resolve_dtype("int8", cpu)
