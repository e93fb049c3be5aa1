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

# minutes of each timed stage on a GPU; features, calibration and the table take about two more
GPU_MINUTES = {"data": 3.0, "fit": 4.5}
GPU = dict(batch=128, max_tokens=384, text_tokens=2_000_000, batch_docs=64, anchors=32, eval_every=500)
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
    run("data", work, a.dest, r, 0.01 if a.toy else GPU_MINUTES["data"])
    run("features", work, a.dest, r, 0)
    run("fit", work, a.dest, r, 1.0 if a.toy else GPU_MINUTES["fit"])
    run("calibrate", work, a.dest, r, 0)
    run("ngram", work, a.dest, r, 0)
    print(f"drafter written to {a.dest} in {(time.time() - start) / 60:.1f} minutes")


if __name__ == "__main__":
    main()
