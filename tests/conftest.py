"""Shared fixtures: tiny random Llama models, built through transformers so that both sides
of every comparison start from the same weights."""
from __future__ import annotations

import pytest
import torch
import transformers

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
