"""A Llama-style decoder over packed tokens and a static, position-addressed KV cache.

One forward serves prefill, decode and speculative verification: the caller packs any tokens
of any slots into one batch `[T]` and says, for each token, its slot, its position and its
place in a small dense query grid `[R, Q]` (one row per slot taking part). Linear layers cost
`T` tokens; attention runs per grid row against that row's slot of the cache. Hardware kernels
live apart, applied to a built model (`cpu.optimize`).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

KV_BLOCK = 256  # attended prefixes (`Batch.ctx_len`) come in multiples of this: cpu.attend_exact's block


@dataclass
class ModelArgs:
    vocab_size: int = 49152
    dim: int = 576
    n_layers: int = 30
    n_heads: int = 9
    n_kv_heads: int = 3
    head_dim: int = 64
    intermediate_size: int = 1536
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # HF `rope_scaling`, e.g. {"rope_type": "llama3", ...}
    max_position_embeddings: int = 8192
    tie_embeddings: bool = True
    qkv_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")


@dataclass
class Batch:
    """Where each packed token goes: `T` tokens, a query grid of `R` rows by `Q` columns. Padding
    tokens carry `slot = S` (the cache's scratch row) and `cell = R * Q` (the grid's scratch cell)."""
    tokens: Tensor  # [T] token ids
    slot: Tensor  # [T] cache row written
    pos: Tensor  # [T] position written and attended up to
    cell: Tensor  # [T] flat index into the query grid [R * Q + 1]
    row_slot: Tensor | slice  # [R] cache row each grid row attends to, or a slice of rows (a view)
    n_cols: int  # Q
    ctx_len: int  # attend to cache positions [0, ctx_len): a bucket, not max_seq_len

    @property
    def n_rows(self) -> int:
        rows = self.row_slot
        return rows.stop - (rows.start or 0) if isinstance(rows, slice) else rows.shape[0]


def rope_frequencies(args: ModelArgs) -> Tensor:
    """Inverse frequencies [D/2], with Llama-3 or linear `rope_scaling` applied."""
    d = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    scaling = args.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are stretched by `factor`, short ones kept, the band between blended.
        smooth = ((old_len / wavelen - lo) / (hi - lo)).clamp(0, 1)
        inv_freq = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    elif kind != "default":
        raise ValueError(f"unsupported rope_scaling type {kind!r}; minispark knows default, linear, llama3")
    return inv_freq.float()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # x: [T, H, D]; cos/sin: [T, 1, D/2] in x's dtype. Half-split rotation, as in HF checkpoints.
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


# Per device type, whether `attend` stacks the query heads of each key head along the query axis
# at Q columns, rather than run the grouped-query kernel (cpu.py sets the CPU's rule; else never).
STACK_RULES: dict[str, Callable[[int], bool]] = {}


def stack_heads(Q: int, G: int, device: torch.device) -> bool:
    return G > 1 and STACK_RULES.get(device.type, lambda Q: False)(Q)


def grid_bias(mask: Tensor, G: int, dtype: torch.dtype, stack: bool | None = None) -> Tensor:
    """The additive form (0 or -inf) of a mask [R, 1, Q, C] (bool: which keys each query sees), as
    `attend` reads it for G query heads per key head: repeated G times along the query axis, rows
    (g, q), where it stacks the heads. Built once per forward rather than by every layer."""
    if stack is None:
        stack = stack_heads(mask.shape[2], G, mask.device)
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    return bias.repeat(1, 1, G, 1) if stack else bias


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, stack: bool | None = None) -> Tensor:
    """Attention of a query grid q [R, Q, H, D] over keys and values [R, Hkv, C, D] under mask
    [R, 1, Q, C] (bool) or its `grid_bias`; returns [R, Q, H, D]. `stack`: one plain attention
    over [R, Hkv, G * Q, D] instead of the grouped-query kernel (None: `stack_heads`)."""
    R, Q, H, D = q.shape
    Hkv = k.shape[1]
    G = H // Hkv
    if stack is None:
        stack = stack_heads(Q, G, q.device)
    if mask.dtype == torch.bool:
        mask = grid_bias(mask, G, q.dtype, stack)
    if not stack:
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask, enable_gqa=G > 1)
        return out.transpose(1, 2)
    stacked = q.view(R, Q, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(R, Hkv, G * Q, D)  # rows (g, q)
    out = F.scaled_dot_product_attention(stacked, k, v, attn_mask=mask)  # [R, Hkv, G * Q, D]
    return out.view(R, Hkv, G, Q, D).permute(0, 3, 1, 2, 4).reshape(R, Q, H, D)


class SDPA:
    """How the layers attend: the mask laid out once per forward (`bias`), the kernel (`__call__`),
    and any scratch beside the cache (`setup_cache`). PyTorch's SDPA; cpu.py has an exact one."""

    def setup_cache(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        pass

    def bias(self, mask: Tensor, G: int, dtype: torch.dtype) -> Tensor:
        return grid_bias(mask, G, dtype)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, bias: Tensor) -> Tensor:
        return attend(q, k.to(q.dtype), v.to(q.dtype), bias)


class Linear(nn.Linear):
    """nn.Linear, marking the layers a hardware module may lay out anew (`cpu.optimize`)."""


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # In fp32, as HF normalises, and in one fused op: a decode step runs two norms a layer.
        return F.rms_norm(x.float(), x.shape[-1:], self.weight.float(), self.eps).type_as(x)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        qkv_dim = (args.n_heads + 2 * args.n_kv_heads) * args.head_dim
        self.wqkv = Linear(args.dim, qkv_dim, bias=args.qkv_bias)
        self.wo = Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.k_cache: Tensor | None = None  # [S + 1, Hkv, L, D]; row S is scratch
        self.v_cache: Tensor | None = None
        self.cache_seq_dim = 2  # the caches' position axis

    def forward(self, x: Tensor, b: Batch, cos: Tensor, sin: Tensor, bias: Tensor, kernel: SDPA) -> Tensor:
        T = x.shape[0]
        H, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        q, k, v = self.wqkv(x).split([H * D, Hkv * D, Hkv * D], dim=-1)
        q = apply_rope(q.view(T, H, D), cos, sin)
        k = apply_rope(k.view(T, Hkv, D), cos, sin)
        self.k_cache[b.slot, :, b.pos] = k.to(self.k_cache.dtype)
        self.v_cache[b.slot, :, b.pos] = v.view(T, Hkv, D).to(self.v_cache.dtype)

        R, Q = b.n_rows, b.n_cols
        grid = q.new_zeros(R * Q + 1, H, D).index_copy(0, b.cell, q)[:-1].view(R, Q, H, D)
        # A slice of rows is a view: decode attends to the cache in place, without a copy.
        keys = self.k_cache[b.row_slot, :, : b.ctx_len]  # [R, Hkv, C, D]
        vals = self.v_cache[b.row_slot, :, : b.ctx_len]
        out = kernel(grid, keys, vals, bias).reshape(R * Q, H * D)
        return self.wo(out[b.cell.clamp(max=R * Q - 1)])  # [T, dim]; padding reads any cell


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w1 = Linear(args.dim, args.intermediate_size, bias=False)  # gate
        self.w3 = Linear(args.dim, args.intermediate_size, bias=False)  # up
        self.w2 = Linear(args.intermediate_size, args.dim, bias=False)  # down

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x: Tensor, b: Batch, cos: Tensor, sin: Tensor, bias: Tensor, kernel: SDPA) -> Tensor:
        h = x + self.attention(self.attention_norm(x), b, cos, sin, bias, kernel)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("inv_freq", rope_frequencies(args), persistent=False)
        self.kernel = SDPA()  # `cpu.optimize` sets an exact one
        self.max_batch_size = self.max_seq_len = 0

    def setup_cache(self, max_batch_size: int, max_seq_len: int, dtype: torch.dtype | None = None) -> None:
        """Allocate the static KV cache [S + 1, Hkv, L, D] (row S: scratch for padding)."""
        device = self.tok_embeddings.weight.device
        dtype = dtype or self.tok_embeddings.weight.dtype
        shape = (max_batch_size + 1, self.args.n_kv_heads, max_seq_len, self.args.head_dim)
        for layer in self.layers:
            layer.attention.k_cache = torch.zeros(shape, dtype=dtype, device=device)
            layer.attention.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.kernel.setup_cache(shape, dtype, device)
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len

    def forward(self, b: Batch, logits_at: Tensor | None = None, hidden_layers: tuple[int, ...] = (),
                exact: bool = True) -> tuple[Tensor, Tensor | None]:
        """Logits `[N, V]` of the packed tokens `logits_at` (all `T` when None) and, when asked,
        the outputs of `hidden_layers` (0-based) for every token, `[T, len(hidden_layers), dim]`.
        exact=False attends with SDPA even where `kernel` is an exact one (a prompt alone)."""
        if any(not 0 <= i < len(self.layers) for i in hidden_layers):
            raise ValueError(f"hidden_layers={hidden_layers} out of range for {len(self.layers)} layers")
        x = self.tok_embeddings(b.tokens)  # [T, dim]
        freqs = b.pos.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        cos, sin = freqs.cos()[:, None, :].to(x.dtype), freqs.sin()[:, None, :].to(x.dtype)
        kernel = self.kernel if exact else SDPA()
        bias = kernel.bias(self.attention_mask(b), self.args.n_heads // self.args.n_kv_heads, x.dtype)
        hidden = {}
        for i, layer in enumerate(self.layers):
            x = layer(x, b, cos, sin, bias, kernel)
            if i in hidden_layers:
                hidden[i] = x
        if logits_at is not None:
            x = x[logits_at]
        logits = self.output(self.norm(x)).float()
        # in the order asked for, repeats included: a drafter concatenates these features
        return logits, (torch.stack([hidden[i] for i in hidden_layers], dim=1) if hidden_layers else None)

    @staticmethod
    def attention_mask(b: Batch) -> Tensor:
        """[R, 1, Q, C] bool: a query sees its slot's cache up to its own position. Empty grid
        cells get position 0 so that no row is fully masked (that would give NaN)."""
        R, Q = b.n_rows, b.n_cols
        qpos = b.pos.new_zeros(R * Q + 1).index_copy(0, b.cell, b.pos)[:-1].view(R, Q)
        kpos = torch.arange(b.ctx_len, device=b.pos.device)
        return (kpos[None, None, :] <= qpos[:, :, None])[:, None]
