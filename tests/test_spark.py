"""The Spark drafter's pieces on a tiny model: the block mask, the context it may see, the
Markov head's left-to-right choice, and its context cache written through the engine."""
from __future__ import annotations

import torch

from conftest import bigram_drafter, tiny_pair
from minispark.drafters import block_mask


def test_block_mask_sees_the_past_context_and_its_own_block_both_ways():
    ctx = torch.tensor([[[1, 1, 0, 0], [1, 1, 1, 0]]], dtype=torch.bool)  # anchors at 2 and 3
    m = block_mask(ctx, g=3)[0, 0]  # [6, 4 + 6]
    assert m.shape == (6, 10)
    assert m[:3, :4].tolist() == [[True, True, False, False]] * 3
    assert m[3:, :4].tolist() == [[True, True, True, False]] * 3
    assert m[:3, 4:7].all() and m[3:, 7:].all()  # bidirectional inside a block, the anchor too
    assert not m[:3, 7:].any() and not m[3:, 4:7].any()  # blocks never see each other


def drafter_on_context(seed: int = 0):
    _, net = tiny_pair(seed, num_hidden_layers=2, vocab_size=32, initializer_range=0.2)
    d = bigram_drafter(net, block=4).attach(net)
    d.setup_cache(2, 64, torch.float32)
    torch.manual_seed(seed)
    for p in d.parameters():  # random, so that every input matters
        p.data.normal_(0, 0.3)
    feats = torch.randn(20, 2, net.args.dim)
    d.write_context(feats, torch.zeros(20, dtype=torch.long), torch.arange(20))
    return d, feats


def test_drafts_read_only_the_context_before_the_anchor():
    d, feats = drafter_on_context()
    anchor, lens = torch.tensor([5]), torch.tensor([12])
    tokens, conf, _, _ = d.draft_block(anchor, lens, ctx=20)
    # Context at and after the anchor's position (a rejected draft's, say) changes nothing.
    later = feats.clone()
    later[12:] = torch.randn_like(later[12:])
    d.write_context(later[12:], torch.zeros(8, dtype=torch.long), torch.arange(12, 20))
    tokens2, conf2, _, _ = d.draft_block(anchor, lens, ctx=20)
    assert torch.equal(tokens, tokens2) and torch.allclose(conf, conf2)
    # Context before it does.
    d.write_context(torch.randn(12, 2, feats.shape[-1]), torch.zeros(12, dtype=torch.long), torch.arange(12))
    _, conf3, _, _ = d.draft_block(anchor, lens, ctx=20)
    assert not torch.allclose(conf, conf3)


def test_the_markov_head_chooses_what_teacher_forcing_computes_on_its_own_tokens():
    d, _ = drafter_on_context(1)
    anchor, lens = torch.tensor([3, 7]), torch.tensor([9, 15])
    kpos = torch.arange(20)
    ctx_kv = [(l.attention.k_cache[:2, :20], l.attention.v_cache[:2, :20]) for l in d.layers]
    h = d.block_states(anchor[:, None], lens[:, None], ctx_kv, (kpos[None, :] < lens[:, None])[:, None])
    tokens, conf_logit = d.chain(h, anchor, None, None)
    prev = torch.cat([anchor[:, None], tokens[:, :-1]], dim=1)  # each slot after the one drafted before
    logits, conf = d.logits(h, prev)
    assert torch.equal(d.d2t[logits.argmax(-1)], tokens)
    torch.testing.assert_close(conf, conf_logit)
