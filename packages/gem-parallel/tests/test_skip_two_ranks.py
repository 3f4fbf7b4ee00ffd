"""``trainer.non_finite=skip`` on two gloo ranks with the NaN on one rank only: the decision is
collective, also between tensor-parallel peers, whom no loss reduction joins.

The ``fsdp`` planner with ``tp: 2`` and ``tables: sharded``: the HSTU blocks split over both ranks
(DTensor TP), the other dense tensors replicated on both, the tables sharded by torchrec with
FBGEMM's optimizer fused into backward. The layout's loss group is one rank, so each rank reduces
no loss but its own; the non-finite flags travel in the step's all-ranks all-reduce. Rank 1's
forward makes a NaN loss from step 3 on (``inline_nan_forward``), rank 0's stays finite: both skip
steps 3 and 4 (no backward: the fused table update never runs) and both halt at step 5, the
``trainer.non_finite_max_skips=3``-th in a row, with status 3. ``inline_digests`` records each
rank's SHA-256 of every tensor of its model state after every step.
"""

from __future__ import annotations

import json

import pytest
from parallel_runs import gem_train_failing, rank_digests

from gem_model.cli import EXIT_NON_FINITE

pytestmark = pytest.mark.multiprocess


def test_a_nan_on_one_rank_is_skipped_by_both_and_halts_both_after_k_in_a_row(reference_overrides, tmp_path):
    out, sums = tmp_path / "run", tmp_path / "digests"
    callbacks = (
        "callbacks=[{name: inline_nan_forward, options: {rank: 1, from_step: 3}}, "
        f"{{name: inline_digests, options: {{path: '{sums}'}}}}]"
    )
    args = [*reference_overrides, "data.global_batch_size=8", "model.num_blocks=1", "trainer.eval_at_end=false",
            "parallel.planner=fsdp", "parallel.planner.options.tp=2", "parallel.planner.options.tables=sharded",
            "trainer.steps=8", "trainer.non_finite=skip", "trainer.non_finite_max_skips=3", callbacks,
            "trainer.collective_timeout_s=30", f"trainer.output_dir={out}"]  # fmt: skip
    # (ranks that decided apart would pair one's backward collectives with the other's next forward:
    # a hang, or garbage; the short timeout makes that a failure in seconds)
    # torchrun itself (as gem-train run --nproc 2 starts it), without the launcher's own imports
    proc = gem_train_failing(args)

    # both ranks halted at step 5, rank 0 on its peer's NaN, and each exits 3 (torchrun: 1)
    assert "NonFiniteLossError: step 5 (rank 1): the loss is nan (task nan" in proc.stderr, proc.stderr[-3000:]
    assert "NonFiniteLossError: step 5 (rank 0): the loss is nan on 1 of the 2 ranks (this rank's: " in proc.stderr
    assert "every parameter and gradient is finite: another rank's forward made it" in proc.stderr
    assert proc.stderr.count("skipped the updates of the 2 step(s) before it in a row") == 2
    assert f"exitcode  : {EXIT_NON_FINITE} " in proc.stderr  # torchrun's report of the first to exit
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]  # written by rank 0
    assert [r["step"] for r in records if "step_loss" in r] == [1, 2]
    skips = [(r["step"], r["in_a_row"], r["non_finite_loss"]) for r in records if r.get("event") == "non_finite_skip"]
    assert skips == [(3, 1, "nan"), (4, 2, "nan")]

    by_rank = [rank_digests(sums, 0), rank_digests(sums, 1)]
    for rank, steps in enumerate(by_rank):
        assert sorted(steps) == [1, 2, 3, 4], (rank, sorted(steps))  # step 5 raised before its hook returned
        assert steps[2]["digests"] != steps[1]["digests"]  # step 2 trained
        for skipped in (3, 4):  # dense tensors, this rank's TP shards and table shards: all unchanged
            assert steps[skipped]["digests"] == steps[2]["digests"], (rank, skipped)
    sharded = set(by_rank[0][1]["sharded"])
    assert any(k.startswith("blocks.") for k in sharded) and any(k.startswith("sparse.") for k in sharded)
    whole = [k for k in by_rank[0][1]["digests"] if k not in sharded]
    assert whole  # the tensors both ranks hold whole stay equal: no rank applied an update the other skipped
    for step in (1, 2, 3, 4):
        assert {k: by_rank[0][step]["digests"][k] for k in whole} == {k: by_rank[1][step]["digests"][k] for k in whole}
