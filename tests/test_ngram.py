"""NgramDrafter against a plain-Python reference matcher.

Reference rule: for n from n_max down to n_min, take the last n tokens of the history
h = tokens[r, :hist_len[r]] and find the earlier starts w with h[w:w+n] == suffix and
w + n < len(h) (at least one continuation token; the window may overlap the suffix). The longest
n wins, the earliest occurrence among equals (in code edits the prompt's copy; in a run like
"x x x x" the longest continuation). The proposal is h[w+n : w+n+K], valid = its length, m = n.
No match: valid 0, m 0.
"""
from __future__ import annotations

import torch
from hypothesis import given, settings, strategies as st

from minispark.drafters import NgramDrafter


def ref_match(h: list[int], n_min: int, n_max: int, k: int) -> tuple[list[int], int, int]:
    L = len(h)
    for n in range(n_max, n_min - 1, -1):
        if n < 1 or L < n + 1:
            continue
        suffix = h[L - n:]
        starts = [w for w in range(L - n) if h[w:w + n] == suffix]  # w + n < L
        if starts:
            w = min(starts)
            cont = h[w + n:w + n + k]
            return cont, len(cont), n
    return [], 0, 0


def run_and_compare(rows: list[list[int]], hist_len: list[int], n_min: int, n_max: int, k: int):
    tokens = torch.tensor(rows, dtype=torch.long)
    hl = torch.tensor(hist_len, dtype=torch.long)
    draft, valid, m = NgramDrafter(n_min=n_min, n_max=n_max, k=k)(tokens, hl)
    assert draft.shape == (len(rows), k)
    assert valid.shape == m.shape == (len(rows),)
    results = []
    for r, row in enumerate(rows):
        cont, v, n = ref_match(row[:hist_len[r]], n_min, n_max, k)
        assert int(valid[r]) == v, (r, row[:hist_len[r]], cont)
        assert int(m[r]) == n, (r, row[:hist_len[r]], cont)
        assert draft[r, :v].tolist() == cont, (r, row[:hist_len[r]])
        results.append((cont, v, n))
    return results


def one(h: list[int], n_min: int, n_max: int, k: int, pad: int = 3, garbage: int = 0):
    """Run a single history (padded with `garbage`) and return (draft list, valid, m)."""
    ((cont, v, n),) = run_and_compare([h + [garbage] * pad], [len(h)], n_min, n_max, k)
    return cont, v, n


# -- explicit cases -------------------------------------------------------------------------

def test_reference_self_check():
    # The reference itself on a few hand-worked histories.
    assert ref_match([1, 2, 3, 4], 1, 3, 4) == ([], 0, 0)
    assert ref_match([5, 6, 7, 1, 5, 6], 2, 4, 3) == ([7, 1, 5], 3, 2)
    assert ref_match([0, 1, 0, 1, 0, 1, 0, 1], 2, 4, 8) == ([0, 1, 0, 1], 4, 4)  # earliest, w = 0
    assert ref_match([0, 1, 0, 1, 0, 1, 0, 1], 2, 4, 2) == ([0, 1], 2, 4)  # earliest, w = 0


def test_occurrence_choice_among_equal_lengths():
    # [1, 2] occurs at w = 0 (followed by 7 8 9 ...) and at w = 5 (followed by 4 4 1 2).
    h = [1, 2, 7, 8, 9, 1, 2, 4, 4, 1, 2]
    # Whatever K, the earliest occurrence wins.
    assert one(h, 2, 2, 2) == ([7, 8], 2, 2)
    assert one(h, 2, 2, 4) == ([7, 8, 9, 1], 4, 2)
    assert one(h, 2, 2, 6) == ([7, 8, 9, 1, 2, 4], 6, 2)


def test_no_match():
    assert one([1, 2, 3, 4, 5, 6, 7], 1, 4, 5) == ([], 0, 0)
    assert one([1, 2, 3, 1, 4], 2, 4, 5) == ([], 0, 0)  # only a 1-gram repeats


def test_match_at_very_start():
    h = [5, 6, 7, 1, 2, 3, 5, 6]
    assert one(h, 2, 4, 4) == ([7, 1, 2, 3], 4, 2)
    # The continuation runs up to the end of history and no further.
    assert one(h, 2, 4, 16) == ([7, 1, 2, 3, 5, 6], 6, 2)


def test_overlapping_repeats():
    abab = [0, 1] * 4
    # Longest n with an earlier occurrence leaving a continuation token: n = 6 at w = 0.
    assert one(abab, 1, 8, 8) == ([0, 1], 2, 6)
    # n_max = 4: the earliest, w = 0: the continuation runs into the suffix itself.
    assert one(abab, 2, 4, 8) == ([0, 1, 0, 1], 4, 4)
    assert one(abab, 2, 4, 2) == ([0, 1], 2, 4)
    aaaa = [3] * 6
    assert one(aaaa, 1, 3, 8) == ([3, 3, 3], 3, 3)  # earliest, w = 0
    assert one(aaaa, 1, 3, 2) == ([3, 3], 2, 3)  # earliest, w = 0
    assert one(aaaa, 1, 8, 8) == ([3], 1, 5)


def test_full_copy_of_prompt():
    prompt = list(range(10, 20))
    h = prompt + prompt[:3]
    # The suffix prompt[:3] matched at the start; the whole rest of the prompt follows,
    # then the copied part again.
    assert one(h, 2, 8, 16) == (prompt[3:] + prompt[:3], 10, 3)
    assert one(h, 2, 8, 4) == (prompt[3:7], 4, 3)
    # n_min above the copied length: no match.
    assert one(h, 4, 8, 4) == ([], 0, 0)


def test_longest_match_beats_more_recent():
    # [2, 3] occurs at w=5 (continuation 8), [1, 2, 3] only at w=0 (continuation 9 4).
    h = [5, 2, 3, 7, 6, 2, 3, 8, 1, 2, 3]
    assert one(h, 2, 2, 2) == ([7, 6], 2, 2)  # the earliest [2, 3]
    h = [1, 2, 3, 9, 4, 2, 3, 8, 1, 2, 3]
    assert one(h, 2, 4, 2) == ([9, 4], 2, 3)  # the longer match wins


def test_history_shorter_than_n():
    for L in range(0, 4):
        h = [7] * L
        cont, v, n = one(h, 3, 5, 4, pad=6, garbage=7)  # garbage would match if read
        assert (v, n) == (0, 0)
    # hist_len == n_min + 1 is the shortest with a match.
    assert one([7] * 4, 3, 5, 4, pad=6, garbage=7) == ([7], 1, 3)


def test_garbage_past_hist_len_ignored():
    rows = [
        [1, 2, 3, 1, 2, 9, 9, 9, 1, 2, 3, 4],  # hist 5: suffix [1, 2] -> 3, 1, 2
        [4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7],  # hist 3: nothing
        [4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7],  # full
        [0] * 12,                               # hist 0
    ]
    res = run_and_compare(rows, [5, 3, 12, 0], 2, 4, 6)
    assert res[0] == ([3, 1, 2], 3, 2)
    assert res[1] == ([], 0, 0)
    assert res[2] == ([4, 5, 6, 7, 4, 5], 6, 4)  # w = 0: the one with K tokens after it
    assert res[3] == ([], 0, 0)


def test_window_wider_than_buffer():
    # n_max larger than the whole buffer must not fail and must fall back to shorter n.
    rows = [[1, 2, 1, 2, 1]]
    res = run_and_compare(rows, [5], 1, 12, 4)
    assert res[0] == ([2, 1], 2, 3)


# -- property test against the reference ------------------------------------------------------

@st.composite
def batches(draw):
    alphabet = draw(st.integers(2, 6))
    C = draw(st.integers(1, 40))
    R = draw(st.integers(1, 5))
    rows = [draw(st.lists(st.integers(0, alphabet - 1), min_size=C, max_size=C)) for _ in range(R)]
    hist = [draw(st.integers(0, C)) for _ in range(R)]
    n_min = draw(st.integers(1, 5))
    n_max = draw(st.integers(n_min, 9))
    k = draw(st.integers(1, 12))
    return rows, hist, n_min, n_max, k


@settings(max_examples=300, deadline=None)
@given(batches())
def test_matches_reference(case):
    rows, hist, n_min, n_max, k = case
    run_and_compare(rows, hist, n_min, n_max, k)


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_repeated_text_matches_reference(data):
    # Histories built from copies of a random snippet (edits, quotes): long matches, long drafts.
    alphabet = data.draw(st.integers(2, 50))
    snippet = data.draw(st.lists(st.integers(0, alphabet - 1), min_size=1, max_size=12))
    reps = data.draw(st.integers(1, 4))
    tail = data.draw(st.lists(st.integers(0, alphabet - 1), max_size=6))
    h = (snippet * reps + tail)[:60]
    C = len(h) + data.draw(st.integers(0, 8))
    cut = data.draw(st.integers(0, len(h)))
    rows = [h + [0] * (C - len(h)), h + [1] * (C - len(h))]
    n_min = data.draw(st.integers(1, 4))
    n_max = data.draw(st.integers(n_min, 10))
    k = data.draw(st.integers(1, 20))
    run_and_compare(rows, [len(h), cut], n_min, n_max, k)
