"""Reference components for testing the core, and any plugin, in isolation.

Nothing here is registered unless a test does it (``GemPluginManager(plugins=[gem_model.testing])``
or ``GEM_PLUGINS=gem_model.testing``). The components are deliberately plain (a per-sequence
attention loop, no sharding) and follow the interface contracts exactly, so a test of one real
plugin package can fill every other seam without installing the sibling packages. Their names
start with ``inline_`` or are kernel names no package uses, so they never clash with real plugins.

For a plugin's own tests:

- :func:`tiny_run`: train a few steps in this process on these components plus the plugin's;
- :func:`random_jagged_batch`: a random :class:`~gem_model.data.batch.Batch` of jagged histories;
- :func:`fake_run_context`: a :class:`~gem_model.context.RunContext` over a real tiny model, to
  call a callback's hooks directly;
- :func:`assert_pinned` (:mod:`gem_model.testing_pins`): losses equal, bit for bit, to one of
  the sets pinned per CPU family;
- :func:`run_until`, :func:`start_run` and :func:`finish` (:mod:`gem_model.testing_runs`): ``gem-train run``
  as a subprocess whose timeout fails with the stacks of its processes (:class:`RunTimedOut`).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torchrec.optim.keyed import KeyedOptimizerWrapper

from gem_model.components import (
    NO_EXTRAS,
    ActivationPolicy,
    CommStrategy,
    ComponentConfig,
    JaggedAttentionKernel,
    NormGateKernel,
    ParallelPlanner,
    PlannerContext,
    PrecisionScheme,
    PreparedModel,
)
from gem_model.context import RunContext
from gem_model.data.batch import Batch
from gem_model.data.synthetic import SyntheticConfig, SyntheticSource
from gem_model.jagged import relative_bias_matrix, time_bias_matrix
from gem_model.lifecycle import Callback
from gem_model.markers import hookimpl
from gem_model.parallel_dims import ParallelDims
from gem_model.plan import DensePlacement, Plan, TablePlacement
from gem_model.results import RunSummary
from gem_model.testing_faults import Digests, Fault, NanForward, StateDump, UnevenSource
from gem_model.testing_pins import assert_pinned as assert_pinned
from gem_model.testing_runs import RunTimedOut as RunTimedOut
from gem_model.testing_runs import finish as finish
from gem_model.testing_runs import run_until as run_until
from gem_model.testing_runs import start_run as start_run


def hstu_mask(n: int, t: int, window: int, device: torch.device) -> torch.Tensor:
    p = torch.clamp(torch.arange(n, device=device), max=n - t)
    diff = p[:, None] - p[None, :]
    keep = diff > 0
    if window > 0:
        keep &= diff <= window
    return keep | torch.eye(n, dtype=torch.bool, device=device)


class LoopAttention(JaggedAttentionKernel):
    """One sequence at a time: full n x n products per sequence, no padding across sequences."""

    name: ClassVar[str] = "loop"
    supports_position_bias: ClassVar[bool] = True
    supports_time_bias: ClassVar[bool] = True

    def __call__(self, q, k, v, seq_offsets, *, max_seq_len, alpha, extras=NO_EXTRAS):
        num_targets, max_attn_len = extras.num_targets, extras.max_attn_len
        position_bias, time_bias = extras.position_bias, extras.time_bias
        timestamps, query_timestamps = extras.timestamps, extras.query_timestamps
        outs = []
        for b in range(seq_offsets.numel() - 1):
            s, e = int(seq_offsets[b]), int(seq_offsets[b + 1])
            n = e - s
            if n == 0:
                continue
            t = int(num_targets[b]) if num_targets is not None else 0
            scores = torch.einsum("ihd,jhd->hij", q[s:e], k[s:e]) * alpha
            if position_bias is not None:
                scores = scores + relative_bias_matrix(position_bias, n, max_seq_len)
            if time_bias is not None:
                scores = scores + time_bias_matrix(time_bias, query_timestamps[s:e], timestamps[s:e])
            w = F.silu(scores) / max_seq_len * hstu_mask(n, t, max_attn_len, q.device)
            outs.append(torch.einsum("hij,jhd->ihd", w, v[s:e]))
        return torch.cat(outs) if outs else v.new_zeros(v.shape)


class PoisonConfig(ComponentConfig):
    nan_from_call: int = 0
    nan_calls: int = 0
    """How many calls return NaN from ``nan_from_call`` on (a transient fault); 0: every later one."""


class PoisonAttention(LoopAttention):
    """The loop kernel, returning NaN from its ``nan_from_call``-th call on (to test the NaN stop)."""

    name: ClassVar[str] = "poison"
    Config = PoisonConfig

    def __init__(self, config=None):
        super().__init__(config)
        self.calls = 0

    def __call__(self, q, *args, **kwargs):
        self.calls += 1
        out = super().__call__(q, *args, **kwargs)
        first, count = self.config.nan_from_call, self.config.nan_calls
        poisoned = self.calls >= first and (count == 0 or self.calls < first + count)
        return out * float("nan") if poisoned else out


class TorchNormGate(NormGateKernel):
    name: ClassVar[str] = "loop"

    def __call__(self, x, u, weight, bias, eps):
        return F.layer_norm(x, x.shape[-1:], weight, bias, eps) * u


class Fp32(PrecisionScheme):
    name: ClassVar[str] = "inline_fp32"

    def convert_linear(self, linear: nn.Linear, fqn: str) -> nn.Module:
        return linear


class HalfGemm(PrecisionScheme):
    """bf16 GEMMs with fp32 master weights; records which modules it converted."""

    name: ClassVar[str] = "inline_bf16"
    gemm_dtype: ClassVar[str] = "bfloat16"
    converted: ClassVar[list[str]] = []

    def convert_linear(self, linear: nn.Linear, fqn: str) -> nn.Module:
        HalfGemm.converted.append(fqn)
        return _Bf16Linear(linear)


class _Bf16Linear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = self.bias.bfloat16() if self.bias is not None else None
        return F.linear(x.bfloat16(), self.weight.bfloat16(), b).float()


class NoPolicy(ActivationPolicy):
    name: ClassVar[str] = "inline_none"

    def wrap_block(self, block: nn.Module, fqn: str) -> nn.Module:
        return block


class PlainComm(CommStrategy):
    """Sums with ``all_reduce`` on the default group when one exists; the identity otherwise."""

    name: ClassVar[str] = "inline_comm"

    def all_reduce_sum(self, values: torch.Tensor, group: Any = None) -> torch.Tensor:
        if not (dist.is_available() and dist.is_initialized()):
            return values
        out = values.clone()
        dist.all_reduce(out, group=group)
        return out

    def all_reduce_mean(self, values: torch.Tensor, group: Any = None) -> torch.Tensor:
        world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
        return self.all_reduce_sum(values, group) / world


class Single(ParallelPlanner):
    name: ClassVar[str] = "inline_single"
    max_world_size: ClassVar[int | None] = 1

    def plan(self, model, ctx):
        tables = {c.name: TablePlacement("unsharded", [0], rows=c.num_embeddings, dim=c.embedding_dim) for c in model.table_configs()}
        return Plan(self.name, ctx.layout.describe(), tables, {"model": DensePlacement("local")})

    def apply(self, model, plan, ctx):
        model.to(ctx.env.device)
        sparse = {f"{m}.{n}": p for m, module in model.table_modules().items() for n, p in module.named_parameters()}
        dense = model.dense_named_parameters()
        spec = ctx.sparse_optimizer
        opt = KeyedOptimizerWrapper(sparse, lambda ps: spec.cls(ps, **spec.kwargs))
        return PreparedModel(module=model, dense_parameters=dense, sparse_optimizer=opt, sparse_optimizer_fused=False)


class Replicated(Single):
    """Every rank holds the whole model and runs the whole global batch: the layout has a ``tp`` dim
    of degree ``world_size`` and no data parallelism, which is what the ranks of one tensor-parallel
    group see of the data (no tensor is split: the ranks stay identical without any gradient sync)."""

    name: ClassVar[str] = "inline_replicated"
    max_world_size: ClassVar[int | None] = None

    def dims(self, world_size):
        return ParallelDims(tp=world_size, dp_shard=1, sparse=1)


class RecorderConfig(ComponentConfig):
    label: str = "recorder"


class Recorder(Callback):
    """A callback that records the lifecycle calls it sees and keeps a step count as its state."""

    name: ClassVar[str] = "inline_recorder"
    Config = RecorderConfig
    config: RecorderConfig
    runs: ClassVar[list[Recorder]] = []  # every instance a run built, for tests to read

    def __init__(self, config=None):
        super().__init__(config)
        self.events: list[str] = []
        self.steps_seen = torch.zeros((), dtype=torch.int64)
        Recorder.runs.append(self)

    @hookimpl
    def gem_run_started(self, run):
        self.events.append(f"started {run.step}")

    @hookimpl(wrapper=True)
    def gem_train_step(self, run, step):
        result = yield
        self.steps_seen += 1
        self.events.append(f"step {step}")
        return result

    @hookimpl
    def gem_run_finished(self, run, summary):
        self.events.append(f"finished {summary.steps}")

    @hookimpl
    def gem_report_sections(self, run, summary):
        from gem_model.results import ReportSection

        return [ReportSection(self.config.label, [("steps seen", str(int(self.steps_seen)))])]

    def state_dict(self):
        return {"steps_seen": self.steps_seen}

    def load_state_dict(self, state):
        self.steps_seen = state["steps_seen"].clone()


@hookimpl
def gem_register_callbacks():
    return [Recorder, Fault, StateDump, NanForward, Digests]


@hookimpl
def gem_register_data_sources():
    return [UnevenSource]


@hookimpl
def gem_register_kernels():
    return [LoopAttention, PoisonAttention, TorchNormGate]


@hookimpl
def gem_register_precision_schemes():
    return [Fp32, HalfGemm]


@hookimpl
def gem_register_activation_policies():
    return [NoPolicy]


@hookimpl
def gem_register_comm_strategies():
    return [PlainComm]


@hookimpl
def gem_register_parallel_planners():
    return [Single, Replicated]



# ------------------------------------------------------------------------- tools for plugin tests

INLINE_COMPONENTS = (
    "kernels.jagged_attention=loop",
    "kernels.norm_gate=loop",
    "precision.scheme=inline_fp32",
    "activation.policy=inline_none",
    "parallel.planner=inline_single",
    "comm.strategy=inline_comm",
    "trainer.progress=false",
)
"""This module's components in every slot, and no live progress display."""

INLINE_OVERRIDES = (
    *INLINE_COMPONENTS,
    "trainer.log_every=1",
    "trainer.eval_at_end=false",
    "data.global_batch_size=16",
    "data.source.options.max_len=15",
    "model.max_seq_len=16",
    "model.num_blocks=1",
)
"""A tiny run on this module's components; later overrides (a plugin's own names) win."""


@dataclass
class TinyRun:
    summary: RunSummary
    losses: list[float]
    """``step_loss`` of every step, as the metrics file has them."""
    output_dir: Path


def tiny_run(
    *overrides: str, output_dir: str | Path, steps: int = 4, plugins: Sequence[object] = ()
) -> TinyRun:
    """Train ``steps`` steps in this process on the inline components, with ``plugins`` registered
    too (a plugin module, or callback classes through their own module) and ``overrides`` on top."""
    from gem_model.config_io import load_config
    from gem_model.plugins import GemPluginManager
    from gem_model.trainer import train

    out = Path(output_dir)
    config = load_config(None, [*INLINE_OVERRIDES, f"trainer.steps={steps}", f"trainer.output_dir={out}", *overrides])
    pm = GemPluginManager(autoload=False, plugins=[sys.modules[__name__], *plugins])
    summary = train(config, pm)
    metrics = out / "metrics.jsonl"
    records = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
    losses = [r["step_loss"] for r in records if "step_loss" in r]  # not the events (train.spikes)
    return TinyRun(summary, losses, out)


def checkpoint_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a saved checkpoint by its dotted key (``model.<name>``, ``dense_optimizer...``),
    read in this process without a process group, whatever world size wrote it (sharded tables
    whole), and without running any code of the checkpoint (:mod:`gem_model.train.safe_load`)."""
    from gem_model.train.compat import leaves
    from gem_model.train.safe_load import read_whole

    return {k: v for k, v in leaves(read_whole(Path(path))) if isinstance(v, torch.Tensor)}


def random_jagged_batch(
    batch_size: int = 4, *, max_len: int = 15, seed: int = 0, num_items: int = 1000, min_len: int = 0
) -> Batch:
    """A random batch of jagged histories (lengths in [min_len, max_len]), from the synthetic source."""
    source = SyntheticSource(SyntheticConfig(seed=seed, max_len=max_len, min_len=min_len, num_items=num_items))
    return source.make_batch(0, batch_size, torch.arange(batch_size))


def fake_run_context(*overrides: str, output_dir: str | Path, step: int = 0) -> RunContext:
    """A :class:`RunContext` over a real tiny model on one process (inline components, no training
    loop), for calling a callback's hooks directly. ``overrides`` as for :func:`tiny_run`."""
    from gem_model.config_io import load_config
    from gem_model.context import Optimizers
    from gem_model.distributed import DistEnv
    from gem_model.model.gem import GemModel
    from gem_model.plugins import GemPluginManager
    from gem_model.resolve import resolve_components
    from gem_model.train.optim import sparse_optimizer_spec

    config = load_config(None, [*INLINE_OVERRIDES, f"trainer.output_dir={output_dir}", *overrides])
    c = resolve_components(config, GemPluginManager(autoload=False, plugins=[sys.modules[__name__]]))
    env = DistEnv(0, 1, 0, torch.device("cpu"), None)
    model = GemModel(config.model, c.source.feature_spec(), attention=c.attention, norm_gate=c.norm_gate,
                     next_item_loss=c.next_item_loss, sequence_pool=c.sequence_pool,
                     sequence_input=c.sequence_input)  # fmt: skip
    spec = sparse_optimizer_spec(config.trainer)
    layout = c.planner.layout(env)
    ctx = PlannerContext(env, layout, c.comm, spec)
    plan = c.planner.plan(model, ctx)
    prepared = c.planner.apply(model, plan, ctx)
    dense = torch.optim.AdamW([p for _, p in prepared.dense_parameters], lr=config.trainer.dense_lr)
    names = [n for n, _ in prepared.dense_parameters]
    optimizers = Optimizers(dense, names, prepared.sparse_optimizer, prepared.sparse_optimizer_fused)
    c.comm.setup(env)
    return RunContext(config, layout, plan, prepared.module, optimizers, c.comm, Path(output_dir), env.device, step)
