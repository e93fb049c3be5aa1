"""Shared fixtures: tiny random Llama models, built through transformers so that both sides
of every comparison start from the same weights."""
from __future__ import annotations

import pytest
import torch
import transformers

from minispark.price import CostModel
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
    from minispark.engine import LLM

    _, ms = tiny_pair(seed, **overrides)
    if spec in ("spark", "hybrid") and drafter is None:
        drafter = bigram_drafter(ms, seed=seed)
    return LLM.from_model(ms, ByteTokenizer(eos), spec=spec, max_batch_size=max_batch_size,
                          max_seq_len=max_seq_len, cost=cost, drafter=drafter)
