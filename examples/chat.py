"""Chat with the demo model in the terminal, and see how speculation pays.

    python examples/chat.py                        # interactive; /help lists the commands
    python examples/chat.py --prompt "Hi there"    # one answer, then exit
    echo "What is a prime?" | python examples/chat.py

While the answer streams, the status line shows tokens/s, mean tokens per decode step and the
share of tokens that came from each drafter. Ctrl-C stops the answer, Ctrl-D leaves.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.text import Text

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from minispark import LLM, SamplingParams  # noqa: E402
from minispark import SPEC_MODES  # noqa: E402

HELP = "/reset clears the conversation, /spec MODE switches speculation, /stats shows totals, /help, Ctrl-D quits"
console = Console(highlight=False)


class Chat:
    def __init__(self, llm: LLM, params: SamplingParams, system: str | None):
        self.llm, self.params, self.system = llm, params, system
        self.history: list[dict] = []
        self.reset()

    def reset(self) -> None:
        self.history = [{"role": "system", "content": self.system}] if self.system else []

    def switch(self, spec: str) -> None:
        if spec not in SPEC_MODES:
            raise ValueError(f"unknown spec {spec!r}; choose one of: {', '.join(SPEC_MODES)}")
        self.llm = self.llm.with_spec(spec)

    def ask(self, text: str) -> None:
        """Stream one answer; Ctrl-C keeps what was said so far and returns to the prompt."""
        history = self.history + [{"role": "user", "content": text}]  # kept only if it is answered
        ids = self.llm.tokenizer.encode_chat(history)
        start, answer, out = time.perf_counter(), "", None
        try:
            for piece in self.llm.stream([ids], self.params):
                out, answer = piece.output, answer + piece.text
                console.print(Text(piece.text), end="", soft_wrap=True)  # model text, not markup
        except KeyboardInterrupt:
            console.print(" [dim](stopped)[/]", end="")
        except ValueError as e:  # refused before it ran: most often a conversation grown too long
            raise ValueError(f"{e}; /reset clears the conversation" if self.history else str(e)) from None
        console.print()
        if out is not None and out.error:
            console.print(f"[red]error:[/] {escape(out.error)}")
            return
        self.history = history + [{"role": "assistant", "content": answer}]
        if out is not None:
            console.print(status_line(out, time.perf_counter() - start), style="dim")

    def stats(self) -> None:
        s = self.llm.stats()
        console.print(f"{s['requests']} answers, {s['tokens']} tokens in {s['steps']} steps "
                      f"({s['tokens_per_step']:.2f} tokens per step); "
                      + ", ".join(f"{k} {s[k]}" for k in self.llm.sources))


def status_line(out, seconds: float) -> str:
    n = max(len(out.token_ids), 1)
    shares = " ".join(f"{k} {out.accepted[k] / n:.0%}" for k in out.accepted)
    return (f"[{len(out.token_ids)} tokens, {len(out.token_ids) / seconds:.1f} tok/s, "
            f"{len(out.token_ids) / max(out.num_steps, 1):.2f} tokens/step, {shares}]")


def repl(chat: Chat) -> None:
    console.print(f"[bold]minispark chat[/] (spec={chat.llm.spec}). {HELP}")
    while True:
        try:
            line = console.input("[bold cyan]> [/]").strip()
        except EOFError:
            console.print()
            return
        except KeyboardInterrupt:
            console.print()
            continue
        if not line:
            continue
        cmd, _, arg = line.partition(" ")
        try:
            if cmd == "/reset":
                chat.reset()
                console.print("[dim](conversation cleared)[/]")
            elif cmd == "/spec":
                chat.switch(arg.strip())
                console.print(f"[dim](spec={escape(arg.strip())})[/]")
            elif cmd == "/stats":
                chat.stats()
            elif cmd == "/help":
                console.print(HELP)
            elif cmd.startswith("/"):
                console.print(f"[red]unknown command {escape(cmd)}[/]; {HELP}")
            else:
                chat.ask(line)
        except ValueError as e:
            console.print(f"[red]error:[/] {escape(str(e))}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", help="ask this, print the answer and exit")
    ap.add_argument("--spec", default=None, help=f"speculation mode: {', '.join(SPEC_MODES)} "
                    "(default: hybrid, or ngram for a model without a drafter)")
    ap.add_argument("--model", default=None, help="checkpoint folder or .gguf (default: the demo model)")
    ap.add_argument("--drafter", default=None, help="Spark drafter folder for --model (made by minispark train)")
    ap.add_argument("--trace", default=None, help="write one JSON line per decode step to this file "
                    "(draw it with: python -m minispark.bench --trace FILE --plot steps.png)")
    ap.add_argument("--system", default=None, help="system message")
    ap.add_argument("--dtype", choices=("auto", "bfloat16", "float32", "float16"), default="auto",
                    help="weights and activations (auto: bfloat16 where the hardware computes in it, "
                    "else float32, which is exact)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--max-seq-len", type=int, default=4096)
    a = ap.parse_args()
    if a.spec is not None and a.spec not in SPEC_MODES:
        ap.error(f"unknown --spec {a.spec!r}; choose one of: {', '.join(SPEC_MODES)}")
    try:
        params = SamplingParams(temperature=a.temperature, top_p=a.top_p, max_tokens=a.max_tokens)
    except ValueError as e:
        ap.error(str(e))
    with console.status("loading the model"):
        llm = LLM(model=a.model, spec=a.spec, drafter=a.drafter, max_batch_size=1, max_seq_len=a.max_seq_len,
                  dtype=a.dtype, trace=a.trace)
    chat = Chat(llm, params, a.system)
    if a.prompt is not None:
        chat.ask(a.prompt)
    elif not sys.stdin.isatty():
        for line in sys.stdin:
            if line.strip():
                console.print(f"[bold cyan]> [/]{escape(line.strip())}")
                chat.ask(line.strip())
    else:
        repl(chat)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (ValueError, RuntimeError, OSError) as e:
        Console(stderr=True).print(f"[red]error:[/] {escape(str(e))}", soft_wrap=True)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
