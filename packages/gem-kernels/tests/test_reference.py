"""The reference is the definition: check it against KERNELS.md by hand and by a per-sequence loop."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gem_kernels.reference import attention_mask, jagged_attention_reference
from gem_kernels.testing import offsets_from_lengths, random_qkv
from gem_model.api import AttentionExtras


def allowed_pairs(n: int, t: int, window: int) -> set[tuple[int, int]]:
    mask = attention_mask(torch.tensor([n]), torch.tensor([t]), window, n)[0]
    return {(i, j) for i in range(n) for j in range(n) if mask[i, j]}


def test_targets_see_the_history_and_themselves_only() -> None:
    pairs = allowed_pairs(5, 2, 0)  # p = 0 1 2 3 3
    assert {j for i, j in pairs if i == 3} == {0, 1, 2, 3}
    assert {j for i, j in pairs if i == 4} == {0, 1, 2, 4}
    assert {j for i, j in pairs if i == 2} == {0, 1, 2}


def test_window_is_measured_from_the_first_target() -> None:
    pairs = allowed_pairs(6, 2, 1)  # p = 0 1 2 3 4 4
    assert {j for i, j in pairs if i == 5} == {3, 5}
    assert {j for i, j in pairs if i == 4} == {3, 4}
    assert {j for i, j in pairs if i == 2} == {1, 2}


def test_mask_matches_the_formula(gen: torch.Generator) -> None:
    for _ in range(20):
        n = int(torch.randint(1, 12, (1,), generator=gen))
        t = int(torch.randint(0, n + 1, (1,), generator=gen))
        window = int(torch.randint(0, 5, (1,), generator=gen))
        p = [min(i, n - t) for i in range(n)]
        expected = {
            (i, j)
            for i in range(n)
            for j in range(n)
            if i == j or (0 < p[i] - p[j] and (window == 0 or p[i] - p[j] <= window))
        }
        assert allowed_pairs(n, t, window) == expected, (n, t, window)


def test_reference_matches_a_per_sequence_loop(gen: torch.Generator) -> None:
    lengths = [4, 0, 9, 1]
    targets = torch.tensor([1, 0, 3, 1])
    offsets = offsets_from_lengths(lengths)
    q, k, v = random_qkv(int(offsets[-1]), 2, 8, 5, torch.float64, gen)
    out = jagged_attention_reference(q, k, v, offsets, max_seq_len=11, alpha=0.7,
                                     extras=AttentionExtras(num_targets=targets, max_attn_len=2))
    for b, n in enumerate(lengths):
        s = int(offsets[b])
        for i in range(n):
            for h in range(2):
                total = torch.zeros(5, dtype=torch.float64)
                for j in range(n):
                    if attention_mask(torch.tensor([n]), targets[b : b + 1], 2, n)[0, i, j]:
                        total += F.silu(0.7 * q[s + i, h] @ k[s + j, h]) / 11 * v[s + j, h]
                torch.testing.assert_close(out[s + i, h], total)
