"""Distil a Spark drafter from its target, calibrate it, and fit the n-gram table.

    python -m minispark.train all --out runs/spark --minutes 30     # the whole recipe
    python -m minispark.train data|features|fit|calibrate|ngram|eval --out runs/spark

Each stage reads the files of the one before in --out and resumes; sizes are in `Recipe`.
  data       the target's answers to templated prompts and to requests it writes, text it reads
  features   the target's features of every document and its top-k distribution, the teacher
  fit        the drafter on 0.1 CE + 0.9 TV + BCE(conf, 1 - TV): ckpt.pt, and the best: best.pt
  calibrate  a temperature and a shift per position of the confidences, on answers the drafter
             never trained on: spark.safetensors + spark.json in --dest
  ngram      P(accepted | last outcome, match length, position) of the n-gram drafter: ngram.json
  eval       (not in `all`) the drafter in --dest on MT-Bench, which no stage trains on
--keep FILE keeps the target's answers across runs: data adds to it, features and ngram read it.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.progress import Progress

from .cpu import resolve_dtype
from .dataset import (KINDS, Corpus, answer_rows, block_batch, calibration_corpus, doc_features, is_held_out,
                      load_corpus, stage_data, stage_features)
from .drafters import (NO_PROPOSAL, PARTIAL, RIGHT, WRONG, NgramDrafter, SparkArgs, SparkDrafter, calibrated,
                       default_ngram_table)
from .tokenizer import Tokenizer
from .weights import default_model, load_drafter, load_model, save_drafter, save_ngram_table
from .workloads import chat_prompts


def spread_layers(n_layers: int, k: int = 5) -> tuple[int, ...]:
    """k target layers, from shallow to deep, whose hidden states feed the drafter."""
    return tuple(sorted({min(n_layers - 1, round(1 + i * (n_layers - 2) / (k - 1))) for i in range(k)}))


@dataclass
class Recipe:
    """Every size of the recipe; the defaults are those of the CPU run of the shipped drafter."""
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
        """The frozen target; dtype None = bfloat16 where the hardware computes in it, else
        float32 (a CPU without native bf16 converts every operand, which is slower)."""
        dtype = dtype or resolve_dtype("auto", torch.device(self.device))
        model, path = load_model(self.model or default_model(), dtype=dtype, device=self.device)
        return model.requires_grad_(False), path


# ----------------------------------------------------------------------------- the drafter and its loss
def new_drafter(target, corpus: Corpus, r: Recipe):
    """A drafter whose layers and norms start as copies of the target's last ones, drafting the
    `r.draft_vocab` tokens the target writes or predicts first most often."""
    args = SparkArgs.for_target(target.args, target_layers=r.feature_layers(target.args.n_layers), block=r.block,
                                rank=r.rank, draft_vocab=min(r.draft_vocab, target.args.vocab_size))
    d = SparkDrafter(args)
    src = target.layers[-1].state_dict()
    for layer in d.layers:
        layer.load_state_dict({k: src[k].float() for k in layer.state_dict()})
    d.norm.weight.data.copy_(target.norm.weight.float())
    d.mask_emb.data.copy_(target.tok_embeddings.weight.float().mean(0))
    torch.nn.init.normal_(d.markov_in.weight, std=0.02)
    counts = torch.bincount(torch.cat([corpus.ids, corpus.top_ids[:, 0]]), minlength=args.draft_vocab)
    d.d2t.copy_(counts.topk(args.draft_vocab).indices.sort().values)
    return d.to(target.tok_embeddings.weight.device)


def starting_drafter(target, train: Corpus, r: Recipe, ckpt: dict | None, init: Path | None):
    """The run's checkpoint if it has one; else the drafter in folder `init` with its
    calibration undone (the confidences train raw, calibrate refits them); else a new one."""
    if ckpt is not None:
        return _drafter_from(ckpt).to(r.device)
    if init is None:
        return new_drafter(target, train, r)
    d = load_drafter(init, target.args, torch.float32, r.device)
    d.conf_temp.fill_(1.0)
    d.conf_bias.fill_(0.0)
    return d


def _drafter_from(ckpt: dict):
    args = {**ckpt["args"], "target_layers": tuple(ckpt["args"]["target_layers"])}
    d = SparkDrafter(SparkArgs(**args))
    d.load_state_dict({"conf_bias": d.conf_bias, **ckpt["model"]})  # older checkpoints have no conf_bias
    return d


def anchor_states(d, batch: dict) -> torch.Tensor:
    """The drafter's hidden states [B, A, g, dim] of each anchor's block, teacher-forced."""
    ids, p = batch["ids"], batch["anchor_pos"]
    B, W = ids.shape
    pos = torch.arange(W, device=ids.device).expand(B, W)
    ctx = d.context(batch["feats"])  # [B, W, dim]
    cos, sin = d.rope(pos, ctx.dtype)
    ctx_kv = [layer.attention.context_kv(ctx, cos, sin) for layer in d.layers]
    ctx_mask = pos[:, None, :] < p[:, :, None]  # [B, A, W]: positions before the anchor
    return d.block_states(ids.gather(1, p), p, ctx_kv, ctx_mask).view(B, p.shape[1], d.args.block, -1)


def drafter_outputs(d, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced draft logits [B, A, g, Vd] and confidence logits [B, A, g]."""
    return d.logits(anchor_states(d, batch), batch["prev"])


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
    w = torch.exp(-torch.arange(logits.shape[2], device=conf.device) / 4.0) * batch["valid"]
    parts = {"ce": (ce * w).sum() / w.sum(), "tv": (tv * w).sum() / w.sum(), "bce": (bce * w).sum() / w.sum()}
    parts["loss"] = 0.1 * parts["ce"] + 0.9 * parts["tv"] + parts["bce"]
    return parts


@torch.no_grad()
def evaluate(d, corpus: Corpus, n_docs: int = 200, anchors: int = 16, seed: int = 1, width: int = 512,
             first: int = 0) -> dict:
    """Greedy chains on answers `first` .. `first + n_docs`, anchored in the answer where the
    window holds it whole: accepted tokens per step (1 + the matching prefix), acceptance per
    slot given the slots before it, and the raw confidence logits for calibration."""
    gen = torch.Generator().manual_seed(seed)
    docs = torch.tensor([i for i, k in enumerate(corpus.kind) if k == "answer"][first:first + n_docs])
    dev = d.d2t.device
    toks, confs, targets, valids = [], [], [], []
    for chunk in docs.split(16):
        lo = torch.where(corpus.lens[chunk] <= width, corpus.start[chunk], 1)
        batch = {k: v.to(dev) for k, v in block_batch(corpus, chunk, width, anchors, d.args.block, gen, lo).items()}
        t, c = d.chain(anchor_states(d, batch).flatten(0, 1), batch["ids"].gather(1, batch["anchor_pos"]).flatten(),
                       None, None)
        toks.append(t); confs.append(c.float())
        targets.append(batch["target"].flatten(0, 1)); valids.append(batch["valid"].flatten(0, 1))
    toks, conf, target, valid = (torch.cat(x).cpu() for x in (toks, confs, targets, valids))
    alive = ((toks == target) & valid).long().cumprod(-1).bool()  # [N, g] slot k accepted with all before it
    full = valid.all(-1)
    acc = alive[full].float()
    rate = [acc[:, 0].mean()] + [acc[:, k].sum() / max(acc[:, k - 1].sum(), 1) for k in range(1, acc.shape[1])]
    return {"tokens_per_step": 1 + acc.sum(-1).mean().item(), "slot_rate": [float(x) for x in rate],
            "conf_logit": conf[full], "alive": acc}


# ----------------------------------------------------------------------------- stage: fit
def stage_fit(out: Path, r: Recipe, minutes: float, init: Path | None = None) -> None:
    """Train from `out/ckpt.pt` (else from the drafter folder `init`, else from scratch) for
    `minutes` more (or `r.max_steps`), keeping the drafter with the most held-out accepted tokens
    per step in `out/best.pt`. The learning rate warms up, then decays over each run's minutes,
    so a resumed run anneals again."""
    target, _ = r.target(torch.float32 if r.device == "cpu" else torch.bfloat16)
    train, held = load_corpus(out)
    if r.device.startswith("cuda") and 2 * train.feats.nbytes < torch.cuda.mem_get_info()[0]:
        train, held = train.to(r.device), held.to(r.device)
    ckpt_path = out / "ckpt.pt"
    ckpt = torch.load(ckpt_path, weights_only=False) if ckpt_path.exists() else None
    d = starting_drafter(target, train, r, ckpt, init).attach(target)
    covered = (d.t2d.cpu()[train.ids.cpu()] < d.args.draft_vocab).float().mean()
    print(f"{len(train)} training documents ({len(train.ids):,} tokens), {len(held)} held out; "
          f"the draft vocabulary covers {covered:.1%} of training tokens")
    params = [p for p in d.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=r.lr, weight_decay=0.0, betas=(0.9, 0.95))
    if ckpt is not None:
        opt.load_state_dict(ckpt["opt"])
    # The best score stands only against the same held-out documents: data added since moves them.
    best = ckpt["best"] if ckpt and ckpt.get("held") == len(held) else 0.0
    first = step = ckpt["step"] if ckpt else 0
    gen = torch.Generator().manual_seed(step)
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
            docs = torch.multinomial(train.lens.float(), r.batch_docs, replacement=True, generator=gen)
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
    surv = calibrated(conf_logit, temps, bias).cumprod(-1)
    return [ece(surv[:, k], alive[:, k]) for k in range(conf_logit.shape[1])]


def fit_calibration(conf_logit: torch.Tensor, alive: torch.Tensor,
                    temps_grid: torch.Tensor = torch.logspace(-1.2, 2, 65),
                    bias_grid: torch.Tensor = torch.linspace(-3, 3, 61)) -> tuple[torch.Tensor, torch.Tensor, list, list]:
    """Position by position, left to right, the temperature and shift whose survival
    prod_{i<=k} sigmoid(z_i / T_i + b_i) best predicts whether slots 0..k were all accepted.
    Best by log loss: the ECE alone is as low for a confidence flattened to the mean acceptance,
    which ranks no draft above another, as for a sharp one. A shift lowers confidences that a
    temperature, pulling them toward 1/2, cannot. Returns the temperatures, the shifts and the
    ECE per position before and after."""
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


def stage_calibrate(out: Path, dest: Path, r: Recipe, init: Path | None = None) -> dict:
    """Fit the confidences' calibration on half the answers the drafter never trained on, report
    it on the other half, and write the drafter folder: of the run's best checkpoint, or of the
    drafter in folder `init`."""
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
    half = max(1, len(held) // 2)
    with torch.autocast(r.device.split(":")[0], dtype=torch.bfloat16), torch.no_grad():
        fit = evaluate(d, held, n_docs=half, anchors=24, seed=2)
        temps, bias, _, _ = fit_calibration(fit["conf_logit"], fit["alive"])
        d.conf_temp.copy_(temps)
        d.conf_bias.copy_(bias)
        test = evaluate(d, held, n_docs=10**6, anchors=8, seed=3, first=half if len(held) > 1 else 0)
    report = {
        "calibrated_on": what,
        "held_out_tokens_per_step": round(test["tokens_per_step"], 3),
        "slot_acceptance": [round(x, 3) for x in test["slot_rate"]],
        "temperatures": [round(x, 3) for x in temps.tolist()],
        "shifts": [round(x, 3) for x in bias.tolist()],
        "survival_ece_before": [round(x, 4) for x in survival_ece(test["conf_logit"], test["alive"])],
        "survival_ece_after": [round(x, 4) for x in survival_ece(test["conf_logit"], test["alive"], temps, bias)],
        "training_step": step,
    }
    if fit_report is not None:
        report["fit_report"] = fit_report
    save_drafter(dest, d, target.args, report)
    print(json.dumps(report, indent=1))
    return report


@torch.no_grad()
def stage_eval(dest: Path, r: Recipe, prompts: int = 80, max_tokens: int = 256) -> dict:
    """The drafter in `dest` on MT-Bench's first turns, answered greedily by the target: accepted
    tokens per step, acceptance per slot and the ECE of its calibrated survival: mt_bench.json."""
    from . import LLM, SamplingParams  # lazily: the package's __init__ imports the engine

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
    """Replay the n-gram drafter over answers as decoding would: propose from the history,
    accept the leading tokens that match, emit one more. docs: (ids, where the answer starts).
    Returns per step and chain position: the state of the last proposal, the match length m,
    whether position j was reached and whether it was accepted."""
    drafter = NgramDrafter(k=k)
    logs = {"state": [], "m": [], "reached": [], "accepted": []}
    col = torch.arange(k)
    for i in range(0, len(docs), batch):
        chunk = docs[i: i + batch]
        C = max(len(ids) for ids, _ in chunk)
        tokens = torch.zeros(len(chunk), C + k + 1, dtype=torch.long)
        for row, (ids, _) in enumerate(chunk):
            tokens[row, : len(ids)] = torch.tensor(ids)
        n = torch.tensor([len(ids) for ids, _ in chunk])
        p = torch.tensor([start for _, start in chunk])  # the anchor's position
        state = torch.full((len(chunk),), NO_PROPOSAL)
        while (live := p + 1 < n).any():
            draft, valid, m = drafter(tokens[:, :C], torch.where(live, p + 1, 0))
            truth = tokens.gather(1, (p[:, None] + 1 + col).clamp(max=C + k))
            ok = (draft == truth) & (col < valid[:, None]) & (p[:, None] + 1 + col < n[:, None])
            acc = ok.long().cumprod(-1).sum(-1)
            reached = (col < valid[:, None]) & (col <= acc[:, None]) & live[:, None]
            for name, v in zip(logs, (state, m, reached, col < acc[:, None])):
                logs[name].append(v[live])
            # As the engine judges it: the step emits acc + 1 tokens, the last one not a copy.
            state = torch.where(acc == 0, WRONG, torch.where(acc >= valid, RIGHT, PARTIAL))
            state = torch.where(valid > 0, state, NO_PROPOSAL)
            p = torch.where(live, p + acc + 1, p)
    return {name: torch.cat(v) for name, v in logs.items()}


def fit_ngram_table(log: dict, n_max: int = 8, k: int = 32, strength: float = 4.0) -> torch.Tensor:
    """P(j accepted | j reached) by [state, m, j], each cell shrunk toward the (m, j) estimate
    pooled over states, which is shrunk toward the per-position estimate."""
    def counts(index: list[torch.Tensor], sizes: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        flat = torch.zeros(sizes)
        j = torch.arange(k).expand_as(log["reached"])
        idx = sum(ix * st for ix, st in zip([*index, j], torch.tensor(flat.stride())))
        n = torch.bincount(idx[log["reached"]], minlength=flat.numel()).view(sizes).float()
        a = torch.bincount(idx[log["accepted"] & log["reached"]], minlength=flat.numel()).view(sizes).float()
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
    k, rows = table.shape[-1], log["reached"].shape[0]
    pred = table[log["state"][:, None].expand(rows, k), log["m"][:, None].expand(rows, k), torch.arange(k)]
    return ece(pred[log["reached"]], log["accepted"][log["reached"]])


def stage_ngram(out: Path, dest: Path, r: Recipe, keep: Path | None = None) -> dict:
    """Fit the n-gram table on the target's answers (the run's and those in `keep`) and report
    its ECE on held-out ones against simpler estimates: per (m, j), per position alone, and the
    hand-set default."""
    tok = Tokenizer.from_path(r.model or default_model())
    docs = {True: [], False: []}
    for row in answer_rows(out, keep):
        prompt = tok.encode_chat([{"role": "user", "content": row["prompt"]}])
        docs[is_held_out(row["prompt"])].append((prompt + row["answer_ids"], len(prompt)))
    fit_log, test_log = simulate_ngram(docs[False]), simulate_ngram(docs[True])
    table = fit_ngram_table(fit_log)
    pooled = table.mean(0, keepdim=True).expand_as(table)
    zeros = {name: torch.zeros_like(fit_log[name]) for name in ("m", "state")}
    positional = fit_ngram_table({**fit_log, **zeros})[0, 0].expand_as(table)
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
    ap.add_argument("--dest", type=Path, default=None, help="drafter folder that calibrate and ngram write "
                    "(default, for the demo model: checkpoints/smollm2-135m-instruct; required with --model)")
    ap.add_argument("--model", default=None, help="the target: a checkpoint folder or .gguf (default: the demo model)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--kinds", default=",".join(KINDS), help="documents for the features stage")
    ap.add_argument("--minutes", type=float, default=20.0, help="time for the data stage and for the fit stage")
    ap.add_argument("--keep", type=Path, default=None, metavar="FILE",
                    help="the target's kept answers (gzip JSON lines, e.g. DEST/answers.jsonl.gz): data answers "
                    "only prompts not there and adds its answers to it; features and ngram read it beside --out's")
    ap.add_argument("--first-round", type=int, default=0, help="data: write requests from this round on "
                    "(new ones for a drafter trained on a run's requests)")
    ap.add_argument("--only-self-written", action="store_true",
                    help="data: answer only the requests the target writes, not the templated prompts")
    ap.add_argument("--init", type=Path, default=None, help="fit: start from this drafter folder when --out "
                    "has no checkpoint; calibrate: recalibrate this drafter on the answers in --out")
    args = ap.parse_args(argv)
    kinds = tuple(args.kinds.split(","))
    if unknown := set(kinds) - set(KINDS):
        ap.error(f"--kinds {args.kinds!r}: unknown {', '.join(sorted(unknown))}; choose from {', '.join(KINDS)}")
    if args.dest is None:
        if args.model is not None and args.stage in ("calibrate", "ngram", "all", "eval"):
            ap.error("--dest is required with --model: the default folder holds the demo model's drafter")
        args.dest = Path("checkpoints/smollm2-135m-instruct")
    torch.manual_seed(0)
    r = Recipe(model=args.model, device=args.device, first_round=args.first_round,
               templates=not args.only_self_written)
    run(args.stage, args.out, args.dest, r, args.minutes, kinds, args.init, args.keep)


def run(stage: str, out: Path, dest: Path, r: Recipe, minutes: float, kinds: tuple[str, ...] = KINDS,
        init: Path | None = None, keep: Path | None = None) -> None:
    """One stage, or all of them in order."""
    if stage in ("data", "all"):
        stage_data(out, r, minutes, keep)
    if stage in ("features", "all"):
        stage_features(out, r, kinds, keep=keep)
    if stage in ("fit", "all"):
        stage_fit(out, r, minutes, init)
    if stage in ("calibrate", "all"):
        stage_calibrate(out, dest, r, init if stage == "calibrate" else None)
    if stage in ("ngram", "all"):
        stage_ngram(out, dest, r, keep)
    if stage == "eval":
        stage_eval(dest, r)


if __name__ == "__main__":
    main(sys.argv[1:])
