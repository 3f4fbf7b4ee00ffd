"""gem-parallel's tests fill the other seams with gem_model.testing: no sibling package needed."""

from __future__ import annotations

import pytest

REFERENCE = [
    "kernels.jagged_attention=loop",
    "kernels.norm_gate=loop",
    "precision.scheme=inline_fp32",
    "activation.policy=inline_none",
    "comm.strategy=inline_comm",
    "trainer.progress=false",
    "trainer.log_every=1",
    "data.global_batch_size=16",
    "data.source.options.max_len=15",
    "model.max_seq_len=16",
]


@pytest.fixture
def reference_overrides(tmp_path) -> list[str]:
    return [*REFERENCE, f"trainer.output_dir={tmp_path}/{{name}}"]
