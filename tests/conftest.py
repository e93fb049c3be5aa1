"""Shared fixtures: tiny random Llama models, built through transformers so that both sides
of every comparison start from the same weights."""
from __future__ import annotations

import random

import pytest
import torch
import transformers

from minispark.planner import CostModel
from minispark.drafters import Drafter
from minispark.model import Batch
from minispark.weights import args_from_hf_config, build_model


def tiny_hf_config(**overrides) -> transformers.LlamaConfig:
    kw = dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    )
    kw.update(overrides)
    return transformers.LlamaConfig(**kw)


def tiny_pair(seed: int = 0, **overrides):
    """(hf_model, minispark_model) in fp32 with identical random weights."""
    torch.manual_seed(seed)
    cfg = tiny_hf_config(**overrides)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    ms = build_model(args_from_hf_config(cfg.to_dict()), hf.state_dict(), torch.float32, "cpu")
    return hf, ms


@pytest.fixture
def tiny_models():
    return tiny_pair()


class ByteTokenizer:
    """A stand-in tokenizer for tiny random models: token id i < 256 is byte i, and ids past
    255 decode to nothing; `eos` (when given) is the only stop token."""

    def __init__(self, eos: int | None = None):
        self.stop_ids = [] if eos is None else [eos]
        self.special_ids = set(self.stop_ids)
        self.eos_id = eos

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode_bytes(self, ids: list[int]) -> bytes:
        return bytes(i for i in ids if i < 256)

    def decode(self, ids: list[int]) -> str:
        return self.decode_bytes(ids).decode(errors="replace")

    def encode_chat(self, messages: list[dict]) -> list[int]:
        return self.encode("".join(f"{m['role']}: {m['content']}\n" for m in messages))


# A fixed cost table (verification nearly free, as on a CPU) keeps budgets deterministic.
FLAT_COST = CostModel([1, 1025], [1.0, 1.5])


def bigram_drafter(net, block: int = 4, seed: int = 0):
    """A tiny Spark drafter whose Markov head copies the target's one-token predictions, so
    that on a tiny random model (which soon repeats itself) many of its drafts are accepted
    and many are not: tests then exercise both."""
    from minispark.drafters import SparkArgs, SparkDrafter

    a = net.args
    V = a.vocab_size
    args = SparkArgs.for_target(a, target_layers=(0, a.n_layers - 1), block=block, rank=V, draft_vocab=V)
    torch.manual_seed(seed)
    d = SparkDrafter(args).to(net.tok_embeddings.weight.dtype)
    with torch.no_grad():
        x = net.norm(net.tok_embeddings.weight)  # a crude one-token guess of the next token
        bigram = net.output(x).argmax(-1)  # [V]
        d.markov_in.weight.zero_()
        d.markov_in.weight[:V] = torch.eye(V)
        d.markov_out.weight.zero_()
        d.markov_out.weight[bigram, torch.arange(V)] = 6.0
    return d


def tiny_llm(spec: str = "off", seed: int = 0, eos: int | None = None, max_batch_size: int = 4,
             max_seq_len: int = 256, cost: CostModel = FLAT_COST, drafter=None, **overrides):
    """An LLM on a tiny random model; spec "three" plugs a third drafter (`Bigram`) into the hybrid."""
    from minispark.api import LLM
    from minispark.drafters import NgramDrafter

    _, ms = tiny_pair(seed, **overrides)
    if spec in ("spark", "hybrid", "three") and drafter is None:
        drafter = bigram_drafter(ms, seed=seed)
    drafters = [NgramDrafter(), drafter, Bigram(p=0.3)] if spec == "three" else None
    return LLM.from_model(ms, ByteTokenizer(eos), spec=None if drafters else spec, drafters=drafters,
                          max_batch_size=max_batch_size, max_seq_len=max_seq_len, cost=cost, drafter=drafter)


class Bigram(Drafter):
    """A model-free drafter through the plug-in: from the chain's last token, the token that most
    recently followed it in the history, then the one that followed that, and so on."""

    name, k = "bigram", 4

    def __init__(self, p: float = 0.5):
        super().__init__()
        self.p = p  # the chance it claims for each token

    def propose(self, tokens: torch.Tensor, n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        R, C = tokens.shape
        pos = torch.arange(C - 1, device=tokens.device)[None, :]
        last = tokens.gather(1, (n - 1).clamp(min=0)[:, None])[:, 0]  # [R]: the token the chain continues
        found = n > 0  # [R]: the chain goes on
        draft, conf = [], []
        for _ in range(self.k):
            before = (tokens[:, :-1] == last[:, None]) & (pos < n[:, None] - 1)  # [R, C-1]: it occurred, and a token followed
            at = torch.where(before, pos, -1).amax(-1)  # [R]: most recently, or -1: never
            found &= at >= 0
            last = tokens.gather(1, (at + 1)[:, None])[:, 0]
            draft.append(last)
            conf.append(torch.where(found, self.p, 0.0))
        return torch.stack(draft, 1), torch.stack(conf, 1)


def spec_drafters(spec: str, net, block: int = 4, seed: int = 0, **ngram) -> list:
    """The drafters of a spec shortcut, a bigram Spark drafter standing in for a trained one."""
    from minispark.drafters import NgramDrafter

    ng = [NgramDrafter(**ngram)] if spec in ("ngram", "hybrid") else []
    return ng + ([bigram_drafter(net, block, seed)] if spec in ("spark", "hybrid") else [])


def reference_greedy(llm, prompt: list[int], n: int, eos: int | None = None) -> list[int]:
    """Greedy decoding by full recomputation: one prefill forward per generated token."""
    model, out, seq = llm.engine.model, [], list(prompt)
    for _ in range(n):
        T = len(seq)
        b = Batch(torch.tensor(seq), torch.zeros(T, dtype=torch.long), torch.arange(T), torch.arange(T),
                  torch.tensor([0]), T, T)
        with torch.no_grad():
            logits, _ = model(b, logits_at=torch.tensor([T - 1]))
        tok = int(logits.argmax())
        out.append(tok)
        seq.append(tok)
        if tok == eos:
            break
    return out


def random_prompts(rng: random.Random, n: int, vocab: int) -> list[list[int]]:
    """Half random, half built from repeated fragments, so the n-gram drafter finds matches."""
    prompts = []
    for i in range(n):
        if i % 2:
            frag = [rng.randrange(3, vocab) for _ in range(rng.randrange(2, 6))]
            p = (frag * 8)[: rng.randrange(2, 30)]
        else:
            p = [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 30))]
        prompts.append(p)
    return prompts
