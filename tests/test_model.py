"""minispark's Transformer against Hugging Face, logit for logit (fp32, max abs diff <= 1e-4).

Every test builds a tiny HF model, copies its weights into minispark through the real loading
path (`args_from_hf_config` + `build_model`), runs minispark on packed batches and compares each
request with HF run on that request alone. Weights use a larger init than HF's default, and norm
weights and biases get noise, so that attention is far from uniform and a swapped or dropped
tensor shows up in the logits.
"""
from __future__ import annotations

import pytest
import torch
from torch import Tensor
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import tiny_hf_config
from minispark import cpu
from minispark.cpu import PackedLinear, attend_exact, can_pack, exact_bias
from minispark.model import KV_BLOCK, Batch, Linear, Transformer, attend, grid_bias, stack_heads
from minispark.planner import round_up
from minispark.weights import args_from_hf_config, build_model

ATOL = 1e-4
N_SLOTS = 4  # cache rows 0..3; row 4 is the scratch row for padding
MAX_SEQ = 96
VOCAB = 128

LLAMA3_ROPE = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}

# name -> (family, HF config overrides). The conftest base: 4 heads, 2 kv heads, tied, 2 layers.
VARIANTS = {
    "gqa_tied": ("llama", {}),
    "mqa": ("llama", {"num_key_value_heads": 1}),
    "mha": ("llama", {"num_key_value_heads": 4}),
    "untied": ("llama", {"tie_word_embeddings": False}),
    "head_dim32": ("llama", {"head_dim": 32}),  # head_dim * n_heads != hidden_size
    "llama3_rope": ("llama", {"rope_scaling": LLAMA3_ROPE}),
    "linear_rope": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    "qkv_bias_qwen2": ("qwen2", {}),  # Qwen2: q/k/v bias, no o_proj bias (Llama's attention_bias adds both)
}
variant_names = pytest.mark.parametrize("variant", list(VARIANTS))


# ---------------------------------------------------------------------------------- helpers


def make_pair(family: str = "llama", seed: int = 0, **overrides):
    """(hf_model, minispark_model, hf_config) in fp32 with identical weights."""
    torch.manual_seed(seed)
    overrides.setdefault("initializer_range", 0.2)
    if family == "llama":
        cfg = tiny_hf_config(**overrides)
        hf = transformers.LlamaForCausalLM(cfg)
    elif family == "qwen2":
        kw = dict(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        )
        cfg = transformers.Qwen2Config(**{**kw, **overrides})
        hf = transformers.Qwen2ForCausalLM(cfg)
    else:
        raise ValueError(family)
    hf.eval()
    with torch.no_grad():  # norms start at 1 and biases at 0: perturb them so their mapping is tested
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    ms = build_model(args_from_hf_config(cfg.to_dict()), hf.state_dict(), torch.float32, "cpu")
    ms.setup_cache(N_SLOTS, MAX_SEQ)
    return hf, ms, cfg


def variant_pair(variant: str, **extra):
    family, overrides = VARIANTS[variant]
    return make_pair(family, **{**overrides, **extra})


def make_batch(chunks, *, n_slots: int = N_SLOTS, pad: int = 0, n_cols: int | None = None,
               ctx_len: int | None = None, perm: list[int] | None = None):
    """A Batch from `(slot, start_pos, tokens)` chunks: one grid row per chunk (slots distinct),
    token j of a chunk in column j. `pad` padding tokens go to scratch slot S and cell R*Q;
    `perm` shuffles the packed order. Returns the batch and, per chunk, the packed indices of
    its tokens in order."""
    R = len(chunks)
    Q = n_cols or max(len(t) for _, _, t in chunks)
    tok, slot, pos, cell = [], [], [], []
    for r, (s, p0, ts) in enumerate(chunks):
        assert len(ts) <= Q
        tok += [int(x) for x in ts]
        slot += [s] * len(ts)
        pos += range(p0, p0 + len(ts))
        cell += range(r * Q, r * Q + len(ts))
    n_real = len(tok)
    tok += [0] * pad
    slot += [n_slots] * pad
    pos += [0] * pad
    cell += [R * Q] * pad
    order = list(range(len(tok))) if perm is None else list(perm)
    assert sorted(order) == list(range(len(tok)))
    where = {old: new for new, old in enumerate(order)}  # packed index of original token i
    spans, i = [], 0
    for _, _, ts in chunks:
        spans.append(torch.tensor([where[k] for k in range(i, i + len(ts))], dtype=torch.long))
        i += len(ts)
    assert i == n_real
    def packed(xs):
        return torch.tensor([xs[k] for k in order], dtype=torch.long)

    b = Batch(
        tokens=packed(tok), slot=packed(slot), pos=packed(pos), cell=packed(cell),
        row_slot=torch.tensor([s for s, _, _ in chunks], dtype=torch.long),
        n_cols=Q, ctx_len=ctx_len or max(p0 + len(ts) for _, p0, ts in chunks),
    )
    return b, spans


@torch.no_grad()
def run(ms: Transformer, b: Batch, **kw):
    return ms(b, **kw)


@torch.no_grad()
def hf_forward(hf, tokens, hidden: bool = False):
    out = hf(torch.as_tensor(tokens, dtype=torch.long)[None], use_cache=False, output_hidden_states=hidden)
    return out if hidden else out.logits[0]


def rand_tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()


def assert_close(got, want, what=""):
    assert got.shape == want.shape, (what, got.shape, want.shape)
    diff = (got - want).abs().max().item()
    assert diff <= ATOL, f"{what}: max abs diff {diff:.3g}"


# ---------------------------------------------------------------------------------- tests


@variant_names
def test_loading_maps_config(variant):
    _, ms, cfg = variant_pair(variant)
    a = ms.args
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    assert (a.n_heads, a.n_kv_heads, a.head_dim) == (cfg.num_attention_heads, cfg.num_key_value_heads, head_dim)
    assert a.tie_embeddings == cfg.tie_word_embeddings
    assert (ms.output.weight is ms.tok_embeddings.weight) == cfg.tie_word_embeddings
    assert a.qkv_bias == (VARIANTS[variant][0] == "qwen2")
    assert (a.rope_scaling or {}).get("rope_type") == (VARIANTS[variant][1].get("rope_scaling") or {}).get("rope_type")


@variant_names
def test_prefill_one_prompt(variant):
    hf, ms, _ = variant_pair(variant)
    prompt = rand_tokens(45, seed=1)  # > 32 positions: past llama3's original context
    # slot 2, padded to a bucket, a wider grid than needed and a larger attention bucket
    b, (idx,) = make_batch([(2, 0, prompt)], pad=3, n_cols=48, ctx_len=64)
    logits, hidden = run(ms, b)
    assert hidden is None and logits.shape == (48, VOCAB)
    assert_close(logits[idx], hf_forward(hf, prompt), "prefill")


@variant_names
def test_decode_step_by_step(variant):
    hf, ms, _ = variant_pair(variant)
    seq = rand_tokens(44, seed=2)
    want = hf_forward(hf, seq)
    n0, slot = 8, 1
    b, (idx,) = make_batch([(slot, 0, seq[:n0])], ctx_len=16)
    assert_close(run(ms, b)[0][idx], want[:n0], "prefill")
    for p in range(n0, len(seq)):
        b, (idx,) = make_batch([(slot, p, seq[p:p + 1])], pad=1, ctx_len=(p // 16 + 1) * 16)
        assert_close(run(ms, b)[0][idx], want[p:p + 1], f"decode at position {p}")


@variant_names
def test_packed_prefill_then_packed_verify(variant):
    hf, ms, _ = variant_pair(variant)
    lens = {2: 7, 0: 30, 3: 1, 1: 36}  # slot -> prompt length; grid rows not in slot order
    extra = {2: 4, 0: 1, 3: 3, 1: 2}  # tokens per slot in the verification step (1..4)
    more = {3: 4, 2: 1, 0: 2, 1: 3}  # later steps: slots 3 and 2 first, then 0 and 1 after sitting idle
    seqs = {s: rand_tokens(lens[s] + extra[s] + more[s], seed=10 + s) for s in lens}
    want = {s: hf_forward(hf, seqs[s]) for s in seqs}

    # 1) all prompts packed into one forward, padded, tokens in a shuffled packed order
    chunks = [(s, 0, seqs[s][:n]) for s, n in lens.items()]
    T = sum(lens.values()) + 5
    perm = torch.randperm(T, generator=torch.Generator().manual_seed(0)).tolist()
    b, spans = make_batch(chunks, pad=5, perm=perm, ctx_len=48)
    logits, _ = run(ms, b)
    for (s, _, ts), idx in zip(chunks, spans):
        assert_close(logits[idx], want[s][: len(ts)], f"packed prefill, slot {s}")

    # 2) verification-like step: each slot 1..4 tokens at its own position, grid rows reordered
    chunks = [(s, lens[s], seqs[s][lens[s]: lens[s] + extra[s]]) for s in (1, 3, 2, 0)]
    b, spans = make_batch(chunks, pad=2, ctx_len=48)
    logits, _ = run(ms, b)
    for (s, p0, ts), idx in zip(chunks, spans):
        assert_close(logits[idx], want[s][p0: p0 + len(ts)], f"verify, slot {s} at {p0}")

    # 3) a subset of slots (3 and 2) goes on; 4) then the idle ones (0 and 1) resume
    for step in ((3, 2), (0, 1)):
        chunks = [(s, lens[s] + extra[s], seqs[s][lens[s] + extra[s]:]) for s in step]
        b, spans = make_batch(chunks, ctx_len=48)
        logits, _ = run(ms, b)
        for (s, p0, ts), idx in zip(chunks, spans):
            assert_close(logits[idx], want[s][p0: p0 + len(ts)], f"slots {step}, slot {s} at {p0}")


@pytest.mark.parametrize("layers", [(0,), (1, 2), (0, 1, 2), (2, 0), (1, 1)])  # order asked for, repeats kept
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_hidden_layers_match_hf_hidden_states(family, layers):
    hf, ms, _ = make_pair(family, num_hidden_layers=4)
    seqs = {1: rand_tokens(11, seed=3), 3: rand_tokens(5, seed=4)}
    chunks = [(s, 0, ts) for s, ts in seqs.items()]
    b, spans = make_batch(chunks, pad=2)
    logits, hidden = run(ms, b, hidden_layers=layers)
    assert hidden.shape == (b.tokens.shape[0], len(layers), 64)
    for (s, _, ts), idx in zip(chunks, spans):
        out = hf_forward(hf, ts, hidden=True)
        assert len(out.hidden_states) == 5  # embeddings, layers 0..2, then layer 3 after the final norm
        for k, layer in enumerate(layers):
            # HF hidden_states[i + 1] is the output of layer i
            assert_close(hidden[idx, k], out.hidden_states[layer + 1][0], f"slot {s}, layer {layer}")
        assert_close(logits[idx], out.logits[0], f"slot {s} logits")


@pytest.mark.parametrize("layers", [(4,), (0, -1)])
def test_hidden_layers_out_of_range_raise(layers):
    _, ms, _ = make_pair(num_hidden_layers=4)
    b, _ = make_batch([(0, 0, rand_tokens(3, seed=0))])
    with pytest.raises(ValueError, match="hidden_layers"):
        run(ms, b, hidden_layers=layers)


def test_logits_at_selects_rows():
    hf, ms, _ = make_pair()
    seqs = {0: rand_tokens(9, seed=5), 2: rand_tokens(4, seed=6), 1: rand_tokens(13, seed=7)}
    chunks = [(s, 0, ts) for s, ts in seqs.items()]
    b, spans = make_batch(chunks, pad=3)
    full, _ = run(ms, b)
    for (s, _, ts), idx in zip(chunks, spans):
        assert_close(full[idx], hf_forward(hf, ts), f"slot {s}")

    last = torch.stack([idx[-1] for idx in spans])  # what a sampler asks for
    rows = torch.tensor([spans[2][5], spans[0][0], spans[2][5], spans[1][3]])  # any order, repeats
    for at in (last, rows):
        got, hidden = run(ms, b, logits_at=at, hidden_layers=(0,))
        assert got.shape == (len(at), VOCAB)
        assert_close(got, full[at], "logits_at")
        assert hidden.shape == (b.tokens.shape[0], 1, 64)  # hidden states stay per packed token


@pytest.mark.parametrize("garbage", ["random_fill", "longer_previous_request"])
def test_stale_cache_rows_past_length_are_ignored(garbage):
    hf, ms, _ = make_pair()
    slot, prompt, tail = 1, rand_tokens(10, seed=8), rand_tokens(3, seed=9)
    if garbage == "random_fill":
        g = torch.Generator().manual_seed(0)
        for layer in ms.layers:
            for c in (layer.attention.k_cache, layer.attention.v_cache):
                c.copy_(1e3 * torch.randn(c.shape, generator=g))
    else:  # the slot held a longer, different request before
        b, _ = make_batch([(slot, 0, rand_tokens(MAX_SEQ, seed=10))])
        run(ms, b)
    want = hf_forward(hf, prompt + tail)
    # ctx_len covers the whole cache, so every stale row is inside the attention window
    b, (idx,) = make_batch([(slot, 0, prompt)], pad=2, ctx_len=MAX_SEQ)
    assert_close(run(ms, b)[0][idx], want[:10], "prefill over stale rows")
    b, (idx,) = make_batch([(slot, 10, tail)], pad=1, n_cols=4, ctx_len=MAX_SEQ)
    assert_close(run(ms, b)[0][idx], want[10:], "verify over stale rows")


@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_packed_forward_matches_hf_per_request(data):
    n_heads = data.draw(st.sampled_from([1, 2, 4, 8]), label="n_heads")
    n_kv = data.draw(st.sampled_from([d for d in (1, 2, 4, 8) if n_heads % d == 0]), label="n_kv_heads")
    n_layers = data.draw(st.integers(1, 3), label="n_layers")
    tied = data.draw(st.booleans(), label="tied")
    hf, ms, _ = make_pair(
        seed=data.draw(st.integers(0, 2**16), label="seed"), num_attention_heads=n_heads,
        num_key_value_heads=n_kv, num_hidden_layers=n_layers, tie_word_embeddings=tied,
    )
    slots = data.draw(st.lists(st.integers(0, N_SLOTS - 1), min_size=1, max_size=N_SLOTS, unique=True), label="slots")
    prefix = {s: data.draw(st.integers(0, 20), label=f"prefix[{s}]") for s in slots}
    chunk = {s: data.draw(st.integers(1, 6), label=f"chunk[{s}]") for s in slots}
    seqs = {s: rand_tokens(prefix[s] + chunk[s], seed=100 * s + prefix[s]) for s in slots}
    ctx = 32

    # first forward: the prefixes (slots with an empty prefix sit it out), packed
    first = [(s, 0, seqs[s][: prefix[s]]) for s in slots if prefix[s]]
    if first:
        b, _ = make_batch(first, pad=data.draw(st.integers(0, 3), label="pad0"), ctx_len=ctx)
        run(ms, b)
    # second forward: each slot's next chunk at its own position, in a random packed order
    chunks = [(s, prefix[s], seqs[s][prefix[s]:]) for s in slots]
    pad = data.draw(st.integers(0, 3), label="pad")
    T = sum(chunk.values()) + pad
    perm = data.draw(st.permutations(range(T)), label="perm")
    b, spans = make_batch(chunks, pad=pad, perm=perm, n_cols=max(chunk.values()) + data.draw(st.integers(0, 2)), ctx_len=ctx)
    logits, _ = run(ms, b)
    for (s, p0, ts), idx in zip(chunks, spans):
        assert_close(logits[idx], hf_forward(hf, seqs[s])[p0:], f"slot {s} at {p0}")


def test_llama_output_projection_bias_is_refused():
    """HF Llama's attention_bias=True also puts a bias on o_proj, which minispark's wo lacks:
    loading must say so rather than drop it (qkv bias alone is tested through Qwen2)."""
    with pytest.raises(ValueError, match="o_proj.bias"):
        make_pair(attention_bias=True)


@pytest.mark.parametrize("stack", [True, None])  # None: the path this CPU takes
@pytest.mark.parametrize("Q", [1, 2, 5, 9, 10])
@pytest.mark.parametrize("heads", [(6, 2), (4, 4)])
def test_attention_over_a_grid_equals_grouped_query_attention(Q, heads, stack):
    """The path that stacks each key head's query heads along the query axis computes the
    same attention as the grouped-query kernel, mask and head order included, at every width
    (which path runs where depends on the CPU), from the bool mask or from the additive one a
    forward builds once for its layers."""
    torch.manual_seed(Q)
    (H, Hkv), R, C, D = heads, 3, 11, 8
    q, k, v = torch.randn(R, Q, H, D), torch.randn(R, Hkv, C, D), torch.randn(R, Hkv, C, D)
    mask = torch.rand(R, 1, Q, C) > 0.4
    mask[..., 0] = True
    want = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask,
                                                            enable_gqa=H != Hkv).transpose(1, 2)
    torch.testing.assert_close(attend(q, k, v, mask, stack), want)
    stacked = stack_heads(Q, H // Hkv, q.device) if stack is None else stack
    bias = grid_bias(mask, H // Hkv, q.dtype, stack)
    assert bias.shape[2] == (Q * H // Hkv if stacked else Q)  # laid out as attend reads it
    torch.testing.assert_close(attend(q, k, v, bias, stack), want)


@pytest.mark.parametrize("heads", [(6, 2), (4, 4)])
def test_exact_attention_gives_a_query_the_same_bits_in_any_company(heads, monkeypatch):
    """attend_exact: each query of a grid gets the same bits as when it is attended alone (one
    column of one row, over the shortest prefix holding its keys), whatever else shares the
    call: other columns, other rows, a longer prefix, a prefill cut into pieces; it is
    attention (SDPA, fp32, within rounding); and a bf16 cache, widened block by block through a
    scratch holding stale values, gives the bits of its fp32 copy."""
    torch.manual_seed(0)
    (H, Hkv), R, Q, D, L = heads, 3, 9, 16, 3 * KV_BLOCK
    G = H // Hkv
    q = torch.randn(R, Q, H, D)
    k, v = torch.randn(R, Hkv, L, D), torch.randn(R, Hkv, L, D)
    first = torch.tensor([5, KV_BLOCK - 4, 2 * KV_BLOCK + 3])  # row r's first column's position

    def grid(rows: list[int], cols: list[int], C: int) -> tuple[Tensor, Tensor]:
        qpos = first[rows, None] + torch.tensor(cols)  # [r, c]
        mask = (torch.arange(C) <= qpos[..., None])[:, None]  # [r, 1, c, C]
        return attend_exact(q[rows][:, cols], k[rows, :, :C], v[rows, :, :C], exact_bias(mask, G)), mask

    full, mask = grid([0, 1, 2], list(range(Q)), L)
    for r in range(R):
        for j in range(Q):
            alone, _ = grid([r], [j], round_up(int(first[r]) + j + 1, KV_BLOCK))  # the shortest prefix
            assert torch.equal(alone[0, 0], full[r, j]), (r, j)
    monkeypatch.setattr(cpu, "SCORES_MAX", 1)  # pieces of MIN_ROWS query rows
    assert torch.equal(grid([0, 1, 2], list(range(Q)), L)[0], full)
    want = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask,
                                                            enable_gqa=G > 1).transpose(1, 2)
    torch.testing.assert_close(full, want)
    k16, v16, bias = k.bfloat16(), v.bfloat16(), exact_bias(mask, G)
    wide = torch.full((R, Hkv, KV_BLOCK, D), float("nan"))
    want = attend_exact(q, k16.float(), v16.float(), bias)
    assert torch.equal(attend_exact(q, k16, v16, bias, wide), want)
    assert torch.equal(attend_exact(q, k16[:, :, : L - 7], v16[:, :, : L - 7], bias[..., : L - 7], wide),
                       attend_exact(q, k16[:, :, : L - 7].float(), v16[:, :, : L - 7].float(), bias[..., : L - 7]))


@pytest.mark.parametrize("variant", ["gqa_tied", "qkv_bias_qwen2"])
def test_packed_bf16_weights_give_the_plain_product_and_follow_changes(variant):
    """On a CPU that computes bf16 natively, loading packs every Linear (the tied LM head too);
    the packed forward equals the plain one, and a weight changed in place afterwards (an
    optimiser step, load_state_dict) is what the next forward uses."""
    hf, _, cfg = variant_pair(variant)
    ms = build_model(args_from_hf_config(cfg.to_dict()), hf.state_dict(), torch.bfloat16, "cpu")
    ms.setup_cache(N_SLOTS, MAX_SEQ)
    linears = [m for m in ms.modules() if isinstance(m, Linear)]
    assert len(linears) == 5 * len(ms.layers) + 1
    assert all(isinstance(m, PackedLinear) == can_pack(m.weight) for m in linears)
    packed = [m for m in linears if isinstance(m, PackedLinear)]
    assert all(m.packed is not None for m in packed)
    b, (idx,) = make_batch([(0, 0, rand_tokens(20, seed=3))], pad=2, ctx_len=32)

    def plain():  # the same forward with every copy set aside
        saved = [m.packed for m in packed]
        for m in packed:
            m.packed = None
        try:
            return run(ms, b)[0]
        finally:
            for m, p in zip(packed, saved):
                m.packed = p

    want = plain()
    assert torch.equal(run(ms, b)[0], want)
    with torch.no_grad():
        ms.layers[1].feed_forward.w2.weight.mul_(-2.0)
        ms.output.weight[:, :8].zero_()  # the embedding it is tied to changes too
    changed = plain()
    assert (changed - want).abs().max() > 0.1
    assert torch.equal(run(ms, b)[0], changed)
    x = torch.randn(3, ms.args.dim, dtype=torch.bfloat16, requires_grad=True)
    assert ms.layers[0].feed_forward.w1(x).requires_grad  # training takes the plain, differentiable path
    ms.float()  # a dtype oneDNN's bf16 path cannot take: the copies go, the plain product runs
    ms.setup_cache(N_SLOTS, MAX_SEQ)
    assert torch.equal(run(ms, b)[0], plain()) and all(m.packed is None for m in packed)
