"""The benchmark harness: modes x workloads x batch sizes, against peers, in one run.

    python -m minispark.bench --modes off,ngram,spark,hybrid --workloads code,chat --batch 1,4,16 --plot bench.png

Every configuration decodes the same prompts with the same weights and dtype; the table gives
output tokens/s, ratios to a baseline column measured in the same run, and mean tokens per step.
Within a row the systems take turns, step by step, on parts of the prompt set (`--rounds`), so
that a change in the machine's speed during the run does not tilt the ratios.
Peers: `hf` is transformers' `generate` (greedy), `hf-pld` its prompt-lookup decoding.
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from .api import LLM, SPEC_MODES, SamplingParams
from .planner import Pieces
from .cpu import resolve_dtype
from .model import Transformer
from .tokenizer import Tokenizer
from .weights import DEMO_DRAFTER, build_model, default_model, load_gguf, load_hf_folder
from .workloads import workload

console = Console(stderr=True)


@dataclass
class Result:
    system: str
    workload: str
    batch: int
    tokens: int
    seconds: float
    steps: int = 0
    chains: dict | None = None  # verified chains by drafter
    answers: list[list[int]] | None = None  # per prompt, up to its first stop token

    def __add__(self, other: "Result") -> "Result":
        chains = None if self.chains is None else {k: v + other.chains[k] for k, v in self.chains.items()}
        answers = None if self.answers is None else self.answers + other.answers
        return Result(self.system, self.workload, self.batch, self.tokens + other.tokens,
                      self.seconds + other.seconds, self.steps + other.steps, chains, answers)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def per_step(self) -> float:
        return self.tokens / self.steps if self.steps else float("nan")


def up_to_stop(ids: list[int], stop_ids: tuple[int, ...]) -> list[int]:
    ends = [j for j, t in enumerate(ids) if t in stop_ids]
    return ids[: ends[0]] if ends else ids


def load_weights(path: str | None):
    path = Path(path) if path else default_model()
    args, hf_sd = load_hf_folder(path) if path.is_dir() else load_gguf(path)
    return path, args, hf_sd


def spec_of(mode: str) -> str:
    """The spec mode behind a bench mode: "spark-fixed" is spark verifying its whole block on
    every step (no adaptive budget); "hybrid-no-trust" is hybrid with one planner piece off."""
    return mode.split("@")[0].split("-")[0]


def pieces_of(mode: str) -> Pieces:
    """The planner pieces of a bench mode: all of them, less the one a "-no-PIECE" names."""
    off = mode.partition("-no-")[2]
    if off and off not in Pieces.names():
        raise ValueError(f"unknown planner piece {off!r} in mode {mode!r}; pieces: {', '.join(Pieces.names())}")
    return Pieces(**{off: False}) if off else Pieces()


def twin(net: Transformer) -> Transformer:
    """Another model over the same weights (shared, not copied) that will hold a KV cache of
    its own: systems taking turns step by step cannot share one cache."""
    tensors = [*net.parameters(), *net.buffers()]
    tensors += [v for m in net.modules() for v in vars(m).values() if isinstance(v, torch.Tensor)]
    return copy.deepcopy(net, memo={id(t): t for t in tensors})


def minispark_llm(net, tok: Tokenizer, mode: str, warm_up: list[int], batch: int, temperature: float,
                  max_seq_len: int, drafter: Path | None, compile: bool = False) -> LLM:
    """An LLM for one mode, profiled and warmed up. Give each mode of a row its own `twin` of
    the model: their steps interleave, and each LLM allocates the KV cache of its model."""
    llm = LLM.from_model(net, tok, spec=spec_of(mode), max_batch_size=batch, max_seq_len=max_seq_len,
                         drafter=drafter, compile=compile, adaptive=not mode.endswith("-fixed"), pieces=pieces_of(mode))
    llm.generate([warm_up], SamplingParams(temperature=temperature, max_tokens=4))
    return llm


def checkout(path: str):
    """The `minispark` package of another checkout at `path`, imported under a name of its own
    (its modules import each other relatively), so that both versions run in one process."""
    import importlib.util

    init = Path(path) / "minispark" / "__init__.py"
    if not init.is_file():
        raise SystemExit(f"--against {path}: no minispark/__init__.py there (give the root of a checkout)")
    spec = importlib.util.spec_from_file_location("minispark_against", init, submodule_search_locations=[str(init.parent)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["minispark_against"] = module
    spec.loader.exec_module(module)
    return module


def against_llm(pkg, args, hf_sd, dtype, device, tok: Tokenizer, mode: str, warm_up: list[int], batch: int,
                temperature: float, max_seq_len: int, drafter: Path | None):
    """`minispark_llm` on another checkout's package (its own model class and engine)."""
    import importlib

    net = importlib.import_module("minispark_against.weights").build_model(args, hf_sd, dtype, device)
    llm = pkg.LLM.from_model(net, tok, spec=spec_of(mode), max_batch_size=batch, max_seq_len=max_seq_len,
                             drafter=drafter, adaptive=not mode.endswith("-fixed"))
    llm.generate([warm_up], pkg.SamplingParams(temperature=temperature, max_tokens=4))
    return llm


def run_minispark(llm: LLM, mode: str, prompts: list[list[int]], batch: int, max_tokens: int,
                  temperature: float) -> Generator[None, None, Result]:
    """Stream the prompts, pausing after each piece of streamed text (at most one step's work)
    so that other systems may take a turn; timed only while it runs."""
    # No seed: each request gets its own from the LLM's (0) and its request id, the same for a
    # prompt in every mode (each runs the same parts in the same order).
    params = sys.modules[type(llm).__module__].SamplingParams  # an --against checkout has its own
    stream = llm.stream(prompts, params(temperature=temperature, max_tokens=max_tokens))
    outs, seconds = {}, 0.0
    while True:
        start = time.perf_counter()
        delta = next(stream, None)
        seconds += time.perf_counter() - start
        if delta is None:
            break
        outs[delta.output.request_id] = delta.output
        yield
    outs = [outs[i] for i in sorted(outs)]  # request ids count up in prompt order
    chains = {k: sum(o.chains[k] for o in outs) for k in outs[0].chains}
    answers = [up_to_stop(o.token_ids, llm.tokenizer.stop_ids) for o in outs]
    return Result(mode, "", batch, sum(len(o.token_ids) for o in outs), seconds, sum(o.num_steps for o in outs),
                  chains, answers)


def hf_model(args, hf_sd, dtype: torch.dtype):
    """transformers' Llama with exactly the weights minispark loaded."""
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=args.vocab_size, hidden_size=args.dim, intermediate_size=args.intermediate_size,
        num_hidden_layers=args.n_layers, num_attention_heads=args.n_heads, num_key_value_heads=args.n_kv_heads,
        head_dim=args.head_dim, rms_norm_eps=args.norm_eps, rope_theta=args.rope_theta,
        rope_scaling=args.rope_scaling, max_position_embeddings=args.max_position_embeddings,
        tie_word_embeddings=args.tie_embeddings, attention_bias=args.qkv_bias,
    )
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    model.load_state_dict({k: v.to(dtype) for k, v in hf_sd.items()}, strict=False, assign=True)
    if args.tie_embeddings:
        model.tie_weights()
    model.model.rotary_emb = type(model.model.rotary_emb)(cfg)  # meta buffers carry no data
    return model.to(dtype).eval()


def run_hf(model, prompts: list[list[int]], batch: int, max_tokens: int, stop_ids: tuple[int, ...],
           prompt_lookup: bool) -> Generator[None, None, Result]:
    """transformers' generate, `batch` prompts at a time (left-padded), greedy, pausing after
    each call. Prompt lookup decoding runs one prompt at a time: transformers supports it only
    at batch size 1."""
    group_size = 1 if prompt_lookup else batch
    kw = dict(max_new_tokens=max_tokens, do_sample=False, eos_token_id=list(stop_ids), pad_token_id=stop_ids[0])
    if prompt_lookup:
        kw["prompt_lookup_num_tokens"] = 10
    tokens, seconds, answers = 0, 0.0, []
    with torch.no_grad():
        model.generate(torch.tensor([prompts[0]]), **{**kw, "max_new_tokens": 4})  # warm-up
        for i in range(0, len(prompts), group_size):
            group = prompts[i: i + group_size]
            width = max(map(len, group))
            ids = torch.tensor([[stop_ids[0]] * (width - len(p)) + p for p in group])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
            start = time.perf_counter()
            out = model.generate(ids, attention_mask=mask, **kw)[:, width:]
            seconds += time.perf_counter() - start
            for row in out.tolist():
                answers.append(up_to_stop(row, stop_ids))
                tokens += min(len(answers[-1]) + 1, len(row))  # the stop token counts, as in minispark
            yield
    return Result("hf-pld" if prompt_lookup else "hf", "", batch, tokens, seconds, answers=answers)


def run_row(systems: dict[str, Callable[[list[list[int]]], Generator[None, None, Result]]],
            prompts: list[list[int]], batch: int, rounds: int) -> list[Result]:
    """Every system on the same prompts, taking turns: each system is a generator that pauses
    after a piece of work (at most one minispark step; one transformers `generate` call) and
    returns its timed Result, and the systems of a part run a piece each in turn until all
    are done, so that a machine whose speed drifts (a shared VM's moves by tens of percent
    within minutes) slows every system alike. (Chat at batch 16 on this project's CPU, four
    repeats: run one after another in both orders, a second `off` made 0.98x to 1.00x the
    first's tokens/s and `ngram` 0.92x to 1.00x; taking turns step by step, 1.00x to 1.01x and
    0.97x every time.) The prompts are split into parts of at least `batch` prompts, and every
    other part starts with the last system; each system's result sums its parts. Prompts for
    one part only (with rounds > 1) run twice, once in each order."""
    n_parts = max(1, min(rounds, len(prompts) // batch))
    parts = [prompts[i::n_parts] for i in range(n_parts)]
    if n_parts == 1 and rounds > 1:
        parts *= 2
    totals: dict[str, Result] = {}
    for i, part in enumerate(parts):
        running = {name: systems[name](part) for name in list(systems)[:: 1 if i % 2 == 0 else -1]}
        while running:
            for name in list(running):
                try:
                    next(running[name])
                except StopIteration as done:
                    del running[name]
                    totals[name] = totals[name] + done.value if name in totals else done.value
    return [totals[name] for name in systems]


def per_workload(value: str, workloads: list[str]) -> dict[str, int]:
    """`--max-tokens`: "96" for every workload, or "code=512,chat=96"."""
    if "=" not in value:
        pairs = {w: value for w in workloads}
    else:
        pairs = dict(item.split("=", 1) for item in value.split(",") if item)
    missing = [w for w in workloads if w not in pairs]
    if missing:
        raise ValueError(f"--max-tokens {value!r} gives no length for {', '.join(missing)}; "
                         f"write one number, or one per workload as code=512,chat=128")
    try:
        out = {w: int(pairs[w]) for w in workloads}
    except ValueError:
        raise ValueError(f"--max-tokens {value!r}: lengths must be whole numbers, as in code=512,chat=128") from None
    if min(out.values()) < 1:
        raise ValueError(f"--max-tokens {value!r}: every length must be at least 1")
    return out


def render(results: list[Result], baseline: str, greedy: bool = False) -> str:
    """A Markdown table: one row per (workload, batch), tokens/s and the ratio to `baseline`.

    Greedy, with `off` in the run, a last column counts each system's answers that are `off`'s
    token for token. In bf16 a kernel may round a logit differently for 33 rows than for 1, and
    a near tie then parts two answers: systems that wrote different answers did different work,
    and their ratio says as much about the answers as about the systems."""
    systems = list(dict.fromkeys(r.system for r in results))
    cells = {(r.workload, r.batch, r.system): r for r in results}
    others = [s for s in systems if s != "off" and all(r.answers is not None for r in results if r.system == s)]
    compare = greedy and "off" in systems and others
    head = ["workload", "batch"] + [f"{s} tok/s" for s in systems] + [f"{s} / {baseline}" for s in systems if s != baseline]
    head += [f"{s} tok/step" for s in systems if spec_of(s) in SPEC_MODES and s != "off"]
    head += ["hybrid n-gram chains"] if "hybrid" in systems else []
    head += [f"answers as off's ({', '.join(others)})"] if compare else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for w, b in dict.fromkeys((r.workload, r.batch) for r in results):
        base = cells.get((w, b, baseline))
        row = [w, str(b)] + [f"{cells[w, b, s].tok_s:.1f}" if (w, b, s) in cells else "" for s in systems]
        row += [f"{cells[w, b, s].tok_s / base.tok_s:.2f}x" if base and (w, b, s) in cells else ""
                for s in systems if s != baseline]
        row += [f"{cells[w, b, s].per_step:.2f}" if (w, b, s) in cells else ""
                for s in systems if spec_of(s) in SPEC_MODES and s != "off"]
        if "hybrid" in systems:
            ch = cells[w, b, "hybrid"].chains if (w, b, "hybrid") in cells else None
            row.append(f"{ch['ngram'] / max(ch['ngram'] + ch['spark'], 1):.0%}" if ch else "")
        if compare:
            ref = cells.get((w, b, "off"))
            same = [sum(x == y for x, y in zip(ref.answers, cells[w, b, s].answers)) if ref and (w, b, s) in cells
                    else "-" for s in others]
            row.append(f"{' · '.join(map(str, same))} of {len(ref.answers)}" if ref else "")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit('plotting needs matplotlib: pip install "minispark[plot]"') from None
    return plt


def plot_results(results: list[Result], path: str) -> None:
    """Throughput by batch size, one line per system, one panel per workload."""
    plt = _pyplot()
    workloads = list(dict.fromkeys(r.workload for r in results))
    fig, axes = plt.subplots(1, len(workloads), figsize=(5 * len(workloads), 4), squeeze=False)
    for ax, w in zip(axes[0], workloads):
        for system in dict.fromkeys(r.system for r in results):
            rows = sorted((r.batch, r.tok_s) for r in results if r.workload == w and r.system == system)
            ax.plot([b for b, _ in rows], [t for _, t in rows], marker="o", label=system)
        ax.set(title=w, xlabel="batch size", ylabel="output tokens/s", xscale="log")
        ax.set_xticks(sorted({r.batch for r in results}), labels=[str(b) for b in sorted({r.batch for r in results})])
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_trace(trace: str, request: int | None, path: str) -> None:
    """One request's steps from an `LLM(trace=...)` file: tokens verified and accepted per
    step, coloured by the drafter whose chain was verified."""
    import json

    plt = _pyplot()
    steps = [json.loads(line) for line in Path(trace).read_text().splitlines() if line.strip()]
    rows = [(s["step"], slot) for s in steps for slot in s["slots"]]
    if request is None and rows:
        request = rows[0][1]["request"]
    rows = [(step, slot) for step, slot in rows if slot["request"] == request]
    if not rows:
        raise SystemExit(f"no steps of request {request} in {trace}")
    colours = {"ngram": "tab:green", "spark": "tab:blue", "target": "tab:gray"}
    fig, ax = plt.subplots(figsize=(max(6, len(rows) * 0.12), 3.5))
    x = list(range(len(rows)))
    ax.bar(x, [slot["verified"] for _, slot in rows], color="none", edgecolor="lightgray", label="verified")
    ax.bar(x, [slot["emitted"] for _, slot in rows], color=[colours[slot["chain"]] for _, slot in rows])
    for name, c in colours.items():
        ax.bar([], [], color=c, label=f"emitted ({name} chain)")
    ax.set(xlabel="decode step", ylabel="tokens", title=f"request {request}: tokens per step")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="minispark bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint folder or .gguf (default: the demo model)")
    ap.add_argument("--drafter", default=None, help="drafter folder for spark/hybrid (default: the demo model's)")
    ap.add_argument("--modes", default="off,ngram,spark,hybrid", help=f"comma-separated spec modes: "
                    f"{', '.join(SPEC_MODES)}; MODE-fixed verifies whole chains on every step (spark-fixed: a "
                    f"fixed block of g), the baseline of adaptive verification")
    ap.add_argument("--ablate", action="store_true", help="the planner's ablation: hybrid with all its "
                    "pieces, and with each piece off in turn (hybrid-no-PIECE), against the fixed baseline")
    ap.add_argument("--against", default=None, help="another checkout's root: each mode also runs on its "
                    "engine (as MODE@against), step by step beside this one's")
    ap.add_argument("--peers", default="hf", help="comma-separated peers: hf, hf-pld (or none)")
    ap.add_argument("--workloads", default="code,chat", help="comma-separated: code, chat")
    ap.add_argument("--batch", default="1,4", help="comma-separated batch sizes")
    ap.add_argument("--n", type=int, default=8, help="prompts per workload")
    ap.add_argument("--max-tokens", default="code=512,chat=128", help="tokens per answer: one number for "
                    "every workload, or per workload as code=512,chat=128 (a code edit is worth measuring "
                    "to its end: cut short, its answer is mostly the preamble before the copy)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--dtype", default="auto", help="auto (bfloat16 where the hardware computes in it, "
                    "else float32), bfloat16, float32 or float16")
    ap.add_argument("--rounds", type=int, default=4, help="parts of the prompt set, each run by every "
                    "system in turn, so that drift in the machine's speed falls on all alike")
    ap.add_argument("--compile", action="store_true", help="torch.compile the decode step (the GPU path)")
    ap.add_argument("--baseline", default=None, help="column the ratios divide by (default: spark if run, else the first mode)")
    ap.add_argument("--out", default=None, help="write the Markdown table to this file")
    ap.add_argument("--plot", default=None, help="draw throughput by batch size to this PNG; with "
                    "--trace, draw one request's steps instead")
    ap.add_argument("--trace", default=None, help="a trace file written by LLM(trace=...) or the examples' --trace")
    ap.add_argument("--request", type=int, default=None, help="the request of --trace to draw (default: the first)")
    a = ap.parse_args(argv)
    if a.plot:
        _pyplot()  # fail now, not after the run, when matplotlib is missing
    if a.trace:
        plot_trace(a.trace, a.request, a.plot or "trace.png")
        console.print(f"wrote {a.plot or 'trace.png'}")
        return
    modes = [m for m in a.modes.split(",") if m]
    if a.ablate:
        modes = ["hybrid"] + [f"hybrid-no-{p}" for p in Pieces.names()]
        a.baseline = a.baseline or "hybrid"
    for m in modes:
        if spec_of(m) not in SPEC_MODES:
            ap.error(f"unknown mode {m!r}; choose from {', '.join(SPEC_MODES)}, with -fixed or -no-PIECE")
        try:
            pieces_of(m)
        except ValueError as e:
            ap.error(str(e))
    peers = [p for p in a.peers.split(",") if p and p != "none"]
    if peers and a.temperature > 0:
        ap.error("the peers decode greedily: with --temperature above 0 add --peers none")
    batches = [int(b) for b in a.batch.split(",")]
    workloads = [w for w in a.workloads.split(",") if w]
    try:
        max_tokens = per_workload(a.max_tokens, workloads)
    except ValueError as e:
        ap.error(str(e))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = resolve_dtype(a.dtype, device)

    drafter = Path(a.drafter) if a.drafter else (DEMO_DRAFTER if a.model is None else None)
    path, args, hf_sd = load_weights(a.model)
    net = build_model(args, hf_sd, dtype, device)
    tok = Tokenizer.from_path(path)
    peer_model = hf_model(args, hf_sd, dtype) if peers else None
    other = checkout(a.against) if a.against else None
    results = []
    nets = {m: twin(net) for m in modes}
    for w in workloads:
        prompts = [tok.encode_chat(c) for c in workload(w, a.n)]
        max_seq_len = max(map(len, prompts)) + max_tokens[w] + 64
        for b in batches:
            llms = {m: minispark_llm(nets[m], tok, m, prompts[0], b, a.temperature, max_seq_len, drafter, a.compile)
                    for m in modes}
            if other:
                llms.update({f"{m}@against": against_llm(other, args, hf_sd, dtype, device, tok, m, prompts[0], b,
                                                          a.temperature, max_seq_len, drafter) for m in modes})
            systems = {m: (lambda part, m=m: run_minispark(llms[m], m, part, b, max_tokens[w], a.temperature))
                       for m in llms}
            systems.update({p: (lambda part, p=p: run_hf(peer_model, part, b, max_tokens[w], tok.stop_ids,
                                                          p == "hf-pld")) for p in peers})
            for r in run_row(systems, prompts, b, a.rounds):
                r.workload = w
                results.append(r)
                won = f"  chains {r.chains}" if r.system == "hybrid" else ""
                per_step = f"  {r.per_step:.2f} tok/step" if r.steps else ""
                console.print(f"{w:5s} batch {b:3d} {r.system:8s} {r.tok_s:7.1f} tok/s{per_step}{won}")
            del llms, systems
    md = render(results, a.baseline or ("spark" if "spark" in modes else modes[0]), greedy=a.temperature == 0)
    where = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU, {torch.get_num_threads()} threads"
    compiled = ", compiled step" if a.compile else ""
    header = (f"{path.name}, {str(dtype).removeprefix('torch.')}{compiled}, {where}, temperature {a.temperature}, "
              f"{a.n} prompts, answers of at most {', '.join(f'{n} ({w})' for w, n in max_tokens.items())} tokens, "
              f"torch {torch.__version__}")
    if peers:
        import transformers

        header += f", transformers {transformers.__version__}"
    table = Table(title=header)
    for line in md.splitlines()[:1]:
        for col in line.strip("|").split("|"):
            table.add_column(col.strip())
    for line in md.splitlines()[2:]:
        table.add_row(*[c.strip() for c in line.strip("|").split("|")])
    Console().print(table)
    if a.out:
        Path(a.out).write_text(f"{header}\n\n{md}\n")
    if a.plot:
        plot_results(results, a.plot)
        console.print(f"wrote {a.plot}")


if __name__ == "__main__":
    main()
