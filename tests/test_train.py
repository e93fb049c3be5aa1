"""train.py: the recipe at toy size end to end, and its pieces on tiny models and made-up data."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import tiny_pair
from minispark import LLM, SamplingParams, dataset, train
from minispark.weights import load_drafter, load_ngram_table

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def toy_drafter(tmp_path_factory) -> Path:
    """scripts/train_gpu.py at toy size, every stage on the demo model (on a GPU where there is
    one, so that a GPU test run covers the script's device paths)."""
    dest = tmp_path_factory.mktemp("drafter")
    subprocess.run([sys.executable, str(ROOT / "scripts" / "train_gpu.py"), str(dest), "--toy",
                    "--keep", str(dest / "kept.jsonl.gz")], check=True, capture_output=True, text=True, timeout=600)
    return dest


def test_the_recipe_writes_a_drafter_that_decodes_losslessly(toy_drafter):
    assert {p.name for p in toy_drafter.iterdir()} >= {"spark.safetensors", "spark.json", "ngram.json"}
    params = SamplingParams(temperature=0, max_tokens=12)
    prompts = ["def add(a, b):\n    return a + b\n\nRepeat the code above.", "Name a colour."]
    hybrid = LLM(spec="hybrid", drafter=str(toy_drafter), dtype="float32", max_batch_size=2, max_seq_len=256)
    got = [o.token_ids for o in hybrid.generate(prompts, params)]
    off = LLM.from_model(hybrid.engine.model, hybrid.tokenizer, spec="off", max_batch_size=2, max_seq_len=256)
    assert got == [o.token_ids for o in off.generate(prompts, params)]


def test_the_data_stage_answers_requests_the_target_wrote_itself(toy_drafter):
    import json

    work = toy_drafter / "work"
    questions = [json.loads(line)["question"] for line in (work / "questions.jsonl").open()]
    prompts = {json.loads(line)["prompt"] for line in (work / "answers.jsonl").open()}
    assert 0 < len(questions) <= 4  # the toy recipe asks for 4
    assert all(dataset.parse_questions(q) == [q] for q in questions) and set(questions) <= prompts
    assert len(prompts) == len(questions) + 8  # and the 8 templated prompts
    kept = dataset.read_jsonl(toy_drafter / "kept.jsonl.gz")
    assert {row["prompt"] for row in kept} == prompts
    assert {row["prompt"] for row in kept if row["own"]} == set(questions)


def test_a_later_run_adds_to_the_kept_answers_and_features_read_them_beside_its_own(toy_drafter, tmp_path):
    """The toy recipe's run kept its answers; a later run in a fresh folder answers only the
    prompts the kept file lacks and adds its answers at the end; the features stage reads the
    kept answers and the run's own that are not kept yet."""
    import json
    import shutil

    from minispark.tokenizer import Tokenizer
    from minispark.weights import default_model

    keep, run = tmp_path / "answers.jsonl.gz", tmp_path / "run"
    shutil.copy(toy_drafter / "kept.jsonl.gz", keep)
    first = dataset.read_jsonl(keep)
    r = train.Recipe(batch=2, max_tokens=8, questions=0, max_prompts=10)
    dataset.stage_data(run, r, minutes=0.01, keep=keep)
    kept = dataset.read_jsonl(keep)
    prompts = [row["prompt"] for row in kept]
    assert kept[: len(first)] == first and len(set(prompts)) == len(prompts)
    assert set(prompts[len(first):]) == set(dataset.training_prompts()[:10]) - set(prompts[: len(first)]) != set()
    assert [row["prompt"] for row in dataset.read_jsonl(run / "answers.jsonl")] == prompts[len(first):]
    assert all(isinstance(row["answer"], str) and not row["own"] for row in kept[len(first):])

    with (run / "answers.jsonl").open("a") as f:  # an answer not kept, as a run without --keep writes
        f.write(json.dumps({"prompt": "Name a colour.", "answer_ids": [11, 12, 2]}) + "\n")
    docs = dataset.documents(run, "answer", Tokenizer.from_path(default_model()), 0, keep=keep)
    assert len(docs) == len(kept) + 1 and docs[-1]["ids"][-3:] == [11, 12, 2]
    assert [d["own"] for d in docs[:-1]] == [row["own"] for row in kept]
    dataset.stage_features(run, r, kinds=("answer",), keep=keep)
    rows = [row for f in sorted((run / "features").glob("*.pt")) for row in torch.load(f, weights_only=False)]
    assert [row["ids"].tolist() for row in rows] == [d["ids"] for d in docs]


def test_requests_are_written_past_the_rounds_of_the_kept_answers(tmp_path):
    from types import SimpleNamespace

    class Writer:  # stands in for the target: one request per completion, named by its seed
        def generate(self, prompts, params):
            return [SimpleNamespace(text=f"What is the number {p.seed}?\n") for p in params]

    kept = [{"prompt": "What is the number 3000?", "answer_ids": [2], "own": True, "round": 2},
            {"prompt": "Name a colour.", "answer_ids": [2], "own": False}]
    r = train.Recipe(batch=1, questions=3)
    questions = dataset.self_written_questions(tmp_path, Writer(), r, deadline=0, kept=kept)
    rounds = [row["round"] for row in dataset.read_jsonl(tmp_path / "questions.jsonl")]
    assert questions == [f"What is the number {3000 + i}?" for i in (1, 2, 3)]  # the kept one is not asked again
    assert rounds == [3, 3, 3]


def test_a_later_run_answers_only_requests_from_its_own_rounds(tmp_path):
    """New text for a drafter that has seen the templated prompts and a run's requests:
    writing starts at `first_round`, and only the requests are answered."""
    import json

    r = train.Recipe(batch=4, max_tokens=12, questions=4, question_tokens=24, first_round=5, templates=False)
    dataset.stage_data(tmp_path, r, minutes=0.01)
    rows = [json.loads(line) for line in (tmp_path / "questions.jsonl").open()]
    prompts = [json.loads(line)["prompt"] for line in (tmp_path / "answers.jsonl").open()]
    assert rows and {row["round"] for row in rows} == {5}  # one round (the time is up), the first asked for
    assert sorted(prompts) == sorted(row["question"] for row in rows)


def test_a_damaged_or_foreign_drafter_is_refused_with_the_file_named(toy_drafter, tmp_path):
    import json

    from minispark.model import ModelArgs

    _, tiny = tiny_pair()
    with pytest.raises(ValueError, match="trained for a target shaped"):
        load_drafter(toy_drafter, tiny.args, torch.float32, "cpu")
    demo = ModelArgs(**json.loads((toy_drafter / "spark.json").read_text())["target"])
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "spark.json").write_text((toy_drafter / "spark.json").read_text())
    data = (toy_drafter / "spark.safetensors").read_bytes()
    (broken / "spark.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="spark.safetensors"):
        load_drafter(broken, demo, torch.float32, "cpu")
    (broken / "ngram.json").write_text('{"table": [[0.5, 2.0]]}')
    with pytest.raises(ValueError, match="ngram.json"):
        load_ngram_table(broken)


def tiny_corpus(n_docs: int = 24, seed: int = 0):
    """Features of a tiny random model over documents that repeat themselves (learnable)."""
    _, net = tiny_pair(seed, num_hidden_layers=3, vocab_size=64, initializer_range=0.2)
    net.setup_cache(1, 256)
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n_docs):
        frag = torch.randint(3, 64, (12,), generator=g).tolist()
        r = dataset.doc_features(net, frag * 6, (0, 2))
        r.update(held_out=i % 6 == 0, kind="answer")
        rows.append(r)
    return net, dataset.Corpus([r for r in rows if not r["held_out"]]), dataset.Corpus([r for r in rows if r["held_out"]])


def test_training_steps_lower_the_loss():
    net, corpus, _ = tiny_corpus()
    r = train.Recipe(draft_vocab=64, block=4, rank=16, layers=(0, 2))
    d = train.new_drafter(net, corpus, r).attach(net)
    opt = torch.optim.AdamW([p for p in d.parameters() if p.requires_grad], lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    ce, tv = [], []
    for _ in range(60):
        batch = dataset.block_batch(corpus, torch.randint(0, len(corpus), (8,), generator=gen), 72, 8, 4, gen)
        parts = train.losses(d, batch, *train.drafter_outputs(d, batch))
        opt.zero_grad()
        parts["loss"].backward()
        opt.step()
        ce.append(parts["ce"].item())
        tv.append(parts["tv"].item())
    # The tiny target is nearly flat, so TV has a high floor; the repeated text is learnable.
    assert sum(ce[-10:]) < 0.8 * sum(ce[:10])
    assert sum(tv[-10:]) < sum(tv[:10])


def test_a_run_can_go_on_from_a_shipped_drafter_with_its_calibration_undone(tmp_path):
    from safetensors.torch import load_file, save_file

    from minispark.weights import load_drafter, save_drafter

    net, corpus, _ = tiny_corpus()
    r = train.Recipe(draft_vocab=64, block=4, rank=16, layers=(0, 2))
    shipped = train.new_drafter(net, corpus, r)
    torch.nn.init.normal_(shipped.markov_in.weight, std=0.5)  # unlike any new drafter
    shipped.conf_temp.fill_(3.0)
    shipped.conf_bias.fill_(-0.5)
    save_drafter(tmp_path, shipped, net.args)
    d = train.starting_drafter(net, corpus, r, None, tmp_path)
    for name, t in shipped.state_dict().items():
        if name not in ("conf_temp", "conf_bias"):
            assert torch.equal(d.state_dict()[name].float(), t.to(torch.bfloat16).float()), name
    assert (d.conf_temp == 1).all() and (d.conf_bias == 0).all()
    sd = load_file(tmp_path / "spark.safetensors")
    del sd["conf_bias"]  # a drafter saved before the shift existed
    save_file(sd, tmp_path / "spark.safetensors")
    old = load_drafter(tmp_path, net.args, torch.float32, "cpu")
    assert (old.conf_bias == 0).all() and (old.conf_temp == 3).all()
    fresh = train.starting_drafter(net, corpus, r, None, None)
    assert not torch.equal(fresh.markov_in.weight, d.markov_in.weight)
    ckpt = {"args": d.args.__dict__, "model": fresh.state_dict()}
    assert torch.equal(train.starting_drafter(net, corpus, r, ckpt, tmp_path).markov_in.weight,
                       fresh.markov_in.weight)  # the run's own checkpoint comes first


def test_sequential_calibration_fixes_overconfidence():
    g = torch.Generator().manual_seed(0)
    true_logit = torch.randn(4000, 5, generator=g)
    accepted = torch.rand(4000, 5, generator=g) < torch.sigmoid(true_logit)
    alive = accepted.long().cumprod(-1).float()
    temps, bias, before, after = train.fit_calibration(3 * true_logit, alive)  # three times too confident
    assert all(a <= b + 1e-9 for a, b in zip(after, before))
    assert after[0] < 0.03 < before[0]
    assert 2.0 < temps[0] < 4.5 and abs(bias[0]) < 0.5


def test_a_shift_corrects_what_a_temperature_cannot():
    # Confident drafts on text the drafter has not seen: scored 0.6-0.9, accepted a third of the
    # time. A temperature only pulls a confidence toward 1/2, still too high; a shift lowers it.
    g = torch.Generator().manual_seed(0)
    z = 0.5 + 1.7 * torch.rand(6000, 3, generator=g)
    alive = (torch.rand(6000, 3, generator=g) < 0.33).long().cumprod(-1).float()
    no_shift = train.fit_calibration(z, alive, bias_grid=torch.zeros(1))
    temps, bias, before, after = train.fit_calibration(z, alive)
    assert no_shift[3][0] > 0.15 and after[0] < 0.03
    assert bias[0] < -0.3


def test_calibration_takes_unseen_answers_to_self_written_requests(tmp_path):
    rows = [{"kind": "answer", "held_out": i % 3 == 0, "own": i % 2 == 0, "ids": torch.arange(20, dtype=torch.int32),
             "feats": torch.zeros(20, 2, 4), "top_ids": torch.zeros(20, 2, dtype=torch.int32),
             "top_p": torch.zeros(20, 2), "start": 5} for i in range(300)]
    (tmp_path / "features").mkdir()
    torch.save(rows, tmp_path / "features" / "answer-0000-300.pt")
    held, what = dataset.calibration_corpus(tmp_path, None)
    assert len(held) == 50 and what.startswith("50 answers to self-written")  # held out and own
    mine, _ = dataset.calibration_corpus(tmp_path, tmp_path)  # another run's drafter: none of them seen
    assert len(mine) == 150
    for r in rows:
        r["own"] = False  # no self-written requests: all held-out answers
    torch.save(rows, tmp_path / "features" / "answer-0000-300.pt")
    held, what = dataset.calibration_corpus(tmp_path, None)
    assert len(held) == 100 and what == "100 held-out answers"


def test_ngram_replay_and_table():
    # The "answer" repeats the prompt: after the first tokens every proposal is right.
    prompt = list(range(10, 40))
    docs = [(prompt + prompt, len(prompt))] * 3 + [([5, 6, 7, 5, 6, 8, 9, 5, 6, 7, 1, 2], 3)]
    log = train.simulate_ngram(docs, k=8)
    assert log["reached"].shape[1] == 8 and (log["accepted"] <= log["reached"]).all()
    table = train.fit_ngram_table(log, n_max=8, k=8)
    assert table.shape == (4, 9, 8) and ((table >= 0) & (table <= 1)).all()
    rate = log["accepted"][log["reached"]].float().mean()
    assert 0.5 < rate < 1  # copies mostly right, the made-up last document not always
    assert train.table_ece(table, log) < 0.2


def test_anchors_start_where_a_document_says():
    rows = [{"ids": torch.arange(n), "feats": torch.zeros(n, 2, 4), "top_ids": torch.zeros(n, 3, dtype=torch.long),
             "top_p": torch.zeros(n, 3), "kind": "answer", "start": s} for n, s in ((40, 25), (30, 1), (12, 50))]
    corpus = dataset.Corpus(rows)
    docs = torch.tensor([0, 1, 2])
    p = dataset.block_batch(corpus, docs, 64, 200, 4, torch.Generator().manual_seed(0), lo=corpus.start)["anchor_pos"]
    assert (p[0] >= 25).all() and (p[0] <= 38).all() and p[0].min() == 25  # inside [start, n - 2]
    assert p[1].min() == 1 and p[1].max() == 28
    assert (p[2] == 10).all()  # a start past the end is clamped to the last anchor there is
    default = dataset.block_batch(corpus, docs, 64, 200, 4, torch.Generator().manual_seed(0))["anchor_pos"]
    assert default[0].min() == 1


def test_answer_documents_start_their_anchors_at_the_answer(tmp_path):
    import json

    from minispark.tokenizer import Tokenizer
    from minispark.weights import default_model

    tok = Tokenizer.from_path(default_model())
    (tmp_path / "answers.jsonl").write_text(json.dumps({"prompt": "Name a colour.", "answer_ids": [11, 12, 13]}) + "\n")
    [doc] = dataset.documents(tmp_path, "answer", tok, 0)
    assert doc["ids"][doc["start"]:] == [11, 12, 13]
    assert doc["ids"][: doc["start"]] == tok.encode_chat([{"role": "user", "content": "Name a colour."}])


def test_requests_the_target_writes_are_read_off_its_list_until_it_strays():
    text = ("How do volcanoes form?\n- I cheated 3 times.\n- Write a poem about rain.\n- ok?\n"
            "- Describe a day at the beach\n- Compare two sorting algorithms.\nThat is all.\n- Explain gravity.")
    assert dataset.parse_questions(text) == ["How do volcanoes form?", "Write a poem about rain.",
                                           "Compare two sorting algorithms."]
    prompt = dataset.question_prompt("rivers", __import__("random").Random(0))
    assert prompt.endswith("\n- ") and "about rivers" in prompt
    assert all(dataset.parse_questions(e) == [e] for e in dataset.QUESTION_EXAMPLES)  # the examples pass the filter


def test_the_mt_bench_evaluation_reports_acceptance_and_calibration(toy_drafter):
    report = train.stage_eval(toy_drafter, train.Recipe(), prompts=3, max_tokens=24)
    g = len(report["slot_acceptance"])
    assert report["prompts"] == 3 and 0 < report["answer_tokens"] <= 72 and report["blocks"] > 0
    assert 1 <= report["tokens_per_step"] <= 1 + g
    assert all(0 <= x <= 1 for x in report["slot_acceptance"] + report["survival_ece"])
    assert len(report["survival_ece_uncalibrated"]) == g
    assert (toy_drafter / "mt_bench.json").exists()


def test_feature_layers_spread_over_any_depth():
    assert train.spread_layers(30) == (1, 8, 15, 22, 29)  # the shipped drafter's
    for n in range(1, 50):
        layers = train.Recipe().feature_layers(n)
        assert layers == tuple(sorted(set(layers))) and 0 <= layers[0] and layers[-1] == n - 1
    assert train.Recipe(layers=(0, 2)).feature_layers(30) == (0, 2)


def test_another_target_needs_its_own_dest(capsys):
    with pytest.raises(SystemExit):
        train.main(["calibrate", "--model", "/some/other/model.gguf"])
    assert "--dest is required with --model" in capsys.readouterr().err


def test_an_unknown_document_kind_is_named(capsys):
    with pytest.raises(SystemExit):
        train.main(["features", "--kinds", "answr"])
    assert "unknown answr" in capsys.readouterr().err



def test_the_gpu_script_refuses_an_init_that_is_no_drafter(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "train_gpu.py"), str(tmp_path / "d"), "--toy",
                           "--init", str(tmp_path)], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 2 and "no spark.json there" in done.stderr
    assert not (tmp_path / "d").exists()  # refused before any stage ran


def test_a_features_rerun_redoes_only_a_last_shard_that_has_grown(tmp_path):
    import json

    def answers(n):
        with (tmp_path / "answers.jsonl").open("w") as f:
            for i in range(n):
                f.write(json.dumps({"prompt": f"Say {i}.", "answer_ids": [28, 29 + i, 2]}) + "\n")

    feats, recipe = tmp_path / "features", train.Recipe()
    answers(4)
    dataset.stage_features(tmp_path, recipe, kinds=("answer",), shard_docs=3)
    assert sorted(p.name for p in feats.iterdir()) == ["answer-0000-3.pt", "answer-0001-1.pt"]
    full = (feats / "answer-0000-3.pt").stat().st_mtime_ns
    answers(5)  # the last shard grows, and is still not full
    dataset.stage_features(tmp_path, recipe, kinds=("answer",), shard_docs=3)
    assert sorted(p.name for p in feats.iterdir()) == ["answer-0000-3.pt", "answer-0001-2.pt"]
    assert (feats / "answer-0000-3.pt").stat().st_mtime_ns == full  # the full shard is not redone
    assert len(torch.load(feats / "answer-0001-2.pt", weights_only=False)) == 2
