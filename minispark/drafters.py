"""Drafters: what they share (`Drafter`), the model-free n-gram matcher and the Spark drafter.

A drafter proposes a chain of tokens for every row at once, with static shapes and no host
sync, and scores each token's chance of acceptance. The engine runs every drafter it was given
on every step (the planner may skip a costly one) and verifies, per row, the chain worth most.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from .model import FeedForward, Linear, ModelArgs, RMSNorm, apply_rope, attend, grid_bias, rope_frequencies
from .price import leading_agreement
from .verify import greedy, sample, uniform_block


class Rows(NamedTuple):
    """What a drafter may read of the rows it drafts for."""
    tokens: Tensor  # [R, C] each row's known tokens in its first n: prompt, output, then the anchor
    n: Tensor  # [R] known tokens (0 for an idle row)
    slot: Tensor  # [R] the engine's slot of each row (per-slot state is indexed by it)
    seed: Tensor  # [R] sampling seeds (for drafters that sample)
    temperature: Tensor | None  # [R] when the step samples, else None


class Chain(NamedTuple):
    """A drafter's proposal for rows [0, R)."""
    tokens: Tensor  # [R, k]
    conf: Tensor  # [R, k] P(slot j accepted | slots before it were); 0 where nothing is proposed
    q: Tensor | None = None  # [R, k, Vq] distributions the tokens were sampled from (None: point masses)
    vocab: Tensor | None = None  # [Vq] the target id of each column of q


class Drafter(nn.Module):
    """The plug-in: subclass, set `name` and `k` (the longest chain), implement `propose`.

    A drafter that reads only the history needs nothing else. The hooks serve drafters with
    state or a model; each does nothing by default."""

    name: str = "drafter"
    k: int = 0
    costly: bool = False  # its pass takes time the planner weighs, and may skip
    feature_layers: tuple[int, ...] = ()  # target layers whose hidden states `see` receives

    def propose(self, tokens: Tensor, n: Tensor) -> tuple[Tensor, Tensor]:
        """tokens [R, C] long, row r's known tokens being tokens[r, :n[r]], the last of them the
        token the chain continues. Returns draft [R, k] long and conf [R, k] in [0, 1]."""
        raise NotImplementedError

    def setup(self, S: int, L: int, target: nn.Module) -> None:
        """Allocate per-slot state for S slots of up to L tokens."""

    def reset(self, slot: int) -> None:
        """A new request takes `slot`."""

    def move(self, src: Tensor, dst: Tensor, upto: int) -> None:
        """Requests move from slots `src` to `dst` (positions below `upto` hold their history)."""

    def see(self, hidden: Tensor, slot: Tensor, pos: Tensor) -> None:
        """The target's hidden states [T, len(feature_layers), dim] of tokens it has just run
        at (slot, pos); rejected positions are seen too, then overwritten."""

    def draft(self, rows: Rows) -> Chain:
        """This step's chain (from `propose` unless overridden)."""
        return Chain(*self.propose(rows.tokens, rows.n))

    def commit(self, rows: Rows, chain: Chain | None, out: Tensor | None, n_out: Tensor | None) -> Tensor | None:
        """After a step (chain, and the emitted tokens out [R, Q] of which n_out are valid) or a
        prefill (None): rows hold the new histories. Returns the conf [R, k] of the chain the
        next step will verify, if the drafter already knows it (so the planner sees it), else None."""
        return None


# ----------------------------------------------------------------------------- n-gram

# The calibration table's first index: how the slot's previous n-gram proposal fared against the
# tokens the step then emitted. A copy that agreed with everything is likely right again (code
# edits); one wrong from its first token is likely wrong again (free text).
NO_PROPOSAL, WRONG, PARTIAL, RIGHT = 0, 1, 2, 3


def default_ngram_table(n_max: int, k: int) -> Tensor:
    """[4, n_max + 1, k] guesses for models without a fitted table: the first copied token is
    uncertain, later ones (after an accepted one) mostly right, more so after a right copy."""
    first = torch.tensor([0.3, 0.15, 0.5, 0.7])[:, None, None]
    rest = torch.tensor([0.75, 0.6, 0.8, 0.9])[:, None, None]
    col = torch.arange(k)[None, None, :]
    return torch.where(col == 0, first, rest).expand(4, n_max + 1, k).clone()


def fit_table_width(table: Tensor, k: int) -> Tensor:
    """The table cut or extended (repeating its last position) to chains of k tokens."""
    if table.shape[-1] >= k:
        return table[..., :k].contiguous()
    return torch.cat([table, table[..., -1:].expand(*table.shape[:-1], k - table.shape[-1])], -1)


def ngram_outcome(proposal: Tensor, valid: Tensor, out: Tensor, n_out: Tensor, last: Tensor) -> Tensor:
    """The new state [R] of each row: NO_PROPOSAL; WRONG when the proposal's first token is not
    the first token emitted; RIGHT when it agrees with every emitted token it covers; PARTIAL
    between. Rows that emitted nothing keep `last`."""
    _, agree = leading_agreement(proposal, valid, out, n_out)
    state = torch.where(agree == 0, WRONG, torch.where(agree >= torch.minimum(n_out, valid), RIGHT, PARTIAL))
    state = torch.where(valid > 0, state, NO_PROPOSAL)
    return torch.where(n_out > 0, state, last)


class NgramDrafter(Drafter):
    """Longest-suffix lookup in each slot's own history (prompt + output so far).

    For n from n_max down to n_min, the last n tokens are compared with every earlier window;
    the longest match wins, the earliest occurrence among equals; up to k tokens that followed
    it are proposed (fewer where the history ends). A calibration table turns how the slot's
    last proposal fared, the match length and the position into each token's conf. The next
    step's proposal is drafted as soon as the history is known (`commit`), so the planner
    plans with the estimates of the very chain the step verifies."""

    name = "ngram"

    def __init__(self, n_min: int = 1, n_max: int = 8, k: int = 32, table: Tensor | None = None):
        super().__init__()
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"ngram_k must be an int >= 1, got {k!r}")
        self.n_min, self.n_max, self.k = n_min, n_max, k
        table = default_ngram_table(n_max, k) if table is None else table
        if table.ndim != 3 or table.shape[1] <= n_max:
            raise ValueError(f"the n-gram table is shaped {tuple(table.shape)}, but the matcher needs "
                             f"[4, m, j] with a row for every match length m up to {n_max}; "
                             f"fit one with `python -m minispark.train ngram`")
        self.register_buffer("table", fit_table_width(table.float(), k))  # [4, m, k]

    def forward(self, tokens: Tensor, hist_len: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """tokens [R, C] (history in [0, hist_len), the rest ignored); hist_len [R].
        Returns draft [R, k], valid [R] (drafted tokens that exist) and match length m [R] (0 = none)."""
        R, C = tokens.shape
        dev = tokens.device
        pos = torch.arange(C, device=dev)[None, :]
        # match[r, p]: how many tokens ending at p equal the history's last ones, up to n_max.
        # One comparison of the whole buffer per suffix token, rather than one per (n, window).
        n = min(self.n_max, C)
        back = torch.arange(n, device=dev)
        last = tokens.gather(1, (hist_len[:, None] - 1 - back).clamp(min=0))  # [R, n]: i-th token from the end
        before = torch.stack([F.pad(tokens, (i, 0))[:, :C] for i in range(n)], dim=1)  # [R, n, C]: at p - i
        same = (before == last[:, :, None]) & (pos[:, None, :] >= back[None, :, None])
        match = same.long().cumprod(1).sum(1)  # [R, C]
        # A window ending at p leaves a following token inside the history when p + 1 < hist_len
        # (its continuation may run into the suffix itself: overlapping repeats copy fine).
        match = torch.where((pos < hist_len[:, None] - 1) & (match >= self.n_min), match, 0)
        # The longest match, then the earliest occurrence: in code edits it is the prompt's copy
        # of the text, and in a run like "x x x x" it has the longest continuation.
        end = (match * C + (C - 1 - pos)).argmax(-1)  # [R]
        best_n = match.gather(1, end[:, None]).squeeze(1)
        best_start = end + 1  # where the continuation starts
        at = best_start[:, None] + torch.arange(self.k, device=dev)  # [R, k]
        draft = tokens.gather(1, at.clamp(max=C - 1))
        valid = torch.where(best_n > 0, (hist_len - best_start).clamp(0, self.k), 0)
        return draft, valid, best_n

    def conf(self, state: Tensor, m: Tensor, valid: Tensor) -> Tensor:
        """[R, k] per-token estimates from the table, 0 past each valid length."""
        col = torch.arange(self.k, device=m.device)[None, :]
        return torch.where(col < valid[:, None], self.table[state, m], 0.0)

    def propose(self, tokens: Tensor, n: Tensor) -> tuple[Tensor, Tensor]:
        draft, valid, m = self(tokens, n)
        return draft, self.conf(torch.zeros_like(m), m, valid)

    def setup(self, S: int, L: int, target: nn.Module) -> None:
        zeros = lambda: torch.zeros(S, dtype=torch.long, device=self.table.device)  # noqa: E731
        self.last, self.valid, self.m = zeros(), zeros(), zeros()  # `last`: the table's first index
        self.tok = torch.zeros(S, self.k, dtype=torch.long, device=self.table.device)

    def reset(self, slot: int) -> None:
        self.last[slot] = NO_PROPOSAL

    def move(self, src: Tensor, dst: Tensor, upto: int) -> None:
        for t in (self.last, self.valid, self.m, self.tok):
            t[dst] = t[src]

    def draft(self, rows: Rows) -> Chain:
        s = rows.slot
        return Chain(self.tok[s], self.conf(self.last[s], self.m[s], self.valid[s]))

    def commit(self, rows: Rows, chain: Chain | None, out: Tensor | None, n_out: Tensor | None) -> Tensor:
        s = rows.slot
        if chain is not None:
            self.last[s] = ngram_outcome(chain.tokens, self.valid[s], out, n_out, self.last[s])
        self.tok[s], self.valid[s], self.m[s] = self(rows.tokens, rows.n)
        return self.conf(self.last[s], self.m[s], self.valid[s])


# ----------------------------------------------------------------------------- Spark


@dataclass
class SparkArgs:
    """The drafter's shape. Attention and MLP sizes are the target's, so draft layers can start
    from a copy of a target layer; the drafter borrows the target's embedding and LM head."""
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's
    norm_eps: float = 1e-5
    target_layers: tuple[int, ...] = (1, 8, 15, 22, 29)  # features read, shallow to deep
    n_layers: int = 1
    block: int = 7  # g: the anchor and g - 1 masks give g drafted tokens
    rank: int = 128  # of the Markov head
    draft_vocab: int = 8192  # tokens the drafter can propose (the target's most frequent)

    @classmethod
    def for_target(cls, a: ModelArgs, **kw) -> "SparkArgs":
        return cls(a.dim, a.n_heads, a.n_kv_heads, a.head_dim, a.intermediate_size, a.vocab_size, a.norm_eps, **kw)

    def as_model_args(self) -> ModelArgs:
        return ModelArgs(vocab_size=self.vocab_size, dim=self.dim, n_layers=self.n_layers, n_heads=self.n_heads,
                         n_kv_heads=self.n_kv_heads, head_dim=self.head_dim,
                         intermediate_size=self.intermediate_size, norm_eps=self.norm_eps)


class DraftAttention(nn.Module):
    """A block of queries attending to context keys (given) and to the block itself, both ways."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.wqkv = Linear(args.dim, (args.n_heads + 2 * args.n_kv_heads) * args.head_dim, bias=False)
        self.wo = Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.k_cache: Tensor | None = None  # [S + 1, L, Hkv, D] keys of the context; row S is scratch
        self.v_cache: Tensor | None = None

    def context_kv(self, ctx: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values [..., Hkv, D] of fused target features ctx [..., dim]."""
        H, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        # The context asks no queries: only the key and value rows of wqkv (2/5 of it here).
        k, v = F.linear(ctx, self.wqkv.weight[H * D:]).split([Hkv * D, Hkv * D], dim=-1)
        k = apply_rope(k.unflatten(-1, (Hkv, D)), cos, sin)
        return k, v.unflatten(-1, (Hkv, D))

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, ctx_k: Tensor, ctx_v: Tensor, mask: Tensor) -> Tensor:
        # x [B, Q, dim]; ctx_k/v [B, C, Hkv, D]; mask [B, 1, Q, C + Q]
        B, Q, _ = x.shape
        H, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        q, k, v = self.wqkv(x).split([H * D, Hkv * D, Hkv * D], dim=-1)
        q = apply_rope(q.view(B, Q, H, D), cos, sin)
        k = apply_rope(k.view(B, Q, Hkv, D), cos, sin)
        keys = torch.cat([ctx_k.to(q.dtype), k], dim=1).transpose(1, 2)  # [B, Hkv, C + Q, D]
        vals = torch.cat([ctx_v.to(q.dtype), v.view(B, Q, Hkv, D)], dim=1).transpose(1, 2)
        return self.wo(attend(q, keys, vals, mask).reshape(B, Q, H * D))


class DraftLayer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention = DraftAttention(args)
        self.feed_forward = FeedForward(args)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, ctx_k: Tensor, ctx_v: Tensor, mask: Tensor) -> Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, ctx_k, ctx_v, mask)
        return h + self.feed_forward(self.ffn_norm(h))


def block_mask(ctx_mask: Tensor, g: int) -> Tensor:
    """[B, 1, A*g, C + A*g] bool: each block's queries see the context its anchor may see
    (ctx_mask [B, A, C]: positions before the anchor) and every position of their own block,
    both ways, but no other block."""
    B, A, _ = ctx_mask.shape
    same = torch.eye(A, dtype=torch.bool, device=ctx_mask.device).repeat_interleave(g, 0).repeat_interleave(g, 1)
    return torch.cat([ctx_mask.repeat_interleave(g, 1), same.expand(B, -1, -1)], dim=-1)[:, None]


def calibrated(conf_logit: Tensor, temp: Tensor | float, bias: Tensor | float) -> Tensor:
    """The confidence head's logit [..., g] as P(token j accepted | tokens < j accepted):
    sigmoid(z / temp + bias), one temperature and shift per position (`conf_temp`,
    `conf_bias`; fitted by `train.fit_calibration`)."""
    return torch.sigmoid(conf_logit / temp + bias)


class SparkDrafter(Drafter):
    """One parallel pass drafts a block of g tokens and scores each one's chance of acceptance.

    Context: hidden states of a few target layers at committed positions, concatenated,
    projected and normalised, then turned into keys/values of every draft layer (cached per
    slot and position like the target's KV). Block: [anchor, MASK x (g-1)] at positions
    lens .. lens + g - 1, attending to the context before `lens` and to itself both ways.
    Heads: the target's own LM head over a reduced draft vocabulary, plus a low-rank Markov
    term on the previous token (`W1[x_{k-1}] @ W2`), choosing tokens left to right; and a
    confidence `c_k = P(slot k accepted | slots before it were)`.
    """

    name = "spark"
    costly = True

    def __init__(self, args: SparkArgs):
        super().__init__()
        self.args = args
        self.feature_layers = tuple(args.target_layers)
        margs = args.as_model_args()
        n_feat = len(args.target_layers)
        self.fuse = Linear(n_feat * args.dim, args.dim, bias=False)
        self.fuse_norm = RMSNorm(args.dim, args.norm_eps)
        self.mask_emb = nn.Parameter(torch.zeros(args.dim))
        self.layers = nn.ModuleList(DraftLayer(margs) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.markov_in = nn.Embedding(args.draft_vocab + 1, args.rank)  # W1; the last row: any other token
        self.markov_out = Linear(args.rank, args.draft_vocab, bias=False)  # W2
        nn.init.zeros_(self.markov_out.weight)
        self.conf = nn.Linear(args.dim + args.rank, 1)
        self.register_buffer("d2t", torch.arange(args.draft_vocab))  # draft id -> target id
        # Calibration, one scale and one shift per position: sigmoid(z / temp + bias). A
        # temperature alone only pulls a confidence toward 1/2, which cannot correct one that
        # is too high where acceptance is below 1/2 (slot 0 on chat: 0.45 accepted).
        self.register_buffer("conf_temp", torch.ones(args.block))
        self.register_buffer("conf_bias", torch.zeros(args.block))
        self.register_buffer("inv_freq", rope_frequencies(margs), persistent=False)
        # Borrowed from the target by `attach`, frozen and not saved with the drafter.
        self.register_buffer("embed", torch.empty(0), persistent=False)  # [V, dim] target embedding
        self.register_buffer("head", torch.empty(0), persistent=False)  # [Vd, dim] target LM head rows
        self.register_buffer("t2d", torch.empty(0, dtype=torch.long), persistent=False)  # [V] -> [0, Vd]

    @property
    def k(self) -> int:
        return self.args.block

    def setup(self, S: int, L: int, target: nn.Module) -> None:
        self.attach(target)
        self.setup_cache(S, L, target.tok_embeddings.weight.dtype)

    def reset(self, slot: int) -> None:
        # A NaN key left by a broken request would poison the next one: attention weighs a
        # masked position by 0, and 0 x NaN is NaN.
        for layer in self.layers:
            layer.attention.k_cache[slot].zero_()
            layer.attention.v_cache[slot].zero_()

    def move(self, src: Tensor, dst: Tensor, upto: int) -> None:
        for layer in self.layers:
            for cache in (layer.attention.k_cache, layer.attention.v_cache):
                written = cache[:, :upto]  # [S + 1, upto, Hkv, D], a view
                written[dst] = written[src]

    def see(self, hidden: Tensor, slot: Tensor, pos: Tensor) -> None:
        self.write_context(hidden, slot, pos)

    def draft(self, rows: Rows) -> Chain:
        """The block after each row's anchor; sampled from q when the step samples, with conf
        taken along the greedy path, which depends on the context alone (see `price`)."""
        lens = (rows.n - 1).clamp(min=0)
        anchor = rows.tokens.gather(1, lens[:, None])[:, 0]
        u = None
        if rows.temperature is not None:
            u = uniform_block(rows.seed, lens, self.args.block, self.args.draft_vocab)
        _, conf, q, sampled = self.draft_block(anchor, lens, rows.tokens.shape[1], rows.temperature, u)
        return Chain(sampled, conf, q, self.d2t)

    def attach(self, target: nn.Module) -> "SparkDrafter":
        """Borrow the target's embedding and the LM head rows of the draft vocabulary."""
        self.embed = target.tok_embeddings.weight.detach()
        self.head = target.output.weight.detach()[self.d2t].clone()
        t2d = torch.full((self.args.vocab_size,), self.args.draft_vocab, dtype=torch.long, device=self.d2t.device)
        self.t2d = t2d.scatter(0, self.d2t, torch.arange(self.args.draft_vocab, device=self.d2t.device))
        return self

    def setup_cache(self, max_batch_size: int, max_seq_len: int, dtype: torch.dtype) -> None:
        a = self.args
        shape = (max_batch_size + 1, max_seq_len, a.n_kv_heads, a.head_dim)
        for layer in self.layers:
            layer.attention.k_cache = torch.zeros(shape, dtype=dtype, device=self.d2t.device)
            layer.attention.v_cache = torch.zeros(shape, dtype=dtype, device=self.d2t.device)

    def rope(self, pos: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        freqs = pos.float()[..., None] * self.inv_freq  # [..., D/2]
        return freqs.cos()[..., None, :].to(dtype), freqs.sin()[..., None, :].to(dtype)

    def context(self, feats: Tensor) -> Tensor:
        """Fused context [..., dim] of target features [..., n_feat, dim]."""
        return self.fuse_norm(self.fuse(feats.flatten(-2).to(self.fuse.weight.dtype)))

    def write_context(self, feats: Tensor, slot: Tensor, pos: Tensor) -> None:
        """Store the context keys/values of tokens the target has just seen, at (slot, pos);
        positions that are later rejected are masked and then overwritten, as in the target."""
        ctx = self.context(feats)  # [T, dim]
        cos, sin = self.rope(pos, ctx.dtype)
        for layer in self.layers:
            att = layer.attention
            k, v = att.context_kv(ctx, cos, sin)
            att.k_cache.index_put_((slot, pos), k.to(att.k_cache.dtype))
            att.v_cache.index_put_((slot, pos), v.to(att.v_cache.dtype))

    def block_states(self, anchor: Tensor, pos: Tensor, ctx_kv: list[tuple[Tensor, Tensor]], ctx_mask: Tensor) -> Tensor:
        """Hidden states [B, Q, dim] of blocks [anchor, MASK x (g-1)].

        anchor [B, A] (A blocks per row, Q = A * g queries), pos [B, A] the anchors' positions,
        ctx_kv per layer ([B, C, Hkv, D] keys, values), ctx_mask [B, A, C]: context each block sees."""
        B, A = anchor.shape
        g = self.args.block
        x = self.mask_emb.expand(B, A, g, -1).clone()
        x[:, :, 0] = F.embedding(anchor, self.embed).to(x.dtype)
        x = x.flatten(1, 2)  # [B, Q, dim]
        qpos = (pos[:, :, None] + torch.arange(g, device=pos.device)).flatten(1)  # [B, Q]
        cos, sin = self.rope(qpos, x.dtype)
        mask = grid_bias(block_mask(ctx_mask, g), self.args.n_heads // self.args.n_kv_heads, x.dtype)
        for layer, (k, v) in zip(self.layers, ctx_kv):
            x = layer(x, cos, sin, k, v, mask)
        return self.norm(x)

    def head_logits(self, h: Tensor) -> Tensor:
        """The target's LM head over the draft vocabulary: [..., Vd] of states h [..., dim]."""
        return F.linear(h, self.head.to(h.dtype)).float()

    def logits(self, h: Tensor, prev: Tensor) -> tuple[Tensor, Tensor]:
        """Draft logits [..., Vd] and confidence logits [...] of states h [..., dim] after the
        previous token prev [...] (target ids)."""
        w1 = self.markov_in(self.t2d[prev])  # [..., r]
        return self.head_logits(h) + self.markov_out(w1), self.confidence(h, w1)

    def confidence(self, h: Tensor, w1: Tensor) -> Tensor:
        """Confidence logits [...] of states h [..., dim] with the previous token's Markov row w1 [..., r]."""
        return self.conf(torch.cat([h, w1.to(h.dtype)], dim=-1)).float()[..., 0]

    def draft_block(self, anchor: Tensor, lens: Tensor, ctx: int, temperature: Tensor | None = None,
              u: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:
        """Draft a block for rows [0, R): anchor and lens [R], attending to the cached context
        before `lens` within the first `ctx` positions.

        Returns (greedy, conf, q, sampled): the greedy tokens [R, g] (target ids), conf [R, g]
        (calibrated acceptance estimates along the greedy path, which depends on the context
        alone), and, when sampling (temperature [R] and uniforms u [R, g, Vd] given), the draft
        distributions q [R, g, Vd] and the tokens sampled from them [R, g]; without sampling,
        q is None and sampled is greedy (as on rows at temperature 0)."""
        R = anchor.shape[0]
        kpos = torch.arange(ctx, device=lens.device)
        ctx_mask = (kpos[None, :] < lens[:, None])[:, None, :]  # [R, 1, C]
        ctx_kv = [(l.attention.k_cache[:R, :ctx], l.attention.v_cache[:R, :ctx]) for l in self.layers]
        h = self.block_states(anchor[:, None], lens[:, None], ctx_kv, ctx_mask)  # [R, g, dim]
        greedy, conf_logit = self.chain(h, anchor, None, None)
        conf = calibrated(conf_logit, self.conf_temp, self.conf_bias)
        if temperature is None:
            return greedy, conf, None, greedy
        sampled, q = self.chain(h, anchor, temperature, u)
        return greedy, conf, q, sampled

    def chain(self, h: Tensor, anchor: Tensor, temperature: Tensor | None, u: Tensor | None) -> tuple[Tensor, Tensor]:
        """Choose tokens left to right: each one's logits add the Markov term of the one before.
        Greedy (temperature None): returns tokens and confidence logits; sampling: tokens and
        their distributions q."""
        # Only the Markov term waits for the token before; the head's part of every position is
        # one matrix product, which reads the head once rather than g times (at one row, the
        # g reads of its 9 MB were most of the drafter's time on a CPU).
        # The confidence head, too, waits for nothing but the Markov rows: one product after the loop.
        head = self.head_logits(h)  # [R, g, Vd]
        prev, toks, w1s, qs = anchor, [], [], []
        for k in range(self.args.block):
            w1 = self.markov_in(self.t2d[prev])  # [R, r]
            logits = head[:, k] + self.markov_out(w1)  # [R, Vd], fp32 like the head's
            if temperature is None:
                d = greedy(logits)
            else:
                cold = temperature <= 0  # greedy rows
                q = (logits / torch.where(cold, 1.0, temperature)[:, None]).softmax(-1)
                d = torch.where(cold, greedy(logits), sample(q, u[:, k]))
                qs.append(torch.where(cold[:, None], F.one_hot(d, q.shape[-1]).to(q.dtype), q))
            prev = self.d2t[d]
            toks.append(prev)
            w1s.append(w1)
        if temperature is None:
            return torch.stack(toks, 1), self.confidence(h, torch.stack(w1s, 1))
        return torch.stack(toks, 1), torch.stack(qs, 1)
