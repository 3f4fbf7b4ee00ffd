"""testing.assert_pinned: losses equal bit for bit to one set pinned per CPU family, or a message
that names the first differing step of every set."""

from __future__ import annotations

import math

import pytest

from gem_model.testing import assert_pinned

A = ["0x1.1d7bac27b9612p+3", "0x1.0358afcb65b2ep+3", "0x1.05f21f61642c8p+3", "0x1.043e843b9611ap+3"]
B = ["0x1.1d7bac27b9612p+3", "0x1.0358b00b65b2ep+3", "0x1.05f21f61642c8p+3", "0x1.043e83211a7bap+3"]
PINS = {"AVX2 CI machine, 4ddf59e": A, "AVX-512 + AMX (Sapphire Rapids), b9cca1e": B}


def ulp_up(x: str) -> str:
    return math.nextafter(float.fromhex(x), math.inf).hex()


def test_an_exact_match_of_either_set_passes_and_names_it():
    assert assert_pinned(list(A), PINS, "PINS") == "AVX2 CI machine, 4ddf59e"
    assert assert_pinned(list(B), PINS, "PINS") == "AVX-512 + AMX (Sapphire Rapids), b9cca1e"


def test_one_ulp_off_is_refused_naming_the_step_of_each_set():
    run = [*B[:2], ulp_up(B[2]), B[3]]
    with pytest.raises(AssertionError) as e:
        assert_pinned(run, PINS, "test_x.py PINNED")
    msg = str(e.value)
    assert f"this run: {run!r}" in msg
    assert f"'AVX2 CI machine, 4ddf59e': first differs at step 2: {B[1]} here, {A[1]} pinned" in msg
    assert f"(Sapphire Rapids), b9cca1e': first differs at step 3: {run[2]} here, {B[2]} pinned" in msg
    assert "add this run's losses to test_x.py PINNED as a new set labelled '<CPU family>, <commit>'" in msg


def test_a_mix_of_sets_a_missing_step_and_given_step_numbers_are_refused():
    with pytest.raises(AssertionError, match=r"4ddf59e': first differs at step 4: .* here"):
        assert_pinned([*A[:3], B[3]], PINS, "PINS")  # steps 1-3 of A, step 4 of B
    with pytest.raises(AssertionError, match=r"4ddf59e': first differs at step 4: nothing here, 0x1.043e843b9611ap\+3"):
        assert_pinned(A[:3], PINS, "PINS")
    with pytest.raises(AssertionError, match=r"4ddf59e': first differs at step 4: 0x"):
        assert_pinned([A[0], A[1], ulp_up(A[2])], {"AVX2 CI machine, 4ddf59e": A[:3]}, "PINS", steps=(1, 2, 4))
    with pytest.raises(ValueError, match="PINS: no pinned sets"):
        assert_pinned(A, {}, "PINS")
