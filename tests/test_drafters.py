"""The drafter plug-in: a model-free drafter is one small class, the hybrid takes any list of
drafters, and a drafter that breaks the contract is refused up front."""
from __future__ import annotations

import pytest
import torch

from conftest import FLAT_COST, Bigram, ByteTokenizer, bigram_drafter, reference_greedy, tiny_llm, tiny_pair
from minispark import Drafter, NgramDrafter, SamplingParams
from minispark.api import LLM


def test_a_history_drafter_proposes_what_followed_its_last_token():
    tokens = torch.tensor([[5, 6, 7, 5, 9, 5, 0, 0], [1, 2, 3, 4, 0, 0, 0, 0]])
    draft, conf = Bigram().propose(tokens, torch.tensor([6, 4]))
    # row 0 ends in 5, last followed by 9, which was followed by 5, then 9 again
    assert draft[0].tolist() == [9, 5, 9, 5] and conf[0].tolist() == [0.5] * 4
    assert conf[1].tolist() == [0.0] * 4  # 4 never occurred before: nothing proposed
    assert draft.shape == conf.shape == (2, Bigram.k)


def test_a_third_drafter_in_the_hybrid_keeps_greedy_output_and_gets_its_own_count():
    llm = tiny_llm("three", initializer_range=0.02, vocab_size=32, max_batch_size=2)
    assert [d.name for d in llm.engine.drafters] == ["ngram", "spark", "bigram"]
    prompts = [[5, 6, 7, 8, 9] * 3, [3, 4, 3, 4, 3], [10, 11, 12]]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=30))
    for p, o in zip(prompts, outs):
        assert o.token_ids == reference_greedy(llm, p, 30)
        assert set(o.accepted) == {"ngram", "spark", "bigram", "target"} and set(o.chains) == {"ngram", "spark", "bigram"}
        assert sum(o.accepted.values()) == len(o.token_ids)
    s = llm.stats()
    assert s["bigram_chains"] > 0 and s["tokens"] == sum(s[k] for k in llm.sources)


def test_the_bigram_drafter_alone_drafts_and_stays_lossless():
    _, net = tiny_pair(0, initializer_range=0.02, vocab_size=32)
    llm = LLM.from_model(net, ByteTokenizer(), drafters=[Bigram()], max_batch_size=2, cost=FLAT_COST)
    assert llm.spec == "bigram"
    prompt = [5, 6, 7, 8, 9] * 3
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40))[0]
    assert out.token_ids == reference_greedy(llm, prompt, 40) and out.accepted["bigram"] > 0


class Unsized(Drafter):
    name = "unsized"


class Named(Drafter):
    def __init__(self, name: str):
        super().__init__()
        self.name, self.k = name, 2


@pytest.mark.parametrize("drafters,match", [
    ([Unsized()], "must set k"),
    ([Named("a"), Named("a")], "distinct"),
    ([Named("target")], "distinct and not 'target'"),
    (["ngram"], "Drafter instances"),
])
def test_a_drafter_that_breaks_the_contract_is_refused_up_front(drafters, match):
    with pytest.raises(ValueError, match=match):
        LLM.from_model(tiny_pair()[1], ByteTokenizer(), drafters=drafters, cost=FLAT_COST)


def test_the_shortcuts_are_lists_of_drafters():
    _, net = tiny_pair(0)
    hybrid = LLM.from_model(net, ByteTokenizer(), spec="hybrid", drafter=bigram_drafter(net), cost=FLAT_COST)
    assert [type(d) for d in hybrid.engine.drafters] == [NgramDrafter, type(bigram_drafter(net))]
    assert LLM.from_model(net, ByteTokenizer(), spec="off", cost=FLAT_COST).engine.drafters == []
