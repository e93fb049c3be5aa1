"""The long soak on the demo model: many mixed requests through continuous batching, each checked
against decoding it alone.

    python scripts/soak.py [--n 300] [--spec hybrid] [--slots 4] [--max-seq-len 1024]
                           [--dtype float32] [--seed 0]

N requests from the bundled prompt sets (MT-Bench chat, HumanEval code edits): random max_tokens
(1..200), mostly greedy with some seeded sampled ones (temperature 0.7, top_p 0.9), ignore_eos
sometimes, stop strings cut from each request's own reference text, and a few long prompts that
run into the cache end. Every greedy request is first decoded alone (a 1-slot LLM, spec="off"):
the reference. Then all requests stream together through fewer slots in the chosen mode, a few
cancelled mid-way and one while still waiting. Checked: each request id finishes once, with
"stop", "length" or "cancelled"; greedy ones (and, in "off"/"ngram", whose seeded samples do not
depend on the batch, sampled ones) give the reference's tokens, text and finish reason, cancelled
ones a prefix of it; every output respects max_tokens, max_seq_len and its stop strings.
Exits 1 on any mismatch, listing the first few.

float32 by default, so comparisons are exact; in bfloat16 greedy paths may part at near-ties
(see the README), and such mismatches are rounding, not bugs.
"""
from __future__ import annotations

import argparse
import codecs
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, replace

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from minispark import LLM, SamplingParams
from minispark.api import RequestOutput
from minispark.tokenizer import Tokenizer
from minispark.weights import DEMO_DRAFTER
from minispark.workloads import chat_prompts, code_edit_prompts

console = Console(stderr=True)


@dataclass
class Req:
    prompt: list[int]
    params: SamplingParams
    kind: str  # "greedy", "sampled" or "long" (runs into the cache end)
    cancel_at: int | None = None  # cancel once this many tokens are out; 0: while still waiting
    expected: tuple[list[int], str, str] | None = None  # (tokens, text, finish) from the reference


def bar() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TimeRemainingColumn(), console=console)


def build(rng: random.Random, tok: Tokenizer, n: int, L: int) -> list[Req]:
    convs = [tok.encode_chat(c) for c in chat_prompts() + code_edit_prompts()]
    convs = [c for c in convs if len(c) < L - 1]
    sampled = set(rng.sample(range(n), max(1, n * 15 // 100)))
    long = set(rng.sample(sorted(set(range(n)) - sampled), max(1, n // 50)))
    reqs = []
    for i in range(n):
        prompt, mt = rng.choice(convs), rng.randint(1, 200)
        if i in long:
            # A chat history cut from the left so that only k tokens fit: "length" at the cache end.
            k = rng.randint(2, 40)
            history = [t for c in rng.sample(convs, 8) for t in c] * (L // 400 + 2)
            prompt, mt = (history + prompt)[-(L - k):], rng.randint(k + 1, 200)
            reqs.append(Req(prompt, SamplingParams(temperature=0.0, max_tokens=mt, ignore_eos=True), "long"))
        elif i in sampled:
            p = SamplingParams(temperature=0.7, top_p=0.9, seed=rng.randrange(2**31), max_tokens=mt,
                               ignore_eos=rng.random() < 0.1)
            reqs.append(Req(prompt, p, "sampled"))
        else:
            reqs.append(Req(prompt, SamplingParams(temperature=0.0, max_tokens=mt, ignore_eos=rng.random() < 0.1),
                            "greedy"))
    for i in rng.sample(sorted(set(range(n)) - long), max(1, n // 30)):
        reqs[i].cancel_at = rng.randint(1, max(1, reqs[i].params.max_tokens - 1))
    reqs[-1].cancel_at = 0  # the last request waits for a slot while the first ones run
    return reqs


def cut(tok: Tokenizer, tokens: list[int], stops: list[str], reason: str) -> tuple[list[int], str, str]:
    """A stop-free output as the engine cuts it: text decoded incrementally (specials show
    nothing), ending after the token where a stop string first completes, the text before it."""
    dec, text = codecs.getincrementaldecoder("utf-8")("replace"), ""
    for j, t in enumerate(tokens):
        if t not in tok.special_ids:
            text += dec.decode(tok.decode_bytes([t]))
        for s in stops:  # in list order, as the engine checks them
            if s in text:
                return tokens[: j + 1], text[: text.find(s)], "stop"
    # No stop string cut it: an incomplete UTF-8 tail is flushed at the end.
    return tokens, text + dec.decode(b"", final=True), reason


def check(i: int, r: Req, o: RequestOutput | None, finishes: int, asked: set[int], L: int) -> str | None:
    """What is wrong with request i's output, or None."""
    if o is None or finishes != 1:
        return f"finished {finishes} times (lost or duplicated)"
    p, n, why = r.params, len(o.token_ids), f"finish {o.finish_reason!r}"
    if o.finish_reason not in ("stop", "length", "cancelled"):
        return f"invalid {why} ({o.error})"
    if o.finish_reason == "cancelled" and i not in asked:
        return "cancelled without being asked"
    if n > p.max_tokens or len(r.prompt) + n > L or sum(o.accepted.values()) != n:
        return f"{n} tokens, max_tokens {p.max_tokens}, prompt {len(r.prompt)}, accepted {o.accepted}"
    if any(s in o.text for s in p.stop):
        return f"text shows a stop string {p.stop}"
    if o.finish_reason == "length" and n != p.max_tokens and len(r.prompt) + n != L:
        return f"'length' after {n} of {p.max_tokens} tokens, {len(r.prompt) + n} of {L} cache positions"
    if r.expected is None:
        return None
    tokens, text, reason = r.expected
    if o.finish_reason == "cancelled":
        tokens = tokens[:n]  # a prefix of the reference
    elif (text, reason) != (o.text, o.finish_reason):
        return f"{why}, expected {reason!r}; text {o.text[-40:]!r}, expected {text[-40:]!r}"
    if o.token_ids != tokens:
        k = next((k for k, (a, b) in enumerate(zip(o.token_ids, tokens)) if a != b), min(n, len(tokens)))
        return f"{why}: tokens part from the reference at {k} of {n} (reference {len(tokens)})"
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--spec", default="hybrid", choices=["off", "ngram", "spark", "hybrid"])
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--max-seq-len", type=int, default=1024)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    L, rng = a.max_seq_len, random.Random(a.seed)
    if a.spec in ("spark", "hybrid") and not (DEMO_DRAFTER / "spark.json").exists():
        sys.exit(f"no demo drafter in {DEMO_DRAFTER} for --spec {a.spec}: `python -m minispark.train all` "
                 f"makes it; or use --spec ngram")
    # The model holds one KV cache, so one LLM at a time: the reference runs first, then the soak
    # LLM is built around the same weights (re-allocating the cache).
    ref = LLM(spec="off", max_batch_size=1, max_seq_len=L, dtype=a.dtype, seed=a.seed)
    tok = ref.tokenizer
    reqs = build(rng, tok, a.n, L)
    # Seeded samples are a function of the request alone in "off" and "ngram" (counter-based
    # noise); Spark's rejection sampling depends on the draft, so there only the finish is checked.
    exact = [r for r in reqs if r.kind != "sampled" or a.spec in ("off", "ngram")]
    t0, ref_tokens = time.perf_counter(), 0
    with bar() as pb:
        for r in pb.track(exact, description="reference, alone"):
            o = ref.generate([r.prompt], r.params)[0]
            ref_tokens += len(o.token_ids)
            stops = []
            if r.kind != "long" and o.text and rng.random() < 0.3:  # a stop string that fires
                at = rng.randrange(len(o.text))
                stops = [o.text[at: at + rng.randint(1, 8)]]
            r.params = replace(r.params, stop=stops)
            r.expected = cut(tok, o.token_ids, stops, o.finish_reason)
    ref_s = time.perf_counter() - t0
    for r in reqs:
        if r.expected is None and rng.random() < 0.3:
            r.params = replace(r.params, stop=["\n\n"])
    llm = LLM.from_model(ref.engine.model, tok, spec=a.spec, max_batch_size=a.slots, max_seq_len=L, seed=a.seed,
                         drafter=DEMO_DRAFTER)
    del ref
    # The LLM is fresh, so its request ids are 0..n-1 in order.
    finals: dict[int, RequestOutput] = {}
    finishes: Counter[int] = Counter()
    asked: set[int] = set()
    t0 = time.perf_counter()
    with bar() as pb:
        task = pb.add_task(f"soak, spec={a.spec}, {a.slots} slots", total=a.n)
        for d in llm.stream([r.prompt for r in reqs], [r.params for r in reqs]):
            o, i = d.output, d.output.request_id
            if a.n - 1 not in asked:
                asked.add(a.n - 1)
                llm.cancel(a.n - 1)
            at = reqs[i].cancel_at if 0 <= i < a.n else None
            if at and not o.finished and len(o.token_ids) >= at and i not in asked:
                asked.add(i)
                llm.cancel(i)
            if o.finished:
                finals[i], finishes[i] = o, finishes[i] + 1
                pb.advance(task)
    soak_s = time.perf_counter() - t0
    bad = [(i, why) for i, r in enumerate(reqs) if (why := check(i, r, finals.get(i), finishes[i], asked, L))]
    bad += [(i, "unknown request id") for i in finals if not 0 <= i < a.n]

    s, kinds = llm.stats(), Counter(r.kind for r in reqs)
    reasons = Counter(o.finish_reason for o in finals.values())
    at_end = sum(len(reqs[i].prompt) + len(o.token_ids) == L for i, o in finals.items() if 0 <= i < a.n)
    print(f"requests   {a.n}: {', '.join(f'{v} {k}' for k, v in kinds.items())}; {len(asked)} asked to cancel; "
          f"finished {', '.join(f'{v} {k}' for k, v in reasons.items())} ({at_end} at the cache end)")
    print(f"reference  {len(exact)} requests alone, {ref_tokens} tokens in {ref_s:.0f} s "
          f"({ref_tokens / ref_s:.1f} tok/s)")
    print(f"soak       {s['tokens']} tokens in {soak_s:.0f} s: {s['tokens'] / soak_s:.1f} tok/s, "
          f"{s['tokens_per_step']:.2f} tokens per step, accepted {', '.join(f'{k} {s[k]}' for k in llm.sources)}")
    print(f"mismatches {len(bad)} of {a.n}")
    for i, why in bad[:8]:
        r = reqs[i] if 0 <= i < a.n else None
        print(f"  request {i}" + (f" ({r.kind}, {r.params})" if r else "") + f": {why}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
