"""Checkpoints: Hugging Face safetensors folders, GGUF files, and the bundled demo model.

Every format is read into Hugging Face tensor names first (`model.layers.0.self_attn.q_proj.weight`
...), then `from_hf` fuses and renames them into minispark's short names. One mapping, one place.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor

from .model import ModelArgs, Transformer, rope_frequencies


def args_from_hf_config(cfg: dict) -> ModelArgs:
    """ModelArgs from a Hugging Face `config.json` of a Llama-family model."""
    try:
        n_heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        # transformers 5 writes `rope_parameters` (theta included); older configs `rope_scaling`.
        rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
        return ModelArgs(
            vocab_size=cfg["vocab_size"],
            dim=cfg["hidden_size"],
            n_layers=cfg["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
            intermediate_size=cfg["intermediate_size"],
            norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=cfg.get("rope_theta") or rope.get("rope_theta", 10000.0),
            rope_scaling=rope if rope.get("rope_type", rope.get("type", "default")) != "default" else None,
            max_position_embeddings=cfg.get("max_position_embeddings", 8192),
            tie_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=cfg.get("attention_bias", cfg.get("model_type") == "qwen2"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
        )
    except KeyError as e:
        raise ValueError(f"config.json lacks {e.args[0]!r}; is this a Llama-family checkpoint?") from None


def from_hf(sd: dict[str, Tensor], args: ModelArgs) -> dict[str, Tensor]:
    """Rename (and fuse q/k/v of) a Hugging Face Llama state dict into minispark's names."""
    def take(name: str) -> Tensor:
        if name not in sd:
            raise ValueError(f"checkpoint is missing tensor {name!r}")
        return sd[name]

    out = {"tok_embeddings.weight": take("model.embed_tokens.weight"), "norm.weight": take("model.norm.weight")}
    if not args.tie_embeddings:
        out["output.weight"] = take("lm_head.weight")
    for i in range(args.n_layers):
        hf, ms = f"model.layers.{i}.", f"layers.{i}."
        qkv = ("q_proj", "k_proj", "v_proj")
        out[ms + "attention.wqkv.weight"] = torch.cat([take(f"{hf}self_attn.{p}.weight") for p in qkv])
        if args.qkv_bias:
            out[ms + "attention.wqkv.bias"] = torch.cat([take(f"{hf}self_attn.{p}.bias") for p in qkv])
        out[ms + "attention.wo.weight"] = take(f"{hf}self_attn.o_proj.weight")
        out[ms + "feed_forward.w1.weight"] = take(f"{hf}mlp.gate_proj.weight")
        out[ms + "feed_forward.w3.weight"] = take(f"{hf}mlp.up_proj.weight")
        out[ms + "feed_forward.w2.weight"] = take(f"{hf}mlp.down_proj.weight")
        out[ms + "attention_norm.weight"] = take(f"{hf}input_layernorm.weight")
        out[ms + "ffn_norm.weight"] = take(f"{hf}post_attention_layernorm.weight")
    return out


def build_model(args: ModelArgs, hf_sd: dict[str, Tensor], dtype: torch.dtype, device: str | torch.device) -> Transformer:
    """A Transformer with the given weights, shapes checked tensor by tensor."""
    with torch.device("meta"):
        model = Transformer(args)
    sd = from_hf(hf_sd, args)
    expected = model.state_dict()
    for name, t in sd.items():
        if tuple(t.shape) != tuple(expected[name].shape):
            raise ValueError(f"tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(expected[name].shape)}")
    sd = {k: v.to(device=device, dtype=dtype) for k, v in sd.items()}
    model.load_state_dict(sd, strict=False, assign=True)
    if args.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    model.inv_freq = rope_frequencies(args).to(device)  # meta buffers carry no data
    return model.eval()
