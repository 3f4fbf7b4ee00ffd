"""``table_output_dtype``: the sharded tables' lookups in another dtype than float32 (FBGEMM's
``output_dtype``, handed to the table kernels through torchrec's sharders' ``fused_params``).

On the CPU, float16 (FBGEMM's CPU sequence lookup has no bfloat16; the GPU's has both): the two-process
run of test_loss_pin.py's config trains with float16 lookups. Their rounding (2**-11 relative) moves
the losses off the float32 run's pinned bits, by far less than 2e-3 relative over 4 steps.
"""

from __future__ import annotations

import math

import pytest
from fbgemm_gpu.split_embedding_configs import SparseType
from test_loss_pin import PINNED, RUN, losses

from gem_model.testing import PlainComm
from gem_parallel.sharded import _sharders

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize(
    "planner",
    [["parallel.planner=torchrec_ddp"], ["parallel.planner=fsdp", "parallel.planner.options.tables=sharded"]],
    ids=["torchrec_ddp", "fsdp_sharded"],
)
def test_float16_lookups_train_two_processes_close_to_the_float32_losses(reference_overrides, tmp_path, planner):
    """Against the float32 run's pins (``fsdp`` with sharded tables gives the same float32 losses up to
    the last bits: the same tables, the same dense arithmetic)."""
    args = [*reference_overrides, *RUN, *planner, "parallel.planner.options.table_output_dtype=float16"]
    got = [float.fromhex(x) for x in losses(args, tmp_path / "two", 2)]
    for family, pinned in PINNED["torchrec_ddp"].items():
        want = [float.fromhex(x) for x in pinned]
        assert all(math.isfinite(x) for x in got)
        assert max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True)) < 2e-3, (family, got, want)
        assert got != want, family  # the lookups were float16: the bits moved


@pytest.mark.parametrize("dtype, sparse", [("float16", SparseType.FP16), ("bfloat16", SparseType.BF16)])
def test_the_sharders_hand_fbgemm_the_output_dtype(dtype, sparse):
    for sharder in _sharders(PlainComm(), dtype):
        assert sharder.fused_params == {"output_dtype": sparse}, type(sharder).__name__
    for sharder in _sharders(PlainComm(), "float32"):
        assert not sharder.fused_params, type(sharder).__name__  # torchrec's own defaults: float32 lookups
