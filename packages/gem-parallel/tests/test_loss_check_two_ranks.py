"""``trainer.loss_check=before_tables`` on two gloo ranks with torchrec's sharded tables, whose
optimizer FBGEMM fuses into backward: a NaN loss on one rank halts both inside backward, at the
tables' gate, before any table update.

The ``torchrec_ddp`` planner: the dense part replicated by DDP, the tables sharded over both ranks.
Rank 1's forward makes a NaN loss from step 3 on (``inline_nan_forward``); the step's loss reduction
carries it to rank 0. Both ranks run backward up to the gate, halt there, and exit 3.
``inline_digests`` (with ``on_raise``) records each rank's SHA-256 of every tensor of its model state
after every step, and after the step that raised: the halted step's state must equal step 2's.
"""

from __future__ import annotations

import json

import pytest
from parallel_runs import gem_train_failing, rank_digests

from gem_model.cli import EXIT_NON_FINITE

pytestmark = pytest.mark.multiprocess


def test_a_nan_on_one_rank_halts_both_at_the_tables_with_no_update(reference_overrides, tmp_path):
    out, sums = tmp_path / "run", tmp_path / "digests"
    callbacks = (
        "callbacks=[{name: inline_nan_forward, options: {rank: 1, from_step: 3}}, "
        f"{{name: inline_digests, options: {{path: '{sums}', on_raise: true}}}}]"
    )
    args = [*reference_overrides, "data.global_batch_size=8", "model.num_blocks=1", "trainer.eval_at_end=false",
            "parallel.planner=torchrec_ddp", "trainer.loss_check=before_tables", "trainer.steps=6", callbacks,
            "trainer.collective_timeout_s=30", f"trainer.output_dir={out}"]  # fmt: skip
    proc = gem_train_failing(args)
    for rank in (0, 1):
        assert f"NonFiniteLossError: step 3 (rank {rank}): the loss is nan (task nan" in proc.stderr, proc.stderr[
            -3000:
        ]
    assert proc.stderr.count("First non-finite parameter on this rank: none (every parameter is finite") == 2
    assert f"exitcode  : {EXIT_NON_FINITE} " in proc.stderr
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "step_loss" in r] == [1, 2]

    for rank in (0, 1):
        steps = rank_digests(sums, rank)
        assert sorted(steps) == [1, 2, 3] and steps[3].get("raised") is True, (rank, sorted(steps))
        assert steps[2]["digests"] != steps[1]["digests"]  # step 2 trained
        assert steps[3]["digests"] == steps[2]["digests"], rank  # the halted step moved no table, no weight
        assert any(k.startswith("sparse.") for k in steps[1]["sharded"])  # the tables are torchrec's shards
