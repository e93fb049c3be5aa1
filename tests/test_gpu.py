"""The CUDA path: the compiled step gives the eager step's tokens on the GPU without
recompiling for new prompts, and greedy output on the GPU is the CPU's. These tests need a CUDA
device and skip without one; `scripts/gpu_check.py` runs them (`pytest -m gpu`) on a GPU machine."""
from __future__ import annotations

import pytest
import torch

from conftest import FLAT_COST, ByteTokenizer, bigram_drafter, spec_drafters, tiny_pair
from minispark.api import LLM, SPEC_MODES, SamplingParams
from minispark.engine import Engine
from minispark.model import Transformer
from minispark.weights import args_from_hf_config, build_model
from test_compile import assert_compiled_matches_eager

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def cuda_pair(seed: int = 0, **overrides) -> tuple[Transformer, Transformer]:
    """(cpu_model, cuda_model) in fp32 with tiny_pair's weights for this seed. Built on the
    device rather than moved there: the model's rope frequencies are a plain attribute."""
    hf, cpu = tiny_pair(seed, **overrides)
    cuda = build_model(args_from_hf_config(hf.config.to_dict()), hf.state_dict(), torch.float32, "cuda")
    return cpu, cuda


@pytest.mark.parametrize("spec", SPEC_MODES)
def test_compiled_step_matches_eager_on_cuda(spec):
    torch._dynamo.reset()
    cpu, eager_net = cuda_pair(3, initializer_range=0.1, vocab_size=48)
    _, compiled_net = cuda_pair(3, initializer_range=0.1, vocab_size=48)
    # One drafter per engine, made from the CPU copy (the engine moves it to the device).
    eager = Engine(eager_net, spec_drafters(spec, cpu), 4, 160)
    compiled = Engine(compiled_net, spec_drafters(spec, cpu), 4, 160, compile=True)
    assert_compiled_matches_eager(eager, compiled, spec, trials=2)


PROMPTS = ["def add(a, b):\n    return a + b\n\ndef add(a, b):\n", "abcabcabcabc", "the cat and the cat and",
           "x = [1, 2, 3]\ny = [1, 2,"]


# Compiled, only "off": its few graphs (one per row bucket) compile quickly; the speculative
# modes' compiled steps are compared with eager ones above.
@pytest.mark.parametrize("spec,compile", [(s, False) for s in SPEC_MODES] + [("off", True)])
def test_greedy_output_on_cuda_matches_cpu(spec, compile):
    torch._dynamo.reset()
    cpu, cuda = cuda_pair(1, initializer_range=0.1)  # wide logits: no near-ties for rounding to flip

    def run(net: Transformer, compile: bool) -> list[tuple[list[int], str]]:
        llm = LLM.from_model(net, ByteTokenizer(eos=2), spec=spec, max_batch_size=4, max_seq_len=256,
                             cost=FLAT_COST, drafter=bigram_drafter(cpu), compile=compile)
        # Five prompts on four slots: one waits for a free slot, as in continuous batching.
        outs = llm.generate(PROMPTS + PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=40))
        return [(o.token_ids, o.finish_reason) for o in outs]

    assert run(cuda, compile) == run(cpu, False)


def test_the_step_clock_reads_the_device_time_of_a_cuda_step():
    from minispark.engine import StepClock

    x = torch.randn(4096, 4096, device="cuda")
    x @ x  # warm-up
    with StepClock(x.device) as clock:
        y = x @ x
    y.sum().item()  # results on the host: the clock's events have completed
    assert 0 < clock.seconds() < 5.0
    # A profiled table learns from the steps it runs on the GPU too.
    _, net = cuda_pair(2)
    llm = LLM.from_model(net, ByteTokenizer(eos=2), spec="ngram", max_batch_size=4, max_seq_len=256)
    llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=24))
    assert llm.cost.drift and all(abs(v) < 5 for v in llm.cost.drift.values())



def test_a_steps_results_reach_the_host_once_their_copy_is_done():
    from dataclasses import fields

    from minispark.engine import StepOut

    vals = [torch.arange(6, device="cuda").view(2, 3) + i for i, _ in enumerate(fields(StepOut))]
    host, copied = StepOut(*vals).to_host()
    x = torch.randn(2048, 2048, device="cuda")
    for _ in range(20):  # the next step, queued behind the copy
        x = x @ x / 64
    copied.synchronize()
    for f, v in zip(fields(StepOut), vals):
        assert getattr(host, f.name).device.type == "cpu" and torch.equal(getattr(host, f.name), v.cpu())
