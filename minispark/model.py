"""A Llama-style decoder over a static, position-addressed KV cache.

One forward serves prefill, decode and speculative verification: the caller packs any tokens
of any slots into one batch `[T]` and says, for each token, its slot, its position and its
place in a small dense query grid `[R, Q]` (one row per slot taking part). Linear layers cost
`T` tokens; attention runs per grid row against that row's slot of the cache.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor


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
    """Where each packed token goes. `T` tokens, a query grid of `R` rows by `Q` columns.

    Padding tokens carry `slot = S` (the scratch row of the cache) and `cell = R * Q` (a
    scratch cell of the grid), so they write nowhere that matters.
    """
    tokens: Tensor  # [T] token ids
    slot: Tensor  # [T] cache row written
    pos: Tensor  # [T] position written and attended up to
    cell: Tensor  # [T] flat index into the query grid [R * Q + 1]
    row_slot: Tensor | slice  # [R] cache row each grid row attends to, or a slice of rows (a view)
    n_cols: int  # Q
    ctx_len: int  # attend to cache positions [0, ctx_len): a bucket, not max_seq_len

    @property
    def n_rows(self) -> int:
        if isinstance(self.row_slot, slice):
            return self.row_slot.stop - (self.row_slot.start or 0)
        return self.row_slot.shape[0]


def rope_frequencies(args: ModelArgs) -> Tensor:
    """Inverse frequencies, with Llama-3 or linear `rope_scaling` applied."""
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


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # In fp32, as HF normalises, and one fused op: eager decode runs 61 norms a step, and
        # as eight small ops they took about 0.3 ms more a step on this project's CPU.
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
        self.wide: Tensor | None = None  # [S + 1, Hkv, KV_BLOCK, D] fp32 scratch of `attend_exact`, shared
        self.cache_seq_dim = 2  # the caches' position axis

    def forward(self, x: Tensor, b: Batch, cos: Tensor, sin: Tensor, mask: Tensor, exact: bool) -> Tensor:
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
        if exact:
            out = attend_exact(grid, keys, vals, mask, self.wide)
        else:
            out = attend(grid, keys.to(q.dtype), vals.to(q.dtype), mask)
        out = out.reshape(R * Q, H * D)
        return self.wo(out[b.cell.clamp(max=R * Q - 1)])  # [T, dim]; padding reads any cell


def cpu_has(feature: str) -> bool:
    """Whether this CPU has an instruction set extension, as PyTorch's own kernels see it
    (False where this torch build cannot tell)."""
    return getattr(torch.cpu, f"_is_{feature}_supported", lambda: False)()


# AMX tiles make the grouped-query attention kernel the faster one at some grid widths (see
# `stacks`); AVX512-BF16 or AMX compute bf16 natively (see `resolve_dtype`).
CPU_HAS_AMX = cpu_has("amx_tile")
CPU_HAS_BF16 = CPU_HAS_AMX or cpu_has("avx512_bf16")


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """A torch dtype from a name; "auto" is bfloat16 where the hardware computes in it (CUDA,
    CPUs with AVX512-BF16 or AMX) and float32 elsewhere. A CPU without native bf16 converts
    every matmul operand: on this project's 2-core CPU a demo-model forward of 8 tokens took
    133 ms in bfloat16 against 87 ms in float32, and verification lives on such forwards."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" or CPU_HAS_BF16 else torch.float32
    torch_dtype = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if not isinstance(torch_dtype, torch.dtype) or not torch_dtype.is_floating_point:
        raise ValueError(f"dtype must be 'auto' or a floating-point dtype ('bfloat16', 'float16', 'float32'), "
                         f"got {dtype!r}")
    return torch_dtype


def stacks(Q: int, G: int, device: torch.device) -> bool:
    """Whether `attend` runs a grid of Q columns with G query heads per key head as one plain
    attention, the G query heads of each key head stacked along the query axis, rather than
    the grouped-query kernel: what was measured faster on CPUs (demo model, bf16, 16 rows, per
    layer). With AMX, stacking won at 2 to 9 columns (a slot verifying a few drafts; Spark's
    block): the grouped kernel took 0.87 ms for 2 columns over 512 positions against 0.41 for 1
    (stacked, 0.47), and 2.3 ms against 1.4 for Spark's block of 7; at 1 column, or many, the
    grouped kernel was the faster. Without AMX (an AVX512-BF16 EPYC), stacking won at every
    width, by 4-7x at 1 column (1.3 ms against 9.2 over 1,024 positions; stacked, `off` ran
    1.7x as fast on chat at batch 16) and by 1.2-1.4x at 9 to 65. On a GPU the grouped kernel
    runs."""
    return device.type == "cpu" and G > 1 and (2 <= Q <= 9 or not CPU_HAS_AMX)


def grid_bias(mask: Tensor, G: int, dtype: torch.dtype, stack: bool | None = None) -> Tensor:
    """The additive form of a mask [R, 1, Q, C] (bool: which keys each query sees), laid out
    as `attend` reads it for G query heads per key head: 0 where a query sees a key, -inf
    elsewhere, in the queries' dtype, and repeated G times along the query axis, rows (g, q),
    where attend stacks the heads. A forward builds it once for all its layers: given a bool
    mask, SDPA converts it on every call and attend repeated it for every layer (on this
    project's CPU, bf16: one layer's SDPA at 16 rows x 1 column over 512 positions took 584 us
    with the bool mask and 563 with this one; the repeats alone were 1.3 ms of a 1-row step;
    16-row decode steps took 0.93-0.99x their time before, and at 1 and 4 rows the change was
    within the A/B's own spread, 0.93-1.10x)."""
    if stack is None:
        stack = stacks(mask.shape[2], G, mask.device)
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    return bias.repeat(1, 1, G, 1) if stack else bias


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, stack: bool | None = None) -> Tensor:
    """Attention of a query grid q [R, Q, H, D] over keys and values [R, Hkv, C, D] under mask
    [R, 1, Q, C] (bool), or its `grid_bias`, built for the same `stack`; returns [R, Q, H, D].

    `stack` runs it as one plain attention with the G query heads of each key head stacked
    along the query axis, [R, Hkv, G * Q, D], instead of the grouped-query kernel; None
    chooses by what was measured (`stacks`)."""
    R, Q, H, D = q.shape
    Hkv = k.shape[1]
    G = H // Hkv
    if stack is None:
        stack = stacks(Q, G, q.device)
    if mask.dtype == torch.bool:
        mask = grid_bias(mask, G, q.dtype, stack)
    if not stack:
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask, enable_gqa=G > 1)
        return out.transpose(1, 2)
    stacked = q.view(R, Q, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(R, Hkv, G * Q, D)  # rows (g, q)
    out = F.scaled_dot_product_attention(stacked, k, v, attn_mask=mask)  # [R, Hkv, G*Q, D]
    return out.view(R, Hkv, G, Q, D).permute(0, 3, 1, 2, 4).reshape(R, Q, H, D)


KV_BLOCK = 256  # attend_exact sums values over blocks of this many keys: prefixes come in its multiples
MIN_ROWS = 4  # the fewest query rows attend_exact multiplies at once
SCORES_MAX = 1 << 24  # score elements attend_exact holds at once (64 MB): a long prefill goes in pieces


def exact_attention(device: torch.device) -> bool:
    """Whether the target attends with `attend_exact`: on a CPU."""
    return device.type == "cpu"


def exact_bias(mask: Tensor, G: int) -> Tensor:
    """The `grid_bias` `attend_exact` reads: fp32, stacked, rows (g, q), and at least MIN_ROWS
    rows (padding rows see every key)."""
    bias = grid_bias(mask, G, torch.float32, stack=True)  # [R, 1, G * Q, C]
    return F.pad(bias, (0, 0, 0, max(0, MIN_ROWS - bias.shape[2])))


def attend_exact(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, wide: Tensor | None = None) -> Tensor:
    """Attention of a query grid q [R, Q, H, D] over keys and values [R, Hkv, C, D] (the cache,
    in the model's dtype) under `exact_bias` [R, 1, max(G * Q, MIN_ROWS), C]; returns
    [R, Q, H, D] in q's dtype. `wide`: fp32 scratch of at least [R, Hkv, KV_BLOCK, D] (`widen`).

    Each query's result is the same bits whatever else the call holds: how many columns its
    row verifies, which rows share the step, how long the attended prefix is (a multiple of
    KV_BLOCK, or the whole cache). With steps of two tokens or more (`Engine.pack`), a
    token's logits are then the same in every step that computes them (bf16 weights, which
    oneDNN multiplies; MKL's fp32 products still round one way for 1 to 3 rows and another
    for more), so speculative decoding writes exactly the tokens plain decoding writes in bf16
    too, where a difference in the last bit of one sum can turn a close argmax (with SDPA's
    flash kernel, 4 of 16 chat answers came out the same in `spark` as in `off` at batch 1).
    Found by measurement on this project's CPU, each rule keeping a row's sums in one order:
    - scores, softmax and the weighted sum in fp32, from bf16 values held exactly in fp32
      (widened block by block as they are read, `widen`);
    - at least MIN_ROWS query rows per product: MKL multiplies 1 to 3 rows by another kernel;
    - values summed block by block of KV_BLOCK keys, in order: keys past a query's reach then
      add exact zeros, where one product over all C keys sums in an order that depends on C.
    A prompt's own forward can take SDPA (`Engine.prefill`): nothing else computes its tokens.
    Decode steps against SDPA's, demo model, bf16, this CPU, two runs alternating old and new
    code, with the fp32 cache of the first version (`widen` has since cut the 16-row steps by
    up to a sixth): 1 row 1.10x and 1.13x the time, 16 rows 0.97x and 1.00x, 16 rows verifying
    32 drafts 1.08x and 1.25x; prefill of 16 code prompts 1.16x."""
    R, Q, H, D = q.shape
    Hkv, C, M = k.shape[1], k.shape[2], bias.shape[2]
    G = H // Hkv
    rows = q.new_zeros(R, Hkv, M, D, dtype=torch.float32)
    rows[:, :, : G * Q] = q.view(R, Q, Hkv, G, D).permute(0, 2, 3, 1, 4).flatten(2, 3)  # rows (g, q)
    rows *= D**-0.5
    step = max(MIN_ROWS, SCORES_MAX // (R * Hkv * C))
    if step >= M:
        out = attend_rows(rows, k, v, bias, wide)
    else:  # a long grid in pieces, none under MIN_ROWS rows
        cuts = list(range(0, M, step))
        if M - cuts[-1] < MIN_ROWS:
            cuts.pop()  # the last piece takes the few rows left
        cuts.append(M)
        out = torch.cat([attend_rows(rows[:, :, i:j], k, v, bias[:, :, i:j], wide) for i, j in zip(cuts, cuts[1:])],
                        dim=2)
    out = out[:, :, : G * Q].view(R, Hkv, G, Q, D).permute(0, 3, 1, 2, 4)
    return out.reshape(R, Q, H, D).to(q.dtype)


def attend_rows(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, wide: Tensor | None) -> Tensor:
    """`attend_exact` of scaled query rows q [R, Hkv, n, D] under bias [R, 1, n, C], block by
    block of KV_BLOCK keys: every score and every partial sum is then a product of one shape,
    whatever C is."""
    blocks = range(0, k.shape[2], KV_BLOCK)
    scores = torch.cat([q @ widen(k[:, :, c:c + KV_BLOCK], wide).transpose(-1, -2) for c in blocks], dim=-1)
    p = torch.softmax(scores.add_(bias), dim=-1)  # [R, Hkv, n, C]
    out = p[..., :KV_BLOCK] @ widen(v[:, :, :KV_BLOCK], wide)
    for c in blocks[1:]:
        out += p[..., c:c + KV_BLOCK] @ widen(v[:, :, c:c + KV_BLOCK], wide)
    return out


def widen(x: Tensor, wide: Tensor | None) -> Tensor:
    """A block of keys or values x [R, Hkv, n <= KV_BLOCK, D] in fp32, copied into the scratch
    `wide` unless x is fp32 already. A step reads every row's keys and values in every layer,
    and a bf16 cache streams half the bytes of an fp32 one: decode steps of the demo model at
    16 rows took 0.83x the time of an fp32 cache's over 1,024 positions and 0.86x verifying 32
    drafts over 512 (this project's CPU, alternating old and new code). Through a scratch
    reused block after block: a fresh multi-MB block on every call (`x.float()`) made those
    steps 2x slower instead, in new memory each time."""
    if x.dtype == torch.float32:
        return x
    if wide is None:
        return x.float()
    return wide[: x.shape[0], :, : x.shape[2]].copy_(x)


class Linear(nn.Linear):
    """nn.Linear that, once `pack`ed, multiplies by a copy of its weight in oneDNN's blocked
    layout: a bf16 CPU inference path.

    Reordered once instead of on every call, a bf16 weight streams ~1.5x faster through a
    skinny product (every linear of the demo model at 1 to 16 tokens: 12 ms against 18 ms on
    the 2-core CPU with AMX; bit for bit equal there, and about equal from 256 tokens up).
    The copy doubles the linear weights' memory. It serves inference only: with gradients on
    the plain product runs, and a weight changed since (an optimiser step, `load_state_dict`,
    `.float()`) is packed again or, where it no longer can be, multiplied plainly, so a
    packed module is never wrong."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.packed: Tensor | None = None
        self.packed_from: tuple[int, int] | None = None  # the weight's storage and version when packed

    def pack(self) -> None:
        """Make the copy of the weight as it is now, or drop it where oneDNN cannot use one."""
        w = self.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w) if can_pack(w) else None
        self.packed_from = (w.data_ptr(), w._version)

    def forward(self, x: Tensor) -> Tensor:
        # A compiled graph gets the plain product: the compiler lays out weights its own way.
        if self.packed is not None and not torch.is_grad_enabled() and not torch.compiler.is_compiling():
            if self.packed_from != (self.weight.data_ptr(), self.weight._version):
                self.pack()  # changed in place, replaced, or moved to another dtype or device
            if self.packed is not None:
                return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def can_pack(w: Tensor) -> bool:
    """Whether oneDNN computes this CPU weight's dtype natively (bf16 with AVX512-BF16 or AMX)."""
    mkldnn = torch.ops.mkldnn
    return (w.device.type == "cpu" and w.dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and hasattr(mkldnn, "_reorder_linear_weight") and mkldnn._is_mkldnn_bf16_supported())


def cpu_weight_layout(module: nn.Module) -> nn.Module:
    """Lay out every Linear weight for a CPU's skinny products (a few verified tokens per slot:
    the cost speculative decoding lives on). Values and shapes are unchanged.

    bf16 where oneDNN computes it natively: each `Linear` is `pack`ed (the LM head too, tied
    or not). fp32: the weight [out, in] goes to column-major memory ([in, out] rows), which
    MKL's GEMM reads about 1.6x faster at a few tokens (a forward of 8 tokens 87 vs 105 ms, 32
    tokens 136 vs 216 ms, 1 token the same); a weight tied to an embedding stays row-major,
    since lookups read its rows. (bf16 against a column-major weight took a slow path, 12x
    slower on a CPU without native bf16.)"""
    tied = {id(m.weight) for m in module.modules() if isinstance(m, nn.Embedding)}
    for m in module.modules():
        if isinstance(m, Linear) and can_pack(m.weight):
            m.pack()
        elif (isinstance(m, nn.Linear) and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32
                and id(m.weight) not in tied):
            m.weight.data = m.weight.data.t().contiguous().t()
    return module


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

    def forward(self, x: Tensor, b: Batch, cos: Tensor, sin: Tensor, mask: Tensor, exact: bool) -> Tensor:
        h = x + self.attention(self.attention_norm(x), b, cos, sin, mask, exact)
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
        self.max_batch_size = 0
        self.max_seq_len = 0

    def setup_cache(self, max_batch_size: int, max_seq_len: int, dtype: torch.dtype | None = None) -> None:
        """Allocate the static KV cache [S + 1, Hkv, L, D], one scratch row beyond
        `max_batch_size` for padding, in the model's dtype (`attend_exact` widens it to fp32 as it reads)."""
        device = self.tok_embeddings.weight.device
        dtype = dtype or self.tok_embeddings.weight.dtype
        shape = (max_batch_size + 1, self.args.n_kv_heads, max_seq_len, self.args.head_dim)
        wide = None
        if exact_attention(device) and dtype != torch.float32:
            wide = torch.zeros(shape[:2] + (KV_BLOCK, shape[3]), device=device)
        for layer in self.layers:
            layer.attention.k_cache = torch.zeros(shape, dtype=dtype, device=device)
            layer.attention.v_cache = torch.zeros(shape, dtype=dtype, device=device)
            layer.attention.wide = wide
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len

    def forward(self, b: Batch, logits_at: Tensor | None = None, hidden_layers: tuple[int, ...] = (),
                exact: bool | None = None) -> tuple[Tensor, Tensor | None]:
        """Logits `[N, V]` of the packed tokens `logits_at` (all `T` when None) and, when asked,
        the outputs of `hidden_layers` (0-based) for every token, `[T, len(hidden_layers), dim]`.
        `exact`: attend with `attend_exact` (None: where `exact_attention` says), else SDPA."""
        if any(not 0 <= i < len(self.layers) for i in hidden_layers):
            raise ValueError(f"hidden_layers={hidden_layers} out of range for {len(self.layers)} layers")
        x = self.tok_embeddings(b.tokens)  # [T, dim]
        freqs = b.pos.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        cos, sin = freqs.cos()[:, None, :].to(x.dtype), freqs.sin()[:, None, :].to(x.dtype)
        exact = exact_attention(x.device) if exact is None else exact
        G = self.args.n_heads // self.args.n_kv_heads
        if exact:
            mask = exact_bias(self.attention_mask(b), G)
        else:
            mask = grid_bias(self.attention_mask(b), G, x.dtype)
        hidden = {}
        for i, layer in enumerate(self.layers):
            x = layer(x, b, cos, sin, mask, exact)
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
