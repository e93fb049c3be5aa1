"""The user API: `LLM(...).generate(prompts, SamplingParams(...))`, in the manner of vLLM.

Requests, text and streaming, stop strings, cancellation and the trace live here, and so does
continuous batching: the host admits waiting requests into free slots, plans each step
(`planner`), launches it on the engine, and reads its results.
"""
from __future__ import annotations

import itertools
import json
from collections import deque
from pathlib import Path
from typing import Iterator, NamedTuple, Sequence

import torch

from .drafters import Drafter, NgramDrafter, SparkDrafter
from .engine import FINISH, Engine, StepClock, StepOut
from .cpu import resolve_dtype
from .model import Transformer
from .planner import BUDGETS, ROWS, CostModel, Pieces, Plan, Planner, bucket, profile, round_up
from .requests import Delta, Request, RequestOutput, SamplingParams, make_requests, randomness
from .tokenizer import Tokenizer
from .weights import DEMO_DRAFTER, load_drafter, load_model, load_ngram_table

SPEC_MODES = ("off", "ngram", "spark", "hybrid")
NON_FINITE = ("the model produced NaN or inf logits for this request (a broken checkpoint, or an "
              "overflow in this dtype: try dtype='float32'); nothing was sampled from them")


class Launched(NamedTuple):
    """A step in flight: its results (on the host once `copied` is done), its rows' requests
    when it launched (None: idle), its plan and its clock."""
    out: StepOut
    copied: "torch.cuda.Event | None"
    owners: list
    plan: Plan
    clock: StepClock


class LLM:
    """A vLLM-style front end: `LLM().generate(prompts, SamplingParams(...))`."""

    def __init__(self, model: str | None = None, spec: str | None = None, drafters: list[Drafter] | None = None,
                 max_batch_size: int = 8, max_seq_len: int = 4096, dtype: str | torch.dtype = "auto",
                 device: str | None = None, seed: int = 0, ngram_k: int = 32, draft_budget: int = 64,
                 compile: bool | None = None, cost: CostModel | None = None, trace: str | None = None,
                 drafter: str | None = None, adaptive: bool = True, pieces: Pieces = Pieces()):
        """model: a checkpoint folder or .gguf (None = the demo model). spec: "off", "ngram",
        "spark" or "hybrid" (None = hybrid where a Spark drafter exists, else ngram); drafters:
        any list of `Drafter`s instead. dtype: "auto" (bfloat16 where the hardware computes in
        it, else float32) or a dtype's name. drafter: a folder with a Spark drafter and n-gram
        table for this model (the shipped one for the demo model). ngram_k: the longest n-gram
        chain; draft_budget: the most draft tokens verified per step, batch-wide; compile:
        torch.compile the decode step (None = on CUDA only); cost: a step-time table (profiled
        at start-up when None); trace: a file that gets one JSON line per step; adaptive: False
        verifies every row's whole chain every step (the fixed baseline); pieces: the planner's
        refinements (`planner.Pieces`)."""
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if compile is None:  # one graph per step on a GPU; on a CPU compiling costs more than it gives
            compile = torch.device(device).type == "cuda"
        check_sizes(spec, max_batch_size, max_seq_len)
        net, path = load_model(model, dtype=resolve_dtype(dtype, torch.device(device)), device=device)
        if drafter is not None and not Path(drafter).expanduser().is_dir():  # even where the mode needs none
            raise ValueError(f"drafter folder {drafter} not found (a folder made by `python -m minispark.train`)")
        if drafter is None and model is None and DEMO_DRAFTER.is_dir():  # a wheel has no checkpoints/
            drafter = DEMO_DRAFTER
        if spec is None and drafters is None:
            spec = "hybrid" if drafter is not None else "ngram"
        self._init(net, Tokenizer.from_path(path), spec, drafters, drafter, None, max_batch_size, max_seq_len,
                   seed, ngram_k, draft_budget, compile, cost, trace, adaptive, pieces)

    @classmethod
    def from_model(cls, net: Transformer, tokenizer: Tokenizer, spec: str | None = None,
                   drafters: list[Drafter] | None = None, max_batch_size: int = 8, max_seq_len: int = 4096,
                   seed: int = 0, ngram_k: int = 32, draft_budget: int = 64, compile: bool = False,
                   cost: CostModel | None = None, trace: str | None = None, drafter: SparkDrafter | str | None = None,
                   ngram_table: torch.Tensor | None = None, adaptive: bool = True, pieces: Pieces = Pieces()) -> "LLM":
        """An LLM around a built model and tokenizer (tests use tiny random models), drafting with
        `spec` or `drafters` (neither: "off"). The model's KV cache is allocated anew: one LLM
        per model at a time."""
        check_sizes(spec, max_batch_size, max_seq_len)
        spec = "off" if spec is None and drafters is None else spec
        self = cls.__new__(cls)
        self._init(net, tokenizer, spec, drafters, drafter, ngram_table, max_batch_size, max_seq_len, seed,
                   ngram_k, draft_budget, compile, cost, trace, adaptive, pieces)
        return self

    def _init(self, net, tokenizer, spec, drafters, drafter, table, S, L, seed, ngram_k, draft_budget, compile,
              cost, trace, adaptive, pieces) -> None:
        if spec is not None and drafters is not None:
            raise ValueError(f"give spec={spec!r} or drafters=[...], not both: a spec is a shortcut for a list of drafters")
        if not isinstance(draft_budget, int) or draft_budget < 1:
            raise ValueError(f"draft_budget must be an int >= 1, got {draft_budget!r}")
        if drafters is None:
            spark, table = shortcut_drafters(spec, drafter, table, net)
            drafters = ([NgramDrafter(k=ngram_k, table=table)] if spec in ("ngram", "hybrid") else []) + spark
        check_drafters(drafters)
        self.spec = spec or "+".join(d.name for d in drafters)
        self.engine = engine = Engine(net, drafters, S, L, compile=compile)
        self.tokenizer, self.seed, self.adaptive = tokenizer, seed, adaptive
        self.names = [d.name for d in drafters]
        self.sources = self.names + ["target"]
        budgets = [b for b in BUDGETS if b <= draft_budget]
        # Only the adaptive plan weighs step times; the fixed baseline verifies everything anyway.
        table_given = cost
        if cost is None and engine.K and adaptive:
            cost = profile(engine, budgets)
        self.planner = Planner(self.names, [d.costly for d in drafters], engine.K, S, L, budgets, cost,
                               learn=table_given is None and cost is not None, adaptive=adaptive, pieces=pieces)
        self._trace = open(trace, "w") if trace else None
        self._step_no = 0
        self._overlap = engine.device.type == "cuda"
        self._ids = itertools.count()
        self._totals = {"requests": 0, "tokens": 0, "steps": 0, **dict.fromkeys(self.sources, 0),
                        **{f"{k}_chains": 0 for k in self.names}}
        self._slots: list[Request | None] = [None] * S
        self._cancel: set[int] = set()  # request ids to stop at the next step
        self._remake = dict(drafter=drafter, ngram_table=table, ngram_k=ngram_k, draft_budget=draft_budget,
                            cost=table_given, pieces=pieces)

    # -- public -------------------------------------------------------------------------------------

    def generate(self, prompts: str | list[int] | Sequence[str | list[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Complete each prompt (text, or a list of token ids); outputs in prompt order."""
        reqs = self._requests(prompts, params)
        for _ in self._run(reqs):
            pass
        return [r.out for r in reqs]

    def stream(self, prompts, params=None) -> Iterator[Delta]:
        """Like `generate`, but yields each request's new text as its tokens are accepted."""
        yield from self._run(self._requests(prompts, params))

    def chat(self, conversations: list[dict] | Sequence[list[dict]],
             params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Answer each conversation (a list of {"role", "content"} messages) with the chat template."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        return self.generate([self.tokenizer.encode_chat(c) for c in conversations], params)

    def cancel(self, request_id: int) -> None:
        """Stop one request of a running `stream`: it finishes "cancelled" with its text so far."""
        self._cancel.add(request_id)

    def with_spec(self, spec: str) -> "LLM":
        """An LLM drafting with `spec` on this one's model, tokenizer, drafter and settings,
        writing on to its trace. The KV cache is allocated anew: use one of the two at a time."""
        e = self.engine
        spark = next((d for d in e.drafters if isinstance(d, SparkDrafter)), None)
        remake = {**self._remake, "drafter": spark or self._remake["drafter"]}
        llm = LLM.from_model(e.model, self.tokenizer, spec=spec, max_batch_size=e.S, max_seq_len=e.L,
                             seed=self.seed, compile=e.compiled, adaptive=self.adaptive, **remake)
        llm._trace = self._trace
        return llm

    def stats(self) -> dict[str, float]:
        """Totals over every finished request: tokens, steps, tokens by source, tokens per step."""
        t = dict(self._totals)
        t["tokens_per_step"] = t["tokens"] / max(t["steps"], 1)
        return t

    def close(self) -> None:
        """Close the trace file (shared with the LLMs `with_spec` made from this one)."""
        if self._trace is not None:
            self._trace.close()
        self._trace = None

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- requests -------------------------------------------------------------------------------------

    def _requests(self, prompts, params) -> list[Request]:
        e = self.engine
        return make_requests(prompts, params, self.tokenizer, e.L, e.model.args.vocab_size, self._ids, self.seed,
                             self.sources)

    # -- the host loop ----------------------------------------------------------------------------------

    def _run(self, reqs: list[Request]) -> Iterator[Delta]:
        """Continuous batching. On a GPU the host launches step t, then reads step t-1's tokens,
        so it streams and schedules while the device works; finished slots go to waiting requests."""
        try:
            yield from self._schedule(reqs)
        finally:  # the caller stopped early (Ctrl-C, break): free the slots of what is left
            for req in self._slots:
                if req is not None and req in reqs:
                    self._finish(req, "cancelled")
            for req in reqs:
                if not req.out.finished:
                    req.out.finish_reason = "cancelled"

    def _schedule(self, reqs: list[Request]) -> Iterator[Delta]:
        eng, slots = self.engine, self._slots
        waiting, pending = deque(reqs), None
        while waiting or pending or any(slots):
            if self._cancel:
                yield from self._drop_cancelled(waiting)
            yield from self._admit(waiting)
            launched = None
            if any(slots):
                # A step still in flight (on a GPU) may add up to width + 1 tokens the host has not seen.
                unseen = pending.plan.width + 1 if pending else 0
                self._compact(unseen)
                R = self._rows(max(i for i, r in enumerate(slots) if r) + 1)
                live = [i for i, r in enumerate(slots[:R]) if r]
                plan = self.planner.plan(R, live, [slots[i].row() for i in live], bool(waiting), unseen)
                eng.set_worth(self.planner.worths)
                sampling, filtered = randomness([r.params for r in slots[:R] if r])
                with StepClock(eng.device) as clock:
                    out = eng.step(R, plan.budget, plan.width, plan.ctx, sampling, plan.runs, filtered)
                launched = Launched(*out.to_host(), list(slots[:R]), plan, clock)
            # On a CPU the step is done when launch returns: reading it at once gives the next
            # plan estimates a step fresher.
            done, pending = (pending, launched) if self._overlap else (launched, None)
            if done:
                if done.copied is not None:
                    done.copied.synchronize()
                if self._trace:
                    self._write_trace(done)
                yield from self._absorb(done.out, done.owners, done.plan.runs)
                self.planner.timed(len(done.owners), done.plan, done.clock.seconds())

    def _admit(self, waiting: deque) -> Iterator[Delta]:
        """Give free slots to waiting requests and prefill their prompts."""
        admitted = []
        for slot in [i for i, r in enumerate(self._slots) if r is None]:
            if not waiting:
                break
            req = waiting.popleft()
            self._slots[slot], req.slot = req, slot
            self.engine.set_request(slot, req.out.prompt_token_ids, req.params, req.seed, req.stop_ids)
            self.planner.reset(slot)
            admitted.append(req)
        if admitted:
            out = self.engine.prefill([r.slot for r in admitted], [r.out.prompt_token_ids for r in admitted],
                                      *randomness([r.params for r in admitted]))
            yield from self._absorb(out, admitted, (True,) * len(self.names), counted=False)

    def _rows(self, n: int) -> int:
        """The rows a step runs over when its highest live slot is n - 1: a bucket, so that steps
        share few static shapes."""
        return min(bucket(n, ROWS + (self.engine.S,)), self.engine.S)

    def _compact(self, unseen: int = 0) -> None:
        """Move the requests in the highest slots down into free ones when that lowers the
        step's rows: a step runs over every row up to the highest live slot, idle rows too.
        `unseen`: tokens a step still in flight (on a GPU) may add."""
        slots = self._slots
        live = [i for i, r in enumerate(slots) if r]
        R = self._rows(len(live))
        src = [i for i in live if i >= R]
        if not src:
            return
        dst = [i for i, r in enumerate(slots[:R]) if r is None][: len(src)]
        upto = round_up(max(slots[i].row().known for i in src) + unseen + 1, 256)
        self.engine.move(src, dst, upto)
        for s, d in zip(src, dst):
            req = slots[s]
            slots[d], slots[s], req.slot = req, None, d
            self.planner.move(s, d)

    def _drop_cancelled(self, waiting: deque) -> Iterator[Delta]:
        for req in self._slots:
            if req is not None and req.out.request_id in self._cancel:
                self._finish(req, "cancelled")
                yield Delta(req.out, req.flush(), "target")
        for req in [r for r in waiting if r.out.request_id in self._cancel]:
            waiting.remove(req)
            req.out.finish_reason = "cancelled"
            yield Delta(req.out, "", "target")
        self._cancel.clear()

    def _absorb(self, out: StepOut, owners: list, runs: tuple[bool, ...], counted: bool = True) -> Iterator[Delta]:
        """Read one step's results on the host and hand them to their requests."""
        # The estimates follow each request to where it runs now (compaction may have moved it
        # since the step launched, on a GPU); a slot given to a new request keeps that one's.
        self.planner.observe(out, [r.slot if r is not None else None for r in owners], runs, counted)
        tokens, n, n_draft = out.tokens.tolist(), out.n.tolist(), out.n_draft.tolist()
        source, finish, length = out.source.tolist(), out.finish.tolist(), out.length.tolist()
        for i, req in enumerate(owners):
            if req is None or req.out.finished or (n[i] == 0 and FINISH.get(finish[i]) != "error"):
                continue
            o, src = req.out, self.sources[source[i]]
            o.num_steps += counted
            if length[i] > 0:
                o.chains[src] += 1
            reason = FINISH.get(finish[i])
            if reason == "error":
                o.error = NON_FINITE
                self._finish(req, reason)
                yield Delta(o, req.flush(), "target")
                continue
            for j, tok in enumerate(tokens[i][: n[i]]):
                by = src if j < n_draft[i] else "target"
                o.accepted[by] += 1
                stopped = req.append(tok, self.tokenizer)
                if stopped or (reason and j == n[i] - 1):
                    self._finish(req, "stop" if stopped else reason, cut=stopped)
                delta = req.flush()
                if delta or o.finished:
                    yield Delta(o, delta, by)
                if stopped:
                    break

    def _write_trace(self, step: Launched) -> None:
        """One JSON line per step: what each slot proposed, was granted and kept, which drafters
        ran, and the step's time on its device (`ms`, what the cost table learns from)."""
        self._step_no += 1
        out, plan = step.out, step.plan
        n, n_draft, length, source = out.n.tolist(), out.n_draft.tolist(), out.length.tolist(), out.source.tolist()
        estimates = out.survival.tolist()
        slots = [{"slot": s, "request": req.out.request_id, "chain": self.sources[source[s]],
                  "estimate": [round(x, 3) for x in estimates[s][:max(plan.width, 1)]],
                  "verified": length[s], "accepted": n_draft[s], "emitted": n[s]}
                 for s, req in enumerate(step.owners) if req is not None and n[s] > 0]
        self._trace.write(json.dumps({"step": self._step_no, "budget": plan.budget, "width": plan.width,
                                      "ctx": plan.ctx, "runs": [nm for nm, r in zip(self.names, plan.runs) if r],
                                      "ms": round(step.clock.seconds() * 1e3, 3), "slots": slots}) + "\n")
        self._trace.flush()

    def _finish(self, req: Request, reason: str, cut: bool = False) -> None:
        """cut: a stop string ended the text, so bytes held by the decoder belong after it."""
        o = req.out
        if not cut:
            o.text += req.decoder.decode(b"", final=True)
        o.finish_reason = reason
        slot, req.slot = req.slot, None
        self._slots[slot] = None
        self.engine.active[slot] = False  # the device may not know yet (stop strings, cancel)
        if reason == "error":
            self.engine.forget(slot)
        t = self._totals
        t["requests"] += 1
        t["tokens"] += len(o.token_ids)
        t["steps"] += o.num_steps
        for k, v in o.accepted.items():
            t[k] += v
        for k, v in o.chains.items():
            t[f"{k}_chains"] += v


def shortcut_drafters(spec: str, folder, table, net: Transformer) -> tuple[list[Drafter], torch.Tensor | None]:
    """The Spark drafter (as a list) and the n-gram table a `spec` shortcut needs: `folder` is a
    drafter folder, or a built SparkDrafter."""
    spark = folder if isinstance(folder, SparkDrafter) else None
    if spec in ("spark", "hybrid") and spark is None:
        if folder is None:
            raise ValueError(f'spec="{spec}" needs a Spark drafter trained for this model: pass drafter=FOLDER '
                             f'(made by `python -m minispark.train`), or use spec="ngram"')
        w = net.tok_embeddings.weight
        spark = load_drafter(folder, net.args, w.dtype, w.device)
    if table is None and spec in ("ngram", "hybrid") and isinstance(folder, (str, Path)) \
            and (Path(folder) / "ngram.json").exists():
        table = load_ngram_table(folder)
    return ([spark] if spec in ("spark", "hybrid") else []), table


def check_sizes(spec: str | None, S: int, L: int) -> None:
    if spec is not None and spec not in SPEC_MODES:
        raise ValueError(f"unknown spec {spec!r}; choose one of: {', '.join(SPEC_MODES)}")
    if not isinstance(S, int) or S < 1:
        raise ValueError(f"max_batch_size must be an int >= 1, got {S!r}")
    if not isinstance(L, int) or L < 8:
        raise ValueError(f"max_seq_len must be an int >= 8, got {L!r}")


def check_drafters(drafters: list) -> None:
    names = [getattr(d, "name", None) for d in drafters]
    for d in drafters:
        if not isinstance(d, Drafter):
            raise ValueError(f"drafters must be minispark.drafters.Drafter instances, got {type(d).__name__}")
        if not isinstance(d.k, int) or d.k < 1:
            raise ValueError(f"drafter {d.name!r} must set k, its longest chain, to an int >= 1 (got {d.k!r})")
    if len(set(names)) != len(names) or "target" in names:
        raise ValueError(f"drafter names must be distinct and not 'target', got {names}")
