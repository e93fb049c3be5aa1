"""Edit a file with an instruction, and watch where each token comes from.

    python examples/code_edit.py                                   # rename a function in a sample
    python examples/code_edit.py my.py "rename foo to bar" --write  # edit a file in place
    python examples/code_edit.py --spec ngram --compare              # speed-up against spec="off"

The edited code streams in colour: n-gram copies in green, Spark drafts in blue, the target's
own tokens in the terminal's default colour. Then a unified diff against the input and a summary.
"""
from __future__ import annotations

import argparse
import difflib
import re
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.syntax import Syntax
from rich.text import Text

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from minispark import LLM, SPEC_MODES, SamplingParams  # noqa: E402
from minispark.workloads import edit_request  # noqa: E402

# The no-argument demo: an edit that the 135M demo model carries out exactly, in bfloat16 and
# float32 alike (tests/test_examples.py checks it); most edits it gets wrong.
SAMPLE = '''def search(items, target):
    """The index of target in the sorted list items, or -1 if target is not found."""
    lo, hi = 0, len(items) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if items[mid] == target:
            return mid
        if items[mid] < target:
            lo = mid + 1
        else:
            hi = mid - 1
    return -1
'''
INSTRUCTION = "Rename the function `search` to `search_sorted`."
COLOURS = {"ngram": "green", "spark": "blue", "target": "default"}
console = Console()


def extract_code(answer: str, closed: bool = False) -> str | None:
    """The first fenced code block of the answer: to show, one left open or the whole answer
    will do; to write (`closed`), only a block whose fence closes, else None."""
    m = re.search(r"```[a-zA-Z0-9_+-]*\n(.*?)(```|$)", answer, re.S)
    if closed and not (m and m.group(2)):
        return None
    return (m.group(1) if m else answer).rstrip() + "\n"


def edit(llm: LLM, code: str, instruction: str, max_tokens: int, show: bool) -> tuple[str, float, dict]:
    msgs = [{"role": "user", "content": edit_request(code, instruction)}]
    ids = llm.tokenizer.encode_chat(msgs)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    start, out = time.perf_counter(), None
    for piece in llm.stream([ids], params):
        out = piece.output
        if show:
            console.print(Text(piece.text, style=COLOURS[piece.source]), end="", soft_wrap=True)
    seconds = time.perf_counter() - start
    if show:
        console.print()
    stats = {"tokens": len(out.token_ids), "steps": max(out.num_steps, 1), "finish": out.finish_reason,
             "error": out.error, "by": out.accepted}  # tokens by source: each drafter, and "target"
    return out.text, seconds, stats


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file", nargs="?", help="file to edit (default: a built-in sample)")
    ap.add_argument("instruction", nargs="?", help=f'what to change (default, for the sample: "{INSTRUCTION}")')
    ap.add_argument("--spec", default=None, help=f"speculation mode: {', '.join(SPEC_MODES)} "
                    "(default: hybrid, or ngram for a model without a drafter)")
    ap.add_argument("--model", default=None, help="checkpoint folder or .gguf (default: the demo model)")
    ap.add_argument("--drafter", default=None, help="Spark drafter folder for --model (made by minispark train)")
    ap.add_argument("--trace", default=None, help="write one JSON line per decode step to this file "
                    "(draw it with: python -m minispark.bench --trace FILE --plot steps.png)")
    ap.add_argument("--dtype", choices=("auto", "bfloat16", "float32", "float16"), default="auto",
                    help="weights and activations (auto: bfloat16 where the hardware computes in it, "
                    "else float32, which is exact)")
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--max-seq-len", type=int, default=4096, help="prompt and answer, in tokens")
    ap.add_argument("--compare", action="store_true", help='also run spec="off" and report the speed-up')
    ap.add_argument("--write", action="store_true", help="save the edited code back to FILE")
    a = ap.parse_args()
    if a.spec is not None and a.spec not in SPEC_MODES:
        ap.error(f"unknown --spec {a.spec!r}; choose one of: {', '.join(SPEC_MODES)}")
    if a.max_tokens < 1:
        ap.error("--max-tokens must be at least 1")
    if a.file:
        path = Path(a.file)
        if not path.is_file():
            ap.error(f"no such file: {a.file}")
        if a.instruction is None:
            ap.error("give an INSTRUCTION to carry out on FILE, e.g. \"Rename foo to bar.\"")
        code = path.read_text()
    else:
        if a.write:
            ap.error("--write needs a FILE to write to")
        path, code = None, SAMPLE
    instruction = a.instruction or INSTRUCTION

    with console.status("loading the model"):
        llm = LLM(model=a.model, spec=a.spec, drafter=a.drafter, max_batch_size=1, max_seq_len=a.max_seq_len,
                  dtype=a.dtype, trace=a.trace)
    console.rule(f"[bold]{escape(instruction)}[/]  (spec={llm.spec})")
    answer, seconds, stats = edit(llm, code, instruction, a.max_tokens, show=True)
    new = extract_code(answer)
    console.rule("diff")
    diff = "".join(difflib.unified_diff(code.splitlines(True), new.splitlines(True), "before", "after"))
    console.print(Syntax(diff or "(no change)\n", "diff", theme="ansi_dark"))
    tok_s = stats["tokens"] / seconds
    drafted = sum(n for k, n in stats["by"].items() if k != "target")
    console.print(f"{stats['tokens']} tokens in {seconds:.1f} s: [bold]{tok_s:.1f} tok/s[/], "
                  f"{stats['tokens'] / stats['steps']:.2f} tokens per step, "
                  f"{drafted / max(stats['tokens'], 1):.0%} drafted ("
                  + ", ".join(f"[{COLOURS[k]}]{k} {n}[/]" for k, n in stats["by"].items()) + ")")
    if a.compare:
        base = LLM.from_model(llm.engine.model, llm.tokenizer, spec="off", max_batch_size=1, max_seq_len=a.max_seq_len)
        with console.status('running spec="off" for comparison'):
            _, off_seconds, off_stats = edit(base, code, instruction, a.max_tokens, show=False)
        console.print(f'spec="off": {off_stats["tokens"] / off_seconds:.1f} tok/s; '
                      f'speed-up [bold]{tok_s / (off_stats["tokens"] / off_seconds):.2f}x[/]')
    if a.write and path is not None:
        # Only a finished answer with a whole code block replaces the file: a cut-off block or
        # a refusal in prose would lose the user's code.
        whole = extract_code(answer, closed=True) if stats["finish"] == "stop" else None
        if whole is None:
            why = {"length": "was cut off at --max-tokens", "error": f"broke off: {stats['error']}"}.get(
                stats["finish"], "holds no closed code block")
            console.print(f"[red]not written:[/] the answer {why}; {escape(str(path))} is unchanged")
            return 1
        path.write_text(whole)
        console.print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (ValueError, RuntimeError, OSError) as e:
        Console(stderr=True).print(f"[red]error:[/] {escape(str(e))}", soft_wrap=True)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
