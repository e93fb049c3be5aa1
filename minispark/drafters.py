"""Drafters: the model-free n-gram matcher (and, later, the Spark drafter).

Both run on every slot at once with static shapes and no host sync.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class NgramDrafter:
    """Longest-suffix lookup in each slot's own history (prompt + output so far).

    For n from n_max down to n_min, the last n tokens are compared with every earlier window;
    the longest match wins, the earliest occurrence among equals; up to K tokens that
    followed it are proposed (fewer where the history ends).
    """
    n_min: int = 1
    n_max: int = 8
    k: int = 32

    def __call__(self, tokens: Tensor, hist_len: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """tokens [R, C] (history in [0, hist_len), the rest ignored); hist_len [R].
        Returns draft [R, K], valid [R] (drafted tokens that exist) and match length m [R] (0 = none)."""
        R, C = tokens.shape
        dev = tokens.device
        best_start = torch.zeros(R, dtype=torch.long, device=dev)  # where the continuation starts
        best_n = torch.zeros(R, dtype=torch.long, device=dev)
        for n in range(self.n_max, self.n_min - 1, -1):
            if n >= C:
                continue
            suffix_at = (hist_len[:, None] - n + torch.arange(n, device=dev)).clamp(min=0)
            suffix = tokens.gather(1, suffix_at)  # [R, n]
            windows = tokens.unfold(1, n, 1)  # [R, C - n + 1, n]
            start = torch.arange(C - n + 1, device=dev)[None, :]
            # An earlier occurrence must leave at least one following token inside the history
            # (its continuation may run into the suffix itself: overlapping repeats copy fine).
            hit = (windows == suffix[:, None, :]).all(-1) & (start + n < hist_len[:, None])
            hit &= (hist_len >= n + 1)[:, None]
            # The earliest occurrence: in code edits it is the prompt's copy of the text, and in
            # a run like "x x x x" it has the longest continuation (measured: more accepted
            # tokens per step than the most recent occurrence on the code-edit set).
            first = torch.where(hit, start, C).amin(-1)
            found = torch.where(first < C, first, -1)  # [R] chosen window, -1 if none
            take = (best_n == 0) & (found >= 0)
            best_start = torch.where(take, found + n, best_start)
            best_n = torch.where(take, n, best_n)
        at = best_start[:, None] + torch.arange(self.k, device=dev)  # [R, K]
        draft = tokens.gather(1, at.clamp(max=C - 1))
        valid = torch.where(best_n > 0, (hist_len - best_start).clamp(0, self.k), 0)
        return draft, valid, best_n
