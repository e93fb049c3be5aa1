"""verify.py: target distribution, counter-based uniforms, sampling, lossless acceptance, chains.

The statistical tests are deterministic (counter-based randomness, fixed seeds), so a pass is
reproducible; the thresholds (p-value 1e-3 on chi-square) would catch a biased rule by a wide
margin at these sample sizes.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings, strategies as st
from scipy import stats

from minispark.verify import (
    ACCEPT_STREAM, SAMPLE_STREAM, accept_chains, accept_tokens, bonus_tokens, greedy, sample, target_probs, uniform,
)

P_MIN = 1e-3  # p-value threshold


def chi2_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of observed counts [V] against probs [V]; zero-probability bins must be empty,
    bins with expected count < 5 are merged."""
    counts, probs = counts.double(), probs.double()
    assert counts[probs <= 0].sum() == 0, "a token of probability 0 was emitted"
    N = counts.sum()
    support = probs > 0
    obs, exp = counts[support], probs[support] / probs[support].sum() * N
    small = exp < 5
    if small.any():
        obs = torch.cat([obs[~small], obs[small].sum()[None]])
        exp = torch.cat([exp[~small], exp[small].sum()[None]])
    if obs.numel() < 2:
        return 1.0
    return float(stats.chisquare(obs.numpy(), exp.numpy()).pvalue)


# -- (a) target_probs -----------------------------------------------------------------------

def ref_target_probs(logits: list[float], temperature: float, top_k: int, top_p: float) -> list[float]:
    V = len(logits)
    if temperature <= 0:
        j = max(range(V), key=lambda i: logits[i])
        return [1.0 if i == j else 0.0 for i in range(V)]
    x = [v / temperature for v in logits]
    order = sorted(range(V), key=lambda i: -x[i])
    kept = order[:top_k] if top_k > 0 else order
    mx = max(x[i] for i in kept)
    z = sum(math.exp(x[i] - mx) for i in kept)
    p = {i: math.exp(x[i] - mx) / z for i in kept}
    # HF-style top-p: the smallest most-likely set whose mass reaches top_p (at least one token).
    out, mass = {}, 0.0
    for i in kept:
        if out and mass >= top_p:
            break
        out[i] = p[i]
        mass += p[i]
    s = sum(out.values())
    return [out.get(i, 0.0) / s for i in range(V)]


def top_p_margin(logits: list[float], temperature: float, top_k: int, top_p: float) -> float:
    """Distance of top_p from the nearest cumulative mass (a boundary case is float-sensitive)."""
    if temperature <= 0:
        return 1.0
    p = sorted(ref_target_probs(logits, temperature, top_k, 1.0), reverse=True)
    cum, best = 0.0, 1.0
    for v in p:
        cum += v
        best = min(best, abs(cum - top_p))
    return best


@st.composite
def prob_rows(draw):
    V = draw(st.integers(2, 24))
    R = draw(st.integers(1, 6))
    rows = []
    for _ in range(R):
        scale = draw(st.sampled_from([0.3, 1.0, 3.0]))
        g = torch.Generator().manual_seed(draw(st.integers(0, 2**32)))
        logits = (scale * torch.randn(V, generator=g)).tolist()
        temperature = draw(st.sampled_from([0.0, 0.05, 0.5, 1.0, 1.7]))
        top_k = draw(st.integers(0, V + 2))
        top_p = draw(st.sampled_from([1.0, 0.99, 0.9, 0.5, 0.1, 1e-6]) | st.floats(0.01, 1.0))
        rows.append((logits, temperature, top_k, top_p))
    return rows


@settings(max_examples=200, deadline=None)
@given(prob_rows())
def test_target_probs_matches_reference(rows):
    for logits, t, k, p in rows:
        # Exclude near-ties (the order of tied logits is arbitrary) and top_p on a mass boundary.
        xs = sorted(logits)
        assume(all(b - a > 1e-5 for a, b in zip(xs, xs[1:])))
        assume(top_p_margin(logits, t, k, p) > 1e-5)
    logits = torch.tensor([r[0] for r in rows], dtype=torch.float32)
    got = target_probs(
        logits,
        torch.tensor([r[1] for r in rows]),
        torch.tensor([r[2] for r in rows]),
        torch.tensor([r[3] for r in rows]),
    )
    want = torch.tensor([ref_target_probs(*r) for r in rows], dtype=torch.float32)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(got.sum(-1), torch.ones(len(rows)), atol=1e-5, rtol=0)
    assert ((got > 0).sum(-1) >= 1).all()


def test_target_probs_plain_softmax_and_point_mass():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 11, generator=g) * 2
    ones, zeros_k = torch.ones(5), torch.zeros(5, dtype=torch.long)
    torch.testing.assert_close(target_probs(logits, ones, zeros_k, ones), logits.softmax(-1))
    torch.testing.assert_close(target_probs(logits, ones * 0.5, zeros_k, ones), (logits / 0.5).softmax(-1))
    # Temperature 0: the argmax point mass, whatever top-k / top-p say.
    zero_t = torch.zeros(5)
    for k, p in [(0, 1.0), (3, 0.5), (1, 1e-6)]:
        got = target_probs(logits, zero_t, torch.full((5,), k), torch.full((5,), p))
        assert torch.equal(got, torch.nn.functional.one_hot(logits.argmax(-1), 11).float())
    # top_k = 1 and a tiny top_p both reduce to the argmax too.
    for k, p in [(1, 1.0), (0, 1e-6)]:
        got = target_probs(logits, ones, torch.full((5,), k), torch.full((5,), p))
        assert torch.equal(got, torch.nn.functional.one_hot(logits.argmax(-1), 11).float())


def test_top_p_on_renormalised_top_k():
    # probs after top-k = 2: [0.5, 0.5] -> top-p 0.6 needs both, although in the full
    # distribution the first token alone would carry less than 0.6.
    logits = torch.log(torch.tensor([[0.3, 0.3, 0.2, 0.2]]))
    logits[0, 1] -= 1e-3  # break the tie
    got = target_probs(logits, torch.ones(1), torch.tensor([2]), torch.tensor([0.6]))
    assert (got[0, :2] > 0.49).all() and (got[0, 2:] == 0).all()
    got = target_probs(logits, torch.ones(1), torch.tensor([0]), torch.tensor([0.6]))
    assert (got[0, :3] > 0).all() and got[0, 3] == 0  # 0.3 + 0.3 < 0.6 <= 0.8


# -- (b) uniform ----------------------------------------------------------------------------

def test_uniform_range_and_determinism():
    seed = torch.arange(2000) * 7919 - 5000  # negative seeds too
    pos = torch.arange(2000) % 300
    for stream in (ACCEPT_STREAM, SAMPLE_STREAM, 0, 12345):
        u = uniform(seed, pos, stream)
        assert u.shape == (2000,) and u.dtype == torch.float32
        assert (u > 0).all() and (u < 1).all()
        assert torch.equal(u, uniform(seed.clone(), pos.clone(), stream))
        uv = uniform(seed, pos, stream, 64)
        assert uv.shape == (2000, 64)
        assert (uv > 0).all() and (uv < 1).all()
        assert torch.equal(uv, uniform(seed, pos, stream, 64))
    # Row r depends on (seed[r], pos[r]) only, not on the batch it sits in.
    u = uniform(seed, pos, SAMPLE_STREAM, 16)
    assert torch.equal(u[37:38], uniform(seed[37:38], pos[37:38], SAMPLE_STREAM, 16))
    # Large positions and seeds are fine.
    big = uniform(torch.tensor([2**31 - 1, 2**40]), torch.tensor([2**31, 10**9]), ACCEPT_STREAM)
    assert ((big > 0) & (big < 1)).all()


def test_uniform_differs_across_inputs():
    n = 4096
    base_seed, base_pos = torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.long)
    ar = torch.arange(n)
    for u in [
        uniform(ar, base_pos, ACCEPT_STREAM),  # across seeds
        uniform(base_seed, ar, ACCEPT_STREAM),  # across positions
        uniform(base_seed[:1], base_pos[:1], ACCEPT_STREAM, n)[0],  # across vocab entries
        uniform(ar << 32 | 7, base_pos, ACCEPT_STREAM),  # across seeds' high bits (all 64 count)
    ]:
        # 23-bit resolution: a handful of birthday collisions at most.
        assert u.unique().numel() >= n - 4
    s, p = torch.arange(n) * 31 + 5, torch.arange(n) * 17
    a, b = uniform(s, p, ACCEPT_STREAM), uniform(s, p, SAMPLE_STREAM)
    assert (a != b).float().mean() > 0.999
    # Vocab entries differ from each other and from the scalar stream.
    uv = uniform(s, p, SAMPLE_STREAM, 8)
    for i in range(8):
        for j in range(i + 1, 8):
            assert (uv[:, i] != uv[:, j]).float().mean() > 0.999
    # No obvious correlation between neighbouring seeds / positions / streams / entries.
    pairs = [
        (uniform(s, p, ACCEPT_STREAM), uniform(s + 1, p, ACCEPT_STREAM)),
        (uniform(s, p, ACCEPT_STREAM), uniform(s, p + 1, ACCEPT_STREAM)),
        (a, b), (a, uv[:, 0]), (uv[:, 0], uv[:, 1]),
        (uniform(s, p, SAMPLE_STREAM, 4)[:, 2], uniform(s, p + 1, SAMPLE_STREAM, 4)[:, 2]),
    ]
    for x, y in pairs:
        corr = torch.corrcoef(torch.stack([x, y]))[0, 1]
        assert abs(float(corr)) < 5 / math.sqrt(n), float(corr)


@pytest.mark.parametrize("layout", ["seeds", "positions", "vocab", "mixed"])
def test_uniform_is_uniform(layout):
    n = 50_000
    ar = torch.arange(n)
    if layout == "seeds":
        u = uniform(ar, torch.full((n,), 3), ACCEPT_STREAM)
    elif layout == "positions":
        u = uniform(torch.full((n,), 42), ar, SAMPLE_STREAM)
    elif layout == "vocab":
        u = uniform(torch.arange(500), torch.arange(500) * 3, SAMPLE_STREAM, 100).flatten()
    else:
        u = uniform(ar % 97, ar // 97, ACCEPT_STREAM)
    assert stats.kstest(u.double().numpy(), "uniform").pvalue > P_MIN
    counts = torch.histc(u, bins=20, min=0, max=1)
    assert chi2_p(counts, torch.full((20,), 0.05)) > P_MIN


# -- (c) sample -----------------------------------------------------------------------------

@pytest.mark.parametrize("probs", [
    [0.125] * 8,
    [0.4, 0.2, 0.1, 0.1, 0.08, 0.06, 0.04, 0.02],
    [0.0, 0.5, 0.0, 0.3, 0.0, 0.15, 0.05, 0.0],
    [0.97, 0.01, 0.01, 0.005, 0.005, 0.0, 0.0, 0.0],
    [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0],
])
def test_sample_matches_distribution(probs):
    N = 20_000
    p = torch.tensor(probs)
    P = p.expand(N, -1)
    pos = torch.arange(N) + 1000  # the counter: many different positions, one seed
    x = sample(P, uniform(torch.full((N,), 7), pos, SAMPLE_STREAM, 8))
    counts = torch.bincount(x, minlength=8)
    assert chi2_p(counts, p) > P_MIN
    # bonus_tokens is the same sampler on the same stream.
    assert torch.equal(bonus_tokens(P, torch.full((N,), 7), pos), x)
    # Rows with different seeds (same position) also give the distribution.
    y = sample(P, uniform(torch.arange(N), torch.full((N,), 5), SAMPLE_STREAM, 8))
    assert chi2_p(torch.bincount(y, minlength=8), p) > P_MIN


def test_the_race_never_picks_a_token_without_mass():
    """At seed 0, position 52, token 24,186 of a 49,152-token vocabulary (SmolLM2's) the hash's
    top 24 bits are all ones: with 24-bit uniforms that one rounded to exactly 1.0, its
    exponential to 0, and a probability of 0 over it to NaN, which argmax takes. A greedy row
    in a sampled batch (a point mass) then emitted token 24,186."""
    V, seed, pos = 49_152, torch.tensor([0]), torch.tensor([52])
    assert uniform(seed, pos, SAMPLE_STREAM, V).max() < 1
    point = torch.zeros(1, V)
    point[0, 7] = 1.0
    assert bonus_tokens(point, seed, pos).item() == 7


def test_unfiltered_probs_skip_the_sort_and_agree_with_it():
    torch.manual_seed(0)
    logits = torch.randn(6, 50) * 3
    t = torch.tensor([0.0, 0.3, 0.7, 1.0, 1.5, 0.0])
    off_k, off_p = torch.zeros(6, dtype=torch.long), torch.ones(6)
    torch.testing.assert_close(target_probs(logits, t, off_k, off_p, filtered=False),
                               target_probs(logits, t, off_k, off_p, filtered=True))


# -- (d) losslessness of accept_tokens --------------------------------------------------------

T_TRIALS = 24_000
P_CONFIGS = {  # name: (V, logits seed, temperature, top_k, top_p)
    "plain": (6, 1, 1.0, 0, 1.0),
    "hot": (8, 2, 1.6, 0, 1.0),
    "cold": (8, 3, 0.6, 0, 1.0),
    "top_k": (8, 4, 1.0, 3, 1.0),
    "top_p": (8, 5, 1.0, 0, 0.8),
    "top_k_top_p": (7, 6, 1.2, 5, 0.7),
}


def make_p(name: str) -> torch.Tensor:
    V, s, t, k, tp = P_CONFIGS[name]
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(s)) * 1.5
    return target_probs(logits, torch.tensor([t]), torch.tensor([k]), torch.tensor([tp]))[0]


def trials(T: int, salt: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + salt)
    seed = torch.randint(0, 2**31 - 1, (T,), generator=g)
    pos = torch.randint(0, 100_000, (T,), generator=g)
    return seed, pos


def draw(dist: torch.Tensor, T: int, salt: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(2000 + salt)
    return torch.multinomial(dist, T, replacement=True, generator=g)


def check_lossless(p: torch.Tensor, draft: torch.Tensor, q: torch.Tensor | None, salt: int, want_rate: float):
    T, V = draft.shape[0], p.shape[0]
    seed, pos = trials(T, salt)
    P = p.expand(T, -1).contiguous()
    Q = None if q is None else q.expand(T, -1).contiguous()
    accept, alt = accept_tokens(P, draft, Q, seed, pos)
    assert accept.dtype == torch.bool and accept.shape == (T,) and alt.shape == (T,)
    assert ((alt >= 0) & (alt < V)).all()
    emitted = torch.where(accept, draft, alt)
    counts = torch.bincount(emitted, minlength=V)
    pv = chi2_p(counts, p)
    assert pv > P_MIN, (pv, counts.tolist(), (p * T).tolist())
    rate = accept.float().mean().item()
    sigma = math.sqrt(max(want_rate * (1 - want_rate), 1e-12) / T)
    assert abs(rate - want_rate) <= 5 * sigma + 1e-9, (rate, want_rate)
    # A draft token of target probability 0 is never accepted.
    assert not (accept & (p[draft] == 0)).any()


@pytest.mark.parametrize("pname", list(P_CONFIGS))
def test_lossless_point_mass_fixed_token(pname):
    p = make_p(pname)
    V = p.shape[0]
    order = p.argsort(descending=True)
    tokens = {order[0].item(), order[V // 2].item(), order[-1].item()}  # likely, middling, maybe p = 0
    for i, x in enumerate(sorted(tokens)):
        draft = torch.full((T_TRIALS,), x)
        check_lossless(p, draft, None, salt=10 * i + 1, want_rate=p[x].item())


@pytest.mark.parametrize("pname", list(P_CONFIGS))
def test_lossless_point_mass_sampled_draft(pname):
    # An n-gram drafter's token is a point mass, whatever distribution it came from.
    p = make_p(pname)
    V = p.shape[0]
    g = torch.Generator().manual_seed(V)
    for i, r in enumerate([
        torch.rand(V, generator=g) ** 3,
        torch.where(p > 0, 0.0, 1.0) + torch.where(torch.arange(V) == p.argmax(), 1.0, 0.0),  # mostly p = 0 tokens
        p.clone(),
    ]):
        r = r / r.sum()
        draft = draw(r, T_TRIALS, salt=20 + i)
        check_lossless(p, draft, None, salt=20 + i, want_rate=(r * p).sum().item())


def draft_distributions(p: torch.Tensor) -> dict[str, torch.Tensor]:
    V = p.shape[0]
    g = torch.Generator().manual_seed(100 + V)
    dense = torch.rand(V, generator=g) + 0.05
    # q = 0 where p > 0 (the most likely target tokens) and q > 0 where p = 0.
    holes = torch.rand(V, generator=g)
    holes[p.argsort(descending=True)[:2]] = 0.0
    holes[p == 0] += 1.0
    peaked = torch.full((V,), 0.01)
    peaked[p.argsort()[0]] = 1.0  # puts its mass on the least likely token
    return {
        "dense": dense / dense.sum(),
        "holes": holes / holes.sum(),
        "peaked": peaked / peaked.sum(),
        "equal": p.clone(),
        "one_hot": torch.nn.functional.one_hot(p.argsort(descending=True)[1], V).float(),
    }


@pytest.mark.parametrize("qname", ["dense", "holes", "peaked", "equal", "one_hot"])
@pytest.mark.parametrize("pname", list(P_CONFIGS))
def test_lossless_with_draft_q(pname, qname):
    p = make_p(pname)
    q = draft_distributions(p)[qname]
    salt = 100 + 7 * list(P_CONFIGS).index(pname) + ["dense", "holes", "peaked", "equal", "one_hot"].index(qname)
    draft = draw(q, T_TRIALS, salt=salt)
    check_lossless(p, draft, q, salt=salt, want_rate=torch.minimum(p, q).sum().item())


def test_explicit_one_hot_q_equals_point_mass():
    p = make_p("top_k_top_p")
    V, T = p.shape[0], 5000
    draft = draw(torch.full((V,), 1.0 / V), T, salt=3)
    seed, pos = trials(T, 3)
    P = p.expand(T, -1)
    a1, alt1 = accept_tokens(P, draft, None, seed, pos)
    a2, alt2 = accept_tokens(P, draft, torch.nn.functional.one_hot(draft, V).float(), seed, pos)
    assert torch.equal(a1, a2) and torch.equal(alt1, alt2)


def test_q_equal_p_always_accepts():
    p = make_p("plain")
    T = 2000
    draft = draw(p, T, salt=4)
    seed, pos = trials(T, 4)
    accept, _ = accept_tokens(p.expand(T, -1), draft, p.expand(T, -1), seed, pos)
    assert accept.all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 16, 144])
def test_greedy_takes_the_first_of_tied_maxima(T, dtype):
    """bf16 logits tie often (8 bits of mantissa): every mode must pick the same token of a tie,
    the first, as argmax and transformers' greedy search do, however many rows a step packs."""
    g = torch.Generator().manual_seed(T)
    V = 49_152
    logits = torch.randint(0, 4, (T, V), generator=g).to(dtype)  # thousands of tied maxima per row
    assert torch.equal(greedy(logits), logits.argmax(-1))
    logits[:, 1000:] = logits.amax() + 1  # the first tied maximum is far into the row
    assert torch.equal(greedy(logits), torch.full((T,), 1000))


def test_greedy_rows_accept_iff_argmax():
    g = torch.Generator().manual_seed(9)
    T, V = 500, 8
    logits = torch.randn(T, V, generator=g)
    P = target_probs(logits, torch.zeros(T), torch.zeros(T, dtype=torch.long), torch.ones(T))
    draft = torch.randint(0, V, (T,), generator=g)
    draft[::2] = logits.argmax(-1)[::2]
    seed, pos = trials(T, 9)
    for q in (None, torch.softmax(torch.randn(T, V, generator=g), -1)):
        accept, alt = accept_tokens(P, draft, q, seed, pos)
        assert torch.equal(accept, draft == logits.argmax(-1))
        assert torch.equal(alt[~accept], logits.argmax(-1)[~accept])


def test_alt_is_independent_of_the_accept_decision_given_rejection():
    # For a point-mass draft x, a rejection must emit a sample of p with x removed.
    p = make_p("hot")
    x = p.argmax().item()
    draft = torch.full((T_TRIALS,), x)
    seed, pos = trials(T_TRIALS, 77)
    accept, alt = accept_tokens(p.expand(T_TRIALS, -1), draft, None, seed, pos)
    rest = p.clone()
    rest[x] = 0
    assert chi2_p(torch.bincount(alt[~accept], minlength=p.shape[0]), rest / rest.sum()) > P_MIN


# -- (e) accept_chains ----------------------------------------------------------------------

def chains(acc, alt, draft, length):
    return accept_chains(torch.tensor(acc, dtype=torch.bool), torch.tensor(alt), torch.tensor(draft), torch.tensor(length))


def test_accept_chains_hand_made():
    draft = [[10, 11, 12, 13, 0]] * 5
    alt = [[20, 21, 22, 23, 24]] * 5
    acc = [
        [1, 1, 1, 1, 1],  # all accepted, length 4 -> 4 drafts + bonus alt[4]
        [1, 1, 0, 1, 1],  # first rejection at 2 -> n = 3, out[2] = alt[2]
        [1, 1, 1, 1, 1],  # length 0 -> just alt[0]
        [1, 1, 1, 1, 1],  # length 2, accept flags past it ignored -> bonus alt[2]
        [0, 1, 1, 1, 1],  # immediate rejection
    ]
    length = [4, 4, 0, 2, 3]
    out, n = chains(acc, alt, draft, length)
    assert n.tolist() == [5, 3, 1, 3, 1]
    assert out[0].tolist() == [10, 11, 12, 13, 24]
    assert out[1, :3].tolist() == [10, 11, 22]
    assert out[2, :1].tolist() == [20]
    assert out[3, :3].tolist() == [10, 11, 22]
    assert out[4, :1].tolist() == [20]


def test_accept_chains_ignores_flags_past_length():
    draft = [[1, 2, 3, 0]]
    alt = [[5, 6, 7, 8]]
    for tail in ([0, 0], [1, 1], [0, 1], [1, 0]):
        out, n = chains([[1] + tail + [1]], alt, draft, [1])
        assert n.tolist() == [2] and out[0, :2].tolist() == [1, 6]


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_accept_chains_matches_reference(data):
    R, Q = data.draw(st.integers(1, 6)), data.draw(st.integers(1, 9))
    grid = lambda s: [[data.draw(s) for _ in range(Q)] for _ in range(R)]
    acc, alt, draft = grid(st.booleans()), grid(st.integers(0, 99)), grid(st.integers(100, 199))
    length = [data.draw(st.integers(0, Q - 1)) for _ in range(R)]
    out, n = chains(acc, alt, draft, length)
    assert out.shape == (R, Q) and n.shape == (R,)
    for r in range(R):
        j = 0
        while j < length[r] and acc[r][j]:
            j += 1
        want = draft[r][:j] + [alt[r][j]]
        assert n[r].item() == j + 1
        assert out[r, : j + 1].tolist() == want
