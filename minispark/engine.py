"""The engine: slots on the device, prefill, and the speculative decode step.

`Engine` owns the device state and the step, which reads like the algorithm: draft, allocate,
pack, verify, accept, commit. Every size it takes (rows, budget, chain width, attended prefix,
which costly drafters run) is chosen by the host planner, so each combination is one static
graph, and nothing in the step reads a tensor value on the host.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, fields
from pathlib import Path

import torch
from torch import Tensor

from . import price, verify
from .drafters import Chain, Drafter, Rows
from .model import KV_BLOCK, Batch, Transformer

MAX_STOP_IDS = 8
FINISH = {1: "stop", 2: "length", 3: "error"}


@dataclass
class StepOut:
    """What one step tells the host, for rows [0, R). Small tensors, copied without blocking."""
    tokens: Tensor  # [R, W + 1] emitted tokens (first n valid)
    n: Tensor  # [R] emitted count (0 for inactive rows)
    n_draft: Tensor  # [R] of those, drafted tokens accepted
    source: Tensor  # [R] the drafter whose chain the row verified (N: none)
    finish: Tensor  # [R] 0 running, 1 stop, 2 length, 3 error (non-finite logits)
    survival: Tensor  # [R, K] survival of the chain each row verified
    est: Tensor  # [R, N, K] each drafter's survival for the planner: of the next chain where known, else this one
    length: Tensor  # [R] drafted tokens verified
    seen: Tensor  # [R, N, 2] each point-mass chain against the emitted tokens: expected and agreeing tokens

    def to_host(self) -> tuple["StepOut", "torch.cuda.Event | None"]:
        """On a GPU, start copying to (pinned) host memory behind the step on its stream and
        return the copy with an event that marks it done: the host then waits for this step's
        results only. On a CPU, itself and None."""
        if self.tokens.device.type != "cuda":
            return self, None
        host = StepOut(*(getattr(self, f.name).to("cpu", non_blocking=True) for f in fields(self)))
        copied = torch.cuda.Event()
        copied.record()
        return host, copied


class Engine:
    """Device state for `S` slots of up to `L` tokens, and the step that advances them."""

    # The state indexed by slot (first dimension S), besides the caches: what `move` carries.
    PER_SLOT = ("tokens", "lens", "next_tok", "n_gen", "max_new", "active", "worth", "temperature", "top_p",
                "top_k", "seed", "stop_ids")

    def __init__(self, model: Transformer, drafters: list[Drafter], max_batch_size: int, max_seq_len: int,
                 compile: bool = False):
        self.model, self.drafters = model.requires_grad_(False), list(drafters)
        S, L = self.S, self.L = max_batch_size, max_seq_len
        dev = self.device = model.tok_embeddings.weight.device
        if dev.type == "cpu":
            # Setting the thread count, even to the one in force, pins it for MKL and OpenMP;
            # unset, steps that verify drafts run slower on a small VM.
            torch.set_num_threads(torch.get_num_threads())
        self.K = max((d.k for d in self.drafters), default=0)
        self.features = tuple(i for d in self.drafters for i in d.feature_layers)
        check_memory(model, S, L, dev, self.drafters)
        model.setup_cache(S, L)
        for d in self.drafters:
            d.to(dev).requires_grad_(False).setup(S, L, model)

        def zeros(*shape, dtype=torch.long):
            return torch.zeros(shape, dtype=dtype, device=dev)

        self.tokens = zeros(S, L + self.K + 1)  # columns past L take writes that are discarded
        self.lens, self.next_tok, self.n_gen, self.max_new = zeros(S), zeros(S), zeros(S), zeros(S)
        self.active = zeros(S, dtype=torch.bool)
        self.worth = torch.ones(S, device=dev)  # what one more token of each slot is worth (the planner's)
        self.temperature, self.top_p = zeros(S, dtype=torch.float), torch.ones(S, device=dev)
        self.top_k, self.seed = zeros(S), zeros(S)
        self.stop_ids = torch.full((S, MAX_STOP_IDS), -1, dtype=torch.long, device=dev)
        self._step, self.compiled = self.decode_step, compile
        if compile:
            # One graph per (R, budget, width, ctx, sampling, runs, filtered); ints stay static.
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 256)
            mode = "max-autotune" if dev.type == "cuda" else None
            self._step = torch.compile(self.decode_step, fullgraph=True, dynamic=False, mode=mode)

    # -- slots ----------------------------------------------------------------------------------

    def set_request(self, slot: int, prompt: list[int], p, seed: int, stop_ids: list[int]) -> None:
        """Write a request's prompt and sampling parameters `p` (temperature, top_p, top_k,
        max_tokens) into `slot`; its prompt then goes through `prefill`."""
        self.temperature[slot], self.top_p[slot], self.top_k[slot] = p.temperature, p.top_p, p.top_k
        self.seed[slot], self.max_new[slot] = seed, p.max_tokens
        self.stop_ids[slot] = -1
        self.stop_ids[slot, : len(stop_ids)] = torch.tensor(stop_ids, dtype=torch.long)
        self.tokens[slot, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
        for d in self.drafters:
            d.reset(slot)

    def forget(self, slot: int) -> None:
        """Zero `slot`'s rows of the target's KV cache after a request there broke: a NaN key
        left past the next prompt's end would break every later request in the slot (a masked
        position is weighed by 0, and 0 x NaN is NaN)."""
        for layer in self.model.layers:
            layer.attention.k_cache[slot].zero_()
            layer.attention.v_cache[slot].zero_()

    def move(self, src: list[int], dst: list[int], upto: int) -> None:
        """Move the requests in slots `src` to free slots `dst`: histories, settings, drafter
        state and cache rows below position `upto`. Nothing depends on a request's slot, so its
        tokens stay the same (sampling's noise is keyed by seed and position)."""
        s, d = (torch.tensor(x, device=self.device) for x in (src, dst))
        for name in self.PER_SLOT:
            t = getattr(self, name)
            t[d] = t[s]
        self.active[s] = False
        upto = min(upto, self.L)
        for layer in self.model.layers:
            for cache in (layer.attention.k_cache, layer.attention.v_cache):
                written = cache[:, :, :upto]  # [S + 1, Hkv, upto, D], a view
                written[d] = written[s]
        for drafter in self.drafters:
            drafter.move(s, d, upto)

    def set_worth(self, worth: list[float]) -> None:
        """What a token of each of rows [0, R) is worth to the run, copied without waiting for
        the device, which may still run the previous step."""
        host = torch.tensor(worth)
        if self.device.type == "cuda":
            host = host.pin_memory()
        self.worth[: len(worth)].copy_(host, non_blocking=True)

    def rows(self, slot: Tensor, ctx: int, sampling: bool) -> Rows:
        """The drafters' view of `slot` [R]: histories within the first `ctx` positions, anchor
        included. An idle row knows no tokens (it may hold a finished request past `ctx`)."""
        n = torch.where(self.active[slot], self.lens[slot] + 1, 0)
        return Rows(self.tokens[slot, :ctx], n, slot, self.seed[slot], self.temperature[slot] if sampling else None)

    def survival(self, conf: Tensor, slot: Tensor) -> Tensor:
        """[R, K] survival of chains conf [R, k]: a chain and the token after it must fit below L."""
        room = torch.where(self.active[slot], (self.L - 2 - self.lens[slot]).clamp(min=0), 0)
        return pad(price.survival(conf, room), self.K)

    # -- prefill ----------------------------------------------------------------------------------

    @torch.no_grad()
    def prefill(self, slots: list[int], prompts: list[list[int]], sampling: bool, filtered: bool = True) -> StepOut:
        """Run the prompts of newly admitted requests through the target and sample each one's
        first token, which becomes its anchor `next_tok`."""
        dev, R, N = self.device, len(slots), len(self.drafters)
        slot_t = torch.tensor(slots, device=dev)
        logits = []
        for s, p in zip(slots, prompts):
            # Each prompt in a forward of its own: its keys, values and first token are then the
            # same bits whichever prompts it comes with, so it may take SDPA's flash kernel.
            n = len(p)
            b = Batch(tokens=torch.tensor(p, device=dev), slot=torch.full((n,), s, device=dev),
                      pos=torch.arange(n, device=dev), cell=torch.arange(n, device=dev), row_slot=slice(s, s + 1),
                      n_cols=n, ctx_len=min(self.L, -(-n // KV_BLOCK) * KV_BLOCK))
            lg, hidden = self.model(b, logits_at=torch.tensor([n - 1], device=dev), hidden_layers=self.features,
                                    exact=False)  # [1, V]
            self.see(hidden, b)
            logits.append(lg)
        logits = torch.cat(logits)  # [R, V]
        lens = torch.tensor([len(p) for p in prompts], device=dev)
        first = self.sample(logits, slot_t, lens, sampling, filtered)
        self.lens[slot_t], self.next_tok[slot_t], self.n_gen[slot_t] = lens, first, 0
        # The first token is emitted like any other: through the same commit rule.
        out = first[:, None]
        n, finish = self.finish_rule(slot_t, out, torch.ones_like(lens), non_finite_logits(logits), first_pos=lens)
        self.tokens[slot_t, lens] = first
        self.n_gen[slot_t] = n
        self.active[slot_t] = finish == 0
        longest = max(len(p) for p in prompts)  # known on the host: no sync for lens.max()
        rows = self.rows(slot_t, min(self.L, -(-(longest + 1) // 64) * 64), sampling)
        # Until a drafter has drafted, the planner guesses even odds for every token.
        guess = torch.full((R, self.K), 0.5, device=dev).cumprod(-1)
        est = torch.stack([self.survival(c, slot_t) if (c := d.commit(rows, None, None, None)) is not None
                           else guess for d in self.drafters], 1) if N else guess[:, None, :0]
        zero = torch.zeros_like(lens)
        return StepOut(out, n, zero, torch.full_like(lens, N), finish, guess, est, zero, torch.zeros(R, N, 2, device=dev))

    def see(self, hidden: Tensor | None, b: Batch) -> None:
        """Hand each drafter its layers' hidden states of the tokens the target just ran."""
        at = 0
        for d in self.drafters:
            if d.feature_layers:
                d.see(hidden[:, at:at + len(d.feature_layers)], b.slot, b.pos)
                at += len(d.feature_layers)

    def sample(self, logits: Tensor, slot: Tensor, pos: Tensor, sampling: bool, filtered: bool = True) -> Tensor:
        """The target's own token for each row of logits [N, V] (greedy unless `sampling`)."""
        if not sampling:
            return verify.greedy(logits)
        probs = verify.target_probs(logits, self.temperature[slot], self.top_k[slot], self.top_p[slot], filtered)
        return verify.bonus_tokens(probs, self.seed[slot], pos)

    # -- the decode step --------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, R: int, budget: int, width: int, ctx: int, sampling: bool, runs: tuple[bool, ...] | None = None,
             filtered: bool = True) -> StepOut:
        """One step over rows [0, R); `runs`: which drafters draft (None: all)."""
        runs = tuple(runs) if runs is not None else (True,) * len(self.drafters)
        width = min(width, self.K, budget)  # no chain is longer than the budget
        return self._step(R, budget if width else 0, width, ctx, sampling, runs, sampling and filtered)

    def decode_step(self, R: int, budget: int, width: int, ctx: int, sampling: bool, runs: tuple[bool, ...],
                    filtered: bool) -> StepOut:
        """Draft, allocate, pack, verify, accept, commit: one step over slots [0, R).

        budget: draft tokens verified, batch-wide; width: the longest chain; ctx: the attended
        cache prefix; runs: which drafters draft; filtered: a sampled row sets top-k or top-p."""
        rows = self.rows(torch.arange(R, device=self.device), ctx, sampling)
        chains = [d.draft(rows) if run else None for d, run in zip(self.drafters, runs)]
        tokens, a = self.stack(chains, rows)  # [R, N, K] each
        w = self.worth[:R, None]
        pick = price.choose_chains(w[:, None] * a[..., :width], budget)  # [R]: the drafter of each row
        a_row = a[torch.arange(R), pick]  # [R, K]
        length = price.admit_top(w * a_row[:, :width], budget)  # [R], at most `width` each
        chain = tokens[torch.arange(R), pick, :width]  # [R, width]
        batch = self.pack(R, chain, length, ctx, budget)
        logits, hidden = self.model(batch, hidden_layers=self.features)  # [T, V], [T, F, dim]
        out, n_out = self.accept(logits, batch, chain, chains, pick, length, sampling, filtered)
        n_out = torch.where(self.active[:R], n_out, 0)
        n, finish = self.commit(R, out, n_out, self.non_finite(logits, batch, R))
        self.see(hidden, batch)
        est, seen = self.debrief(self.rows(rows.slot, ctx, sampling), chains, a, out, n_out)
        n_draft = torch.minimum(n, n_out - 1).clamp(min=0)
        source = torch.where(length == 0, len(self.drafters), pick)
        return StepOut(out, n, n_draft, source, finish, a_row, est, length, seen)

    def stack(self, chains: list[Chain | None], rows: Rows) -> tuple[Tensor, Tensor]:
        """Every drafter's tokens and survival [R, N, K] (zeros for a drafter that did not run)."""
        R, K = rows.n.shape[0], self.K
        zero = torch.zeros(R, K, device=self.device)
        tokens = [pad(c.tokens, K) if c else zero.long() for c in chains]
        a = [self.survival(c.conf, rows.slot) if c else zero for c in chains]
        if not chains:
            return zero.long()[:, None, :0], zero[:, None, :0]
        return torch.stack(tokens, 1), torch.stack(a, 1)

    def pack(self, R: int, draft: Tensor, length: Tensor, ctx: int, budget: int) -> Batch:
        """Slot r verifies [next_tok, d_1 .. d_l] at positions lens_r ..; all rows are packed into
        one batch of T = R + budget tokens (at least 2), padding going to the scratch slot and cell."""
        # At least two tokens: oneDNN multiplies a single row by another kernel, whose sums
        # round differently (see `cpu.attend_exact`).
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
        return Batch(tokens=torch.where(real, grid_tok.flatten()[safe], 0), slot=torch.where(real, safe // Q, self.S),
                     pos=torch.where(real, grid_pos.flatten()[safe], 0), cell=cell, row_slot=slice(0, R), n_cols=Q,
                     ctx_len=ctx)

    def accept(self, logits: Tensor, b: Batch, draft: Tensor, chains: list[Chain | None], pick: Tensor,
               length: Tensor, sampling: bool, filtered: bool = True) -> tuple[Tensor, Tensor]:
        """Verify every packed position, then read each row's chain off the grid.

        Greedy: accept while the draft is the target's argmax. Sampling: a point-mass draft (a
        copy) by sample-and-compare; a draft with its own q by rejection sampling."""
        R, Q = draft.shape[0], draft.shape[1] + 1
        grid_draft = torch.cat([draft, draft.new_zeros(R, 1)], dim=1)  # [R, Q]: next token's draft
        safe = b.cell.clamp(max=R * Q - 1)
        row = safe // Q
        draft_next = grid_draft.flatten()[safe]  # [T]
        if sampling:
            probs = verify.target_probs(logits, self.temperature[row], self.top_k[row], self.top_p[row], filtered)
            ok, alt = verify.accept_copies(probs, draft_next, self.seed[row], b.pos + 1)
            for i, c in enumerate(chains):
                if c is None or c.q is None:
                    continue
                # Past the verified length (the bonus position) q = 0: the token there is a plain
                # sample from p, not from the residual of a draft nobody verified.
                col = torch.arange(Q, device=logits.device)[None, :, None]
                q = pad(c.q, Q - 1)
                q_grid = torch.cat([q, q.new_zeros(R, 1, q.shape[-1])], dim=1)  # [R, Q, Vq]
                q_grid = torch.where(col < length[:, None, None], q_grid, 0.0).flatten(0, 1)[safe]  # [T, Vq]
                q_full = torch.zeros_like(probs).index_copy(1, c.vocab, q_grid.to(probs.dtype))
                ok_i, alt_i = verify.accept_tokens(probs, draft_next, q_full, self.seed[row], b.pos + 1)
                mine = pick[row] == i
                ok, alt = torch.where(mine, ok_i, ok), torch.where(mine, alt_i, alt)
        else:
            alt = verify.greedy(logits)
            ok = alt == draft_next

        def to_grid(x: Tensor) -> Tensor:
            return x.new_zeros(R * Q + 1).index_copy(0, b.cell, x)[:-1].view(R, Q)

        return verify.accept_chains(to_grid(ok), to_grid(alt), grid_draft, length)

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
        finish = torch.where(broken, 3, torch.where(stopped, 1, torch.where(full, 2, 0)))
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

    def debrief(self, rows: Rows, chains: list[Chain | None], a: Tensor, out: Tensor,
                n_out: Tensor) -> tuple[Tensor, Tensor]:
        """Tell each drafter how the step went. Returns the survival each drafter offers the
        planner [R, N, K] and, for each point-mass chain, the emitted tokens' verdict on it
        [R, N, 2] (verified or not, a copy is accepted exactly when it equals the target's token)."""
        est, seen = [], []
        for i, (d, c) in enumerate(zip(self.drafters, chains)):
            nxt = d.commit(rows, c, out, n_out)
            est.append(self.survival(nxt, rows.slot) if nxt is not None else a[:, i])
            if c is None or c.q is not None:
                seen.append(torch.zeros(out.shape[0], 2, device=self.device))
            else:
                seen.append(price.proposal_outcome(pad(c.tokens, self.K), a[:, i], (a[:, i] > 0).sum(-1), out, n_out))
        if not est:
            return a, torch.zeros(out.shape[0], 0, 2, device=self.device)
        return torch.stack(est, 1), torch.stack(seen, 1)


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



def check_memory(model: Transformer, S: int, L: int, device: torch.device, drafters: list) -> None:
    """Refuse KV caches (the target's and a drafter's context) that cannot fit, before
    allocating them, saying what to turn down."""
    per_position = 0  # keys (and as many values) of one position
    for a in [model.args] + [d.args for d in drafters if hasattr(d, "args")]:
        per_position += a.n_layers * a.n_kv_heads * a.head_dim
    need = 2 * (S + 1) * L * per_position * model.tok_embeddings.weight.dtype.itemsize
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else available_memory()
    if free is not None and need > 0.9 * free:
        gib = 2**30
        raise ValueError(f"the KV cache for max_batch_size={S} x max_seq_len={L} needs {need / gib:.1f} GiB, "
                         f"but only {free / gib:.1f} GiB is free on {device}; lower max_seq_len or max_batch_size")


def available_memory() -> int | None:
    """Bytes of host memory a new allocation can have: Linux's MemAvailable (which counts the
    page cache it can drop), else the free pages, else None."""
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


def non_finite_logits(logits: Tensor) -> Tensor:
    """[T] True where a row of logits [T, V] holds a NaN or inf: a sum is NaN or inf exactly when
    a term is (short of 1e33-sized logits), at a sixth of the cost of an elementwise isfinite."""
    return ~logits.sum(-1, dtype=torch.float32).isfinite()


def pad(x: Tensor, width: int) -> Tensor:
    """x [R, k, ...] cut or padded with zeros to [R, width, ...] along dim 1."""
    if x.shape[1] >= width:
        return x[:, :width]
    return torch.cat([x, x.new_zeros(x.shape[0], width - x.shape[1], *x.shape[2:])], dim=1)
