"""The user API: `LLM(...).generate(prompts, SamplingParams(...))`, in the manner of vLLM.

Requests, text and streaming, stop strings, cancellation and the trace live here, and so does
continuous batching: the host admits waiting requests into free slots, plans each step
(`planner`), launches it on the engine, and reads its results.
"""
from __future__ import annotations

import codecs
import itertools
import json
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, NamedTuple, Sequence

import torch

from .drafters import Drafter, NgramDrafter, SparkDrafter
from .engine import FINISH, MAX_STOP_IDS, Engine, StepOut
from .cpu import resolve_dtype
from .model import Transformer
from .planner import BUDGETS, ROWS, CostModel, Pieces, Plan, Planner, Row, bucket, profile, round_up
from .tokenizer import Tokenizer
from .weights import DEMO_DRAFTER, load_drafter, load_model, load_ngram_table

SPEC_MODES = ("off", "ngram", "spark", "hybrid")
NON_FINITE = ("the model produced NaN or inf logits for this request (a broken checkpoint, or an "
              "overflow in this dtype: try dtype='float32'); nothing was sampled from them")


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_tokens: int = 16
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        def bad(what: str) -> ValueError:
            return ValueError(f"SamplingParams: {what}")

        if not isinstance(self.temperature, (int, float)) or not 0 <= self.temperature < float("inf"):
            raise bad(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if self.seed is not None and not (isinstance(self.seed, int) and -2**63 <= self.seed < 2**63):
            raise bad(f"seed must be a 64-bit int or None, got {self.seed!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple, type(None))) or not all(isinstance(s, str) and s for s in self.stop or []):
            raise bad(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        self.stop = list(self.stop or [])
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple, type(None))) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids or []):
            raise bad(f"stop_token_ids must be a list of token ids >= 0, got {ids!r}")
        self.stop_token_ids = list(ids or [])
        if not isinstance(self.ignore_eos, bool):
            raise bad(f"ignore_eos must be True or False, got {self.ignore_eos!r}")


@dataclass
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error"
    error: str | None = None  # why, when finish_reason is "error"
    num_steps: int = 0  # decode steps this request took part in
    accepted: dict[str, int] = field(default_factory=dict)  # tokens by source: each drafter, and "target"
    chains: dict[str, int] = field(default_factory=dict)  # verified chains by drafter

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Delta(NamedTuple):
    """A piece of streamed text and the source whose tokens produced it (a drafter or "target")."""
    output: RequestOutput
    text: str
    source: str


@dataclass
class _Request:
    out: RequestOutput
    params: SamplingParams
    seed: int
    stop_ids: list[int]
    decoder: codecs.IncrementalDecoder = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace"))
    sent: int = 0  # characters of `out.text` already streamed
    slot: int | None = None  # where it runs (None: waiting or finished); compaction moves it

    def row(self) -> Row:
        o = self.out
        pace = len(o.token_ids) / o.num_steps if o.num_steps else 1.0
        return Row(self.params.max_tokens - len(o.token_ids), pace, len(o.prompt_token_ids) + len(o.token_ids))


class StepClock:
    """A step's time on its device: CUDA events around the launch on a GPU (read once the
    step's results are on the host, so reading needs no sync of its own), wall time on a CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def __enter__(self) -> "StepClock":
        if self.cuda:
            self.start.record()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            self.end.record()
        self.t1 = time.perf_counter()

    def seconds(self) -> float:
        return self.start.elapsed_time(self.end) / 1000 if self.cuda else self.t1 - self.t0


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
        self._slots: list[_Request | None] = [None] * S
        self._cancel: set[int] = set()  # request ids to stop at the next step
        self._remake = dict(drafter=drafter, ngram_table=table, ngram_k=ngram_k, draft_budget=draft_budget,
                            cost=table_given, pieces=pieces)

    # -- public -------------------------------------------------------------------------------------

    def generate(self, prompts: str | list[int] | Sequence[str | list[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Complete each prompt (text, or a list of token ids); outputs in prompt order."""
        reqs = self._make_requests(prompts, params)
        for _ in self._run(reqs):
            pass
        return [r.out for r in reqs]

    def stream(self, prompts, params=None) -> Iterator[Delta]:
        """Like `generate`, but yields each request's new text as its tokens are accepted."""
        yield from self._run(self._make_requests(prompts, params))

    def chat(self, conversations: list[dict] | Sequence[list[dict]],
             params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Answer each conversation (a list of {"role", "content"} messages) with the chat template."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        return self.generate([self.tokenizer.encode_chat(c) for c in conversations], params)

    def cancel(self, request_id: int) -> None:
        """Stop one request of a running `stream`: it finishes "cancelled" with its text so far,
        and its slot goes to the next waiting request."""
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

    def _make_requests(self, prompts, params) -> list[_Request]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(f"prompts must be a string, a list of token ids, or a list of those; "
                             f"got {type(prompts).__name__}")
        params = SamplingParams() if params is None else params
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else params
        if not isinstance(params, (list, tuple)) or not all(isinstance(p, SamplingParams) for p in params):
            raise ValueError("params must be a SamplingParams or a list of them, one per prompt")
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} SamplingParams; pass one, or one per prompt")
        # Validate everything before anything runs, so one bad request cannot cost the others.
        encoded = [self._encode(i, p) for i, p in enumerate(prompts)]
        stops = [self._stop_ids(p) for p in params]
        reqs = []
        for prompt, ids, p, stop_ids in zip(prompts, encoded, params, stops):
            rid = next(self._ids)
            seed = p.seed if p.seed is not None else self.seed * 1_000_003 + rid
            out = RequestOutput(rid, prompt if isinstance(prompt, str) else None, ids,
                                accepted=dict.fromkeys(self.sources, 0), chains=dict.fromkeys(self.names, 0))
            reqs.append(_Request(out, p, seed, stop_ids))
        return reqs

    def _stop_ids(self, p: SamplingParams) -> list[int]:
        stop_ids = list(dict.fromkeys([*p.stop_token_ids, *([] if p.ignore_eos else self.tokenizer.stop_ids)]))
        if len(stop_ids) > MAX_STOP_IDS:
            own = "" if p.ignore_eos else (f", with the tokenizer's {len(self.tokenizer.stop_ids)} end-of-turn "
                                           f"ids (ignore_eos=True leaves those out)")
            raise ValueError(f"at most {MAX_STOP_IDS} stop token ids per request, got {len(stop_ids)}: "
                             f"{len(p.stop_token_ids)} in stop_token_ids{own}")
        return stop_ids

    def _encode(self, i: int, prompt) -> list[int]:
        L, V = self.engine.L, self.engine.model.args.vocab_size
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError(f"prompt {i} is empty; give at least one character or token")
            ids = self.tokenizer.encode(prompt)
            if any(not 0 <= t < V for t in ids):
                raise ValueError(f"prompt {i} encodes to token ids outside the model's vocabulary [0, {V}): "
                                 f"the tokenizer does not belong to this model")
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
            if not ids:
                raise ValueError(f"prompt {i} is empty; give at least one token")
            bad = [t for t in ids if not 0 <= t < V]
            if bad:
                raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {V}): {bad[:5]}")
        else:
            raise ValueError(f"prompt {i} must be a string or a list of token ids, got {type(prompt).__name__}")
        if len(ids) > L - 1:
            raise ValueError(f"prompt {i} has {len(ids)} tokens, more than max_seq_len={L} allows "
                             f"({L - 1}, leaving room for one generated token); raise max_seq_len or "
                             f"shorten the prompt")
        return ids

    # -- the host loop ----------------------------------------------------------------------------------

    def _run(self, reqs: list[_Request]) -> Iterator[Delta]:
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

    def _schedule(self, reqs: list[_Request]) -> Iterator[Delta]:
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
                yield Delta(req.out, self._flush(req), "target")
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
                yield Delta(o, self._flush(req), "target")
                continue
            for j, tok in enumerate(tokens[i][: n[i]]):
                by = src if j < n_draft[i] else "target"
                o.accepted[by] += 1
                stopped = self._append(req, tok)
                if stopped or (reason and j == n[i] - 1):
                    self._finish(req, "stop" if stopped else reason, cut=stopped)
                delta = self._flush(req)
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

    def _append(self, req: _Request, tok: int) -> bool:
        """Add one token to a request's output; True when a stop string completed."""
        o = req.out
        o.token_ids.append(tok)
        before = len(o.text)
        if tok not in self.tokenizer.special_ids:
            o.text += req.decoder.decode(self.tokenizer.decode_bytes([tok]))
        # One token may complete several stop strings: the text ends at the earliest.
        found = [o.text.find(stop, max(0, before - len(stop) + 1)) for stop in req.params.stop]
        found = [at for at in found if at >= 0]
        if found:
            o.text = o.text[: min(found)]
        return bool(found)

    def _flush(self, req: _Request) -> str:
        """New text that is safe to show: hold back what could still become a stop string."""
        o = req.out
        hold = 0 if o.finished else max((len(s) - 1 for s in req.params.stop), default=0)
        end = max(req.sent, len(o.text) - hold)
        delta, req.sent = o.text[req.sent:end], end
        return delta

    def _finish(self, req: _Request, reason: str, cut: bool = False) -> None:
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


def randomness(params: list[SamplingParams]) -> tuple[bool, bool]:
    """Whether any request samples, and whether any that samples sets top-k or top-p: two static
    choices of a step's graph (a greedy step draws nothing, an unfiltered one sorts nothing)."""
    sampled = [p for p in params if p.temperature > 0]
    return bool(sampled), any(p.top_k > 0 or p.top_p < 1 for p in sampled)


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
