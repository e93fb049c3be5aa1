"""The Spark recipe end to end on one CUDA GPU in about 10 minutes: the target answers the
training prompts, one pass extracts its features, the drafter trains, its confidences are
calibrated and the n-gram table is fitted; the drafter folder is written to DEST.

    python scripts/train_gpu.py DEST [--model PATH] [--work runs/spark-gpu]
    python scripts/train_gpu.py DEST --toy        # a few prompts and steps on the CPU (tests)

Then: LLM(spec="hybrid", drafter=DEST). The same stages run on a CPU with `python -m minispark.train`.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from minispark.train import Recipe, run

# Minutes of each timed stage on a GPU; features, calibration and the table take about three
# more. The answers are the data that matters (chat prompts the target answers, in its voice);
# reading text is cut to 800k tokens so that every feature fits in GPU memory for the fit.
GPU_MINUTES = {"data": 2.5, "fit": 3.0}
TOTAL_MINUTES, AFTER_FIT_MINUTES = 9.0, 1.5  # the fit is cut short to leave calibration its time
GPU = dict(batch=256, max_tokens=384, questions=4000, text_tokens=800_000, batch_docs=64, anchors=32,
           eval_every=500)
TOY_MINUTES = {"data": 0.01, "fit": 1.0}
TOY = dict(device="cpu", batch=4, max_tokens=12, max_prompts=8, questions=4, question_tokens=24, text_tokens=3000,
           draft_vocab=2048, batch_docs=2, anchors=4, width=64, eval_every=2, max_steps=4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dest", type=Path, help="folder for the drafter (spark.safetensors, spark.json, ngram.json)")
    ap.add_argument("--model", default=None, help="the target (default: the demo model)")
    ap.add_argument("--work", type=Path, default=None, help="work folder (default: DEST/work)")
    ap.add_argument("--toy", action="store_true", help="toy sizes on the CPU, to test the script")
    a = ap.parse_args()
    if not a.toy and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run `python -m minispark.train all` on a CPU, or pass --toy")
    r = Recipe(model=a.model, **(TOY if a.toy else {**GPU, "device": "cuda"}))
    work = a.work or a.dest / "work"
    start = time.time()
    for stage in ("data", "features", "fit", "calibrate", "ngram"):
        t, minutes = time.time(), (TOY_MINUTES if a.toy else GPU_MINUTES).get(stage, 0)
        if stage == "fit" and not a.toy:
            minutes = max(0.5, min(minutes, TOTAL_MINUTES - AFTER_FIT_MINUTES - (t - start) / 60))
        run(stage, work, a.dest, r, minutes)
        print(f"stage {stage}: {time.time() - t:.0f} s", flush=True)
    print(f"drafter written to {a.dest} in {(time.time() - start) / 60:.1f} minutes")


if __name__ == "__main__":
    main()
