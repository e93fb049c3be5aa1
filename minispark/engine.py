"""The engine: slots on the device, prefill, the speculative decode step, continuous batching.

`Engine` owns the device state and the step; `LLM` is the user API on top (requests, text,
streaming). The step reads like the algorithm: draft, allocate, pack, verify, accept, commit.
"""
from __future__ import annotations

import codecs
import itertools
import json
import os
import time
from collections import deque
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Iterator, NamedTuple, Sequence

import torch
from torch import Tensor

from . import price, verify
from .drafters import NgramDrafter, SparkDrafter
from .model import KV_BLOCK, Batch, Transformer, resolve_dtype
from .tokenizer import Tokenizer
from .weights import DEMO_DRAFTER, load_drafter, load_model, load_ngram_table, progress

SPEC_MODES = ("off", "ngram", "spark", "hybrid")
SOURCES = ("ngram", "spark", "target")
MAX_STOP_IDS = 8
FINISH = {1: "stop", 2: "length", 3: "error"}
NON_FINITE = ("the model produced NaN or inf logits for this request (a broken checkpoint, or an "
              "overflow in this dtype: try dtype='float32'); nothing was sampled from them")


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def bucket(x: int, sizes: Sequence[int]) -> int:
    """The smallest size >= x (the last size when none is)."""
    return next((s for s in sizes if s >= x), sizes[-1])


# ----------------------------------------------------------------------------- user-facing types


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

        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0 or self.temperature == float("inf"):
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
    accepted: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SOURCES, 0))  # tokens by source
    chains: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SOURCES[:2], 0))  # verified chains by drafter

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Delta(NamedTuple):
    """A piece of streamed text and the drafter whose accepted tokens produced it."""
    output: RequestOutput
    text: str
    source: str  # "ngram" | "spark" | "target"


@dataclass
class StepOut:
    """What one step tells the host, for rows [0, R). Small tensors, copied without blocking."""
    tokens: Tensor  # [R, W + 1] emitted tokens (first n valid)
    n: Tensor  # [R] emitted count (0 for inactive rows)
    n_draft: Tensor  # [R] of those, drafted tokens accepted
    source: Tensor  # [R] index into SOURCES of the verified chain
    finish: Tensor  # [R] 0 running, 1 stop, 2 length, 3 error (non-finite logits)
    survival: Tensor  # [R, K] survival of the chain each row verified (the trace shows it)
    ngram_a: Tensor  # [R, K] survival estimates of the n-gram chains the next step verifies
    spark_a: Tensor  # [R, K] and of this step's Spark chains (zeros when its pass was skipped)
    length: Tensor  # [R] drafted tokens verified
    ngram_seen: Tensor  # [R, 2] this step's n-gram proposal, verified or not, against the tokens
    # the step emitted: summed per-token estimates of the positions reached, and tokens agreeing

    def to_host(self) -> tuple["StepOut", "torch.cuda.Event | None"]:
        """On a GPU, start copying to (pinned) host memory behind the step on its stream and
        return the copy with an event that marks it done: the host waits for this step's
        results only, not for a step launched after it. On a CPU, itself and None."""
        if self.tokens.device.type != "cuda":
            return self, None
        host = StepOut(*(getattr(self, f.name).to("cpu", non_blocking=True) for f in fields(self)))
        copied = torch.cuda.Event()
        copied.record()
        return host, copied


# ----------------------------------------------------------------------------- the device engine


class Drafts(NamedTuple):
    """Both drafters' chains for rows [0, R), padded to the longest chain K, with survival estimates."""
    ngram: Tensor  # [R, K] n-gram tokens
    ngram_a: Tensor  # [R, K] their survival (0 past the valid length)
    m: Tensor  # [R] match lengths
    ngram_valid: Tensor  # [R] proposed n-gram tokens
    spark: Tensor  # [R, K] Spark tokens to verify (sampled when sampling)
    spark_a: Tensor  # [R, K] survival along Spark's greedy path (depends on the context alone)
    spark_q: Tensor | None  # [R, K, Vd] draft distributions of the sampled tokens


class Engine:
    """Device state for `S` slots of up to `L` tokens, and the step that advances them."""

    # The state indexed by slot (first dimension S), besides the cache rows: what `move` carries.
    PER_SLOT = ("tokens", "lens", "next_tok", "n_gen", "max_new", "active", "worth", "temperature", "top_p",
                "top_k", "seed", "stop_ids")
    PER_SLOT_NGRAM = ("ng_last", "ng_tok", "ng_valid", "ng_m")  # where the n-gram drafter runs

    def __init__(self, model: Transformer, spec: str, max_batch_size: int, max_seq_len: int, ngram_k: int = 32,
                 ngram: NgramDrafter | None = None, spark: SparkDrafter | None = None,
                 ngram_table: Tensor | None = None, draft_budget: int = 64, compile: bool = False):
        for name, value in (("ngram_k", ngram_k), ("draft_budget", draft_budget)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.model, self.spec = model.requires_grad_(False), spec
        S, L = self.S, self.L = max_batch_size, max_seq_len
        dev = self.device = model.tok_embeddings.weight.device
        if dev.type == "cpu":
            # Setting the thread count, even to the one already in force, fixes it for MKL and
            # OpenMP; left unset, steps that verify drafts ran about 15% slower on a 2-core VM
            # (chat, batch 4: ngram / off 0.82x before, 0.95x after).
            torch.set_num_threads(torch.get_num_threads())
        self.ngram = (ngram or NgramDrafter(k=ngram_k)) if spec in ("ngram", "hybrid") else None
        if spec in ("spark", "hybrid") and spark is None:
            raise ValueError(f'spec="{spec}" needs a Spark drafter for this model (drafter=PATH)')
        self.spark = spark.to(dev).requires_grad_(False).attach(model) if spec in ("spark", "hybrid") else None
        self.K = max(self.ngram.k if self.ngram else 0, self.spark.args.block if self.spark else 0)
        self.draft_budget = draft_budget if self.K else 0
        check_memory(model, S, L, dev, self.spark)
        model.setup_cache(S, L)
        if self.spark:
            self.spark.setup_cache(S, L, model.tok_embeddings.weight.dtype)

        def zeros(*shape, dtype=torch.long):
            return torch.zeros(shape, dtype=dtype, device=dev)

        self.tokens = zeros(S, L + self.K + 1)  # columns past L take writes that are discarded
        self.lens, self.next_tok, self.n_gen, self.max_new = zeros(S), zeros(S), zeros(S), zeros(S)
        self.active = zeros(S, dtype=torch.bool)
        self.worth = torch.ones(S, device=dev)  # what one more token of each slot is worth: see LLM._worth
        self.temperature, self.top_p = zeros(S, dtype=torch.float), torch.ones(S, device=dev)
        self.top_k, self.seed = zeros(S), zeros(S)
        self.stop_ids = torch.full((S, MAX_STOP_IDS), -1, dtype=torch.long, device=dev)
        if self.ngram:
            table = ngram_table if ngram_table is not None else price.default_ngram_table(self.ngram.n_max, self.ngram.k)
            if table.ndim != 3 or table.shape[1] <= self.ngram.n_max:
                raise ValueError(f"the n-gram table is shaped {tuple(table.shape)}, but the matcher needs "
                                 f"[4, m, j] with a row for every match length m up to {self.ngram.n_max}; "
                                 f"fit one with `python -m minispark.train ngram`")
            self.ng_table = price.fit_table_width(table, self.ngram.k).to(dev)  # [F, m, K]
            self.ng_last = zeros(S)  # how the slot's last n-gram proposal fared: the table's first index
            # Each slot's n-gram proposal for its next step, drafted as soon as its history is
            # known (at the end of a step, in prefill), so the host plans with its estimates.
            self.ng_tok, self.ng_valid, self.ng_m = zeros(S, self.K), zeros(S), zeros(S)
        self._step, self.compiled = self.decode_step, compile
        if compile:
            # One graph per (R, budget, width, ctx, sampling, spark_pass, filtered); ints stay static.
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 256)
            mode = "max-autotune" if self.device.type == "cuda" else None
            self._step = torch.compile(self.decode_step, fullgraph=True, dynamic=False, mode=mode)

    # -- prefill ------------------------------------------------------------------------------

    def set_request(self, slot: int, prompt: list[int], p: SamplingParams, seed: int, stop_ids: list[int]) -> None:
        """Write a request's parameters into `slot` (its prompt goes through `prefill`)."""
        self.temperature[slot], self.top_p[slot], self.top_k[slot] = p.temperature, p.top_p, p.top_k
        self.seed[slot], self.max_new[slot] = seed, p.max_tokens
        self.stop_ids[slot] = -1
        self.stop_ids[slot, : len(stop_ids)] = torch.tensor(stop_ids, dtype=torch.long)
        self.tokens[slot, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
        if self.ngram:
            self.ng_last[slot] = 0

    def forget(self, slot: int) -> None:
        """Zero `slot`'s rows of the KV caches (the target's and Spark's context) after a request
        there broke: attention weighs a masked position by 0, and 0 x NaN is NaN, so a NaN key
        left past the next prompt's end would break every later request in the slot."""
        for att in self.caches():
            att.k_cache[slot].zero_()
            att.v_cache[slot].zero_()

    def caches(self) -> list[torch.nn.Module]:
        """The attention modules holding a KV cache row per slot: the target's and Spark's context."""
        spark = [layer.attention for layer in self.spark.layers] if self.spark else []
        return [layer.attention for layer in self.model.layers] + spark

    def move(self, src: list[int], dst: list[int], upto: int) -> None:
        """Move the requests in slots `src` to free slots `dst`: their histories, settings,
        drafter state and cache rows (the target's and Spark's context, positions below `upto`,
        beyond which nothing has been written). Nothing depends on a request's slot, so its
        tokens stay the same (sampling's noise is keyed by seed and position)."""
        s, d = (torch.tensor(x, device=self.device) for x in (src, dst))
        for name in self.PER_SLOT + (self.PER_SLOT_NGRAM if self.ngram else ()):
            t = getattr(self, name)
            t[d] = t[s]
        self.active[s] = False
        upto = min(upto, self.L)
        for att in self.caches():
            for cache in (att.k_cache, att.v_cache):
                written = cache.narrow(att.cache_seq_dim, 0, upto)  # positions below `upto`
                written[d] = written[s]

    def set_worth(self, worth: dict[int, float], R: int) -> None:
        """What a token of each of rows [0, R) is worth to the run (absent rows: 0), copied
        without waiting for the device, which is still running the previous step."""
        host = torch.tensor([worth.get(i, 0.0) for i in range(R)])
        if self.device.type == "cuda":
            host = host.pin_memory()
        self.worth[:R].copy_(host, non_blocking=True)

    @torch.no_grad()
    def prefill(self, slots: list[int], prompts: list[list[int]], sampling: bool, filtered: bool = True) -> StepOut:
        """Run the prompts of newly admitted requests through the target and sample each one's
        first token, which becomes its anchor `next_tok`."""
        dev, R = self.device, len(slots)
        lengths = [len(p) for p in prompts]
        slot_t = torch.tensor(slots, device=dev)
        logits = []
        for s, p in zip(slots, prompts):
            # Each prompt in a forward of its own: its keys, values and first token are then the
            # same bits whichever prompts it comes with, so it may take SDPA's flash kernel,
            # faster than `attend_exact` on a long prompt (see `model.attend_exact`).
            n = len(p)
            b = Batch(tokens=torch.tensor(p, device=dev), slot=torch.full((n,), s, device=dev),
                      pos=torch.arange(n, device=dev), cell=torch.arange(n, device=dev), row_slot=slice(s, s + 1),
                      n_cols=n, ctx_len=min(self.L, round_up(n, KV_BLOCK)))
            last = torch.tensor([n - 1], device=dev)
            lg, hidden = self.model(b, logits_at=last, hidden_layers=self.feature_layers(), exact=False)  # [1, V]
            if self.spark:
                self.spark.write_context(hidden, b.slot, b.pos)
            logits.append(lg)
        logits = torch.cat(logits)  # [R, V]
        lens = torch.tensor(lengths, device=dev)
        first = self.sample(logits, slot_t, lens, sampling, filtered)
        self.lens[slot_t], self.next_tok[slot_t] = lens, first
        self.n_gen[slot_t] = 0
        # The first token is emitted like any other: through the same commit rule.
        out = first[:, None]
        broken = non_finite_logits(logits)
        n, finish = self.finish_rule(slot_t, out, torch.ones_like(lens), broken, first_pos=lens)
        self.tokens[slot_t, lens] = first
        self.n_gen[slot_t] = n
        self.active[slot_t] = finish == 0
        zero = torch.zeros_like(lens)
        # Until Spark has drafted, the host plans with a guess for it: every chain token even odds.
        guess = torch.full((R, self.K), 0.5, device=dev).cumprod(-1)
        ngram_a = self.draft_ngrams(slot_t, min(self.L, round_up(max(lengths) + 1, 64))) if self.ngram else 0 * guess
        return StepOut(out, n, zero, torch.full_like(lens, SOURCES.index("target")), finish, guess,
                       ngram_a, guess if self.spark else 0 * guess, zero, torch.zeros(R, 2, device=dev))

    def feature_layers(self) -> tuple[int, ...]:
        return self.spark.args.target_layers if self.spark else ()

    def sample(self, logits: Tensor, slot: Tensor, pos: Tensor, sampling: bool, filtered: bool = True) -> Tensor:
        """The target's own token for each row of logits [N, V] (greedy unless `sampling`;
        `filtered`: some row sets top-k or top-p)."""
        if not sampling:
            return verify.greedy(logits)
        probs = verify.target_probs(logits, self.temperature[slot], self.top_k[slot], self.top_p[slot], filtered)
        return verify.bonus_tokens(probs, self.seed[slot], pos)

    # -- the decode step ----------------------------------------------------------------------

    @torch.no_grad()
    def step(self, R: int, budget: int, width: int, ctx: int, sampling: bool, spark_pass: bool = True,
             filtered: bool = True) -> StepOut:
        width = min(width, self.K, budget)  # no chain is longer than the budget
        return self._step(R, budget if width else 0, width, ctx, sampling, spark_pass and self.spark is not None,
                          sampling and filtered)

    def decode_step(self, R: int, budget: int, width: int, ctx: int, sampling: bool, spark_pass: bool,
                    filtered: bool) -> StepOut:
        """One decode step over slots [0, R): draft, allocate, pack, verify, accept, commit.

        R, budget (draft tokens verified, batch-wide), width (the longest chain), ctx (attended
        cache prefix), sampling, spark_pass (whether Spark drafts this step) and filtered
        (whether a sampled row sets top-k or top-p) are chosen by the host from what it already
        knows, so each combination is one static graph; nothing here reads a tensor value on
        the host."""
        d = self.draft(R, ctx, sampling, spark_pass)
        w = self.worth[:R, None]
        use_spark, _ = price.choose_chains(w * d.ngram_a[:, :width], w * d.spark_a[:, :width], budget)  # [R]
        a = torch.where(use_spark[:, None], d.spark_a, d.ngram_a)  # [R, K]
        length = price.admit_top(w * a[:, :width], budget)  # [R], at most `width` each
        chain = torch.where(use_spark[:, None], d.spark, d.ngram)[:, :width]  # [R, width]
        batch = self.pack(R, chain, length, ctx, budget)
        logits, hidden = self.model(batch, hidden_layers=self.feature_layers())  # [T, V], [T, F, dim]
        q = None if d.spark_q is None else d.spark_q[:, :width]  # read only on rows that use Spark
        out, n_out = self.accept(logits, batch, chain, q, use_spark, length, sampling, filtered)
        n_out = torch.where(self.active[:R], n_out, 0)
        n, finish = self.commit(R, out, n_out, self.non_finite(logits, batch, R))
        if self.spark:
            self.spark.write_context(hidden, batch.slot, batch.pos)
        next_ngram_a, ngram_seen = torch.zeros_like(d.ngram_a), torch.zeros(R, 2, device=self.device)
        if self.ngram:
            ngram_seen = price.proposal_outcome(d.ngram, d.ngram_a, d.ngram_valid, out, n_out)
            self.ng_last[:R] = price.ngram_outcome(d.ngram, d.ngram_valid, out, n_out, self.ng_last[:R])
            next_ngram_a = self.draft_ngrams(torch.arange(R, device=self.device), ctx)
        n_draft = torch.minimum(n, n_out - 1).clamp(min=0)
        source = torch.where(length == 0, SOURCES.index("target"),
                             torch.where(use_spark, SOURCES.index("spark"), SOURCES.index("ngram")))
        return StepOut(out, n, n_draft, source, finish, a, next_ngram_a, d.spark_a, length, ngram_seen)

    def draft(self, R: int, ctx: int, sampling: bool, spark_pass: bool = True) -> Drafts:
        """Both drafters on every row (the ones this mode uses; Spark unless the host skips its
        pass this step), padded to the width K."""
        dev, K = self.device, self.K
        # Room in the cache: a chain and the token after it must fit below L.
        room = torch.where(self.active[:R], (self.L - 2 - self.lens[:R]).clamp(min=0), 0)
        zeros = torch.zeros(R, K, device=dev)
        ng_tok, ng_a, m = zeros.long(), zeros, torch.zeros(R, dtype=torch.long, device=dev)
        valid = m
        if self.ngram:  # drafted at the end of the step before (or in prefill)
            ng_tok, m = self.ng_tok[:R].clone(), self.ng_m[:R].clone()
            valid = torch.minimum(self.ng_valid[:R], room)
            ng_a = self.ngram_survival(torch.arange(R, device=dev), valid)
        sp_tok, sp_a, q = zeros.long(), zeros, None
        if self.spark and spark_pass:
            g = self.spark.args.block
            u = verify.uniform_block(self.seed[:R], self.lens[:R], g, self.spark.args.draft_vocab) if sampling else None
            _, conf, q, sampled = self.spark.draft(self.next_tok[:R], self.lens[:R], ctx,
                                                        self.temperature[:R] if sampling else None, u)
            sp_tok, sp_a = pad(sampled, K), pad(price.survival(conf, room.clamp(max=g)), K)
            q = None if q is None else pad(q, K)
        return Drafts(ng_tok, ng_a, m, valid, sp_tok, sp_a, q)

    def draft_ngrams(self, slot: Tensor, ctx: int) -> Tensor:
        """Draft the next step's n-gram proposals of `slot` [N] from their histories (all within
        the first `ctx` positions) into the slots' buffers; returns their survival [N, K]."""
        # The anchor next_tok sits at tokens[lens]. An idle row may hold a finished request
        # longer than the attended prefix: it matches nothing.
        hist_len = torch.where(self.active[slot], self.lens[slot] + 1, 0)
        tok, valid, m = self.ngram(self.tokens[slot, :ctx], hist_len)
        self.ng_tok[slot], self.ng_valid[slot], self.ng_m[slot] = pad(tok, self.K), valid, m
        room = (self.L - 2 - self.lens[slot]).clamp(min=0)
        return self.ngram_survival(slot, torch.minimum(valid, room))

    def ngram_survival(self, slot: Tensor, valid: Tensor) -> Tensor:
        """[N, K] survival of the slots' n-gram proposals from the calibrated table, indexed by
        how the slot's last proposal fared and by the match length."""
        conf = self.ng_table[self.ng_last[slot], self.ng_m[slot]]  # [N, k]: P(token j ok | < j ok)
        return pad(price.survival(conf, valid), self.K)

    def pack(self, R: int, draft: Tensor, length: Tensor, ctx: int, budget: int) -> Batch:
        """Slot r verifies [next_tok, d_1 .. d_l] at positions lens_r ..; all rows are packed
        into one batch of T = R + budget tokens (at least 2), padding going to the scratch slot and cell."""
        # At least two tokens: oneDNN multiplies a single row by another kernel, whose sums
        # round differently (see `model.attend_exact`).
        Q, T = draft.shape[1] + 1, max(R + budget, 2)
        dev = self.device
        col = torch.arange(Q, device=dev)[None, :]
        grid_tok = torch.cat([self.next_tok[:R, None], draft], dim=1)  # [R, Q]
        grid_pos = self.lens[:R, None] + col  # [R, Q]
        keep = (self.active[:R, None] & (col <= length[:, None])).flatten()  # [R*Q]
        dest = torch.where(keep, keep.long().cumsum(0) - 1, T)
        cell = torch.full((T + 1,), R * Q, dtype=torch.long, device=dev)
        cell = cell.scatter(0, dest, torch.arange(R * Q, device=dev))[:T]  # [T]
        real = cell < R * Q
        safe = cell.clamp(max=R * Q - 1)
        return Batch(
            tokens=torch.where(real, grid_tok.flatten()[safe], 0),
            slot=torch.where(real, safe // Q, self.S),
            pos=torch.where(real, grid_pos.flatten()[safe], 0),
            cell=cell, row_slot=slice(0, R), n_cols=Q, ctx_len=ctx,
        )

    def accept(self, logits: Tensor, b: Batch, draft: Tensor, q: Tensor | None, use_spark: Tensor, length: Tensor,
               sampling: bool, filtered: bool = True) -> tuple[Tensor, Tensor]:
        """Verify every packed position, then read each row's chain off the grid.

        Greedy: accept while the draft is the target's argmax. Sampling: a Spark token (drawn
        from q) by rejection sampling; an n-gram copy (a point mass) by sample-and-compare."""
        R, Q = draft.shape[0], draft.shape[1] + 1
        grid_draft = torch.cat([draft, draft.new_zeros(R, 1)], dim=1)  # [R, Q]: next token's draft
        safe = b.cell.clamp(max=R * Q - 1)
        row = safe // Q
        draft_next = grid_draft.flatten()[safe]  # [T]
        if sampling:
            probs = verify.target_probs(logits, self.temperature[row], self.top_k[row], self.top_p[row], filtered)
            ok, alt = verify.accept_copies(probs, draft_next, self.seed[row], b.pos + 1)
            if q is not None:
                # Past the verified length (the bonus position) q = 0: the token there is a plain
                # sample from p, not from the residual of a draft nobody verified.
                col = torch.arange(Q, device=q.device)[None, :, None]
                q_grid = torch.cat([q, q.new_zeros(R, 1, q.shape[-1])], dim=1)  # [R, Q, Vd]
                q_grid = torch.where(col < length[:, None, None], q_grid, 0.0).flatten(0, 1)[safe]  # [T, Vd]
                q_full = torch.zeros_like(probs).index_copy(1, self.spark.d2t, q_grid.to(probs.dtype))
                ok_sp, alt_sp = verify.accept_tokens(probs, draft_next, q_full, self.seed[row], b.pos + 1)
                ok, alt = torch.where(use_spark[row], ok_sp, ok), torch.where(use_spark[row], alt_sp, alt)
        else:
            alt = verify.greedy(logits)
            ok = alt == draft_next

        def to_grid(x: Tensor) -> Tensor:
            return x.new_zeros(R * Q + 1).index_copy(0, b.cell, x)[:-1].view(R, Q)

        return verify.accept_chains(to_grid(ok), to_grid(alt), grid_draft, length)

    @torch.no_grad()
    def profile(self, budgets: Sequence[int], repeats: int = 5) -> price.CostModel:
        """Time whole steps of all S rows, every slot idle (all tokens padding), for each budget
        without the Spark pass, then the Spark pass itself, and the largest budget over the
        narrowest and the widest query grid (what a grid query costs): the cost table the host
        plans with. Idle slots change no state but the scratch row. All rows take part, as in a
        full batch: attention over the R x (width + 1) query grid grows with the rows, so a
        one-row profile would make drafts look cheaper than they are."""
        active = self.active.clone()
        self.active.zero_()

        def width(B: int) -> int:
            return min(chain_width(self.K, B, self.S), B)  # as `step` clamps it

        def seconds(B: int, spark_pass: bool, W: int) -> float:
            start = time.perf_counter()
            self.step(self.S, B, W, min(self.L, 512), False, spark_pass).n.cpu()
            return time.perf_counter() - start  # .cpu() above waits for the device

        top = max(budgets)
        widest = min(self.K, top)
        kinds = ([(B, False, width(B)) for B in budgets] + ([(0, True, 0)] if self.spark else [])
                 + ([(top, False, 1), (top, False, widest)] if top > 1 else []))
        try:
            for kind in dict.fromkeys(kinds):
                seconds(*kind)  # warm-up
            # Rounds over all kinds, the fastest of each kept: a slow spell on a shared machine
            # falls on one round of every size rather than on every round of one.
            best = dict.fromkeys(kinds, float("inf"))
            for _ in progress(range(repeats), "timing steps for the cost table"):
                for kind in best:
                    best[kind] = min(best[kind], seconds(*kind))
        finally:
            self.active.copy_(active)
        times = [best[B, False, width(B)] for B in budgets]
        spark = max(best[0, True, 0] - best[0, False, 0], 0.0) if self.spark else 0.0
        per_query = 0.0
        if widest > 1:
            narrow, wide = best[top, False, 1], best[top, False, widest]
            per_query = max(wide - narrow, 0.0) / (self.S * (widest - 1))
        return price.CostModel([self.S + B for B in budgets], times, spark=spark,
                               grids=[self.S * (width(B) + 1) for B in budgets], per_query=per_query)

    def finish_rule(self, slot: Tensor, out: Tensor, n_out: Tensor, broken: Tensor,
                    first_pos: Tensor) -> tuple[Tensor, Tensor]:
        """Truncate each row's emitted tokens (the first at position `first_pos`) at a stop
        token, at max_tokens and at max_seq_len; a broken row keeps none. Returns the count
        kept [R] and the finish code [R] (0 running, 1 stop, 2 length, 3 error)."""
        Q = out.shape[1]
        col = torch.arange(Q, device=out.device)[None, :]
        is_stop = (out[:, :, None] == self.stop_ids[slot][:, None, :]).any(-1) & (col < n_out[:, None])
        n_stop = torch.where(is_stop.any(-1), is_stop.long().argmax(-1) + 1, Q + 1)
        limit = torch.minimum(self.max_new[slot] - self.n_gen[slot], self.L - first_pos)
        n = torch.minimum(torch.minimum(n_out, limit), n_stop)
        stopped = n_stop <= n
        full = (self.n_gen[slot] + n >= self.max_new[slot]) | (first_pos + n >= self.L)
        finish = torch.where(stopped, 1, torch.where(full, 2, 0))
        finish = torch.where(broken, 3, finish)
        return torch.where(broken, 0, n), torch.where(n_out > 0, finish, 0)

    @staticmethod
    def non_finite(logits: Tensor, b: Batch, R: int) -> Tensor:
        """[R] rows with a NaN or inf among their logits: they stop with an error, unsampled."""
        bad = non_finite_logits(logits).long()  # [T]
        row = b.cell // b.n_cols  # padding lands in row R
        return torch.zeros(R + 1, dtype=torch.long, device=logits.device).index_add_(0, row, bad)[:R] > 0

    def commit(self, R: int, out: Tensor, n_out: Tensor, broken: Tensor) -> tuple[Tensor, Tensor]:
        """Append the kept tokens to each slot's history, advance lens and the anchor."""
        Q, L = out.shape[1], self.L
        rows = torch.arange(R, device=self.device)
        n, finish = self.finish_rule(rows, out, n_out, broken, first_pos=self.lens[:R] + 1)
        col = torch.arange(Q, device=self.device)[None, :]
        lens = self.lens[:R]
        at = torch.where(col < n[:, None], lens[:, None] + 1 + col, L + col)  # [R, Q]
        self.tokens[:R].scatter_(1, at, out)
        last = out.gather(1, (n - 1).clamp(min=0)[:, None])[:, 0]
        self.next_tok[:R] = torch.where(n > 0, last, self.next_tok[:R])
        self.lens[:R] = lens + n
        self.n_gen[:R] += n
        self.active[:R] &= finish == 0
        return n, finish


class StepClock:
    """A step's time on its device: CUDA events around the launch on a GPU (read after the
    step's results have reached the host, so reading needs no sync of its own), the call's
    wall time on a CPU, where the call runs the step."""

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


class Plan(NamedTuple):
    """The static sizes of one step, chosen by the host (see LLM._plan)."""
    budget: int  # draft tokens verified, batch-wide
    width: int  # the longest chain
    ctx: int  # attended cache prefix
    spark_pass: bool  # whether Spark drafts


class Launched(NamedTuple):
    """A step in flight: its results (on the host once `copied` is done), whose rows they are,
    how it was planned and timed."""
    out: StepOut
    copied: "torch.cuda.Event | None"
    owners: list  # the request in each of rows [0, R) when the step launched (None: idle)
    plan: Plan
    clock: StepClock

    @property
    def rows(self) -> list[int]:
        return list(range(len(self.owners)))


# ----------------------------------------------------------------------------- the user API


TRUST_PRIOR, TRUST_DECAY = 4.0, 0.98  # expected tokens of prior agreement; decay per observed chain
GAIN_DECAY = 0.9  # per step: a row's gain remembers its last ten or so chains
SPARK_DECAY = 0.9  # per pass: the typical Spark chain remembers the last ten or so passes
SPARK_PATIENCE, SPARK_RELAX = 32, 0.02  # steps without a Spark pass, then per step back to the prior
WORTH_HORIZON = 8  # tokens of margin over which a row that will be done in time loses its worth
BUDGETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
WIDTHS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256)
ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


@dataclass
class _Request:
    out: RequestOutput
    params: SamplingParams
    seed: int
    stop_ids: list[int]
    decoder: codecs.IncrementalDecoder = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace"))
    sent: int = 0  # characters of `out.text` already streamed
    slot: int | None = None  # where it runs (None: waiting or finished); compaction moves it

    @property
    def known_len(self) -> int:
        return len(self.out.prompt_token_ids) + len(self.out.token_ids)


class LLM:
    """A vLLM-style front end: `LLM().generate(prompts, SamplingParams(...))`."""

    def __init__(self, model: str | None = None, spec: str | None = None, max_batch_size: int = 8,
                 max_seq_len: int = 4096, dtype: str | torch.dtype = "auto", device: str | None = None,
                 seed: int = 0, ngram_k: int = 32, draft_budget: int = 64, compile: bool | None = None,
                 cost: price.CostModel | None = None, trace: str | None = None, drafter: str | None = None,
                 adaptive: bool = True):
        """model: a checkpoint folder or .gguf (None = the demo model). spec: "off", "ngram",
        "spark" or "hybrid" (None = hybrid where a drafter exists, else ngram). dtype: "auto"
        (bfloat16 where the hardware computes in it, else float32) or a dtype's name. drafter: a folder
        with a Spark drafter and n-gram table for this model (the shipped one for the demo
        model). ngram_k: the longest n-gram chain; draft_budget: the most draft tokens verified
        per step, batch-wide; compile: torch.compile the decode step (None = on CUDA only; eager
        is faster to start on a CPU); cost: a step-time table (profiled on this device at
        start-up when None); trace: a file that gets one JSON line per step (each slot's chain,
        estimates, verified and accepted; the step's time); adaptive: False verifies every
        row's whole chain on every step (Spark's full block of g), the fixed baseline of
        adaptive verification."""
        if spec is not None:
            check_spec(spec)
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be an int >= 1, got {max_batch_size!r}")
        if not isinstance(max_seq_len, int) or max_seq_len < 8:
            raise ValueError(f"max_seq_len must be an int >= 8, got {max_seq_len!r}")
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        torch_dtype = resolve_dtype(dtype, torch.device(device))
        if compile is None:  # one graph per step on a GPU; on a CPU compiling costs more than it gives
            compile = torch.device(device).type == "cuda"
        net, path = load_model(model, dtype=torch_dtype, device=device)
        if drafter is not None and not Path(drafter).expanduser().is_dir():  # even where the mode needs none
            raise ValueError(f"drafter folder {drafter} not found (a folder made by `python -m minispark.train`)")
        # A wheel has no checkpoints/ beside the package: the demo model then runs without Spark.
        if drafter is None and model is None and DEMO_DRAFTER.is_dir():
            drafter = DEMO_DRAFTER
        if spec is None:  # the best mode available: hybrid needs a drafter trained for this model
            spec = "hybrid" if drafter is not None else "ngram"
        spark, table = load_drafters(spec, drafter, net)
        engine = Engine(net, spec, max_batch_size, max_seq_len, ngram_k=ngram_k, spark=spark, ngram_table=table,
                        draft_budget=draft_budget, compile=compile)
        self._setup(engine, Tokenizer.from_path(path), seed, cost, trace, adaptive)
        self.drafter = drafter  # the folder, so that a mode switch can reload it
        self._options = dict(ngram_k=ngram_k, draft_budget=draft_budget, cost=cost)  # for `with_spec`

    @classmethod
    def from_model(cls, net: Transformer, tokenizer: Tokenizer, spec: str = "off", max_batch_size: int = 8,
                   max_seq_len: int = 4096, seed: int = 0, ngram_k: int = 32, draft_budget: int = 64,
                   compile: bool = False, cost: price.CostModel | None = None, trace: str | None = None,
                   drafter: SparkDrafter | str | None = None, ngram_table: Tensor | None = None,
                   adaptive: bool = True) -> "LLM":
        """An LLM around an already built model and tokenizer (tests use tiny random models).
        The model's KV cache is re-allocated: one LLM per model at a time."""
        check_spec(spec)
        self = cls.__new__(cls)
        spark = drafter if isinstance(drafter, SparkDrafter) else None
        if spark is None:
            spark, table = load_drafters(spec, drafter, net)
            ngram_table = table if ngram_table is None else ngram_table
        elif spec not in ("spark", "hybrid"):
            spark = None
        engine = Engine(net, spec, max_batch_size, max_seq_len, ngram_k=ngram_k, spark=spark,
                        ngram_table=ngram_table, draft_budget=draft_budget, compile=compile)
        self._setup(engine, tokenizer, seed, cost, trace, adaptive)
        self.drafter = drafter
        self._options = dict(ngram_k=ngram_k, draft_budget=draft_budget, cost=cost, ngram_table=ngram_table)
        return self

    def _setup(self, engine: Engine, tokenizer: Tokenizer, seed: int, cost: price.CostModel | None,
               trace: str | None, adaptive: bool = True) -> None:
        self.engine, self.tokenizer, self.seed, self.adaptive = engine, tokenizer, seed, adaptive
        self._trace = open(trace, "w") if trace else None
        self._step_no = 0
        self._budgets = [b for b in BUDGETS if b <= engine.draft_budget]
        # Only the adaptive plan weighs step times; the fixed baseline verifies everything anyway.
        self.cost = cost or (engine.profile(self._budgets) if engine.K and adaptive else None)
        # A profiled table goes on learning from the steps as they run; a given one is kept as is.
        self._learn_cost = cost is None and self.cost is not None
        self._overlap = engine.device.type == "cuda"
        self._ids = itertools.count()
        self._totals = {"requests": 0, "tokens": 0, "steps": 0, **dict.fromkeys(SOURCES, 0),
                        **{f"{k}_chains": 0 for k in SOURCES[:2]}}
        self._slots: list[_Request | None] = [None] * engine.S
        self._cancel: set[int] = set()  # request ids to stop at the next step
        # Per drafter, decayed sums of expected and accepted tokens over its verified chains,
        # starting from a prior of agreement: see `_trust`.
        self._seen = {k: [TRUST_PRIOR, TRUST_PRIOR] for k in SOURCES[:2]}
        self._gain: list[float | None] = [None] * engine.S  # per slot: see `_slowest_share`
        self._spark_typical: list[float] | None = None  # see `_typical_spark`
        self._spark_quiet = 0  # see `_relax_spark`

    # -- public -------------------------------------------------------------------------------

    def generate(self, prompts: str | list[int] | Sequence[str | list[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Complete each prompt (text, or a list of token ids); outputs in prompt order."""
        reqs = self._make_requests(prompts, params)
        for _ in self._run(reqs):
            pass
        return [r.out for r in reqs]

    def with_spec(self, spec: str) -> "LLM":
        """An LLM drafting with `spec` on this one's model, tokenizer, drafter and settings
        (batch, length, chain and budget limits, a cost table given to it), compiled if this one
        is, writing on to its trace. The model's KV cache is allocated anew: use one of the two
        at a time (a chat's /spec switches this way)."""
        llm = LLM.from_model(self.engine.model, self.tokenizer, spec=spec, max_batch_size=self.engine.S,
                             max_seq_len=self.engine.L, seed=self.seed, compile=self.engine.compiled,
                             drafter=self.drafter, adaptive=self.adaptive, **self._options)
        llm._trace = self._trace
        return llm

    def close(self) -> None:
        """Close the trace file (shared with the LLMs `with_spec` made from this one, whose
        traces end with it); the LLM goes on working without a trace. Also `with LLM(...) as llm:`."""
        if self._trace is not None:
            self._trace.close()
        self._trace = None

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

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
        """Stop one request of a running `stream` (its `output.request_id`): it finishes with
        finish_reason "cancelled" and the text so far; its slot goes to the next waiting request
        and the others continue unchanged."""
        self._cancel.add(request_id)

    def stats(self) -> dict[str, float]:
        """Totals over every finished request: tokens, steps, tokens by source, tokens per step."""
        t = dict(self._totals)
        t["tokens_per_step"] = t["tokens"] / max(t["steps"], 1)
        return t

    # -- requests -----------------------------------------------------------------------------

    def _make_requests(self, prompts, params) -> list[_Request]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(f"prompts must be a string, a list of token ids, or a list of those; "
                             f"got {type(prompts).__name__}")
        prompts = list(prompts)
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if not isinstance(params, (list, tuple)) or not all(isinstance(p, SamplingParams) for p in params):
            raise ValueError("params must be a SamplingParams or a list of them, one per prompt")
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} SamplingParams; pass one, or one per prompt")
        # Validate everything before anything runs, so one bad request cannot cost the others.
        encoded = [self._encode(i, p) for i, p in enumerate(prompts)]
        reqs = []
        for prompt, ids, p in zip(prompts, encoded, params):
            rid = next(self._ids)
            seed = p.seed if p.seed is not None else self.seed * 1_000_003 + rid
            stop_ids = list(dict.fromkeys([*p.stop_token_ids, *([] if p.ignore_eos else self.tokenizer.stop_ids)]))
            if len(stop_ids) > MAX_STOP_IDS:
                own = "" if p.ignore_eos else (f", with the tokenizer's {len(self.tokenizer.stop_ids)} end-of-turn "
                                               f"ids (ignore_eos=True leaves those out)")
                raise ValueError(f"at most {MAX_STOP_IDS} stop token ids per request, got {len(stop_ids)}: "
                                 f"{len(p.stop_token_ids)} in stop_token_ids{own}")
            text = prompt if isinstance(prompt, str) else None
            reqs.append(_Request(RequestOutput(rid, text, ids), p, seed, stop_ids))
        return reqs

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

    # -- the host loop --------------------------------------------------------------------------

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
        waiting = deque(reqs)
        pending: Launched | None = None
        # Per slot: survival estimates of its next n-gram chain (on a GPU, the one before) and of
        # its last Spark chain.
        est: list[tuple[list[float], list[float]]] = [([], []) for _ in range(eng.S)]
        while waiting or pending or any(slots):
            if self._cancel:
                yield from self._drop_cancelled(waiting)
            free = [i for i, r in enumerate(slots) if r is None]
            admitted = []
            while waiting and free:
                slot, req = free.pop(0), waiting.popleft()
                slots[slot], req.slot = req, slot
                eng.set_request(slot, req.out.prompt_token_ids, req.params, req.seed, req.stop_ids)
                self._gain[slot] = None
                admitted.append(slot)
            if admitted:
                out = eng.prefill(admitted, [slots[s].out.prompt_token_ids for s in admitted],
                                  *randomness([slots[s].params for s in admitted]))
                yield from self._absorb(out, [slots[s] for s in admitted], True, est, count_step=False)
            launched = None
            if any(slots):
                # A step still in flight (on a GPU) may add up to width + 1 tokens the host has not seen.
                unseen = pending.plan.width + 1 if pending else 0
                self._compact(est, unseen)
                R = self._rows(max(i for i, r in enumerate(slots) if r) + 1)
                plan = self._plan(R, est, queued=bool(waiting), unseen=unseen)
                sampling, filtered = randomness([r.params for r in slots[:R] if r])
                with StepClock(eng.device) as clock:
                    out = eng.step(R, plan.budget, plan.width, plan.ctx, sampling, plan.spark_pass, filtered)
                launched = Launched(*out.to_host(), list(slots[:R]), plan, clock)
            # On a CPU the step is done when launch returns: reading it at once gives the next
            # plan estimates a step fresher.
            done, pending = (pending, launched) if self._overlap else (launched, None)
            if done:
                if done.copied is not None:
                    done.copied.synchronize()
                if self._trace:
                    self._write_trace(done)
                yield from self._absorb(done.out, done.owners, done.plan.spark_pass, est)
                if self._learn_cost:  # the step's results are on the host, so its clock can be read
                    n, plan = len(done.rows), done.plan
                    self.cost.observe(n + plan.budget, plan.spark_pass, done.clock.seconds(), n * (plan.width + 1))

    def _rows(self, n: int) -> int:
        """The rows R a step runs over when its highest live slot is n - 1: a bucket, so that
        steps share few static shapes."""
        return min(bucket(n, ROWS + (self.engine.S,)), self.engine.S)

    def _compact(self, est: list[tuple[list[float], list[float]]], unseen: int = 0) -> None:
        """Move the requests in the highest slots down into free ones when that lowers the
        step's rows: a step runs over every row up to the highest live slot, idle rows too, so
        three requests left in slots 1, 6 and 10 of 16 would pay for 16 rows (traced on batch-16
        code on this CPU: 188 ms a step verifying chains of up to 6, against 78 ms over 4 rows).
        `unseen`: tokens a step still in flight (on a GPU) may add; the device moves the rows
        after that step."""
        slots = self._slots
        live = [i for i, r in enumerate(slots) if r]
        R = self._rows(len(live))
        src = [i for i in live if i >= R]
        if not src:
            return
        dst = [i for i, r in enumerate(slots[:R]) if r is None][: len(src)]
        upto = round_up(max(slots[i].known_len for i in src) + unseen + 1, 256)
        self.engine.move(src, dst, upto)
        for s, d in zip(src, dst):
            req = slots[s]
            slots[d], slots[s], req.slot = req, None, d
            est[d], est[s] = est[s], ([], [])
            self._gain[d], self._gain[s] = self._gain[s], None

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

    def _plan(self, R: int, est: list[tuple[list[float], list[float]]], queued: bool = False,
              unseen: int = 0) -> Plan:
        """Static sizes of the next step from what the host knows: whether Spark drafts, the
        draft budget, the longest chain and the attended cache prefix.

        DSpark's adaptive verification over the latest estimates the host has, for each kind of step:
        with the Spark pass (each row offers the better of its two chains) or without it (its
        n-gram chain, or nothing), at the cost the profile measured for that kind, each drafter's
        estimates scaled by how far they have been borne out (`_trust`) and each row's tokens
        by what they are worth to the run (`_worth`). Spark's pass is skipped where the tokens
        it is expected to add do not pay for its time."""
        eng = self.engine
        rows = [i for i, r in enumerate(self._slots[:R]) if r]
        budget = width = 0
        spark_pass = False
        if eng.K and not self.adaptive:  # the fixed baseline: every row verifies its whole chain
            eng.set_worth(dict.fromkeys(rows, 1.0), R)
            budget, width, spark_pass = R * eng.K, eng.K, eng.spark is not None
        elif eng.K:
            worth = self._worth(rows, queued)
            eng.set_worth(dict(zip(rows, worth)), R)
            rate = -1.0
            trust = torch.tensor([self._trust("ngram"), self._trust("spark")])
            trusted = price.trusted(torch.tensor([est[i] for i in rows]), trust)  # [N, 2, K]
            best = trusted[torch.arange(len(rows)), trusted.sum(-1).argmax(-1)]  # [N, K]: each row's better chain
            share = self._slowest_share(rows, best, worth, queued)
            scaled = (trusted * (torch.tensor(worth) * share)[:, None, None]).tolist()
            scaled = dict(zip(rows, scaled))
            for with_spark in (False, True) if eng.spark else (False,):
                # A budget is worth the pairs within the step's widest chain only: the device
                # admits nothing past it (counting them made small steps look like bargains).
                for W, group in itertools.groupby(self._budgets, lambda B: chain_width(eng.K, B, len(rows))):
                    chains = [max((c[:W] for c in scaled[i]), key=sum) if with_spark else scaled[i][0][:W]
                              for i in rows]
                    a, reach = price.ranked(chains)
                    # Attention runs over a grid of R x (width + 1) queries, however few are real:
                    # a budget spread one token per row needs width 1, not the 4 a fair share
                    # would give, and its step costs that grid.
                    group = list(group)
                    widths = [min(W, B, bucket(reach[min(B, len(reach) - 1)], WIDTHS)) for B in group]
                    B, r = price.best_budget(R, sum(worth), a, group, self.cost, with_spark,
                                             [R * (w + 1) for w in widths])
                    if r > rate:
                        budget, spark_pass, rate, width = B, with_spark, r, widths[group.index(B)]
            budget = budget if width else 0  # nothing admitted: the step verifies no drafts
        # This step writes positions up to what the host knows, plus `unseen`, plus the chain. A
        # prefix no longer than needed matters: every row's attention reads all of it.
        ctx = min(eng.L, round_up(max(self._slots[i].known_len for i in rows) + unseen + width + 1, KV_BLOCK))
        return Plan(budget, width, ctx, spark_pass)

    def _worth(self, rows: list[int], queued: bool) -> list[float]:
        """What one more token of each row is worth to the run's time, in [0, 1]. While requests
        wait, a token is a token: a slot that finishes early takes the next request. When none
        wait, the run ends with its slowest row, and a token of a row that will be done before
        then anyway only idles the row sooner, while its drafts cost every row's step. A row is
        sure to be done in time when its tokens left, even at one per step, fit in the steps
        the run is expected to take; its worth falls from 1 to 0 as that margin grows from 0
        to WORTH_HORIZON tokens. A row that may still end last keeps its worth: copies come in
        bursts, and one not taken now may not come again. (A row that stops at a stop token
        before max_tokens is only ever overrated.)"""
        if queued:
            return [1.0] * len(rows)
        left, steps = self._left(rows)
        return [min(1.0, max(0.0, 1.0 - (steps - r) / WORTH_HORIZON)) for r in left]

    def _left(self, rows: list[int]) -> tuple[list[int], float]:
        """Tokens left to each row, and the steps the run is expected to take: every row at its
        pace so far."""
        left, steps = [], 0.0
        for i in rows:
            o = self._slots[i].out
            left.append(self._slots[i].params.max_tokens - len(o.token_ids))
            pace = len(o.token_ids) / o.num_steps if o.num_steps else 1.0
            steps = max(steps, left[-1] / max(pace, 1.0))
        return left, steps

    def _slowest_share(self, rows: list[int], best: Tensor, worth: list[float], queued: bool) -> float:
        """How much of a drafted token shortens the run (`price.slowest_share`): all of it while
        requests wait; with none waiting, the share the slowest row gains, luck included (the
        spread of each row's better chain, `best` [N, K], over the steps left). A row's gain is
        what its best chains have promised lately (decayed over GAIN_DECAY steps), not just
        now: a row copying code pauses at each edit and resumes, a row writing new text
        seldom copies at all."""
        for i, g in zip(rows, best.sum(-1).tolist()):
            last = self._gain[i]
            self._gain[i] = g if last is None else GAIN_DECAY * last + (1 - GAIN_DECAY) * g
        if queued:
            return 1.0
        spread = price.luck_spread(best, self._left(rows)[1]).tolist()
        return price.slowest_share([self._gain[i] for i in rows], worth, spread)

    def _trust(self, drafter: str) -> float:
        """Accepted over expected tokens of the drafter's recent chains, at the positions they
        reached (every earlier token accepted), expected being the sum of per-token estimates
        there. Its estimates were calibrated on its training text, and a workload unlike that
        text makes them optimistic (an earlier Spark drafter: first-slot acceptance 0.32 on
        MT-Bench, 0.49 estimated) or pessimistic (n-gram copies in a code edit); the plan scales
        each per-token estimate by this ratio (`price.trusted`), so that an error compounds
        along a chain as it does in the chain's survival. n-gram proposals count whether
        verified or not: the emitted tokens check them for free, so a plan that stopped
        verifying copies learns when to resume. It reads finished steps only, so like the
        budget it is fixed before a step's drafts exist."""
        expected, accepted = self._seen[drafter]
        return accepted / expected

    def _observe(self, drafter: str, expected: float, accepted: float) -> None:
        seen = self._seen[drafter]
        seen[0] = TRUST_DECAY * seen[0] + expected
        seen[1] = TRUST_DECAY * seen[1] + accepted

    def _typical_spark(self, chains: list[list[float]]) -> None:
        """Fold one pass's Spark survivals into the chain a slot can expect from its next pass
        when this one is skipped (decayed over SPARK_DECAY passes). A skipped slot's own last
        estimates belong to a context that has since moved on; kept, one low estimate would
        skip every later pass of the slot, since only a pass renews them (measured on chat at
        batch 1: one answer drafted nothing for its last 46 steps after a first-slot 0.12)."""
        if not chains:
            return
        mean = torch.tensor(chains).mean(0).tolist()
        last = self._spark_typical
        self._spark_typical = mean if last is None else [SPARK_DECAY * x + (1 - SPARK_DECAY) * y
                                                         for x, y in zip(last, mean)]

    def _relax_spark(self, spark_pass: bool) -> None:
        """Only a step with Spark's pass renews the plan's view of Spark: its trust (from the
        chains verified) and the correction of such steps' time. A plan that stopped running the
        pass (after a run of rejected chains, or sampled steps slower than the greedy profile)
        would hear of Spark no more for the rest of the LLM's life, though later requests may
        suit it (measured: a sampled run at batch 1 ran no pass in its last 758 steps). So after
        SPARK_PATIENCE steps without a pass, each step moves both back toward where the LLM
        started by SPARK_RELAX: a drafter written off is tried again about once per patience,
        and, if still bad, written off again by its next chain."""
        self._spark_quiet = 0 if spark_pass else self._spark_quiet + 1
        if self._spark_quiet <= SPARK_PATIENCE:
            return
        seen = self._seen["spark"]
        seen[:] = [x + SPARK_RELAX * (TRUST_PRIOR - x) for x in seen]
        if self._learn_cost:
            self.cost.relax(True, SPARK_RELAX)

    def _absorb(self, out: StepOut, owners: list, spark_pass: bool,
                est: list[tuple[list[float], list[float]]], count_step: bool = True) -> Iterator[Delta]:
        """Read one step's results on the host and hand them to their requests."""
        tokens, n, n_draft = out.tokens.tolist(), out.n.tolist(), out.n_draft.tolist()
        source, finish, length = out.source.tolist(), out.finish.tolist(), out.length.tolist()
        ngram_a, spark_a = out.ngram_a.tolist(), out.spark_a.tolist()
        per_tok = price.per_token(out.survival).tolist()  # [R, K]: c_j of each verified chain
        ngram_seen = out.ngram_seen.tolist()
        if spark_pass and count_step:  # a prefill's Spark estimates are a guess, not a pass
            self._typical_spark([a for a, req in zip(spark_a, owners) if req is not None])
        if count_step and self.engine.spark is not None:
            self._relax_spark(spark_pass)
        for i, req in enumerate(owners):
            # Until a first pass has run, a skipped slot keeps the prefill's guess. The estimates
            # follow the request to where it runs now (compaction may have moved it since this
            # step was launched, on a GPU); a slot given to a new request keeps that one's.
            if req is not None and req.slot is not None:
                est[req.slot] = (ngram_a[i], spark_a[i] if spark_pass else self._spark_typical or est[req.slot][1])
            if count_step and req is not None and n[i] > 0:
                if length[i] > 0:  # the positions reached: the accepted ones and the first rejected
                    self._observe(SOURCES[source[i]], sum(per_tok[i][: min(n_draft[i] + 1, length[i])]), n_draft[i])
                if not (length[i] > 0 and SOURCES[source[i]] == "ngram") and ngram_seen[i][0] > 0:
                    self._observe("ngram", *ngram_seen[i])  # a proposal not verified, checked for free
            if req is None or req.out.finished or (n[i] == 0 and FINISH.get(finish[i]) != "error"):
                continue
            o = req.out
            o.num_steps += count_step
            if length[i] > 0:
                o.chains[SOURCES[source[i]]] += 1
            reason = FINISH.get(finish[i])
            if reason == "error":
                o.error = NON_FINITE
                self._finish(req, reason)
                yield Delta(o, self._flush(req), "target")
                continue
            for j, tok in enumerate(tokens[i][: n[i]]):
                o.accepted[SOURCES[source[i]] if j < n_draft[i] else "target"] += 1
                stopped = self._append(req, tok)
                if stopped or (reason and j == n[i] - 1):
                    self._finish(req, "stop" if stopped else reason, cut=stopped)
                delta = self._flush(req)
                if delta or o.finished:
                    yield Delta(o, delta, SOURCES[source[i]] if j < n_draft[i] else "target")
                if stopped:
                    break

    def _write_trace(self, step: Launched) -> None:
        """One JSON line per step: for teaching, what each slot proposed, was granted and kept,
        and how long the step took on its device (`ms`, the time the cost table learns from)."""
        self._step_no += 1
        out, owners, rows, (budget, width, ctx, spark_pass) = step.out, step.owners, step.rows, step.plan
        n, n_draft, length, source = out.n.tolist(), out.n_draft.tolist(), out.length.tolist(), out.source.tolist()
        estimates = out.survival.tolist()
        slots = [{"slot": s, "request": req.out.request_id, "chain": SOURCES[source[i]],
                  "estimate": [round(x, 3) for x in estimates[i][:max(width, 1)]],
                  "verified": length[i], "accepted": n_draft[i], "emitted": n[i]}
                 for i, (req, s) in enumerate(zip(owners, rows)) if req is not None and n[i] > 0]
        self._trace.write(json.dumps({"step": self._step_no, "budget": budget, "width": width, "ctx": ctx,
                                      "spark_pass": spark_pass, "ms": round(step.clock.seconds() * 1e3, 3),
                                      "slots": slots}) + "\n")
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


def check_memory(model: Transformer, S: int, L: int, device: torch.device, spark: SparkDrafter | None = None) -> None:
    """Refuse KV caches (the target's and the drafter's context) that cannot fit, before
    allocating them, saying what to turn down."""
    a = model.args
    per_position = a.n_layers * a.n_kv_heads * a.head_dim  # keys (and as many values) of one position
    if spark:
        per_position += spark.args.n_layers * spark.args.n_kv_heads * spark.args.head_dim
    need = 2 * (S + 1) * L * per_position * model.tok_embeddings.weight.dtype.itemsize
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else available_memory()
    if free is not None and need > 0.9 * free:
        gib = 2**30
        raise ValueError(f"the KV cache for max_batch_size={S} x max_seq_len={L} needs {need / gib:.1f} GiB, "
                         f"but only {free / gib:.1f} GiB is free on {device}; lower max_seq_len or max_batch_size")


def available_memory() -> int | None:
    """Bytes of host memory a new allocation can have: Linux's MemAvailable, which counts the
    page cache it can drop (a checkpoint just read fills it), else the free pages, else None."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):  # not on this OS (macOS): leave the allocator to refuse
        return None


def randomness(params: list[SamplingParams]) -> tuple[bool, bool]:
    """Whether any of these requests samples, and whether any that samples sets top-k or top-p:
    two static choices of a step's graph (a greedy step draws nothing, an unfiltered one sorts
    nothing)."""
    sampled = [p for p in params if p.temperature > 0]
    return bool(sampled), any(p.top_k > 0 or p.top_p < 1 for p in sampled)


def non_finite_logits(logits: Tensor) -> Tensor:
    """[T] True where a row of logits [T, V] holds a NaN or inf. A sum is NaN or inf exactly
    when a term is (short of 1e33-sized logits), and costs a sixth of an elementwise isfinite
    over the vocabulary."""
    return ~logits.sum(-1, dtype=torch.float32).isfinite()


def pad(x: Tensor, width: int) -> Tensor:
    """x [R, k, ...] padded with zeros to [R, width, ...] along dim 1."""
    if x.shape[1] >= width:
        return x[:, :width]
    return torch.cat([x, x.new_zeros(x.shape[0], width - x.shape[1], *x.shape[2:])], dim=1)


def chain_width(K: int, budget: int, n_live: int) -> int:
    """The longest chain of a step. The query grid is R x (width + 1), so chains are capped at
    twice a fair share of the budget (at least 8), rounded up to a width bucket (so at most
    about four times the share): attention must not grow as R x budget."""
    return min(K, bucket(min(budget, max(8, 2 * budget // max(n_live, 1))), WIDTHS))


def load_drafters(spec: str, folder: str | Path | None, net: Transformer) -> tuple[SparkDrafter | None, Tensor | None]:
    """The Spark drafter and the n-gram table this mode needs, from a drafter folder."""
    spark = table = None
    if spec in ("spark", "hybrid"):
        if folder is None:
            raise ValueError(f'spec="{spec}" needs a Spark drafter trained for this model: pass drafter=FOLDER '
                             f'(made by `python -m minispark.train`), or use spec="ngram"')
        w = net.tok_embeddings.weight
        spark = load_drafter(folder, net.args, w.dtype, w.device)
    if spec in ("ngram", "hybrid") and folder is not None and (Path(folder) / "ngram.json").exists():
        table = load_ngram_table(folder)
    return spark, table


def check_spec(spec: str) -> None:
    if spec not in SPEC_MODES:
        raise ValueError(f"unknown spec {spec!r}; choose one of: {', '.join(SPEC_MODES)}")
