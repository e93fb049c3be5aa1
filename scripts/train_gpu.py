"""The Spark recipe end to end on one CUDA GPU in about 10 minutes: the target answers the
training prompts, one pass extracts its features, the drafter trains, its confidences are
calibrated and the n-gram table is fitted; the drafter folder is written to DEST.

    python scripts/train_gpu.py DEST [--model PATH] [--work runs/spark-gpu] [--minutes 9] [--init DIR]
                                     [--keep FILE]
    python scripts/train_gpu.py DEST --toy        # a few prompts and steps (tests; on the GPU if any)

--keep FILE (e.g. checkpoints/smollm2-135m-instruct/answers.jsonl.gz) pools the answers of
runs in several short GPU sessions: the prompts answered there are skipped, the new answers
added to it, and all of them trained on; copy the file back after each session. --init starts
the fit from a drafter folder, such as the shipped one, instead of from scratch.
Then: LLM(spec="hybrid", drafter=DEST). The same stages run on a CPU with `python -m minispark.train`.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from minispark.train import Recipe, run

# Minutes of each timed stage on a GPU; --minutes scales them. The answers are the data that
# matters (chat prompts the target answers, in its voice); reading text is cut to 800k tokens so
# that every feature fits in GPU memory for the fit.
GPU_MINUTES = {"data": 2.5, "fit": 3.0}
TOTAL_MINUTES, AFTER_FIT_MINUTES = 9.0, 1.5  # the fit is cut short to leave calibration its time
GPU = dict(batch=256, max_tokens=384, questions=4000, text_tokens=800_000, batch_docs=64, anchors=32,
           eval_every=500)
TOY_MINUTES = {"data": 0.01, "fit": 1.0}
TOY = dict(device="cuda" if torch.cuda.is_available() else "cpu", batch=4, max_tokens=12, max_prompts=8,
           questions=4, question_tokens=24, text_tokens=3000, draft_vocab=2048, batch_docs=2, anchors=4,
           width=64, eval_every=2, max_steps=4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dest", type=Path, help="folder for the drafter (spark.safetensors, spark.json, ngram.json)")
    ap.add_argument("--model", default=None, help="the target (default: the demo model)")
    ap.add_argument("--work", type=Path, default=None, help="work folder (default: DEST/work)")
    ap.add_argument("--minutes", type=float, default=TOTAL_MINUTES, help="the whole run's time on a GPU")
    ap.add_argument("--init", type=Path, default=None, help="start the fit from this drafter folder")
    ap.add_argument("--keep", type=Path, default=None, metavar="FILE",
                    help="the target's kept answers (gzip JSON lines) to read and add to")
    ap.add_argument("--toy", action="store_true", help="toy sizes, to test the script (on the CPU where there is no GPU)")
    a = ap.parse_args()
    if a.init is not None and not (a.init / "spark.json").is_file():
        ap.error(f"--init {a.init}: no spark.json there; name a drafter folder (e.g. checkpoints/smollm2-135m-instruct)")
    if not a.toy and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run `python -m minispark.train all` on a CPU, or pass --toy")
    r = Recipe(model=a.model, **(TOY if a.toy else {**GPU, "device": "cuda"}))
    work = a.work or a.dest / "work"
    start = time.time()
    for stage in ("data", "features", "fit", "calibrate", "ngram"):
        t, scale = time.time(), 1 if a.toy else a.minutes / TOTAL_MINUTES
        minutes = scale * (TOY_MINUTES if a.toy else GPU_MINUTES).get(stage, 0)
        if stage == "fit" and not a.toy:
            minutes = max(0.5, min(minutes, a.minutes - scale * AFTER_FIT_MINUTES - (t - start) / 60))
        # --init for the fit only: calibrate then takes the fit's drafter
        run(stage, work, a.dest, r, minutes, init=a.init if stage == "fit" else None, keep=a.keep)
        print(f"stage {stage}: {time.time() - t:.0f} s", flush=True)
    print(f"drafter written to {a.dest} in {(time.time() - start) / 60:.1f} minutes")


if __name__ == "__main__":
    main()
