"""Requests: what a user asks (SamplingParams) and gets back (RequestOutput, streamed as Deltas),
each prompt checked before anything runs, and the text of each request as its tokens arrive,
cut at stop strings."""
from __future__ import annotations

import codecs
from dataclasses import dataclass, field
from typing import NamedTuple

from .engine import MAX_STOP_IDS
from .planner import Row


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_tokens: int = 16
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        def bad(what: str) -> ValueError:
            return ValueError(f"SamplingParams: {what}")

        if not isinstance(self.temperature, (int, float)) or not 0 <= self.temperature < float("inf"):
            raise bad(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if self.seed is not None and not (isinstance(self.seed, int) and -2**63 <= self.seed < 2**63):
            raise bad(f"seed must be a 64-bit int or None, got {self.seed!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple, type(None))) or not all(isinstance(s, str) and s for s in self.stop or []):
            raise bad(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        self.stop = list(self.stop or [])
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple, type(None))) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids or []):
            raise bad(f"stop_token_ids must be a list of token ids >= 0, got {ids!r}")
        self.stop_token_ids = list(ids or [])
        if not isinstance(self.ignore_eos, bool):
            raise bad(f"ignore_eos must be True or False, got {self.ignore_eos!r}")


@dataclass
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error"
    error: str | None = None  # why, when finish_reason is "error"
    num_steps: int = 0  # decode steps this request took part in
    accepted: dict[str, int] = field(default_factory=dict)  # tokens by source: each drafter, and "target"
    chains: dict[str, int] = field(default_factory=dict)  # verified chains by drafter

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Delta(NamedTuple):
    """A piece of streamed text and the source whose tokens produced it (a drafter or "target")."""
    output: RequestOutput
    text: str
    source: str


@dataclass
class Request:
    out: RequestOutput
    params: SamplingParams
    seed: int
    stop_ids: list[int]
    decoder: codecs.IncrementalDecoder = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace"))
    sent: int = 0  # characters of `out.text` already streamed
    slot: int | None = None  # where it runs (None: waiting or finished); compaction moves it

    def append(self, tok: int, tokenizer) -> bool:
        """Add one token to a request's output; True when a stop string completed."""
        o = self.out
        o.token_ids.append(tok)
        before = len(o.text)
        if tok not in tokenizer.special_ids:
            o.text += self.decoder.decode(tokenizer.decode_bytes([tok]))
        # One token may complete several stop strings: the text ends at the earliest.
        found = [o.text.find(stop, max(0, before - len(stop) + 1)) for stop in self.params.stop]
        found = [at for at in found if at >= 0]
        if found:
            o.text = o.text[: min(found)]
        return bool(found)

    def flush(self) -> str:
        """New text that is safe to show: hold back what could still become a stop string."""
        o = self.out
        hold = 0 if o.finished else max((len(s) - 1 for s in self.params.stop), default=0)
        end = max(self.sent, len(o.text) - hold)
        delta, self.sent = o.text[self.sent:end], end
        return delta

    def row(self) -> Row:
        o = self.out
        pace = len(o.token_ids) / o.num_steps if o.num_steps else 1.0
        return Row(self.params.max_tokens - len(o.token_ids), pace, len(o.prompt_token_ids) + len(o.token_ids))


def randomness(params: list[SamplingParams]) -> tuple[bool, bool]:
    """Whether any request samples, and whether any that samples sets top-k or top-p: two static
    choices of a step's graph (a greedy step draws nothing, an unfiltered one sorts nothing)."""
    sampled = [p for p in params if p.temperature > 0]
    return bool(sampled), any(p.top_k > 0 or p.top_p < 1 for p in sampled)


def make_requests(prompts, params, tokenizer, L: int, V: int, counter, seed: int,
                  sources: list[str]) -> list[Request]:
    """Requests from prompts (text or token ids) and their SamplingParams, every one checked
    before any runs, so that one bad request cannot cost the others."""
    if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(f"prompts must be a string, a list of token ids, or a list of those; "
                         f"got {type(prompts).__name__}")
    params = SamplingParams() if params is None else params
    params = [params] * len(prompts) if isinstance(params, SamplingParams) else params
    if not isinstance(params, (list, tuple)) or not all(isinstance(p, SamplingParams) for p in params):
        raise ValueError("params must be a SamplingParams or a list of them, one per prompt")
    if len(params) != len(prompts):
        raise ValueError(f"got {len(prompts)} prompts but {len(params)} SamplingParams; pass one, or one per prompt")
    encoded = [encode(i, p, tokenizer, L, V) for i, p in enumerate(prompts)]
    stops = [stop_ids_of(p, tokenizer) for p in params]
    reqs = []
    for prompt, ids, p, stop_ids in zip(prompts, encoded, params, stops):
        rid = next(counter)
        own_seed = p.seed if p.seed is not None else seed * 1_000_003 + rid
        out = RequestOutput(rid, prompt if isinstance(prompt, str) else None, ids,
                            accepted=dict.fromkeys(sources, 0), chains=dict.fromkeys(sources[:-1], 0))
        reqs.append(Request(out, p, own_seed, stop_ids))
    return reqs


def stop_ids_of(p: SamplingParams, tokenizer) -> list[int]:
    stop_ids = list(dict.fromkeys([*p.stop_token_ids, *([] if p.ignore_eos else tokenizer.stop_ids)]))
    if len(stop_ids) > MAX_STOP_IDS:
        own = "" if p.ignore_eos else (f", with the tokenizer's {len(tokenizer.stop_ids)} end-of-turn "
                                       f"ids (ignore_eos=True leaves those out)")
        raise ValueError(f"at most {MAX_STOP_IDS} stop token ids per request, got {len(stop_ids)}: "
                         f"{len(p.stop_token_ids)} in stop_token_ids{own}")
    return stop_ids


def encode(i: int, prompt, tokenizer, L: int, V: int) -> list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError(f"prompt {i} is empty; give at least one character or token")
        ids = tokenizer.encode(prompt)
        if any(not 0 <= t < V for t in ids):
            raise ValueError(f"prompt {i} encodes to token ids outside the model's vocabulary [0, {V}): "
                             f"the tokenizer does not belong to this model")
    elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = list(prompt)
        if not ids:
            raise ValueError(f"prompt {i} is empty; give at least one token")
        bad = [t for t in ids if not 0 <= t < V]
        if bad:
            raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {V}): {bad[:5]}")
    else:
        raise ValueError(f"prompt {i} must be a string or a list of token ids, got {type(prompt).__name__}")
    if len(ids) > L - 1:
        raise ValueError(f"prompt {i} has {len(ids)} tokens, more than max_seq_len={L} allows "
                         f"({L - 1}, leaving room for one generated token); raise max_seq_len or "
                         f"shorten the prompt")
    return ids
