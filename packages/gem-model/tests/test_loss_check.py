"""``trainer.loss_check``: the loss read before backward or at the tables' gate inside it.

At the tables the run trains the same bits (the loss is normalised on the device by the same counts),
the gate runs in every step before any gradient reaches a table, and a non-finite loss halts there
with nothing applied. Where the check cannot run inside backward, the config or the step refuses it
and says why.
"""

from __future__ import annotations

import pytest
import torch

from gem_model import testing
from gem_model.api import hookimpl
from gem_model.config_io import load_config
from gem_model.errors import ConfigError, NonFiniteLossError
from gem_model.layout import Layout
from gem_model.parallel_dims import ParallelDims
from gem_model.train.loss_check import LossNotFinite, PendingSums, StepSums, TableGate, check_in_backward

AT_TABLES = "trainer.loss_check=before_tables"
BEFORE = "trainer.loss_check=before_backward"
POISON = ["kernels.jagged_attention=poison", "kernels.jagged_attention.options.nan_from_call=3"]


def gate_of(model: torch.nn.Module) -> TableGate:
    gates = {id(m.grad_gate): m.grad_gate for m in model.modules() if getattr(m, "grad_gate", None) is not None}
    assert len(gates) == 1, gates
    return next(iter(gates.values()))


class TableGradients:
    """Before each step: hooks on the tables' weights that record, per gradient that reaches one, the
    step and how many checks the gate had run by then; after each step, the gate's count."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int]] = []  # (step counted from 1, gate checks when the gradient came)
        self.checks_after: dict[int, int] = {}
        self.step = 0
        self.hooked = False

    @hookimpl(wrapper=True)
    def gem_train_step(self, run, step):
        gate = gate_of(run.model)
        self.step = step + 1
        if not self.hooked:
            tables = [p for n, p in run.model.named_parameters() if n.startswith("sparse.")]
            assert tables
            for p in tables:
                p.register_hook(lambda g: self.seen.append((self.step, gate.checks)))
            self.hooked = True
        result = yield
        self.checks_after[step + 1] = gate.checks
        return result


class Snapshots:
    """Every parameter after each step, and after a step that raised (under ``raised``)."""

    def __init__(self) -> None:
        self.after: dict[int, torch.Tensor] = {}
        self.raised: dict[int, torch.Tensor] = {}

    @hookimpl(wrapper=True)
    def gem_train_step(self, run, step):
        try:
            result = yield
        except NonFiniteLossError:
            self.raised[step + 1] = self._params(run)
            raise
        self.after[step + 1] = self._params(run)
        return result

    @staticmethod
    def _params(run) -> torch.Tensor:
        return torch.cat([p.detach().flatten() for p in run.model.parameters()]).clone()


def test_at_the_tables_the_run_trains_the_same_bits_and_the_gate_checks_every_step_first(tmp_path):
    before = testing.tiny_run(BEFORE, output_dir=tmp_path / "before", steps=4)
    probe = TableGradients()
    at = testing.tiny_run(AT_TABLES, output_dir=tmp_path / "at", steps=4, plugins=[probe])
    assert [x.hex() for x in at.losses] == [x.hex() for x in before.losses]
    assert probe.checks_after == {1: 1, 2: 2, 3: 3, 4: 4}  # one check a step, inside its backward
    steps = sorted({s for s, _ in probe.seen})
    assert steps == [1, 2, 3, 4]
    # every table gradient of step s came after that step's check: the gate stands before the tables
    assert all(checks == s for s, checks in probe.seen), probe.seen


def test_before_backward_leaves_the_gate_unarmed_and_auto_is_the_default_at_the_tables(tmp_path):
    probe = TableGradients()
    testing.tiny_run(BEFORE, output_dir=tmp_path / "before", steps=2, plugins=[probe])
    assert probe.checks_after == {1: 0, 2: 0} and probe.seen
    assert load_config(None, []).trainer.loss_check == "auto"
    default = TableGradients()
    testing.tiny_run(output_dir=tmp_path / "default", steps=2, plugins=[default])
    assert default.checks_after == {1: 1, 2: 2}


def test_a_non_finite_loss_halts_at_the_tables_with_nothing_applied(tmp_path):
    snap = Snapshots()
    with pytest.raises(NonFiniteLossError) as info:
        testing.tiny_run(AT_TABLES, *POISON, output_dir=tmp_path, steps=6, plugins=[snap])
    message = str(info.value)
    assert message.startswith("step 3 (rank 0): the loss is nan"), message
    assert "the run stopped before applying this step's update" in message
    # this step's gradients exist (backward ran up to the tables): only parameters are named
    assert "First non-finite parameter on this rank: none (every parameter is finite: this forward made it)" in message
    assert sorted(snap.after) == [1, 2] and sorted(snap.raised) == [3]
    assert torch.equal(snap.raised[3], snap.after[2])  # neither the tables nor the dense weights moved
    assert not torch.equal(snap.after[2], snap.after[1])


def test_at_the_tables_cannot_go_with_skip():
    with pytest.raises(ConfigError, match="trainer: .*loss_check=before_tables cannot go with trainer.non_finite=skip"):
        load_config(None, [AT_TABLES, "trainer.non_finite=skip"])


def test_auto_under_skip_reads_the_loss_before_backward(tmp_path):
    probe = TableGradients()
    testing.tiny_run("trainer.loss_check=auto", "trainer.non_finite=skip", output_dir=tmp_path, steps=2, plugins=[probe])
    assert probe.checks_after == {1: 0, 2: 0}


def trainer(**options: str):
    return load_config(None, [f"trainer.{k}={v}" for k, v in options.items()]).trainer


def test_where_the_check_runs_by_layout():
    dims = {"dp_shard": 1, "sparse": 1}
    data_parallel = Layout.data_parallel(rank=0, world_size=4, group=None)
    tensor_parallel = Layout(ParallelDims(**dims, dp_replicate=2, tp=2), 0)
    assert (data_parallel.loss_degree, tensor_parallel.loss_degree, tensor_parallel.world_size) == (4, 2, 4)
    assert check_in_backward(trainer(loss_check="before_tables"), data_parallel)
    assert check_in_backward(trainer(loss_check="auto"), data_parallel)
    assert not check_in_backward(trainer(loss_check="before_backward"), data_parallel)
    assert not check_in_backward(trainer(loss_check="auto", non_finite="skip"), data_parallel)
    assert not check_in_backward(trainer(loss_check="auto"), tensor_parallel)
    with pytest.raises(ValueError, match=r"loss group has 2 of the 4 ranks .*Use trainer.loss_check=before_backward"):
        check_in_backward(trainer(loss_check="before_tables"), tensor_parallel)


def test_the_gate_runs_its_check_once_a_step_and_nothing_when_unarmed():
    gate, calls = TableGate(), []
    gate()  # unarmed: a step reading its loss before backward
    gate.arm(lambda: calls.append(1))
    gate()
    gate()  # a second table output of the same backward
    assert calls == [1] and gate.checks == 1
    gate.arm(lambda: (_ for _ in ()).throw(LossNotFinite()))
    with pytest.raises(LossNotFinite):
        gate()
    gate.arm(lambda: calls.append(2))
    gate.disarm()
    gate()
    assert calls == [1] and gate.checks == 2


def test_pending_sums_read_what_the_step_reduced():
    values = [12.5, 3.0, 2.0, 5.0, 40.0, 1e9, 0.0, 1.0]
    sums = PendingSums(torch.tensor(values, dtype=torch.float64)).get()
    assert sums == StepSums.of(values)
    assert (sums.task_loss, sums.next_loss, sums.late_ranks, sums.stop_ranks) == (2.5, 1.5, 0.0, 1.0)
    assert StepSums.of([1.0, 0.0, 0.0, 2.0, 0, 0, 0, 0]).next_loss == 0.0  # no next-item targets: no division by 0
