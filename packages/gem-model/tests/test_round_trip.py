"""Full-state round trip: after a resume, every piece of state equals the saved run's, and the next
batch and the next loss are identical.

The state: the model (dense and tables), the dense AdamW and the table Adam (both with moments),
the warm-up schedule (a function of the restored step), the RNG (dropout draws from it), the data
position, a stateful callback (``inline_recorder``) and the loss guards (spike window).
"""

from __future__ import annotations

import copy
import json
import shutil

import torch

from gem_model.config_io import load_config
from gem_model.distributed import init_distributed
from gem_model.resolve import resolve_components
from gem_model.train import state as run_state
from gem_model.train.compat import leaves
from gem_model.train.run import Run

SAVE_AT = 3


def batch_digest(batch) -> list[torch.Tensor]:
    parts = [batch.sequence.values(), batch.sequence.lengths(), batch.pooled.values(), batch.pooled.lengths()]
    return [t.clone() for t in (*parts, batch.dense, batch.labels, batch.sample_ids)]


def build(pm, overrides: list[str], *, record: dict[int, list[torch.Tensor]]) -> Run:
    config = load_config(None, overrides)
    run = Run(config, pm, resolve_components(config, pm), init_distributed("cpu"))
    pipeline, next_batch = run.components.pipeline, run.components.pipeline.next_batch

    def recording(step):  # observes the batches the step gets; changes nothing
        staged = next_batch(step)
        record[step] = batch_digest(staged.ready())
        return staged

    pipeline.next_batch = recording
    return run


def full_state(run: Run) -> dict[str, object]:
    state = run_state.run_state(**run._state_owners())  # type: ignore[arg-type]
    state["guards"] = list(run.spikes.losses)
    return {k: copy.deepcopy(v) for k, v in leaves(state)}


def test_resume_restores_every_piece_of_state_and_the_next_batch_and_loss(pm, tiny_overrides, tmp_path):
    common = [*tiny_overrides, "trainer.steps=5", "model.dropout=0.1", "trainer.warmup_steps=4",
              "trainer.sparse_optimizer=adam", "trainer.weight_decay=0.01",
              "callbacks=[{name: inline_recorder}]"]  # fmt: skip
    batches_a: dict[int, list[torch.Tensor]] = {}
    a = build(pm, [*common, f"trainer.output_dir={tmp_path}/a", f"trainer.checkpoint_every={SAVE_AT}"], record=batches_a)
    saved: dict[str, object] = {}
    save = a.save_checkpoint

    def save_and_remember(step):
        path = save(step)
        if step == SAVE_AT:
            saved.update(full_state(a))  # the live state the checkpoint was written from
        return path

    a.save_checkpoint = save_and_remember
    a.fit()
    assert saved, "the run wrote no checkpoint at step 3"

    # a second process's view: a fresh run whose output directory holds only that checkpoint
    shutil.copytree(tmp_path / "a" / "checkpoints" / f"step_{SAVE_AT:08d}", tmp_path / "b" / "checkpoints" / f"step_{SAVE_AT:08d}")
    batches_b: dict[int, list[torch.Tensor]] = {}
    b = build(pm, [*common, f"trainer.output_dir={tmp_path}/b"], record=batches_b)
    assert b.start_step == SAVE_AT
    restored = full_state(b)
    assert restored.keys() == saved.keys()
    assert any(k.startswith("components.callbacks.inline_recorder") for k in saved)
    assert any(k.startswith("sparse_optimizer.") for k in saved) and any("exp_avg" in k for k in saved)
    different = [
        k for k in saved
        if not (torch.equal(saved[k], restored[k]) if isinstance(saved[k], torch.Tensor) else saved[k] == restored[k])
    ]  # fmt: skip
    assert not different, different
    b.fit()
    assert all(torch.equal(x, y) for x, y in zip(batches_a[SAVE_AT], batches_b[SAVE_AT], strict=True))
    loss = {d: [json.loads(x) for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()] for d in "ab"}
    after_a = [(r["step"], r["step_loss"]) for r in loss["a"] if r["step"] > SAVE_AT]
    after_b = [(r["step"], r["step_loss"]) for r in loss["b"]]
    assert after_a == after_b and after_b[0][0] == SAVE_AT + 1  # bitwise, the next loss and those after
