"""The drafter's training data: prompts, the target's greedy answers to them, text it reads, the
target's features of all of it (`python -m minispark.train data|features`), and the corpus and
batches that the fit and the calibration read from those features.

A run's files live in its work folder; answers can also be kept in a gzip JSON-lines file
(`--keep`, e.g. checkpoints/smollm2-135m-instruct/answers.jsonl.gz) that later runs read and add
to instead of answering the same prompts again."""
from __future__ import annotations

import ast
import gzip
import hashlib
import json
import random
import sysconfig
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pydoc_data.topics
import torch
from rich.progress import Progress

from .model import Batch
from .tokenizer import Tokenizer
from .workloads import _local_name, edit_request

if TYPE_CHECKING:
    from .train import Recipe

DATA = Path(__file__).parent / "data"
KINDS = ("text", "answer")  # documents: text the target reads, its answers
TOPK = 16  # the teacher's distribution is kept as its top-k tokens (most of its mass)


def lines(name: str) -> list[str]:
    return [t for t in (DATA / name).read_text().splitlines() if t.strip()]


# Prompts on many topics, in the kinds of request a chat benchmark asks, so the drafter hears the
# target's voice in each; and a few-shot list that the target continues with requests of its own
# (a 135M model asked outright to write one answers the instruction instead): text phrased as no
# template is.
TEMPLATES = tuple(lines("templates.txt"))
QUESTION_EXAMPLES = tuple(lines("request-examples.txt"))
# Most lines the target writes are statements ("I cheated 3 times."); a request starts with one of these.
REQUEST_VERBS = set("""act analyze build calculate choose compare compose convert create describe design
    develop discuss draft evaluate explain find generate give help identify imagine implement list
    make name outline plan prepare pretend propose provide recommend rewrite share show solve suggest
    summarize tell translate write""".split())


def is_held_out(text: str, share: float = 0.1) -> bool:
    """A stable split by content: the same document is held out on every machine."""
    return int(hashlib.sha1(text.encode()).hexdigest()[:8], 16) / 2**32 < share


def read_jsonl(path: Path | None) -> list[dict]:
    """The rows of a JSON-lines file, gzip-compressed where its name ends in .gz; none if it is missing."""
    if path is None or not path.exists():
        return []
    with (gzip.open(path, "rt") if path.suffix == ".gz" else path.open()) as f:
        return [json.loads(line) for line in f if line.strip()]


# ----------------------------------------------------------------------------- prompts
def training_prompts(seed: int = 0) -> list[str]:
    """Templated prompts on every topic, MBPP's questions and code-edit requests, shuffled so
    that a run stopped early has a share of each."""
    rng = random.Random(seed)
    ts = lines("topics.txt")
    prompts = [tpl.format(t=t, u=rng.choice(ts)) for t in ts for tpl in TEMPLATES]
    prompts += [json.loads(line)["turns"][0] for line in lines("mbpp.jsonl")]
    prompts += code_edit_prompts(rng)
    rng.shuffle(prompts)
    return prompts


def code_edit_prompts(rng: random.Random, limit: int = 200) -> list[str]:
    """Edit requests on a small top-level function of each of `limit` standard-library modules
    (the benchmark's code edits come from HumanEval, which training never sees)."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    rng.shuffle(files)
    prompts = []
    for f in files:
        if len(prompts) >= limit:
            break
        try:
            src = f.read_text()
            tree = ast.parse(src)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        funcs = (ast.get_source_segment(src, node) or "" for node in ast.walk(tree)
                 if isinstance(node, ast.FunctionDef) and node.col_offset == 0)
        code = next((c for c in funcs if 200 < len(c) < 1200), None)
        if code is None:
            continue
        name = code.split("(")[0].removeprefix("def ").strip()
        choices = [f"Rename the function `{name}` to `{name}_new`.", "Add a docstring to this function.",
                   "Add type hints to this function."]
        if var := _local_name(code, name):
            choices.append(f"Rename the variable `{var}` to `{var}_value`.")
        prompts.append(edit_request(code, rng.choice(choices)))
    return prompts


def reading_texts(max_chars: int = 2000) -> list[str]:
    """Text the target reads: the standard library's source and pydoc's topic help, in pieces
    of about `max_chars` cut at line boundaries."""
    docs = list(pydoc_data.topics.topics.values())
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            docs.append(f.read_text())
        except UnicodeDecodeError:
            continue
    pieces = []
    for doc in docs:
        buf = ""
        for line in doc.splitlines(keepends=True):
            buf += line
            if len(buf) >= max_chars:
                pieces.append(buf)
                buf = ""
        if len(buf) > 200:
            pieces.append(buf)
    return pieces


def question_prompt(topic: str, rng: random.Random) -> str:
    examples = "".join(f"- {e}\n" for e in rng.sample(QUESTION_EXAMPLES, 6))
    return f"Requests about {topic} that users sent to an AI assistant, one per line:\n{examples}- "


def parse_questions(text: str) -> list[str]:
    """The requests in a continuation of `question_prompt` (lines that ask something, or
    instructions that start with a verb), up to the first line off the list."""
    out = []
    for i, line in enumerate(text.split("\n")):
        if i and not line.startswith("- "):
            break
        q = line.removeprefix("- ").strip()
        if 15 <= len(q) <= 400 and ("?" in q or q.endswith(".") and q.split()[0].lower() in REQUEST_VERBS):
            out.append(q)
    return out


def self_written_questions(out: Path, llm, r: Recipe, deadline: float, kept: list[dict] | tuple = ()) -> list[str]:
    """Up to `r.questions` new requests written by the target (sampled, one seed per
    completion), in rounds appended to questions.jsonl; a later run starts past the rounds of
    its folder and of the kept answers, so it writes new ones."""
    from . import SamplingParams

    path = out / "questions.jsonl"
    rows = read_jsonl(path)
    questions = [row["question"] for row in rows]
    seen = set(questions) | set(QUESTION_EXAMPLES) | {row["prompt"] for row in kept}
    rounds = [row["round"] for row in rows] + [row["round"] for row in kept if "round" in row]
    first = k = max(r.first_round, 1 + max(rounds, default=-1))
    topics = lines("topics.txt")
    with Progress() as bar, path.open("a") as f:
        task = bar.add_task("self-written requests", total=r.questions, completed=len(questions))
        while len(questions) < r.questions and (k == first or time.time() < deadline):
            rng = random.Random(k)
            prompts = [question_prompt(rng.choice(topics), rng) for _ in range(4 * r.batch)]
            params = [SamplingParams(temperature=1.0, top_p=0.95, max_tokens=r.question_tokens, seed=1000 * k + i)
                      for i in range(len(prompts))]
            for o in llm.generate(prompts, params):
                for q in parse_questions(o.text):
                    if q not in seen and len(questions) < r.questions:
                        seen.add(q)
                        questions.append(q)
                        f.write(json.dumps({"round": k, "question": q}) + "\n")
            f.flush()
            bar.update(task, completed=len(questions))
            k += 1
    return questions


# ----------------------------------------------------------------------------- answers
def stage_data(out: Path, r: Recipe, minutes: float, keep: Path | None = None) -> None:
    """Requests the target writes itself, then its answers to them and to the templated prompts
    until the time is up, appended to answers.jsonl (a rerun goes on where one stopped); prompts
    answered in `keep` are skipped and the new answers added to it. And the reading texts."""
    from . import LLM, SamplingParams

    out.mkdir(parents=True, exist_ok=True)
    texts = out / "text.jsonl"
    if not texts.exists():
        texts.write_text("".join(json.dumps({"text": t}) + "\n" for t in reading_texts()))
    # Unspeculated: on chat at large batches speculation gains little. Eager: a GPU would
    # compile a graph for every batch and context bucket, which costs more than the stage.
    llm = LLM(r.model, spec="off", max_batch_size=r.batch, max_seq_len=1024, device=r.device, compile=False)
    kept = read_jsonl(keep)
    start = time.time()
    # Writing a request takes about as long as answering one: beside the templates, a quarter of the time.
    share = 0.25 if r.templates else 0.45
    questions = self_written_questions(out, llm, r, start + share * 60 * minutes, kept)
    deadline = start + 60 * minutes
    answers = out / "answers.jsonl"
    done = {row["prompt"] for row in read_jsonl(answers) + kept}
    templated = training_prompts()[: r.max_prompts] if r.templates else []
    todo = [p for p in templated + questions if p not in done]
    random.Random(len(done)).shuffle(todo)  # a run stopped early still has a varied share of everything
    params = SamplingParams(temperature=0, max_tokens=r.max_tokens)
    with Progress() as bar, answers.open("a") as f:
        task = bar.add_task("target answers", total=len(todo) + len(done), completed=len(done))
        for i in range(0, len(todo), 4 * r.batch):
            if i and time.time() > deadline:
                break
            chunk = todo[i: i + 4 * r.batch]
            for p, o in zip(chunk, llm.chat([[{"role": "user", "content": p}] for p in chunk], params)):
                f.write(json.dumps({"prompt": p, "answer": o.text, "answer_ids": o.token_ids}) + "\n")
            f.flush()
            bar.advance(task, len(chunk))
    if keep is not None:
        print(f"{keep_answers(out, keep)} new answers added to {keep}")
    print(f"{len(read_jsonl(answers))} answers in {answers}, {len(questions)} self-written requests, "
          f"{sum(1 for _ in texts.open())} reading texts in {texts}")


def keep_answers(out: Path, keep: Path) -> int:
    """Add the run's answers to prompts that `keep` lacks to it, each marked `own` (with its
    round) where the target wrote the request itself. They go in as one more gzip member: a
    reader sees the members as one stream, so the file only ever grows at its end."""
    have = {row["prompt"] for row in read_jsonl(keep)}
    rounds = {row["question"]: row["round"] for row in read_jsonl(out / "questions.jsonl")}
    new = {}
    for row in read_jsonl(out / "answers.jsonl"):
        p = row["prompt"]
        if p not in have:
            new[p] = {**row, "own": p in rounds, **({"round": rounds[p]} if p in rounds else {})}
    if new:
        keep.parent.mkdir(parents=True, exist_ok=True)
        text = "".join(json.dumps(row) + "\n" for row in new.values()).encode()
        with keep.open("ab") as f:
            f.write(gzip.compress(text, mtime=0) if keep.suffix == ".gz" else text)
    return len(new)


def answer_rows(out: Path, keep: Path | None = None) -> list[dict]:
    """The target's answers, one per prompt: those kept in `keep`, then the run's, each with
    `own`, whether the target wrote the request itself. Kept ones first, so that the order
    only grows at the end as runs add to both (the features stage's shards rely on it)."""
    own = {row["question"] for row in read_jsonl(out / "questions.jsonl")}
    rows = {}
    for row in read_jsonl(keep) + read_jsonl(out / "answers.jsonl"):
        rows.setdefault(row["prompt"], {**row, "own": row.get("own", False) or row["prompt"] in own})
    return list(rows.values())


# ----------------------------------------------------------------------------- features
def documents(out: Path, kind: str, tokenizer, max_text_tokens: int, max_len: int = 1024,
              keep: Path | None = None) -> list[dict]:
    """Training documents as token ids with a stable held-out flag: "answer" = chat transcripts
    (prompt and answer, `start` = where the answer begins), "text" = reading texts."""
    if kind == "answer":
        docs = []
        for row in answer_rows(out, keep):
            prompt = tokenizer.encode_chat([{"role": "user", "content": row["prompt"]}])
            docs.append({"ids": (prompt + row["answer_ids"])[:max_len], "held_out": is_held_out(row["prompt"]),
                         "start": len(prompt), "own": row["own"]})
        return docs
    docs, budget = [], max_text_tokens
    for row in read_jsonl(out / "text.jsonl"):
        if budget <= 0:
            break
        ids = tokenizer.encode(row["text"])[:max_len]
        budget -= len(ids)
        docs.append({"ids": ids, "held_out": is_held_out(row["text"]), "start": 1})  # anchors anywhere
    return docs


@torch.no_grad()
def doc_features(model, ids: list[int], layers: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """One forward of the target over a document: its features and its top-k teacher."""
    n, dev = len(ids), model.tok_embeddings.weight.device
    ar = torch.arange(n, device=dev)
    b = Batch(tokens=torch.tensor(ids, device=dev), slot=torch.zeros_like(ar), pos=ar, cell=ar,
              row_slot=slice(0, 1), n_cols=n, ctx_len=n)
    logits, hidden = model(b, hidden_layers=layers)  # [n, V], [n, F, dim]
    top = logits.softmax(-1).topk(TOPK, dim=-1)
    return {"ids": torch.tensor(ids, dtype=torch.int32), "feats": hidden.to(torch.bfloat16).cpu(),
            "top_ids": top.indices.to(torch.int32).cpu(), "top_p": top.values.to(torch.float16).cpu()}


def stage_features(out: Path, r: Recipe, kinds: tuple[str, ...] = KINDS, shard_docs: int = 200,
                   keep: Path | None = None) -> None:
    """Target features of every document (answers: the run's and those kept in `keep`) in
    shards of `shard_docs`, named by index and size: a rerun skips the shards it already has
    and redoes a last one that has grown since."""
    model, path = r.target()
    model.setup_cache(1, 1024)
    tok = Tokenizer.from_path(path)
    layers = r.feature_layers(model.args.n_layers)
    (out / "features").mkdir(exist_ok=True)
    for kind in kinds:
        docs = documents(out, kind, tok, r.text_tokens, keep=keep)
        with Progress() as bar:
            task = bar.add_task(f"target features ({kind})", total=sum(len(d["ids"]) for d in docs))
            for i in range(0, len(docs), shard_docs):
                shard = docs[i: i + shard_docs]
                f = out / "features" / f"{kind}-{i // shard_docs:04d}-{len(shard)}.pt"
                if not f.exists():
                    for old in (out / "features").glob(f"{kind}-{i // shard_docs:04d}-*.pt"):
                        old.unlink()  # the same shard, smaller, from before the data grew
                    rows = [dict(doc_features(model, d["ids"], layers), held_out=d["held_out"], kind=kind,
                                 start=d["start"], own=d.get("own", False)) for d in shard]
                    torch.save(rows, f.with_suffix(".tmp"))
                    f.with_suffix(".tmp").rename(f)
                bar.advance(task, sum(len(d["ids"]) for d in shard))


# ----------------------------------------------------------------------------- batches
class Corpus:
    """The documents of one split, flat: ids [N], feats [N, F, dim], teacher top-k [N, k]."""

    def __init__(self, rows: list[dict]):
        self.lens = torch.tensor([len(r["ids"]) for r in rows])
        self.starts = torch.cumsum(self.lens, 0) - self.lens
        self.ids = torch.cat([r["ids"] for r in rows]).long()
        self.feats = torch.cat([r["feats"] for r in rows])
        self.top_ids = torch.cat([r["top_ids"] for r in rows]).long()
        self.top_p = torch.cat([r["top_p"] for r in rows]).float()
        self.kind = [r["kind"] for r in rows]
        # The first position an anchor may take: in an answer, its start, since the chat template
        # before it is easy text no answer holds (older feature files have none: anywhere).
        self.start = torch.tensor([r.get("start", 1) for r in rows])

    def __len__(self) -> int:
        return len(self.lens)

    def to(self, device: str) -> Corpus:
        """Tokens, features and teacher on `device`, so that a GPU gathers each batch in place;
        the window bookkeeping stays on the host."""
        for k in ("ids", "feats", "top_ids", "top_p"):
            setattr(self, k, getattr(self, k).to(device))
        return self

    def windows(self, docs: torch.Tensor, width: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat indices [B, width] of a random window of each doc (clamped to the doc; the
        caller masks past `n`) and the window lengths n [B]."""
        n = self.lens[docs].clamp(max=width)
        off = (torch.rand(len(docs), generator=gen) * (self.lens[docs] - n + 1)).long()
        at = self.starts[docs, None] + off[:, None] + torch.arange(width)[None, :]
        return torch.minimum(at, (self.starts[docs] + self.lens[docs] - 1)[:, None]), n


def feature_rows(out: Path) -> list[dict]:
    # mmap: the corpus is built without a second copy of every file in memory
    rows = [r for f in sorted((out / "features").glob("*.pt")) for r in torch.load(f, mmap=True)]
    if not rows:
        raise SystemExit(f"no features in {out / 'features'}; run the features stage first")
    return rows


def hold_out_one(rows: list[dict]) -> list[dict]:
    """Tiny runs, where the stable split holds out no answer: hold out the last one."""
    if not any(r["held_out"] and r["kind"] == "answer" for r in rows):
        next(r for r in reversed(rows) if r["kind"] == "answer")["held_out"] = True
    return rows


def load_corpus(out: Path) -> tuple[Corpus, Corpus]:
    rows = hold_out_one(feature_rows(out))
    return Corpus([r for r in rows if not r["held_out"]]), Corpus([r for r in rows if r["held_out"]])


MIN_OWN = 40  # answers to self-written requests enough to calibrate on them alone


def calibration_corpus(out: Path, init: Path | None) -> tuple[Corpus, str]:
    """Answers the drafter never trained on: held out ones, or all of them for a drafter from
    another folder (`init`); of those, the answers to requests the target wrote itself where
    there are enough. The templated prompts are the drafter's home ground, so a calibration
    fitted there is overconfident on requests phrased as a user's."""
    rows = [r for r in feature_rows(out) if r["kind"] == "answer"]
    own = [r for r in rows if r.get("own", False) and (init is not None or r["held_out"])]
    if len(own) >= MIN_OWN:
        return Corpus(own), f"{len(own)} answers to self-written requests"
    held = [r for r in hold_out_one(rows) if r["held_out"]]
    return Corpus(held), f"{len(held)} held-out answers"


def block_batch(corpus: Corpus, docs: torch.Tensor, width: int, anchors: int, g: int, gen: torch.Generator,
                lo: torch.Tensor | None = None) -> dict:
    """Windows of documents and random anchors in them: everything a training step reads."""
    at, n = corpus.windows(docs, width, gen)  # [B, W], [B]
    # Anchors p in [lo, n - 2] (lo >= 1): at least one context position and one token to predict.
    lo = torch.ones_like(n) if lo is None else torch.minimum(lo, n - 2).clamp(min=1)
    p = lo[:, None] + (torch.rand(len(docs), anchors, generator=gen) * (n - 1 - lo)[:, None].clamp(min=1)).long()
    pk = p[:, :, None] + torch.arange(g)  # [B, A, g] position of slot k's input (its prediction is pk + 1)
    valid = pk + 1 < n[:, None, None]
    pk = pk.clamp(max=width - 1)
    nxt = (pk + 1).clamp(max=width - 1)
    flat = at.gather(1, pk.flatten(1)).view_as(pk)
    flat_next = at.gather(1, nxt.flatten(1)).view_as(pk)
    return {"ids": corpus.ids[at], "feats": corpus.feats[at], "anchor_pos": p, "valid": valid,
            "prev": corpus.ids[flat], "target": corpus.ids[flat_next],
            "top_ids": corpus.top_ids[flat], "top_p": corpus.top_p[flat]}
