"""The `minispark` command: `minispark chat`, `minispark edit`, `minispark bench`, `minispark train`.

    minispark chat --prompt "What is a prime number?"
    minispark edit my.py "rename foo to bar" --compare
    minispark bench --modes spark,hybrid --workloads code,chat --batch 1,4
    minispark train all --out runs/spark --minutes 30
"""
from __future__ import annotations

import runpy
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
COMMANDS = {
    "chat": ("examples/chat.py", "chat in the terminal with streamed answers"),
    "edit": ("examples/code_edit.py", "edit a file with an instruction, tokens coloured by drafter"),
    "bench": ("minispark.bench", "benchmark modes x workloads x batch sizes against transformers"),
    "train": ("minispark.train", "distil a Spark drafter from its target and calibrate it"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(__doc__.strip() + "\n\ncommands:")
        for name, (_, what) in COMMANDS.items():
            print(f"  {name:6s} {what}")
        print("\n`minispark COMMAND --help` shows each command's options.")
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    target, _ = COMMANDS[argv[0]]
    sys.argv = [f"minispark {argv[0]}", *argv[1:]]
    if target.endswith(".py"):
        script = EXAMPLES / Path(target).name
        if not script.is_file():
            print(f"minispark {argv[0]} needs the examples folder of a source checkout ({script} is missing)",
                  file=sys.stderr)
            return 2
        runpy.run_path(str(script), run_name="__main__")
    else:
        runpy.run_module(target, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
