"""The decode step is one static graph: torch.compile(fullgraph=True) takes it whole, new prompts
never recompile it, and the compiled step gives the eager step's tokens."""
from __future__ import annotations

import random

import pytest
import torch

from conftest import spec_drafters, tiny_pair
from minispark.api import SamplingParams
from minispark.engine import Engine


def run_steps(eng: Engine, prompts: list[list[int]], sampling: bool, steps: int = 3) -> list[tuple]:
    """Prefill `prompts` into slots 0.. and run a few steps of one fixed bucket."""
    params = SamplingParams(temperature=0.8 if sampling else 0.0, top_k=20, top_p=0.9, max_tokens=50)
    for i, p in enumerate(prompts):
        eng.set_request(i, p, params, seed=i, stop_ids=[2])
    eng.prefill(list(range(len(prompts))), prompts, sampling)
    outs = []
    for _ in range(steps):
        o = eng.step(len(prompts), 8, 4, 128, sampling)
        outs.append((o.tokens.clone(), o.n.clone(), o.finish.clone()))
    return outs


@pytest.mark.parametrize("spec", ["off", "ngram", "spark", "hybrid"])
def test_compiled_step_matches_eager_without_recompiling(spec):
    torch._dynamo.reset()
    _, net = tiny_pair(3, initializer_range=0.1, vocab_size=48)
    eager = Engine(net, spec_drafters(spec, net), 4, 160)
    _, net2 = tiny_pair(3, initializer_range=0.1, vocab_size=48)
    compiled = Engine(net2, spec_drafters(spec, net2), 4, 160, compile=True)
    assert_compiled_matches_eager(eager, compiled, spec, trials=3)


def assert_compiled_matches_eager(eager: Engine, compiled: Engine, spec: str, trials: int) -> None:
    """The first trial compiles one graph per sampling flag; later ones, with new prompts of new
    lengths (vocabulary 48), must reuse them and give the eager step's tokens."""
    rng = random.Random(0)
    samplings = [False, True] if spec in ("ngram", "hybrid") else [False]
    try:
        for trial in range(trials):
            torch._dynamo.config.error_on_recompile = trial > 0
            frag = [rng.randrange(3, 48) for _ in range(3)]
            prompts = [frag * 4, [rng.randrange(3, 48) for _ in range(rng.randrange(2, 20))],
                       frag * 2 + [5], [rng.randrange(3, 48) for _ in range(rng.randrange(2, 20))]]
            for sampling in samplings:
                for a, b in zip(run_steps(eager, prompts, sampling), run_steps(compiled, prompts, sampling)):
                    assert all(torch.equal(x, y) for x, y in zip(a, b))
    finally:
        torch._dynamo.config.error_on_recompile = False
