"""bench.py: systems take turns on parts of the prompt set, and the command writes its table."""
from __future__ import annotations

import pytest
from conftest import FLAT_COST, ByteTokenizer, tiny_pair

from minispark import LLM, SamplingParams, bench


def test_systems_take_turns_piece_by_piece_on_parts_and_each_sees_every_prompt_once():
    calls = []

    def system(name, pieces=2):
        def run(part):
            for k in range(pieces):
                calls.append((name, k, tuple(part)))
                yield
            return bench.Result(name, "", 2, tokens=len(part), seconds=1.0, steps=1, chains={"ngram": 1, "spark": 0})
        return run

    prompts = [[i] for i in range(9)]
    results = bench.run_row({"a": system("a"), "b": system("b", pieces=3)}, prompts, batch=2, rounds=3)
    # Within a part the systems alternate piece by piece, the one with work left going on
    # alone; every other part starts with the last system.
    assert [(name, k) for name, k, _ in calls] == [("a", 0), ("b", 0), ("a", 1), ("b", 1), ("b", 2),
                                                   ("b", 0), ("a", 0), ("b", 1), ("a", 1), ("b", 2),
                                                   ("a", 0), ("b", 0), ("a", 1), ("b", 1), ("b", 2)]
    for name in "ab":
        seen = sorted(p for n, k, part in calls if n == name and k == 0 for p in part)
        assert seen == [[i] for i in range(9)]
    a, b = results
    assert (a.system, a.tokens, a.seconds, a.steps, a.chains) == ("a", 9, 3.0, 3, {"ngram": 3, "spark": 0})
    # Parts hold at least a batch of prompts: 9 prompts at batch 4 make two parts, at batch 16 one.
    calls.clear()
    bench.run_row({"a": system("a", 1)}, prompts, batch=4, rounds=3)
    assert len(calls) == 2
    calls.clear()
    bench.run_row({"a": system("a", 1)}, prompts, batch=16, rounds=1)
    assert len(calls) == 1 and len(calls[0][2]) == 9
    # Prompts for one part run twice, once in each order, so the systems still take turns.
    calls.clear()
    a, b = bench.run_row({"a": system("a", 1), "b": system("b", 1)}, prompts, batch=16, rounds=3)
    assert [name for name, _, _ in calls] == ["a", "b", "b", "a"] and all(len(part) == 9 for _, _, part in calls)
    assert (a.tokens, a.seconds) == (18, 2.0)


def test_modes_on_twins_of_one_model_interleave_steps_and_keep_their_answers():
    # Each LLM writes the KV cache of its model: two taking turns step by step on one model
    # read each other's keys (here both answers then part from decoding alone). A twin shares
    # the weights and holds a cache of its own. (Untied embeddings: this tiny random model's
    # greedy answers then vary, rather than repeat the prompt's last token.)
    _, net = tiny_pair(tie_word_embeddings=False)
    other = bench.twin(net)
    assert other is not net and other.output.weight is net.output.weight
    prompts = [list(b"def add(a, b): return a + b\n" * 2), list(b"abcabcabc"), list(b"the cat sat on")]

    def llm(model, spec):
        return LLM.from_model(model, ByteTokenizer(), spec=spec, max_batch_size=2, max_seq_len=128, cost=FLAT_COST)

    alone = {spec: llm(model, spec).generate(prompts, SamplingParams(temperature=0.0, max_tokens=24))
             for model, spec in ((net, "off"), (other, "ngram"))}
    llms = {"off": llm(net, "off"), "ngram": llm(other, "ngram")}
    systems = {m: (lambda part, m=m: bench.run_minispark(llms[m], m, part, 2, 24, 0.0)) for m in llms}
    off, ngram = bench.run_row(systems, prompts, batch=2, rounds=1)
    assert off.answers == ngram.answers == [o.token_ids for o in alone["off"]]
    assert [o.token_ids for o in alone["ngram"]] == off.answers
    assert ngram.steps < off.steps  # the n-gram drafts were taken, in turns with off's steps
    assert off.tokens == sum(len(o.token_ids) for o in alone["off"]) and off.seconds > 0


def test_the_command_writes_a_table_with_ratios(tmp_path):
    out = tmp_path / "t.md"
    bench.main(["--modes", "off,ngram-fixed", "--peers", "none", "--workloads", "code", "--batch", "1", "--n", "2",
                "--max-tokens", "8", "--rounds", "2", "--dtype", "float32", "--out", str(out)])
    lines = out.read_text().splitlines()
    assert "float32" in lines[0] and "2 prompts, answers of at most 8 (code) tokens" in lines[0]
    head, row = lines[2], lines[4]
    # ngram-fixed: n-gram chains verified whole on every step, the baseline of adaptive verification
    assert "off tok/s" in head and "ngram-fixed / off" in head and "ngram-fixed tok/step" in head
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[:2] == ["code", "1"] and float(cells[2]) > 0 and cells[4].endswith("x")
    # float32 and greedy: the n-gram answers are off's, token for token
    assert "answers as off's (ngram-fixed)" in head and cells[-1] == "2 of 2"


def test_the_table_counts_the_answers_each_system_shares_with_off():
    def result(system, answers):
        return bench.Result(system, "code", 4, tokens=10, seconds=1.0, steps=2, answers=answers)

    rows = [result("off", [[1, 2], [3], [4, 5]]), result("ngram", [[1, 2], [3, 9], [4, 5]]),
            result("hybrid", [[1, 2], [3], [4, 5]]), bench.Result("hf", "code", 4, tokens=10, seconds=2.0,
                                                                   answers=[[7], [3], [4, 5]])]
    head, _, row = bench.render(rows, "off", greedy=True).splitlines()
    assert head.strip("| ").endswith("answers as off's (ngram, hybrid, hf)")
    assert row.strip("| ").endswith("2 · 3 · 2 of 3")
    # sampling: answers differ by design, so no such column
    assert "answers as off's" not in bench.render(rows, "off", greedy=False)


def test_max_tokens_is_one_length_or_one_per_workload():
    assert bench.per_workload("96", ["code", "chat"]) == {"code": 96, "chat": 96}
    assert bench.per_workload("code=512,chat=96", ["chat"]) == {"chat": 96}
    for bad, says in [("code=512", "no length for chat"), ("code=a,chat=1", "whole numbers"),
                      ("0", "at least 1")]:
        with pytest.raises(ValueError, match=says):
            bench.per_workload(bad, ["code", "chat"])


def test_peers_are_refused_when_sampling(capsys):
    # transformers' generate runs greedy here: set beside sampled minispark, it would measure another task.
    with pytest.raises(SystemExit):
        bench.main(["--peers", "hf", "--temperature", "0.7"])
    assert "with --temperature above 0 add --peers none" in capsys.readouterr().err
