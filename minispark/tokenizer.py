"""Tokeniser: a tiktoken Encoding built from a checkpoint's byte-level BPE, plus its chat template.

Only byte-level BPE vocabularies (GPT-2, Llama-3, Qwen2, SmolLM, ...) are supported. tiktoken
merges the adjacent pair whose concatenation has the lowest rank, so the token ids serve as ranks
when, as in these vocabularies, every merged token's id grows with its merge's priority.
"""
from __future__ import annotations

import base64
import json
import unicodedata
from datetime import datetime
from functools import cached_property
from pathlib import Path

import gguf
import jinja2
import jinja2.ext
import regex
import tiktoken
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Pre-tokeniser split patterns, keyed by llama.cpp's `tokenizer.ggml.pre` names.
GPT2_PAT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
LLAMA3_PAT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
QWEN2_PAT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
# SmolLM2's (and StarCoder's) tokenizer.json splits off every digit before the GPT-2 regex runs
# on the text between, so a whitespace run before a digit stays whole ("\n\n1." is "\n\n", "1",
# "."), as llama.cpp's "smollm" splits. transformers reads a GGUF labelled "smollm" with GPT2_PAT,
# which differs on such runs: from_gguf(pre="gpt2") matches it.
SMOLLM_PAT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?![^\s\p{N}])|\s+"""
PATTERNS = {
    "gpt2": GPT2_PAT, "mpt": GPT2_PAT, "olmo": GPT2_PAT,
    "llama-bpe": LLAMA3_PAT, "llama3": LLAMA3_PAT, "llama-v3": LLAMA3_PAT, "smaug-bpe": LLAMA3_PAT,
    "qwen2": QWEN2_PAT, "deepseek-r1-qwen": QWEN2_PAT,
    "smollm": SMOLLM_PAT, "starcoder": SMOLLM_PAT, "refact": SMOLLM_PAT,
}

# Meta's original Llama-3.1 `tokenizer.model` folders carry no list of special tokens.
LLAMA3_SPECIALS = [
    "<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>",
    "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>",
] + [f"<|reserved_special_token_{i}|>" for i in range(2, 247)]
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
# Chat models end a turn with one of these rather than (or as well as) their eos token.
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from bytes to printable characters, in which byte-level vocabularies are spelled."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    unprintable = [b for b in range(256) if b not in bs]  # spelled by the characters after 255, in order
    cs = bs + [256 + n for n in range(len(unprintable))]
    return dict(zip(bs + unprintable, map(chr, cs)))


_U2B = {c: b for b, c in bytes_to_unicode().items()}


def _token_bytes(token: str) -> bytes:
    if all(c in _U2B for c in token):
        return bytes(_U2B[c] for c in token)
    return token.encode("utf-8")  # a raw-text entry (as transformers also reads it)


class Tokenizer:
    def __init__(self, tokens: dict[bytes, int], specials: dict[str, int], pattern: str, *,
                 always: set[str] = frozenset(), bos: str | None = None, eos: str | None = None,
                 chat_template: str | None = None, stop: tuple[int, ...] = (), nfc: bool = False):
        """tokens: byte string -> id of the BPE vocabulary; specials: text -> id of added tokens,
        of which those in `always` are matched in any text (tokenizer.json's non-special ones)."""
        self.enc = tiktoken.Encoding("minispark", pat_str=pattern, mergeable_ranks=tokens, special_tokens=specials)
        self.pattern, self.specials, self.always, self.nfc = pattern, specials, frozenset(always), nfc
        self.chat_template = chat_template
        n = max([*tokens.values(), *specials.values()]) + 1
        self._bytes = [b""] * n  # own decode table: ids may have holes or duplicate spellings
        for b, i in tokens.items():
            self._bytes[i] = b
        for s, i in specials.items():
            self._bytes[i] = s.encode("utf-8")
        # tiktoken panics on a byte the vocabulary lacks; transformers drops it (see _encode_slow).
        self._missing = bytes(b for b in range(256) if bytes([b]) not in tokens)
        self.bos_token, self.eos_token = bos, eos
        self.bos_id = specials.get(bos) if bos is not None else None
        if eos is None or eos not in specials:
            raise ValueError(f"eos token {eos!r} is not a special token of this vocabulary")
        self.eos_id: int = specials[eos]
        extra = [specials[t] for t in END_OF_TURN if t in specials] + list(stop)
        self.stop_ids: tuple[int, ...] = tuple(dict.fromkeys([self.eos_id, *extra]))

    @cached_property
    def special_ids(self) -> frozenset[int]:
        """Ids whose text is markup (turn markers, EOS), left out of decoded output. Added tokens
        that are not special (`always`: matched in any text, as a tool-call tag) are text."""
        return frozenset(i for s, i in self.specials.items() if s not in self.always)

    @property
    def vocab_size(self) -> int:
        return len(self._bytes)

    # ---- encode / decode

    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        """Special-token text in `text` is encoded as plain text unless `allow_special`: user input
        must not be able to forge turn markers. Chat templating allows it."""
        if self.nfc:
            text = unicodedata.normalize("NFC", text)
        allowed = "all" if allow_special else self.always
        if self._missing:
            data = text.encode("utf-8", "surrogatepass")
            if len(data.translate(None, self._missing)) != len(data):
                return self._encode_slow(text, allowed)
        return self.enc.encode(text, allowed_special=allowed, disallowed_special=())

    def _encode_slow(self, text: str, allowed: str | frozenset[str]) -> list[int]:
        # Like transformers: split the text, then drop the bytes the vocabulary cannot spell from
        # each piece, so that the bytes around them can still merge.
        allowed = sorted(self.specials if allowed == "all" else allowed, key=len, reverse=True)
        parts = regex.split("(" + "|".join(map(regex.escape, allowed)) + ")", text) if allowed else [text]
        ids: list[int] = []
        for k, part in enumerate(parts):
            if k % 2:  # a special token, captured by the split
                ids.append(self.specials[part])
                continue
            for m in regex.finditer(self.pattern, part):
                piece = m.group().encode("utf-8", "surrogatepass").translate(None, self._missing)
                ids += self.enc._encode_single_piece(piece) if piece else []
        return ids

    def decode_bytes(self, ids: list[int]) -> bytes:
        """Raw bytes; a streaming detokeniser holds back an incomplete UTF-8 tail. An id past the
        tokenizer's table (a model's embedding rows are often padded beyond it) spells nothing,
        as in transformers, rather than failing the batch that sampled it."""
        n = len(self._bytes)
        return b"".join([self._bytes[i] if i < n else b"" for i in ids])

    def decode(self, ids: list[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    # ---- chat

    @cached_property
    def _template(self) -> jinja2.Template:
        if self.chat_template is None:
            raise ValueError("this checkpoint has no chat template")
        # The environment transformers renders chat templates in, so outputs match it exactly.
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        return env.from_string(self.chat_template)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        _check_messages(messages)
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token or "", eos_token=self.eos_token,
                                         tools=None, documents=None)
        except jinja2.TemplateError as e:  # raise_exception() in the template: these messages are refused
            raise ValueError(f"the chat template refused these messages: {e}") from None

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), allow_special=True)

    # ---- constructors

    @classmethod
    def from_gguf(cls, path_or_reader: str | Path | gguf.GGUFReader, pre: str | None = None) -> Tokenizer:
        """`pre` overrides the file's pre-tokeniser name (e.g. for a file labelled "default")."""
        r = path_or_reader if isinstance(path_or_reader, gguf.GGUFReader) else gguf.GGUFReader(path_or_reader)

        def get(key, default=None):
            return r.fields[key].contents() if key in r.fields else default

        model, pre = get("tokenizer.ggml.model"), pre or get("tokenizer.ggml.pre", "gpt2")
        if model != "gpt2":
            raise ValueError(f"GGUF tokenizer model {model!r} is not supported: only byte-level BPE "
                             "('gpt2', e.g. GPT-2, Llama-3, Qwen2, SmolLM) is, not SentencePiece ('llama') or others")
        if pre not in PATTERNS:
            raise ValueError(f"unknown pre-tokeniser {pre!r}; supported: {sorted(PATTERNS)}")
        names, types = get("tokenizer.ggml.tokens"), get("tokenizer.ggml.token_type", [])
        tokens, specials, always = {}, {}, set()
        for i, name in enumerate(names):
            t = types[i] if i < len(types) else 1
            if t in (3, 4):  # CONTROL are special; USER_DEFINED are matched whole in any text
                specials[name] = i
                if t == 4:
                    always.add(name)
            else:
                tokens.setdefault(_token_bytes(name), i)

        def text_of(key):
            return names[get(key)] if key in r.fields else None

        stop = tuple(get(k) for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if k in r.fields)
        return cls(tokens, specials, PATTERNS[pre], always=always, bos=text_of("tokenizer.ggml.bos_token_id"),
                   eos=text_of("tokenizer.ggml.eos_token_id"), chat_template=get("tokenizer.chat_template"), stop=stop)

    @classmethod
    def from_hf_folder(cls, folder: str | Path) -> Tokenizer:
        folder = Path(folder)
        cfg, gen = _read_json(folder / "tokenizer_config.json"), _read_json(folder / "generation_config.json")
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = {t["name"]: t["template"] for t in template}.get("default")
        if (folder / "chat_template.jinja").exists():
            template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
        added = {int(i): t for i, t in cfg.get("added_tokens_decoder", {}).items()}
        nfc = False
        if (folder / "tokenizer.json").exists():
            tj = _read_json(folder / "tokenizer.json")
            m = tj["model"]
            if m["type"] != "BPE" or m.get("byte_fallback"):
                raise ValueError(f"tokenizer.json model {m['type']!r} (byte_fallback={m.get('byte_fallback')}) "
                                 "is not supported: only byte-level BPE is")
            pattern = _pattern_from_hf(tj.get("pre_tokenizer"))
            norm = tj.get("normalizer")
            if norm is not None and norm.get("type") != "NFC":
                raise ValueError(f"tokenizer.json normalizer {norm.get('type')!r} is not supported (only none or NFC)")
            nfc = norm is not None
            added |= {t["id"]: t for t in tj.get("added_tokens", [])}
            tokens = {}
            for name, i in sorted(m["vocab"].items(), key=lambda kv: kv[1]):
                if i not in added:
                    tokens.setdefault(_token_bytes(name), i)
        elif (folder / "tokenizer.model").exists():
            try:  # lines of "base64(token bytes) rank"
                lines = (folder / "tokenizer.model").read_bytes().splitlines()
                tokens = {base64.b64decode(t, validate=True): int(r) for t, r in map(bytes.split, filter(None, lines))}
            except ValueError as e:  # binascii.Error is one
                raise ValueError(f"{folder / 'tokenizer.model'} is not a tiktoken BPE file (SentencePiece models "
                                 "are not supported)") from e
            pattern = LLAMA3_PAT
            if not added:
                added = {len(tokens) + k: {"content": s, "special": True} for k, s in enumerate(LLAMA3_SPECIALS)}
                cfg = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", **cfg}
                template = template or LLAMA3_TEMPLATE
        else:
            raise ValueError(f"{folder} has neither tokenizer.json nor a tiktoken tokenizer.model")
        specials = {t["content"]: i for i, t in added.items()}
        always = {t["content"] for t in added.values() if not t.get("special", True)}
        stop = gen.get("eos_token_id", [])
        stop = tuple(stop) if isinstance(stop, list) else (stop,)  # one id or a list
        return cls(tokens, specials, pattern, always=always, bos=_content(cfg.get("bos_token")),
                   eos=_content(cfg.get("eos_token")), chat_template=template, stop=stop, nfc=nfc)

    @classmethod
    def from_path(cls, path: str | Path) -> Tokenizer:
        """A .gguf file or a Hugging Face model folder (`model_source`, as the model loader reads it)."""
        path = model_source(path)
        if path.is_dir():
            return cls.from_hf_folder(path)
        if path.suffix == ".gguf" or is_gguf(path):
            return cls.from_gguf(path)
        raise ValueError(f"{path}: expected a .gguf file or a folder with tokenizer.json / tokenizer.model")


def is_gguf(path: Path) -> bool:
    """A GGUF file by its magic, whatever its name."""
    if not path.is_file():
        return False
    with path.open("rb") as f:
        return f.read(4) == b"GGUF"


def model_source(path: str | Path) -> Path:
    """Where a model and its tokenizer are read from, one rule for both: a folder, or a GGUF
    file; a file inside a Hugging Face folder (config.json, a shard) means the folder."""
    path = Path(path).expanduser()
    if path.is_file() and not is_gguf(path) and (path.parent / "config.json").is_file():
        return path.parent
    return path


def _pattern_from_hf(pre: dict | None) -> str:
    steps = pre.get("pretokenizers", []) if pre and pre["type"] == "Sequence" else [pre] if pre else []
    kinds = [s["type"] for s in steps]
    last = steps[-1] if steps else {}
    if kinds and kinds[-1] == "ByteLevel" and not last.get("add_prefix_space", False):
        if kinds == ["ByteLevel"] and last.get("use_regex", True):
            return GPT2_PAT
        if kinds == ["Split", "ByteLevel"] and not last.get("use_regex", True) and "Regex" in steps[0]["pattern"] \
                and steps[0].get("behavior") == "Isolated" and not steps[0].get("invert"):
            return steps[0]["pattern"]["Regex"]
        if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and last.get("use_regex", True):
            return SMOLLM_PAT
    raise ValueError(f"unsupported tokenizer.json pre_tokenizer {kinds or None}; supported: ByteLevel, "
                     "Split(regex) + ByteLevel, Digits(individual) + ByteLevel")


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}


def _content(tok) -> str | None:
    return tok.get("content") if isinstance(tok, dict) else tok


def _check_messages(messages) -> None:
    if not isinstance(messages, list):
        raise ValueError(f"messages must be a list of {{'role': ..., 'content': ...}} dicts, "
                         f"got {type(messages).__name__}")
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"message {k} must be a dict with 'role' and 'content', got {m!r:.80}")
        if not isinstance(m["role"], str) or not isinstance(m["content"], str):
            raise ValueError(f"message {k}: 'role' and 'content' must be strings, got "
                             f"{type(m['role']).__name__} and {type(m['content']).__name__}")
