"""The examples as a user drives them: chat.py in a real terminal (tmux), both scripts on the
command line and on pipes, and every command-line mistake answered with one line, no traceback."""
from __future__ import annotations

import ast
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
CHAT, EDIT = ROOT / "examples" / "chat.py", ROOT / "examples" / "code_edit.py"
ENV = {**os.environ, "COLUMNS": "100", "NO_COLOR": "1", "PYTHONPATH": str(ROOT)}
LOAD_S = 180  # one run loads the demo model and profiles the step: seconds alone, more on a busy CPU


def run(script: Path, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(script), *args], input=stdin, capture_output=True, text=True,
                          cwd=ROOT, env=ENV, timeout=LOAD_S + 60,
                          **({} if stdin is not None else {"stdin": subprocess.DEVNULL}))


# ----------------------------------------------------------------------------- chat.py in a terminal


class Tmux:
    def __init__(self, name: str, command: str):
        self.name = name
        subprocess.run(["tmux", "new-session", "-d", "-s", name, "-x", "100", "-y", "50", command], check=True)
        subprocess.run(["tmux", "set-option", "-t", name, "history-limit", "5000"], check=True)

    def pane(self) -> str:
        r = subprocess.run(["tmux", "capture-pane", "-p", "-J", "-S", "-", "-t", self.name],
                           capture_output=True, text=True)
        return r.stdout.rstrip()

    def send(self, *keys: str, literal: bool = False) -> None:
        subprocess.run(["tmux", "send-keys", "-t", self.name, *(["-l"] if literal else []), *keys], check=True)

    def type(self, line: str) -> None:
        self.send(line, literal=True)
        self.send("Enter")

    def wait(self, what: str, ok, timeout: float = 90, every: float = 0.2) -> str:
        end = time.monotonic() + timeout
        while True:
            pane = self.pane()
            if ok(pane):
                return pane
            if time.monotonic() > end:
                pytest.fail(f"no {what} within {timeout:.0f} s; the terminal shows:\n{pane}")
            time.sleep(every)

    def kill(self) -> None:
        subprocess.run(["tmux", "kill-session", "-t", self.name], capture_output=True)


def at_prompt(pane: str) -> bool:
    return pane.splitlines()[-1:] == [">"] if pane else False


def test_chat_in_a_terminal():
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed (apt-get install -y tmux)")
    name = f"minispark-chat-{os.getpid()}"
    # A small cache makes an over-long question cheap to provoke; the answers are short anyway,
    # except the story, which Ctrl-C cuts.
    cmd = (f"cd {ROOT} && PYTHONPATH={ROOT} {sys.executable} examples/chat.py --max-tokens 200 "
           f"--max-seq-len 256 --dtype float32; echo CHAT-EXITED rc=$?; sleep 120")
    t = Tmux(name, cmd)
    try:
        pane = t.wait("prompt", at_prompt, timeout=LOAD_S)
        assert "minispark chat" in pane and "/stats" in pane

        t.type("What is the capital of France?")
        pane = t.wait("status line", lambda p: "tok/s" in p and at_prompt(p))
        assert "tokens/step" in pane and "Paris" in pane

        t.type("/stats")
        pane = t.wait("/stats", lambda p: "tokens in" in p and at_prompt(p))
        assert re.search(r"1 answers, \d+ tokens in \d+ steps \(\d+\.\d\d tokens per step\); ngram \d+", pane), pane

        t.type("/spec [/x]")  # text that looks like rich markup is shown as typed
        pane = t.wait("error line", lambda p: "unknown spec" in p and at_prompt(p))
        assert "error: unknown spec '[/x]'" in pane
        t.type("/spec ngram")  # the rest of the chat drafts with n-grams on the same model
        t.wait("spec switched", lambda p: "(spec=ngram)" in p and at_prompt(p))

        t.type("word " * 300)  # longer than the cache: one error line, and the chat goes on
        pane = t.wait("error line", lambda p: "more than max_seq_len" in p and at_prompt(p))
        assert "Traceback" not in pane and "/reset clears the conversation" in pane
        t.type("And of Italy?")  # the refused question is not part of the conversation
        pane = t.wait("second answer", lambda p: p.count("tokens/step") == 2 and at_prompt(p))
        assert "max_seq_len" not in pane.split("And of Italy?")[-1], pane

        t.type("Tell me a long story about a brave dragon.")
        before = t.pane()
        # Ctrl-C as soon as the answer streams: the answer stops and the prompt returns.
        t.wait("answer to start", lambda p: len(p.split("brave dragon.")[-1].strip()) > 0, every=0.05)
        t.send("C-c")
        pane = t.wait("prompt after Ctrl-C", lambda p: at_prompt(p) and p != before)
        assert "(stopped)" in pane.split("brave dragon.")[-1], pane
        assert "Traceback" not in pane

        t.type("/stats")  # still alive and counting
        pane = t.wait("/stats after Ctrl-C", lambda p: p.count("tokens in") == 2 and at_prompt(p))

        t.send("C-d")
        pane = t.wait("exit on Ctrl-D", lambda p: "CHAT-EXITED" in p)
        assert "CHAT-EXITED rc=0" in pane and "Traceback" not in pane
    finally:
        t.kill()


# ----------------------------------------------------------------------------- on the command line


def test_chat_prompt_answers_and_exits():
    # float32: in bfloat16 the 135M model's first answer token is a near-tie it can lose.
    r = run(CHAT, "--prompt", "What is the capital of France?", "--max-tokens", "24", "--dtype", "float32")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout and "tok/s" in r.stdout and "tokens/step" in r.stdout
    assert "Traceback" not in r.stderr


def test_chat_piped_stdin_answers_every_line():
    lines = ["What is the capital of France?", "What does a[i] mean in [/code]?"]
    r = run(CHAT, "--max-tokens", "24", "--dtype", "float32", stdin="\n".join(lines) + "\n\n")
    assert r.returncode == 0, r.stderr
    for line in lines:  # echoed as typed, brackets and all
        assert f"> {line}\n" in r.stdout, r.stdout
    assert r.stdout.count("tokens/step") == 2, r.stdout
    assert "Paris" in r.stdout.split(lines[1])[0]


def load(script: Path):
    """The example as a module, for its constants and helpers (running it stays a subprocess)."""
    spec = importlib.util.spec_from_file_location(script.stem, script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("dtype", ["auto", "float32"])
def test_code_edit_default_is_a_correct_edit(dtype):
    # The first thing a user runs, `python examples/code_edit.py`, must show the model doing the
    # edit right: the built-in sample with the function renamed, and nothing else changed.
    demo = load(EDIT)
    old, new = re.fullmatch(r"Rename the function `(\w+)` to `(\w+)`\.", demo.INSTRUCTION).groups()
    r = run(EDIT, *([] if dtype == "auto" else ["--dtype", dtype]))
    assert r.returncode == 0, r.stderr
    answer = r.stdout.split(demo.INSTRUCTION, 1)[1]  # after the title: the streamed answer, the diff
    edited = demo.extract_code(answer, closed=True)
    assert edited is not None, r.stdout
    assert new in {f.name for f in ast.walk(ast.parse(edited)) if isinstance(f, ast.FunctionDef)}, edited
    assert not re.search(rf"\b{old}\b", edited), edited
    assert edited == re.sub(rf"\b{old}\b", new, demo.SAMPLE), edited  # renamed where it stood, nothing else
    line = next(ln for ln in demo.SAMPLE.splitlines() if f"def {old}(" in ln)
    changed = [ln.rstrip() for ln in answer.split("+++ after")[1].splitlines() if ln.startswith(("-", "+"))]
    assert changed == [f"-{line}", f"+{line.replace(old, new)}"], r.stdout  # and the diff shows just that


SOURCE = '''def mean(xs):
    """The average of a list of numbers."""
    total = 0
    for i in range(len(xs)):
        total += xs[i]
    return total / len(xs)
'''


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_code_edit_writes_only_its_file(tmp_path):
    target = tmp_path / "stats.py"
    target.write_text(SOURCE)
    (tmp_path / "notes.txt").write_text("leave me alone\n")
    before = snapshot(tmp_path)
    instruction = "Rename `mean` to `average`; keep xs[i]."
    r = run(EDIT, str(target), instruction, "--write", "--max-tokens", "200")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert instruction in out  # the title shows the instruction as given, brackets and all
    assert re.search(r"\d+ tokens in \d+\.\d s: \d+\.\d tok/s, \d+\.\d\d tokens per step, \d+% drafted", out), out
    assert f"wrote {target}" in out.replace("\n", "")
    after = snapshot(tmp_path)
    assert after.keys() == before.keys(), "files were created or removed"
    assert {k: v for k, v in after.items() if k != "stats.py"} == {k: v for k, v in before.items() if k != "stats.py"}
    new = target.read_text()
    if "(no change)" in out:
        assert new == SOURCE
    else:
        assert "--- before" in out and "+++ after" in out
        assert new != SOURCE and new.endswith("\n")
        added = [ln[1:] for ln in out.split("+++ after")[1].splitlines() if ln.startswith("+")]
        assert added and all(ln.rstrip() in {x.rstrip() for x in new.splitlines()} for ln in added), (added, new)


def test_code_edit_does_not_write_an_answer_cut_short(tmp_path):
    target = tmp_path / "stats.py"
    target.write_text(SOURCE)
    r = run(EDIT, str(target), "Rename `mean` to `average`.", "--write", "--max-tokens", "12")
    assert r.returncode == 1
    assert "not written" in r.stdout and "cut off at --max-tokens" in r.stdout
    assert target.read_text() == SOURCE


# ----------------------------------------------------------------------------- mistakes


MISTAKES = {  # id: (script, args, words the one error line must contain)
    "chat-spec": (CHAT, ["--spec", "bogus"], ["bogus", "spec"]),
    "edit-spec": (EDIT, ["--spec", "bogus"], ["bogus", "spec"]),
    "edit-missing-file": (EDIT, ["/nonexistent/missing.py", "do it"], ["no such file", "/nonexistent/missing.py"]),
    "edit-file-no-instruction": (EDIT, [str(EDIT)], ["INSTRUCTION", "FILE"]),  # the default is for the sample
    "chat-model": (CHAT, ["--model", "/nonexistent/path.gguf"], ["/nonexistent/path.gguf", "not found"]),
    "edit-model": (EDIT, ["--model", "/nonexistent/path.gguf"], ["/nonexistent/path.gguf", "not found"]),
    "chat-model-brackets": (CHAT, ["--model", "/nonexistent/x[/y].gguf"], ["/nonexistent/x[/y].gguf", "not found"]),
    "chat-temperature": (CHAT, ["--temperature", "-1"], ["temperature", "-1"]),
    "chat-top-p": (CHAT, ["--top-p", "2"], ["top_p", "2"]),
    "chat-max-tokens": (CHAT, ["--max-tokens", "0"], ["max_tokens"]),
    "edit-max-tokens": (EDIT, ["--max-tokens", "0"], ["--max-tokens"]),
    "edit-write-no-file": (EDIT, ["--write"], ["--write", "FILE"]),
    "edit-dtype": (EDIT, ["--dtype", "int8"], ["--dtype", "int8"]),
    "chat-drafter": (CHAT, ["--spec", "ngram", "--drafter", "/nonexistent/drafter"], ["/nonexistent/drafter", "not found"]),
}


@pytest.fixture(scope="module")
def mistakes():
    """All the mistakes at once (each only starts Python): {id: (returncode, stdout + stderr)}."""
    procs = {k: subprocess.Popen([sys.executable, str(s), *args], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=ENV)
             for k, (s, args, _) in MISTAKES.items()}
    done = {}
    for k, p in procs.items():
        out, _ = p.communicate(timeout=LOAD_S)
        done[k] = (p.returncode, out)
    return done


@pytest.mark.parametrize("case", list(MISTAKES))
def test_mistakes_get_one_clear_line(mistakes, case):
    rc, out = mistakes[case]
    assert rc != 0, out
    assert "Traceback" not in out, out
    errors = [ln for ln in out.splitlines() if "error:" in ln]
    assert len(errors) == 1, out
    for word in MISTAKES[case][2]:
        assert word in errors[0], out
