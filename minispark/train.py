"""Distil a Spark drafter from its target, calibrate it, and fit the n-gram calibration table.

    python -m minispark.train all --out runs/spark --minutes 30     # the whole recipe
    python -m minispark.train data|features|fit|calibrate|ngram --out runs/spark

Stages (each resumable, each reading the previous one's files in `--out`; sizes in `Recipe`):
  data       prompts on many topics and requests the target writes itself, answered greedily by
             the target, plus text it reads (the Python standard library's source and pydoc
             topics): questions.jsonl, answers.jsonl, text.jsonl
  features   one target pass over every document: the hidden states of the drafter's layers and
             the target's top-k next-token distribution (the teacher): features/*.pt
  fit        trains the drafter (0.1 CE + 0.9 TV + BCE(conf, 1 - TV), decaying position weights)
             from a resumable checkpoint: ckpt.pt, and the best so far: best.pt
  calibrate  a temperature and a shift per position of the confidences, fitted left to right on
             answers the drafter never trained on (to self-written requests where there are
             enough; with --init, recalibrates that drafter), and the acceptance and ECE they
             give: spark.safetensors + spark.json in --dest
  ngram      replays the n-gram drafter over the target's answers and fits the table
             P(token j accepted | tokens < j accepted, last outcome, match length m): ngram.json
  eval       (not part of `all`) the drafter in --dest on MT-Bench's first turns, which no stage
             trains on: acceptance per slot and the survival's ECE: mt_bench.json in --dest
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import json
import random
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

DATA = Path(__file__).parent / "data"
KINDS = ("text", "answer")  # documents the features stage reads: text the target reads, its answers


def spread_layers(n_layers: int, k: int = 5) -> tuple[int, ...]:
    """k target layers whose hidden states feed the drafter, spread from shallow to deep:
    (1, 8, 15, 22, 29) of the demo model's 30."""
    return tuple(sorted({min(n_layers - 1, round(1 + i * (n_layers - 2) / (k - 1))) for i in range(k)}))


@dataclass
class Recipe:
    """Every size of the recipe; the defaults are the CPU run that made the shipped drafter."""
    model: str | None = None  # the target (None = the demo model)
    device: str = "cpu"
    batch: int = 24  # answers generated at once
    max_tokens: int = 320  # per answer
    max_prompts: int | None = None
    questions: int = 2000  # requests the target writes itself, answered beside the templates'
    first_round: int = 0  # of request writing: a later run starts past the rounds a drafter saw
    templates: bool = True  # answer the templated prompts too (False: only self-written requests)
    question_tokens: int = 160  # per completion of the request list
    text_tokens: int = 250_000  # of reading text to featurise
    draft_vocab: int = 8192
    block: int = 7
    rank: int = 128
    batch_docs: int = 16  # windows per training step
    anchors: int = 16  # blocks per window
    width: int = 512  # window length
    lr: float = 1e-3
    eval_every: int = 200
    max_steps: int | None = None
    layers: tuple[int, ...] | None = None  # None: spread_layers over the target's depth

    def feature_layers(self, n_layers: int) -> tuple[int, ...]:
        return self.layers or spread_layers(n_layers)

    def target(self, dtype: torch.dtype | None = None):
        """The target, frozen; dtype None = bfloat16 where the hardware computes in it, else
        float32 (a CPU without native bf16 converts every operand: the toy recipe's feature
        pass took 8 minutes in bf16 on a 2-core VM)."""
        from .model import resolve_dtype
        from .weights import default_model, load_model

        dtype = dtype or resolve_dtype("auto", torch.device(self.device))
        model, path = load_model(self.model or default_model(), dtype=dtype, device=self.device)
        return model.requires_grad_(False), path

TEMPLATES = (
    "Explain {t} to a beginner.",
    "What are three interesting facts about {t}?",
    "Write a short essay about {t}.",
    "Give me five practical tips related to {t}.",
    "What are the pros and cons of {t}?",
    "Write a short poem about {t}.",
    "Summarize the history of {t} in one paragraph.",
    "Write a dialogue between a teacher and a student about {t}.",
    "Write a Python program related to {t}, with comments.",
    "Compare {t} and {u}.",
    "Write a friendly email to a colleague about {t}.",
    "List common misconceptions about {t} and correct them.",
    # The kinds of request a chat benchmark asks (role play, persuasion, reasoning, extraction),
    # so the drafter sees the target's voice in each, not only explanations.
    "Imagine you are an expert on {t}. Answer a curious visitor's questions in character.",
    "Write a persuasive speech arguing that everyone should learn about {t}.",
    "Compose an engaging blog post about a weekend spent exploring {t}.",
    "Draft a professional memo proposing a new project about {t}, with a timeline.",
    "Create a short quiz with answers about {t}.",
    "Write a word problem about {t} that needs arithmetic, then solve it step by step.",
    "Pose a logic puzzle set in the world of {t}, then reason through its solution.",
    "Write a short paragraph about {t}, then extract its key facts as a JSON object.",
    "Describe a day in the life of someone whose job involves {t}.",
    "Rewrite this sentence to be more formal, then more playful: '{t} is really something.'",
)


def is_held_out(text: str, share: float = 0.1) -> bool:
    """A stable split by content: the same document is held out on every machine."""
    return int(hashlib.sha1(text.encode()).hexdigest()[:8], 16) / 2**32 < share


# ----------------------------------------------------------------------------- stage: data


def topic_prompts(rng: random.Random) -> list[str]:
    topics = [t for t in (DATA / "topics.txt").read_text().splitlines() if t.strip()]
    return [tpl.format(t=t, u=rng.choice(topics)) for t in topics for tpl in TEMPLATES]


def mbpp_prompts() -> list[str]:
    lines = (DATA / "mbpp.jsonl").read_text().splitlines()
    return [json.loads(line)["turns"][0] for line in lines if line.strip()]


def stdlib_functions(rng: random.Random, limit: int) -> list[str]:
    """Small functions of the standard library: material for code-edit requests (the benchmark's
    code edits come from HumanEval, which training never sees)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))
    rng.shuffle(files)
    out = []
    for f in files:
        try:
            src = f.read_text()
            tree = ast.parse(src)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.col_offset == 0:
                code = ast.get_source_segment(src, node) or ""
                if 200 < len(code) < 1200:
                    out.append(code)
                    break
        if len(out) >= limit:
            break
    return out


def code_edit_prompts(rng: random.Random, limit: int = 200) -> list[str]:
    from .workloads import _local_name, edit_request

    prompts = []
    for code in stdlib_functions(rng, limit):
        name = code.split("(")[0].removeprefix("def ").strip()
        var = _local_name(code, name)
        choices = [f"Rename the function `{name}` to `{name}_new`.",
                   "Add a docstring to this function.",
                   "Add type hints to this function."]
        if var:
            choices.append(f"Rename the variable `{var}` to `{var}_value`.")
        prompts.append(edit_request(code, rng.choice(choices)))
    return prompts


def training_prompts(seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    prompts = topic_prompts(rng) + mbpp_prompts() + code_edit_prompts(rng)
    rng.shuffle(prompts)  # a run stopped early still has a varied share of everything
    return prompts


def reading_texts(max_chars: int = 2000) -> list[str]:
    """General text the target reads: the standard library's source and pydoc's topic help,
    cut into pieces of about `max_chars` at line boundaries."""
    import pydoc_data.topics

    docs = list(pydoc_data.topics.topics.values())
    root = Path(sysconfig.get_paths()["stdlib"])
    for f in sorted(root.glob("*.py")):
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


# A few-shot list the target continues with requests of its own: a 135M model asked outright
# ("write a question about X") answers the instruction instead, but it continues a list. Its
# requests are often odd; what the drafter needs is the target's voice answering many kinds of
# request, phrased in ways no template is.
QUESTION_EXAMPLES = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Pretend you are a tour guide in ancient Rome and describe the Colosseum to a group of visitors.",
    "A train travels 180 km at 60 km/h. How long does the trip take? Show your steps.",
    "Explain why the sky is blue in simple terms.",
    "Draft an email to my landlord asking him to fix the heating.",
    "What were the main causes of the French Revolution?",
    "Give me advice on preparing for a job interview.",
    "Summarize the plot of a famous novel in three sentences.",
    "Write a Python function that checks whether a string is a palindrome.",
    "List the planets of the solar system and one fact about each.",
)


def question_prompt(topic: str, rng: random.Random) -> str:
    examples = "".join(f"- {e}\n" for e in rng.sample(QUESTION_EXAMPLES, 6))
    return f"Requests about {topic} that users sent to an AI assistant, one per line:\n{examples}- "


# Three in four lines the target writes are statements ("I cheated 3 times."), not requests.
REQUEST_VERBS = set("""act analyze build calculate choose compare compose convert create describe design
    develop discuss draft evaluate explain find generate give help identify imagine implement list
    make name outline plan prepare pretend propose provide recommend rewrite share show solve suggest
    summarize tell translate write""".split())


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


def self_written_questions(out: Path, llm, r: Recipe, deadline: float) -> list[str]:
    """Up to `r.questions` distinct requests written by the target (sampled, one seed per
    completion), in rounds appended to questions.jsonl so a later run goes on."""
    from rich.progress import Progress

    from .engine import SamplingParams

    path = out / "questions.jsonl"
    rows = [json.loads(line) for line in path.open()] if path.exists() else []
    questions = [row["question"] for row in rows]
    seen = set(questions) | set(QUESTION_EXAMPLES)
    topics = [t for t in (DATA / "topics.txt").read_text().splitlines() if t.strip()]
    first = k = max(r.first_round, 1 + max((row["round"] for row in rows), default=-1))
    with Progress() as bar, path.open("a") as f:
        task = bar.add_task("self-written requests", total=r.questions, completed=len(questions))
        while len(questions) < r.questions and (k == first or time.time() < deadline):
            rng = random.Random(k)
            prompts = [question_prompt(rng.choice(topics), rng) for _ in range(4 * r.batch)]
            params = [SamplingParams(temperature=1.0, top_p=0.95, max_tokens=r.question_tokens,
                                     seed=1000 * k + i)
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


def stage_data(out: Path, r: Recipe, minutes: float) -> None:
    """Requests the target writes itself, then its answers to them and to the templated
    prompts, appended to answers.jsonl until the time is up (a later run goes on where this one
    stopped); and the reading texts."""
    from rich.progress import Progress

    from .engine import LLM, SamplingParams

    out.mkdir(parents=True, exist_ok=True)
    texts = out / "text.jsonl"
    if not texts.exists():
        texts.write_text("".join(json.dumps({"text": t}) + "\n" for t in reading_texts()))
    # spec="off": on chat, speculation gains little at large batch sizes.
    # Eager: a GPU would otherwise compile (max-autotune) a graph for every batch and context
    # bucket the stage passes through, which costs more than the stage itself.
    llm = LLM(r.model, spec="off", max_batch_size=r.batch, max_seq_len=1024, device=r.device, compile=False)
    start = time.time()
    # Writing a request takes about as long as answering one, so a run of requests alone writes
    # for nearly half its time; beside the templates, a quarter at most.
    share = 0.25 if r.templates else 0.45
    questions = self_written_questions(out, llm, r, start + share * 60 * minutes)
    deadline = start + 60 * minutes
    answers = out / "answers.jsonl"
    done = {json.loads(line)["prompt"] for line in answers.open()} if answers.exists() else set()
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
            outs = llm.chat([[{"role": "user", "content": p}] for p in chunk], params)
            for p, o in zip(chunk, outs):
                f.write(json.dumps({"prompt": p, "answer_ids": o.token_ids}) + "\n")
            f.flush()
            bar.advance(task, len(chunk))
    n = sum(1 for _ in answers.open())
    print(f"{n} answers in {answers}, {len(questions)} self-written requests, "
          f"{sum(1 for _ in texts.open())} reading texts in {texts}")


def self_written(out: Path) -> set[str]:
    """The requests the target wrote itself (questions.jsonl of the data stage)."""
    f = out / "questions.jsonl"
    return {json.loads(line)["question"] for line in f.open()} if f.exists() else set()


# ----------------------------------------------------------------------------- stage: features

TOPK = 16  # the teacher's distribution is kept as its top-k tokens (most of its mass)


def documents(out: Path, kind: str, tokenizer, max_text_tokens: int, max_len: int = 1024) -> list[dict]:
    """Training documents as token ids, each with a stable held-out flag: "answer" = chat
    transcripts (prompt + the target's answer, `start` = where the answer begins), "text" =
    reading texts."""
    docs = []
    if kind == "answer":
        own = self_written(out)
        for line in (out / "answers.jsonl").open():
            r = json.loads(line)
            prompt = tokenizer.encode_chat([{"role": "user", "content": r["prompt"]}])
            docs.append({"ids": (prompt + r["answer_ids"])[:max_len], "held_out": is_held_out(r["prompt"]),
                         "start": len(prompt), "own": r["prompt"] in own})
        return docs
    budget = max_text_tokens
    for line in (out / "text.jsonl").open():
        if budget <= 0:
            break
        t = json.loads(line)["text"]
        ids = tokenizer.encode(t)[:max_len]
        budget -= len(ids)
        docs.append({"ids": ids, "held_out": is_held_out(t), "start": 1})  # anchors anywhere after the first token
    return docs


@torch.no_grad()
def doc_features(model, ids: list[int], layers: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """One forward of the target over a document: its features and its top-k teacher."""
    from .model import Batch

    n, dev = len(ids), model.tok_embeddings.weight.device
    ar = torch.arange(n, device=dev)
    b = Batch(tokens=torch.tensor(ids, device=dev), slot=torch.zeros_like(ar), pos=ar, cell=ar,
              row_slot=slice(0, 1), n_cols=n, ctx_len=n)
    logits, hidden = model(b, hidden_layers=layers)  # [n, V], [n, F, dim]
    top = logits.softmax(-1).topk(TOPK, dim=-1)
    return {"ids": torch.tensor(ids, dtype=torch.int32), "feats": hidden.to(torch.bfloat16).cpu(),
            "top_ids": top.indices.to(torch.int32).cpu(), "top_p": top.values.to(torch.float16).cpu()}


def stage_features(out: Path, r: Recipe, kinds: tuple[str, ...] = KINDS, shard_docs: int = 200) -> None:
    """Target features of every document, in shards of `shard_docs`; a rerun skips shards
    already written as they are, and redoes a last shard that has grown since (more answers)."""
    from rich.progress import Progress

    from .tokenizer import Tokenizer

    model, path = r.target()
    model.setup_cache(1, 1024)
    tok = Tokenizer.from_path(path)
    (out / "features").mkdir(exist_ok=True)
    for kind in kinds:
        docs = documents(out, kind, tok, r.text_tokens)
        shards = [docs[i: i + shard_docs] for i in range(0, len(docs), shard_docs)]
        with Progress() as bar:
            task = bar.add_task(f"target features ({kind})", total=sum(len(d["ids"]) for d in docs))
            for i, shard in enumerate(shards):
                f = out / "features" / f"{kind}-{i:04d}-{len(shard)}.pt"
                done = list((out / "features").glob(f"{kind}-{i:04d}-*.pt"))
                if f.exists():
                    bar.advance(task, sum(len(d["ids"]) for d in shard))
                    continue
                for old in done:  # a partial shard of an earlier run, grown since
                    old.unlink()
                # Held-out scores and calibration anchor blocks in answers only (`start`), as the
                # MT-Bench evaluation does: the fixed chat template is easy text no answer holds.
                rows = [dict(doc_features(model, d["ids"], r.feature_layers(model.args.n_layers)),
                             held_out=d["held_out"], kind=kind,
                             start=d["start"], own=d.get("own", False)) for d in shard]
                torch.save(rows, f.with_suffix(".tmp"))
                f.with_suffix(".tmp").rename(f)
                bar.advance(task, sum(len(d["ids"]) for d in shard))


# ----------------------------------------------------------------------------- stage: fit


class Corpus:
    """All documents of one split, flat: ids [N], feats [N, F, dim], teacher top-k [N, k]."""

    def __init__(self, rows: list[dict]):
        self.lens = torch.tensor([len(r["ids"]) for r in rows])
        self.starts = torch.cumsum(self.lens, 0) - self.lens
        self.ids = torch.cat([r["ids"] for r in rows]).long()
        self.feats = torch.cat([r["feats"] for r in rows])
        self.top_ids = torch.cat([r["top_ids"] for r in rows]).long()
        self.top_p = torch.cat([r["top_p"] for r in rows]).float()
        self.kind = [r["kind"] for r in rows]
        # the first position an anchor may take (feature files from before `start` anchor anywhere)
        self.start = torch.tensor([r.get("start", 1) for r in rows])

    def __len__(self) -> int:
        return len(self.lens)

    def to(self, device: str) -> "Corpus":
        """Tokens, features and teacher on `device` (the window bookkeeping stays on the host):
        on a GPU each step then gathers its batch there instead of copying it over."""
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
    # mmap: the corpus is then built without a second copy of every file in memory
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


def draft_vocabulary(corpus: Corpus, size: int) -> torch.Tensor:
    """The `size` target tokens most often written or predicted first by the target."""
    counts = torch.bincount(torch.cat([corpus.ids, corpus.top_ids[:, 0]]), minlength=size)
    return counts.topk(size).indices.sort().values


def new_drafter(target, corpus: Corpus, r: Recipe):
    """A drafter whose layers start as copies of the target's last layer, as do its norms."""
    from .drafters import SparkArgs, SparkDrafter

    args = SparkArgs.for_target(target.args, target_layers=r.feature_layers(target.args.n_layers), block=r.block,
                                rank=r.rank,
                                draft_vocab=min(r.draft_vocab, target.args.vocab_size))
    d = SparkDrafter(args)
    src = target.layers[-1]
    for layer in d.layers:
        layer.attention.wqkv.weight.data.copy_(src.attention.wqkv.weight.float())
        layer.attention.wo.weight.data.copy_(src.attention.wo.weight.float())
        layer.feed_forward.load_state_dict({k: v.float() for k, v in src.feed_forward.state_dict().items()})
        layer.attention_norm.weight.data.copy_(src.attention_norm.weight.float())
        layer.ffn_norm.weight.data.copy_(src.ffn_norm.weight.float())
    d.norm.weight.data.copy_(target.norm.weight.float())
    d.mask_emb.data.copy_(target.tok_embeddings.weight.float().mean(0))
    torch.nn.init.normal_(d.markov_in.weight, std=0.02)
    d.d2t.copy_(draft_vocabulary(corpus, args.draft_vocab))
    return d.to(target.tok_embeddings.weight.device)


def block_batch(corpus: Corpus, docs: torch.Tensor, width: int, anchors: int, g: int, gen: torch.Generator,
                lo: torch.Tensor | None = None) -> dict:
    """Windows of documents and random anchors in them: everything a training step reads."""
    at, n = corpus.windows(docs, width, gen)  # [B, W], [B]
    # Anchors p in [lo, n - 2] (lo >= 1): at least one context position and one token to predict.
    lo = torch.ones_like(n) if lo is None else torch.minimum(lo, n - 2).clamp(min=1)
    p = lo[:, None] + (torch.rand(len(docs), anchors, generator=gen) * (n - 1 - lo)[:, None].clamp(min=1)).long()  # [B, A]
    k = torch.arange(g)
    pk = p[:, :, None] + k  # [B, A, g] position of slot k's input (its prediction is pk + 1)
    valid = pk + 1 < n[:, None, None]
    pk = pk.clamp(max=width - 1)
    nxt = (pk + 1).clamp(max=width - 1)
    flat = at.gather(1, pk.flatten(1)).view_as(pk)
    flat_next = at.gather(1, nxt.flatten(1)).view_as(pk)
    return {"ids": corpus.ids[at], "feats": corpus.feats[at], "anchor_pos": p, "valid": valid,
            "prev": corpus.ids[flat], "target": corpus.ids[flat_next],
            "top_ids": corpus.top_ids[flat], "top_p": corpus.top_p[flat]}


def drafter_outputs(d, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced draft logits [B, A, g, Vd] and confidence logits [B, A, g]."""
    ids, feats, p = batch["ids"], batch["feats"], batch["anchor_pos"]
    B, W = ids.shape
    A, g = p.shape[1], d.args.block
    pos = torch.arange(W, device=ids.device).expand(B, W)
    ctx = d.context(feats)  # [B, W, dim]
    cos, sin = d.rope(pos, ctx.dtype)
    ctx_kv = [layer.attention.context_kv(ctx, cos, sin) for layer in d.layers]
    ctx_mask = pos[:, None, :] < p[:, :, None]  # [B, A, W]: positions before the anchor
    h = d.block_states(ids.gather(1, p), p, ctx_kv, ctx_mask).view(B, A, g, -1)
    return d.logits(h, batch["prev"])


def losses(d, batch: dict, logits: torch.Tensor, conf: torch.Tensor) -> dict[str, torch.Tensor]:
    """0.1 CE + 0.9 TV + BCE(conf, 1 - TV), slot k weighted by exp(-k / 4)."""
    Vd = d.args.draft_vocab
    q = logits.float().softmax(-1)
    q = torch.cat([q, q.new_zeros(*q.shape[:-1], 1)], -1)  # column Vd: tokens outside the draft vocabulary
    q_top = q.gather(-1, d.t2d[batch["top_ids"]])
    tv = 1 - torch.minimum(q_top, batch["top_p"]).sum(-1)  # [B, A, g]; exact where the top-k holds the mass
    target = d.t2d[batch["target"]]
    ce = F.cross_entropy(logits.float().flatten(0, -2), target.flatten(), ignore_index=Vd,
                         reduction="none").view(target.shape)
    bce = F.binary_cross_entropy_with_logits(conf, (1 - tv).detach().clamp(0, 1), reduction="none")
    g = logits.shape[2]
    w = torch.exp(-torch.arange(g, device=conf.device) / 4.0) * batch["valid"]
    norm = w.sum()
    parts = {"ce": (ce * w).sum() / norm, "tv": (tv * w).sum() / norm, "bce": (bce * w).sum() / norm}
    parts["loss"] = 0.1 * parts["ce"] + 0.9 * parts["tv"] + parts["bce"]
    return parts


@torch.no_grad()
def evaluate(d, corpus: Corpus, n_docs: int = 200, anchors: int = 16, seed: int = 1, width: int = 512,
             first: int = 0) -> dict:
    """Greedy chains on held-out documents (answers `first` .. `first + n_docs`): accepted
    tokens per step (1 + the matching prefix) and per-slot conditional acceptance, plus raw
    confidence logits for calibration. Anchors start at each document's `start` where the
    window holds the whole document."""
    gen = torch.Generator().manual_seed(seed)
    docs = torch.tensor([i for i, k in enumerate(corpus.kind) if k == "answer"][first:first + n_docs])
    g = d.args.block
    toks, confs, targets, valids = [], [], [], []
    dev = d.d2t.device
    for chunk in docs.split(16):
        whole = corpus.lens[chunk] <= width
        lo = torch.where(whole, corpus.start[chunk], 1)
        batch = {k: v.to(dev) for k, v in block_batch(corpus, chunk, width, anchors, g, gen, lo).items()}
        ids, p = batch["ids"], batch["anchor_pos"]
        B, W = ids.shape
        ctx = d.context(batch["feats"])
        pos = torch.arange(W, device=dev).expand(B, W)
        cos, sin = d.rope(pos, ctx.dtype)
        ctx_kv = [layer.attention.context_kv(ctx, cos, sin) for layer in d.layers]
        mask = pos[:, None, :] < p[:, :, None]
        h = d.block_states(ids.gather(1, p), p, ctx_kv, mask).view(B * anchors, g, -1)
        t, c = d.chain(h, ids.gather(1, p).flatten(), None, None)
        toks.append(t); confs.append(c.float())
        targets.append(batch["target"].flatten(0, 1)); valids.append(batch["valid"].flatten(0, 1))
    toks, conf, target, valid = (torch.cat(x).cpu() for x in (toks, confs, targets, valids))
    ok = (toks == target) & valid
    alive = ok.long().cumprod(-1).bool()  # [N, g] slot k accepted with all before it
    full = valid.all(-1)
    acc = alive[full].float()
    return {"tokens_per_step": 1 + acc.sum(-1).mean().item(),
            "slot_rate": [(alive[full, k].float().sum() / max(alive[full, k - 1].float().sum(), 1) if k
                           else alive[full, 0].float().mean()).item() for k in range(g)],
            "conf_logit": conf[full], "alive": acc}


def stage_fit(out: Path, r: Recipe, minutes: float, init: Path | None = None) -> None:
    """Train from `out/ckpt.pt` (else from the drafter folder `init`, else from scratch) for
    `minutes` more (or `r.max_steps`), keeping the drafter with the most held-out accepted tokens
    per step in `out/best.pt`. The learning rate warms up, then decays over each run's minutes,
    so a resumed run anneals again."""
    from rich.progress import Progress

    target, _ = r.target(torch.float32 if r.device == "cpu" else torch.bfloat16)
    train, held = load_corpus(out)
    if r.device.startswith("cuda") and 2 * train.feats.nbytes < torch.cuda.mem_get_info()[0]:
        train, held = train.to(r.device), held.to(r.device)
    ckpt_path = out / "ckpt.pt"
    ckpt = torch.load(ckpt_path, weights_only=False) if ckpt_path.exists() else None
    d = starting_drafter(target, train, r, ckpt, init).attach(target)
    print(f"{len(train)} training documents ({len(train.ids):,} tokens), {len(held)} held out; the draft "
          f"vocabulary covers {(d.t2d.cpu()[train.ids.cpu()] < d.args.draft_vocab).float().mean():.1%} of training tokens")
    params = [p for p in d.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=r.lr, weight_decay=0.0, betas=(0.9, 0.95))
    if ckpt is not None:
        opt.load_state_dict(ckpt["opt"])
    # The best score stands only against the same held-out documents: data added since moves them.
    best = ckpt["best"] if ckpt and ckpt.get("held") == len(held) else 0.0
    step = ckpt["step"] if ckpt else 0
    first = step
    gen = torch.Generator().manual_seed(step)
    weights = train.lens.float()
    start, budget = time.time(), 60 * minutes
    autocast = torch.autocast(r.device.split(":")[0], dtype=torch.bfloat16)

    def done() -> bool:
        return time.time() - start >= budget or (r.max_steps is not None and step - first >= r.max_steps)

    with Progress() as bar:
        task = bar.add_task("training", total=budget)
        while not done():
            frac = (time.time() - start) / budget
            for group in opt.param_groups:
                group["lr"] = r.lr * min(1.0, (step - first + 1) / 50) * (0.1 + 0.9 * (1 - frac))
            docs = torch.multinomial(weights, r.batch_docs, replacement=True, generator=gen)
            batch = {k: v.to(r.device) for k, v in block_batch(train, docs, r.width, r.anchors, r.block, gen).items()}
            with autocast:
                logits, conf = drafter_outputs(d, batch)
            parts = losses(d, batch, logits, conf)
            opt.zero_grad(set_to_none=True)
            parts["loss"].backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1
            bar.update(task, completed=time.time() - start,
                       description=f"training step {step} tv {parts['tv']:.3f} ce {parts['ce']:.2f}")
            if step % r.eval_every == 0 or done():
                with autocast, torch.no_grad():
                    score = evaluate(d, held)["tokens_per_step"]
                bar.console.print(f"step {step}: held-out accepted tokens per step {score:.3f}")
                state = {"args": d.args.__dict__, "model": d.state_dict(), "opt": opt.state_dict(),
                         "step": step, "best": max(best, score), "held": len(held)}
                torch.save(state, ckpt_path)
                if score > best or not (out / "best.pt").exists():
                    best = max(best, score)
                    torch.save(state, out / "best.pt")


def starting_drafter(target, train: Corpus, r: Recipe, ckpt: dict | None, init: Path | None):
    """The run's checkpoint if it has one; else the drafter in folder `init`, going on from its
    weights with its calibration undone (the confidences train raw, calibrate refits them); else
    a new drafter."""
    if ckpt is not None:
        return _drafter_from(ckpt).to(r.device)
    if init is not None:
        from .weights import load_drafter

        d = load_drafter(init, target.args, torch.float32, r.device)
        d.conf_temp.fill_(1.0)
        d.conf_bias.fill_(0.0)
        return d
    return new_drafter(target, train, r)


def _drafter_from(ckpt: dict):
    from .drafters import SparkArgs, SparkDrafter

    args = dict(ckpt["args"])
    args["target_layers"] = tuple(args["target_layers"])
    d = SparkDrafter(SparkArgs(**args))
    d.load_state_dict({"conf_bias": d.conf_bias, **ckpt["model"]})  # checkpoints from before conf_bias
    return d


# ----------------------------------------------------------------------------- stage: calibrate


def ece(pred: torch.Tensor, hit: torch.Tensor, bins: int = 10) -> float:
    """Expected calibration error: |mean prediction - mean outcome| over equal-width bins,
    weighted by how many predictions fall in each."""
    pred, hit = pred.flatten().float(), hit.flatten().float()
    which = (pred * bins).long().clamp(max=bins - 1)
    n = torch.bincount(which, minlength=bins).float()
    gap = (torch.bincount(which, pred, bins) - torch.bincount(which, hit, bins)).abs()
    return (gap.sum() / n.sum().clamp(min=1)).item()


def log_loss(pred: torch.Tensor, hit: torch.Tensor) -> float:
    p = pred.float().clamp(1e-6, 1 - 1e-6)
    return -(hit * p.log() + (1 - hit) * (1 - p).log()).mean().item()


def survival_ece(conf_logit: torch.Tensor, alive: torch.Tensor, temps: torch.Tensor | float = 1.0,
                 bias: torch.Tensor | float = 0.0) -> list[float]:
    """ECE per position k of the calibrated survival prod_{i<=k} c_i against whether slots
    0..k were all accepted (conf_logit, alive [N, g]); temps 1 and bias 0: uncalibrated."""
    from .drafters import calibrated

    surv = calibrated(conf_logit, temps, bias).cumprod(-1)
    return [ece(surv[:, k], alive[:, k]) for k in range(conf_logit.shape[1])]


def fit_calibration(conf_logit: torch.Tensor, alive: torch.Tensor,
                    temps_grid: torch.Tensor = torch.logspace(-1.2, 2, 65),
                    bias_grid: torch.Tensor = torch.linspace(-3, 3, 61)) -> tuple[torch.Tensor, torch.Tensor, list, list]:
    """Sequential scaling: position by position, left to right, the temperature and shift whose
    survival prod_{i<=k} sigmoid(z_i / T_i + b_i) best predicts whether slots 0..k were all
    accepted. Best by log loss, not by ECE: the ECE alone is as low for a confidence flattened
    to the mean acceptance, which ranks no draft above another, as for a sharp one (fitted by
    ECE, the shipped drafter's first slots took the grid's largest temperature). Returns the
    temperatures, the shifts and the ECE per position before and after."""
    from .drafters import calibrated

    g = conf_logit.shape[1]
    temps, bias = torch.ones(g), torch.zeros(g)

    def survival(k: int) -> torch.Tensor:
        return calibrated(conf_logit[:, : k + 1], temps[: k + 1], bias[: k + 1]).prod(-1)

    pairs = [(t, b) for t in temps_grid for b in bias_grid]
    for k in range(g):
        prefix = survival(k - 1) if k else torch.ones(len(conf_logit))
        scores = [log_loss(prefix * calibrated(conf_logit[:, k], t, b), alive[:, k]) for t, b in pairs]
        temps[k], bias[k] = pairs[int(torch.tensor(scores).argmin())]
    return temps, bias, survival_ece(conf_logit, alive), survival_ece(conf_logit, alive, temps, bias)


MIN_OWN = 40  # answers to self-written requests enough to calibrate on them alone


def calibration_corpus(out: Path, init: Path | None) -> tuple[Corpus, str]:
    """Answers the drafter never trained on, to requests the target wrote itself where there
    are enough: held-out ones, or, for a drafter from another folder (`init`), all of them.
    The templated prompts are the drafter's home ground, where it drafts better than on text
    phrased as no template is, so a calibration fitted there is overconfident elsewhere (on
    MT-Bench, for the shipped drafter); answers to requests the target wrote are phrased like
    a user's. Otherwise all held-out answers."""
    rows = [r for r in feature_rows(out) if r["kind"] == "answer"]
    own = [r for r in rows if r.get("own", False) and (init is not None or r["held_out"])]
    if len(own) >= MIN_OWN:
        return Corpus(own), f"{len(own)} answers to self-written requests"
    held = [r for r in hold_out_one(rows) if r["held_out"]]
    return Corpus(held), f"{len(held)} held-out answers"


def stage_calibrate(out: Path, dest: Path, r: Recipe, init: Path | None = None) -> dict:
    """Fit the confidences' calibration on answers the drafter never trained on and write the
    drafter folder: the run's best checkpoint, or the drafter in folder `init`."""
    from .weights import load_drafter, save_drafter

    target, _ = r.target(torch.float32 if r.device == "cpu" else torch.bfloat16)
    held, what = calibration_corpus(out, init)
    if init is None:
        best = torch.load(out / "best.pt", weights_only=False)
        d, step, fit_report = _drafter_from(best).to(r.device), best["step"], None
    else:
        d = load_drafter(init, target.args, torch.float32, r.device)
        old = json.loads((init / "spark.json").read_text()).get("report", {})
        fit_report = old.get("fit_report", old)  # the fit's own report, kept beside the new calibration
        step = fit_report.get("training_step")
    d.attach(target).requires_grad_(False)
    print(f"calibrating on {what}")
    # Fitted on one half, reported on the other: an ECE on the fitting blocks flatters the fit.
    half = max(1, len(held) // 2)
    with torch.autocast(r.device.split(":")[0], dtype=torch.bfloat16), torch.no_grad():
        fit = evaluate(d, held, n_docs=half, anchors=24, seed=2)
        temps, bias, _, _ = fit_calibration(fit["conf_logit"], fit["alive"])
        d.conf_temp.copy_(temps)
        d.conf_bias.copy_(bias)
        test = evaluate(d, held, n_docs=10**6, anchors=8, seed=3, first=half if len(held) > 1 else 0)
    before = survival_ece(test["conf_logit"], test["alive"])
    after = survival_ece(test["conf_logit"], test["alive"], temps, bias)
    report = {
        "calibrated_on": what,
        "held_out_tokens_per_step": round(test["tokens_per_step"], 3),
        "slot_acceptance": [round(x, 3) for x in test["slot_rate"]],
        "temperatures": [round(x, 3) for x in temps.tolist()],
        "shifts": [round(x, 3) for x in bias.tolist()],
        "survival_ece_before": [round(x, 4) for x in before],
        "survival_ece_after": [round(x, 4) for x in after],
        "training_step": step,
    }
    if fit_report is not None:
        report["fit_report"] = fit_report
    save_drafter(dest, d, target.args, report)
    print(json.dumps(report, indent=1))
    return report


@torch.no_grad()
def stage_eval(dest: Path, r: Recipe, prompts: int = 80, max_tokens: int = 256) -> dict:
    """The drafter in `dest` on MT-Bench, whose prompts no stage trains on: the target answers
    the first turns greedily, then teacher-forced blocks anchored inside the answers give the
    accepted tokens per step, the per-slot acceptance and the ECE of the calibrated survival
    prod c_i against how often slots 0..k were all accepted: mt_bench.json in `dest`."""
    from .drafters import calibrated
    from .engine import LLM, SamplingParams
    from .weights import load_drafter
    from .workloads import chat_prompts

    llm = LLM(r.model, spec="off", max_batch_size=16, max_seq_len=1024, device=r.device, dtype="float32",
              compile=False)
    convs = chat_prompts(prompts)
    outs = llm.chat(convs, SamplingParams(temperature=0, max_tokens=max_tokens))
    model = llm.engine.model
    d = load_drafter(dest, model.args, torch.float32, r.device).attach(model)
    rows = []
    for conv, o in zip(convs, outs):
        prompt = llm.tokenizer.encode_chat(conv)
        rows.append(dict(doc_features(model, (prompt + o.token_ids)[:1024], d.args.target_layers),
                         held_out=True, kind="answer", start=len(prompt)))
    res = evaluate(d, Corpus(rows), n_docs=len(rows), anchors=16, width=1024)
    z, alive = res["conf_logit"], res["alive"]  # [N, g]
    temps, bias = d.conf_temp.float().cpu(), d.conf_bias.float().cpu()
    report = {"prompts": len(rows), "answer_tokens": sum(len(o.token_ids) for o in outs), "blocks": len(z),
              "tokens_per_step": round(res["tokens_per_step"], 3),
              "slot_acceptance": [round(x, 3) for x in res["slot_rate"]],
              "survival_ece_uncalibrated": [round(x, 4) for x in survival_ece(z, alive)],
              "survival_ece": [round(x, 4) for x in survival_ece(z, alive, temps, bias)],
              "survival_ece_all_slots": round(ece(calibrated(z, temps, bias).cumprod(-1), alive), 4)}
    (dest / "mt_bench.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))
    return report


# ----------------------------------------------------------------------------- stage: ngram


def simulate_ngram(docs: list[tuple[list[int], int]], k: int = 32, batch: int = 64) -> dict[str, torch.Tensor]:
    """Replay the n-gram drafter over the target's own answers, as decoding would: at each step
    propose from the history, accept the leading tokens that match the answer, emit one more.
    docs: (ids, where the answer starts). Returns per step and chain position: the state of the
    last proposal, the match length m, whether position j was reached and whether accepted."""
    from .drafters import NgramDrafter
    from .price import NO_PROPOSAL, PARTIAL, RIGHT, WRONG

    drafter = NgramDrafter(k=k)
    logs = {"state": [], "m": [], "reached": [], "accepted": []}
    for i in range(0, len(docs), batch):
        chunk = docs[i: i + batch]
        C = max(len(ids) for ids, _ in chunk)
        tokens = torch.zeros(len(chunk), C + k + 1, dtype=torch.long)
        for r, (ids, _) in enumerate(chunk):
            tokens[r, : len(ids)] = torch.tensor(ids)
        n = torch.tensor([len(ids) for ids, _ in chunk])
        p = torch.tensor([start for _, start in chunk])  # the anchor's position
        state = torch.full((len(chunk),), NO_PROPOSAL)
        col = torch.arange(k)
        while True:
            live = p + 1 < n
            if not live.any():
                break
            draft, valid, m = drafter(tokens[:, :C], torch.where(live, p + 1, 0))
            truth = tokens.gather(1, (p[:, None] + 1 + col).clamp(max=C + k))
            ok = (draft == truth) & (col < valid[:, None]) & (p[:, None] + 1 + col < n[:, None])
            acc = ok.long().cumprod(-1).sum(-1)
            reached = (col < valid[:, None]) & (col <= acc[:, None]) & live[:, None]
            logs["state"].append(state[live]); logs["m"].append(m[live])
            logs["reached"].append(reached[live]); logs["accepted"].append((col < acc[:, None])[live])
            # As the engine judges it: the step emits acc + 1 tokens, the last one not a copy.
            state = torch.where(acc == 0, WRONG, torch.where(acc >= valid, RIGHT, PARTIAL))
            state = torch.where(valid > 0, state, NO_PROPOSAL)
            p = torch.where(live, p + acc + 1, p)
    return {name: torch.cat(v) for name, v in logs.items()}


def fit_ngram_table(log: dict, n_max: int = 8, k: int = 32, strength: float = 4.0) -> torch.Tensor:
    """P(j accepted | j reached) by [state, m, j], each cell shrunk toward the (m, j) estimate
    pooled over states, which is shrunk toward the per-position estimate."""
    def counts(index: list[torch.Tensor], sizes: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        flat = torch.zeros(sizes).long()
        strides = torch.tensor(flat.stride())
        j = torch.arange(k).expand_as(log["reached"])
        idx = sum(ix * st for ix, st in zip([*index, j], strides))
        reached, acc = log["reached"], log["accepted"] & log["reached"]
        n = torch.bincount(idx[reached], minlength=flat.numel()).view(sizes).float()
        a = torch.bincount(idx[acc], minlength=flat.numel()).view(sizes).float()
        return a, n

    rows = log["reached"].shape[0]
    s_ix, m_ix = log["state"][:, None].expand(rows, k), log["m"][:, None].expand(rows, k)
    a_j, n_j = counts([], (k,))
    c_j = (a_j + 1) / (n_j + 2)
    a_mj, n_mj = counts([m_ix], (n_max + 1, k))
    c_mj = (a_mj + strength * c_j) / (n_mj + strength)
    a_smj, n_smj = counts([s_ix, m_ix], (4, n_max + 1, k))
    return (a_smj + strength * c_mj) / (n_smj + strength)


def table_ece(table: torch.Tensor, log: dict) -> float:
    k = table.shape[-1]
    rows = log["reached"].shape[0]
    pred = table[log["state"][:, None].expand(rows, k), log["m"][:, None].expand(rows, k), torch.arange(k)]
    r = log["reached"]
    return ece(pred[r], log["accepted"][r])


def stage_ngram(out: Path, dest: Path, r: Recipe) -> dict:
    """Fit the n-gram table on the target's answers and report its ECE on held-out ones against
    simpler estimates: one rate per position, and per (m, j) without the last outcome."""
    from .price import default_ngram_table
    from .tokenizer import Tokenizer
    from .weights import default_model, save_ngram_table

    tok = Tokenizer.from_path(r.model or default_model())
    docs = {True: [], False: []}
    for line in (out / "answers.jsonl").open():
        row = json.loads(line)
        prompt = tok.encode_chat([{"role": "user", "content": row["prompt"]}])
        docs[is_held_out(row["prompt"])].append((prompt + row["answer_ids"], len(prompt)))
    fit_log, test_log = simulate_ngram(docs[False]), simulate_ngram(docs[True])
    table = fit_ngram_table(fit_log)
    pooled = table.mean(0, keepdim=True).expand_as(table)  # (m, j) only
    positional = fit_ngram_table({**fit_log, "m": torch.zeros_like(fit_log["m"]),
                                  "state": torch.zeros_like(fit_log["state"])})[0, 0].expand_as(table)
    report = {"fit_steps": int(fit_log["m"].numel()), "held_out_steps": int(test_log["m"].numel()),
              "ece_held_out": {"state_m_j": round(table_ece(table, test_log), 4),
                               "m_j": round(table_ece(pooled, test_log), 4),
                               "j_only": round(table_ece(positional, test_log), 4),
                               "hand_set_default": round(table_ece(default_ngram_table(8, 32), test_log), 4)}}
    save_ngram_table(dest, table, report)
    print(json.dumps(report, indent=1))
    return report


# ----------------------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m minispark.train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=["data", "features", "fit", "calibrate", "ngram", "all", "eval"])
    ap.add_argument("--out", type=Path, default=Path("runs/spark"), help="work folder (default runs/spark)")
    ap.add_argument("--dest", type=Path, default=None,
                    help="drafter folder written by calibrate and ngram (default, for the demo model: "
                    "checkpoints/smollm2-135m-instruct; required with --model)")
    ap.add_argument("--model", default=None, help="the target: a checkpoint folder or .gguf (default: the demo model)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--kinds", default=",".join(KINDS), help="documents for the features stage")
    ap.add_argument("--minutes", type=float, default=20.0, help="time for the data stage and for the fit stage")
    ap.add_argument("--first-round", type=int, default=0,
                    help="data: write requests from this round on (a drafter trained on a run's requests "
                    "gets new ones from a later round)")
    ap.add_argument("--only-self-written", action="store_true",
                    help="data: answer only the requests the target writes, not the templated prompts "
                    "(new text for a drafter that trained on them)")
    ap.add_argument("--init", type=Path, default=None,
                    help="fit: start from this drafter folder (e.g. the shipped one) when --out has no checkpoint; "
                    "calibrate: recalibrate this drafter on the answers in --out")
    args = ap.parse_args(argv)
    kinds = tuple(args.kinds.split(","))
    unknown = set(kinds) - set(KINDS)
    if unknown:
        ap.error(f"--kinds {args.kinds!r}: unknown {', '.join(sorted(unknown))}; choose from {', '.join(KINDS)}")
    if args.dest is None:
        if args.model is not None and args.stage in ("calibrate", "ngram", "all", "eval"):
            ap.error("--dest is required with --model: the default folder holds the demo model's drafter")
        args.dest = Path("checkpoints/smollm2-135m-instruct")
    torch.manual_seed(0)
    r = Recipe(model=args.model, device=args.device, first_round=args.first_round,
               templates=not args.only_self_written)
    run(args.stage, args.out, args.dest, r, args.minutes, kinds, args.init)


def run(stage: str, out: Path, dest: Path, r: Recipe, minutes: float, kinds: tuple[str, ...] = KINDS,
        init: Path | None = None) -> None:
    """One stage, or all of them in order."""
    if stage in ("data", "all"):
        stage_data(out, r, minutes)
    if stage in ("features", "all"):
        stage_features(out, r, kinds)
    if stage in ("fit", "all"):
        stage_fit(out, r, minutes, init)
    if stage in ("calibrate", "all"):
        stage_calibrate(out, dest, r, init if stage == "calibrate" else None)
    if stage in ("ngram", "all"):
        stage_ngram(out, dest, r)
    if stage == "eval":
        stage_eval(dest, r)


if __name__ == "__main__":
    main(sys.argv[1:])
