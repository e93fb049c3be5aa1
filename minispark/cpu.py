"""CPU kernels, applied to a built model (`optimize`) from beside model.py, as gpt-fast keeps
quantize.py: exact attention, the grouped-query layout, and linear weights laid out for skinny
products. Importing this module sets the CPU's rule in `model.STACK_RULES`.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from .model import KV_BLOCK, SDPA, STACK_RULES, Linear, Transformer, grid_bias

MIN_ROWS = 4  # the fewest query rows attend_exact multiplies at once
SCORES_MAX = 1 << 24  # score elements attend_exact holds at once (64 MB): a long prefill goes in pieces


def cpu_has(feature: str) -> bool:
    """Whether this CPU has an instruction set extension, as PyTorch's kernels see it (False where
    this torch build cannot tell)."""
    return getattr(torch.cpu, f"_is_{feature}_supported", lambda: False)()


CPU_HAS_AMX = cpu_has("amx_tile")  # AMX tiles: the grouped-query kernel wins at some widths (`stacks`)
CPU_HAS_BF16 = CPU_HAS_AMX or cpu_has("avx512_bf16")  # computes bf16 natively (`resolve_dtype`)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """A torch dtype from a name; "auto" is bfloat16 where the hardware computes in it (CUDA,
    CPUs with AVX512-BF16 or AMX) and float32 elsewhere: a CPU without native bf16 converts
    every matmul operand, and a demo-model forward of 8 tokens takes 1.5x as long as in fp32."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" or CPU_HAS_BF16 else torch.float32
    torch_dtype = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if not isinstance(torch_dtype, torch.dtype) or not torch_dtype.is_floating_point:
        raise ValueError(f"dtype must be 'auto' or a floating-point dtype ('bfloat16', 'float16', 'float32'), "
                         f"got {dtype!r}")
    return torch_dtype


def stacks(Q: int) -> bool:
    """Whether `attend` stacks query heads for a grid of Q columns on this CPU, as measured on
    the demo model in bf16. With AMX the grouped-query kernel wins at 1 column and past 9;
    without AMX stacking wins at every width, by 4-7x at 1 column."""
    return 2 <= Q <= 9 or not CPU_HAS_AMX


STACK_RULES["cpu"] = stacks


def optimize(module: nn.Module) -> nn.Module:
    """Apply the CPU's kernels, in place, to a model or drafter on the CPU (values and shapes
    unchanged): a Transformer attends by `attend_exact`, and each Linear weight is laid out for
    skinny products (a few tokens per slot, what speculative decoding runs on): in bf16 where
    oneDNN computes it natively, a `PackedLinear` (the LM head too, tied or not); in fp32,
    column-major, which MKL's GEMM reads about 1.6x faster at a few tokens, unless tied to an
    embedding, whose lookups read rows."""
    if isinstance(module, Transformer) and module.tok_embeddings.weight.device.type == "cpu":
        module.kernel = ExactAttention()
    tied = {id(m.weight) for m in module.modules() if isinstance(m, nn.Embedding)}
    for parent in list(module.modules()):
        for name, m in list(parent.named_children()):
            if not isinstance(m, nn.Linear) or m.weight.device.type != "cpu":
                continue
            if type(m) is Linear and can_pack(m.weight):
                setattr(parent, name, PackedLinear(m))
            elif m.weight.dtype == torch.float32 and id(m.weight) not in tied:
                m.weight.data = m.weight.data.t().contiguous().t()
    return module


class ExactAttention(SDPA):
    """`attend_exact` as a model's kernel, with the fp32 scratch `wide` [S + 1, Hkv, KV_BLOCK, D]
    that its layers share where the cache is not fp32."""

    def __init__(self) -> None:
        self.wide: Tensor | None = None

    def setup_cache(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        self.wide = None if dtype == torch.float32 else torch.zeros(shape[:2] + (KV_BLOCK, shape[3]), device=device)

    def bias(self, mask: Tensor, G: int, dtype: torch.dtype) -> Tensor:
        return exact_bias(mask, G)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, bias: Tensor) -> Tensor:
        return attend_exact(q, k, v, bias, self.wide)


def exact_bias(mask: Tensor, G: int) -> Tensor:
    """The `grid_bias` `attend_exact` reads: fp32, stacked, rows (g, q), and at least MIN_ROWS
    rows (padding rows see every key)."""
    bias = grid_bias(mask, G, torch.float32, stack=True)  # [R, 1, G * Q, C]
    return F.pad(bias, (0, 0, 0, max(0, MIN_ROWS - bias.shape[2])))


def attend_exact(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, wide: Tensor | None = None) -> Tensor:
    """Attention of a query grid q [R, Q, H, D] over keys and values [R, Hkv, C, D] (the cache,
    in the model's dtype) under `exact_bias` [R, 1, max(G * Q, MIN_ROWS), C]; returns
    [R, Q, H, D] in q's dtype. `wide`: fp32 scratch of at least [R, Hkv, KV_BLOCK, D] (`widen`).

    Each query's result is the same bits whatever else the call holds (other columns, other
    rows, a longer prefix: a multiple of KV_BLOCK, or the whole cache). With steps of two tokens
    or more (`Engine.pack`) and bf16 weights (MKL's fp32 products round one way for 1 to 3 rows,
    another for more), a token's logits are then the same in every step that computes them, so
    speculative decoding writes exactly plain decoding's tokens, where one last bit can turn a
    close argmax. Each rule keeps a row's sums in one order:
    - scores, softmax and the weighted sum in fp32, from bf16 values held exactly in fp32;
    - at least MIN_ROWS query rows per product: MKL multiplies 1 to 3 rows by another kernel;
    - values summed block by block of KV_BLOCK keys, in order: keys past a query's reach then
      add exact zeros, where one product over all C keys sums in an order that depends on C.
    A prompt's own forward may take SDPA (`Engine.prefill`): nothing else computes its tokens."""
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
    block of KV_BLOCK keys: every score and partial sum is a product of one shape, whatever C is."""
    blocks = range(0, k.shape[2], KV_BLOCK)
    scores = torch.cat([q @ widen(k[:, :, c:c + KV_BLOCK], wide).transpose(-1, -2) for c in blocks], dim=-1)
    p = torch.softmax(scores.add_(bias), dim=-1)  # [R, Hkv, n, C]
    out = p[..., :KV_BLOCK] @ widen(v[:, :, :KV_BLOCK], wide)
    for c in blocks[1:]:
        out += p[..., c:c + KV_BLOCK] @ widen(v[:, :, c:c + KV_BLOCK], wide)
    return out  # [R, Hkv, n, D]


def widen(x: Tensor, wide: Tensor | None) -> Tensor:
    """A block of keys or values x [R, Hkv, n <= KV_BLOCK, D] in fp32 (a bf16 cache streams half
    the bytes), copied into the reused scratch `wide`: a fresh multi-MB `x.float()` per block
    makes a step twice as slow."""
    if x.dtype == torch.float32:
        return x
    if wide is None:
        return x.float()
    return wide[: x.shape[0], :, : x.shape[2]].copy_(x)


class PackedLinear(Linear):
    """A Linear multiplying by a copy of its weight in oneDNN's blocked layout, made once rather
    than per call: a bf16 weight streams ~1.5x faster through a skinny product (bit for bit the
    same where measured), for twice the memory. With gradients on the plain product runs; a
    weight changed since (an optimiser step, `load_state_dict`, `.float()`) is packed again, or
    multiplied plainly where it no longer can be."""

    def __init__(self, linear: Linear):
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        self.weight, self.bias = linear.weight, linear.bias  # shared, not copied: ties stay tied
        self.train(linear.training)
        self.packed: Tensor | None = None
        self.packed_from: tuple[int, int] | None = None  # the weight's storage and version when packed
        self.pack()

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
