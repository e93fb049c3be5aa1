"""bench.py: systems take turns on parts of the prompt set, and the command writes its table."""
from __future__ import annotations

import pytest

from minispark import bench


def test_systems_take_turns_on_parts_and_each_sees_every_prompt_once():
    calls = []

    def system(name):
        def run(part):
            calls.append((name, tuple(part)))
            return bench.Result(name, "", 2, tokens=len(part), seconds=1.0, steps=1, chains={"ngram": 1, "spark": 0})
        return run

    prompts = [[i] for i in range(9)]
    results = bench.run_row({"a": system("a"), "b": system("b")}, prompts, batch=2, rounds=3)
    assert [name for name, _ in calls] == ["a", "b", "b", "a", "a", "b"]  # reversed on every other part
    for name in "ab":
        seen = sorted(p for n, part in calls if n == name for p in part)
        assert seen == [[i] for i in range(9)]
    a, b = results
    assert (a.system, a.tokens, a.seconds, a.steps, a.chains) == ("a", 9, 3.0, 3, {"ngram": 3, "spark": 0})
    # Parts hold at least a batch of prompts: 9 prompts at batch 4 make two parts, at batch 16 one.
    calls.clear()
    bench.run_row({"a": system("a")}, prompts, batch=4, rounds=3)
    assert len(calls) == 2
    calls.clear()
    bench.run_row({"a": system("a")}, prompts, batch=16, rounds=1)
    assert len(calls) == 1 and len(calls[0][1]) == 9
    # Prompts for one part run twice, once in each order, so the systems still take turns.
    calls.clear()
    a, b = bench.run_row({"a": system("a"), "b": system("b")}, prompts, batch=16, rounds=3)
    assert [name for name, _ in calls] == ["a", "b", "b", "a"] and all(len(part) == 9 for _, part in calls)
    assert (a.tokens, a.seconds) == (18, 2.0)


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
