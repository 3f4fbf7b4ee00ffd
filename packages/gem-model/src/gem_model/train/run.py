"""A training run: built from the config and the registries, stepped through the plugin hook."""

from __future__ import annotations

import math
import os
import signal
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from gem_model.components import PreparedModel
from gem_model.config import RunConfig
from gem_model.context import Optimizers, RunContext
from gem_model.data.batch import Batch
from gem_model.data.loader import ShardedLoader
from gem_model.data.prefetch import StepFacts, make_feed
from gem_model.distributed import DistEnv
from gem_model.errors import (
    CheckpointWriteError,
    KernelUnavailableError,
    NonFiniteStateError,
    RunInterrupted,
)
from gem_model.model.flops import count_flops
from gem_model.plan import Plan
from gem_model.plugins import GemPluginManager
from gem_model.resolve import Components, run_shape
from gem_model.results import ReportSection, RunSummary, StepResult
from gem_model.train import checkpoint as ckpt
from gem_model.train import compat, lock, outputs, peers, resume
from gem_model.train import state as run_state
from gem_model.train.collector import GcSchedule
from gem_model.train.dense_optimizer import dense_adamw
from gem_model.train.finite import first_non_finite
from gem_model.train.loss_check import TableGate
from gem_model.train.metrics import MetricsFile, Throughput, peak_flops
from gem_model.train.optim import sparse_optimizer_spec
from gem_model.train.out_of_memory import out_of_memory_error
from gem_model.train.prepare import initial_model, prepare_model
from gem_model.train.progress import Progress, live_progress
from gem_model.train.report import format_sections, run_summary, step_record, summary_printed
from gem_model.train.signals import StopRequest, stop_on_signals
from gem_model.train.soundness import Soundness
from gem_model.train.spikes import LossSpikes, warn
from gem_model.train.step import CoreStep

__all__ = ["Run", "StepResult"]


class Run:
    def __init__(
        self, config: RunConfig, pm: GemPluginManager, components: Components, env: DistEnv, *,
        refusal: lock.OutputDirRefused | None = None,
    ):  # fmt: skip
        """``refusal``: rank 0's, when another run holds the output directory's lock (train.lock):
        every rank learns of it in the start-up collective and stops with it, before the model is built."""
        self.config, self.pm, self.components, self.env = config, pm, components, env
        tc = config.trainer
        self.output_dir = outputs.output_dir(config)
        torch.manual_seed(tc.seed * 1_000 + env.rank)
        components.comm.setup(env)
        self.comm = components.comm
        ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or None
        components.planner.bind_run(run_shape(config, components, ranks_per_node=ranks_per_node))
        self.layout = components.planner.layout(env)  # before the loader: it shards by the dp rank
        if self.layout.world_size != env.world_size:
            raise ValueError(
                f"parallel.planner {components.planner.name!r} made the layout {self.layout}, "
                f"but the run has {env.world_size} processes; its degrees must multiply to that"
            )
        self.loader = ShardedLoader(
            components.source,
            components.balancer,
            global_batch_size=config.data.global_batch_size,
            rank=self.layout.dp_rank,
            world_size=self.layout.dp_degree,
        )
        self.spec = self.loader.spec
        components.balancer.bind_model(config.model, self.spec)  # before the first batch is assigned
        if peers.check_same_data(self.loader, self.comm, rank=env.rank, world_size=env.world_size, device=env.device,
                                 timeout_s=tc.collective_timeout_s, refused=refusal is not None):  # fmt: skip
            raise refusal.anew() if refusal is not None else lock.refusal_seen_by_peer(self.output_dir)
        self.feed = make_feed(
            self.loader, prefetch=tc.prefetch, device=env.device, facts=self._batch_facts, end=tc.steps
        )
        kernels = ((components.attention, "jagged_attention"), (components.norm_gate, "norm_gate"),
                   (components.sequence_input, "sequence_input"), (components.sequence_pool, "sequence_pool"),
                   (components.next_item_loss, "next_item_loss"))  # fmt: skip
        for kernel, path in kernels:
            try:
                kernel.check_available(env.device)
            except KernelUnavailableError as exc:
                raise KernelUnavailableError(f"kernels.{path}: {kernel.name!r} cannot run here: {exc}") from None
        self.model = initial_model(config, components, self.spec)  # every rank from rank 0's stream
        if env.rank:  # then ranks > 0 go on with their own stream (dropout)
            torch.manual_seed(tc.seed * 1_000 + env.rank)
        self.preparation = prepare_model(
            self.model,
            precision_config=config.precision,
            schemes=components.precision,
            activation_config=config.activation,
            policies=components.activation,
            compile_blocks=tc.compile,
            planner=components.planner,
            layout=self.layout,
            env=env,
            comm=components.comm,
            sparse_optimizer=sparse_optimizer_spec(tc),
        )
        self.prepared: PreparedModel = self.preparation.prepared
        self.plan: Plan = self.preparation.plan
        dense_optimizer = dense_adamw([p for _, p in self.prepared.dense_parameters], tc)
        self.optimizers = Optimizers(
            dense_optimizer,
            [n for n, _ in self.prepared.dense_parameters],
            self.prepared.sparse_optimizer,
            self.prepared.sparse_optimizer_fused,
            self.prepared.after_optimizer_step,
        )
        self.checkpointer = ckpt.Checkpointer(self.output_dir / "checkpoints", env, timeout_s=tc.collective_timeout_s)
        self.metrics = MetricsFile(self.output_dir / "metrics.jsonl" if env.is_main else None, tensorboard=tc.tensorboard)
        gemm_dtype = components.precision[config.precision.scheme.name].gemm_dtype
        self.peak, self.peak_source = peak_flops(env.device, gemm_dtype, tc.peak_flops)
        self.start_step = 0
        self.steps_done = config.trainer.steps  # fewer when trainer.time_limit_s stops the run early
        self.last_checkpoint: Path | None = None
        self.soundness = Soundness(writes=env.is_main)  # which checkpoints a step trained from
        self.stop = StopRequest(tc.stop_grace_s)
        self.spikes = LossSpikes(tc.loss_spike_factor, tc.loss_spike_window)
        self.stopped_by_signal = False  # agreed by every rank in a step's all-reduce
        components.pipeline.setup(
            model=self.prepared.module, optimizers=self.optimizers, feed=self.feed, layout=self.layout
        )
        table_gate = TableGate()  # where trainer.loss_check=before_tables reads the loss (train.loss_check)
        self.model.set_table_grad_gate(table_gate)
        self.core_step = CoreStep(
            config=config,
            layout=self.layout,
            comm=self.comm,
            pipeline=components.pipeline,
            optimizers=self.optimizers,
            dense_parameters=[p for _, p in self.prepared.dense_parameters],
            device=env.device,
            resume_point=self._after_halt,
            first_non_finite=lambda gradients: first_non_finite(self.prepared.module, gradients=gradients),
            stop=self.stop,
            table_gate=table_gate,
        )
        self.context = RunContext(
            config=config,
            layout=self.layout,
            plan=self.plan,
            model=self.prepared.module,
            optimizers=self.optimizers,
            comm=self.comm,
            output_dir=self.output_dir,
            device=env.device,
            _execute_step=self.core_step,
        )
        self._continue_or_refuse()

    def _continue_or_refuse(self) -> None:
        """Resume what :mod:`~gem_model.train.resume` chooses, or start afresh; it refuses the rest."""
        config, env = self.config, self.env
        model_state = self.prepared.module.state_dict()
        choice = resume.choose(self.checkpointer.root, config, env.world_size, self.pm, model_state)
        if choice.path is not None:
            self.resume(choice.path, choice.report())
        if env.is_main:
            for line in outputs.start_metrics(self.output_dir, config, env.world_size, start_step=self.start_step):
                print(f"[{config.name}] {line}", flush=True)

    def _after_halt(self, step: int, loss: float) -> str:
        """The non-finite halt's last words: the resume point that trains, what it passed over."""
        return resume.after_halt(self.checkpointer.root, self.soundness, step=step, loss=loss)

    # -------------------------------------------------------------------------------------- a step

    def _batch_facts(self, batch: Batch) -> StepFacts:
        """The step's host-side facts, from the CPU batch (in the prefetch thread when there is one)."""
        lengths = batch.history_lengths()
        cand = batch.batch_size if self.config.model.use_candidate else 0
        flops = count_flops(self.config.model, self.spec, lengths).train_step
        return StepFacts(batch.batch_size, int(lengths.sum()) + cand, flops)

    # --------------------------------------------------------------------------------- checkpoints

    def _state_owners(self) -> dict[str, object]:
        return {
            "model": self.prepared.module,
            "optimizers": self.optimizers,
            "loader": self.loader,
            "rank": self.env.rank,
            "components": self.components.stateful(),
        }

    def save_checkpoint(self, step: int) -> Path:
        """Save the state after ``step`` steps (the loader resumes at ``step``), never from non-finite
        parameters: every rank checks its own (and its table shards) before any rank writes."""
        bad = first_non_finite(self.prepared.module, gradients=False)
        flag = torch.tensor([0.0 if bad is None else 1.0], dtype=torch.float64, device=self.env.device)
        ranks = self.comm.all_reduce_sum(flag, group=None).item() if self.env.world_size > 1 else flag.item()
        if ranks > 0:
            where = f"{bad} is non-finite on rank {self.env.rank}" if bad else "another rank holds a non-finite value"
            raise NonFiniteStateError(
                f"step {step} (rank {self.env.rank}): {where}; the checkpoint of step {step} was not written. "
                f"Resume point: {resume.resume_point(self.checkpointer.root, self.soundness)}"
            )
        self.loader.step = step
        meta = {
            "world_size": self.env.world_size,
            "layout": self.layout.describe(),
            "name": self.config.name,
            "config": self.config.model_dump(mode="json"),
            # the loss guards' state: the same on every rank (global losses), exact through JSON
            "guards": {"loss_window": list(self.spikes.losses), "skipped_in_a_row": self.core_step.skipped_in_a_row},
        }
        state = run_state.run_state(**self._state_owners())  # type: ignore[arg-type]
        try:
            self.last_checkpoint = self.checkpointer.save(step, state, meta, files={"plan.json": self.plan.to_json()})
        except CheckpointWriteError as exc:
            point = resume.resume_point(self.checkpointer.root, self.soundness)
            raise CheckpointWriteError(f"{exc}; the checkpoints before stay as they were. Resume point: {point}") from exc
        self.soundness.written(self.last_checkpoint)
        return self.last_checkpoint

    def resume(self, path: Path, skipped: Sequence[str] = ()) -> None:
        """Load the checkpoint ``path`` (its manifest verified); ``skipped``: newer ones that did not verify."""
        if self.env.is_main:
            for line in skipped:
                print(f"[{self.config.name}] {line}", flush=True)
        run_state.prepare_for_load(self.optimizers)
        state = run_state.run_state(**self._state_owners())  # type: ignore[arg-type]
        meta = ckpt.read_meta(path)
        skip, notes = resume.what_to_load(path, meta, state, self.config, self.layout, self.pm)  # or refuse, exit 2
        self.checkpointer.load(path, compat.loadable(state, skip))
        run_state.restore(state, **self._state_owners())  # type: ignore[arg-type]
        guards = meta.get("guards", {})
        self.spikes.losses.extend(float(x) for x in guards.get("loss_window", []))
        self.core_step.skipped_in_a_row = int(guards.get("skipped_in_a_row", 0))
        for line in notes if self.env.is_main else ():
            print(f"[{self.config.name}] {line}", flush=True)
        self.start_step = self.loader.step
        self.last_checkpoint = path
        self.soundness.loaded(path)
        if self.env.is_main:
            steps = self.config.trainer.steps
            if self.start_step >= steps:
                print(
                    f"[{self.config.name}] {path} is at step {self.start_step} of trainer.steps={steps}: "
                    "nothing to train (raise trainer.steps to train on)",
                    flush=True,
                )
            else:
                print(f"[{self.config.name}] continuing from {path} (step {self.start_step} of {steps})", flush=True)

    # ---------------------------------------------------------------------------------------- loop

    def fit(self) -> RunSummary:
        with self.pm.callbacks_registered(self.components.callbacks):  # for this run only
            return self._fit()

    def _fit(self) -> RunSummary:
        tc, ctx = self.config.trainer, self.context
        ctx.step = self.start_step
        self.pm.call("gem_run_started", run=ctx)
        try:
            with stop_on_signals(self.stop):  # a signal after the last step: that checkpoint completes first
                first_loss, last_loss, wall, meter = self._loop()
                if self.stopped_by_signal:
                    self._stop_on_signal()
                if tc.checkpoint_at_end and self.steps_done > self.start_step:
                    self.save_checkpoint(self.steps_done)
            final_eval = self.evaluate(self.steps_done, ("valid", "test")) if tc.eval_at_end else {}
        finally:
            self.feed.close()
            self.metrics.close()
        summary = self._summary(first_loss, last_loss, wall, meter)
        summary.extra["eval"] = final_eval
        ctx.step = self.steps_done
        self.pm.call("gem_run_finished", run=ctx, summary=summary)
        extra: list[ReportSection] = [s for group in self.pm.call("gem_report_sections", run=ctx, summary=summary) for s in group]
        if self.env.is_main and summary_printed():
            print(format_sections([summary.section(), *extra]), flush=True)
        return summary

    def _stop_on_signal(self) -> None:
        """After the step every rank agreed to stop at: its checkpoint (unless just written), then out."""
        done = self.steps_done
        if self.last_checkpoint is None or self.last_checkpoint.name != ckpt.step_dir(self.checkpointer.root, done).name:
            self.save_checkpoint(done)
        signum = self.stop.signum or int(signal.SIGTERM)  # None: only a peer got it (torchrun passes SIGTERM on)
        got = signal.Signals(signum).name if self.stop.signum else "a peer's signal"
        raise RunInterrupted(
            f"[{self.config.name}] stopped by {got} after step {done} of {self.config.trainer.steps}; wrote "
            f"{self.last_checkpoint}, and the same command continues from it",
            signum=signum,
            checkpoint=self.last_checkpoint,
        )

    def _loop(self) -> tuple[float, float, float, Throughput]:
        tc = self.config.trainer
        meter = Throughput(warmup=min(2, max(0, tc.steps - self.start_step - 1)))
        progress = Progress(tc.steps, self.start_step, tc.progress and self.env.is_main, self.config.name)
        first_loss = last_loss = float("nan")
        window: list[float] = []
        wall = time.perf_counter()
        self.core_step.deadline = None if tc.time_limit_s is None else wall + tc.time_limit_s
        self.core_step.clock.restart()
        collector = GcSchedule(tc.gc_every)
        collector.start()
        try:
            for step in range(self.start_step, tc.steps):
                self.context.step = step
                try:
                    result: StepResult = self.pm.call("gem_train_step", run=self.context, step=step)
                except torch.OutOfMemoryError as exc:
                    raise out_of_memory_error(self.config, self.pm, step, exc, self.last_checkpoint) from exc
                collector.after_step(step)
                meter.add(result.seconds, result.samples, result.tokens, result.flops)
                if result.skipped:
                    self._event({"step": step + 1, "event": "non_finite_skip", "non_finite_loss": str(result.loss),
                                 "in_a_row": self.core_step.skipped_in_a_row})  # fmt: skip
                else:
                    self.soundness.trained(step + 1, result.loss)  # the checkpoints before this step train
                    first_loss = result.loss if math.isnan(first_loss) else first_loss
                    window.append(result.loss)
                    spike = self.spikes.observe(step + 1, result.loss)
                    if spike is not None:
                        self._event(spike.record())
                self.stopped_by_signal = result.stop_requested
                stop = result.out_of_time or result.stop_requested
                last = step + 1 == tc.steps or stop
                logged = None
                if ((step + 1) % tc.log_every == 0 or last) and window:
                    last_loss = sum(window) / len(window)
                    window.clear()
                    logged = self._log(result, last_loss)
                progress.update(step, logged)
                if tc.checkpoint_every and (step + 1) % tc.checkpoint_every == 0 and not last:
                    self.save_checkpoint(step + 1)
                    self.core_step.clock.restart()  # not step time
                if tc.eval_every and (step + 1) % tc.eval_every == 0 and not last:
                    self.evaluate(step + 1, ("valid",))
                    self.core_step.clock.restart()
                if stop:
                    self.steps_done = step + 1
                    break
        finally:
            collector.stop()
            progress.close()
            self.feed.close()  # no thread outlives the loop, also when a step raised
        return first_loss, last_loss, time.perf_counter() - wall, meter

    def evaluate(self, step: int, splits: tuple[str, ...]) -> dict[str, float]:
        """Offline metrics from the data source (rank 0, unwrapped model); logged to the metrics file."""
        out: dict[str, float] = {}
        if not self.env.is_main:
            return out
        was_training = self.model.training
        self.model.eval()
        try:
            for split in splits:
                with self.feed.exclusive(), live_progress(self.config.trainer.progress):  # the prefetch thread calls the source too
                    metrics = self.components.source.evaluate(self.model, device=self.env.device, split=split)
                out.update({f"{split}/{k}": v for k, v in (metrics or {}).items()})
        finally:
            self.model.train(was_training)
        if out:
            self.metrics.write({"step": step, **out})
        return out

    def _event(self, record: dict[str, object]) -> None:
        """A structured warning (train.spikes): in the log and in metrics.jsonl, from rank 0."""
        if self.env.is_main:
            warn(self.config.name, record)
            self.metrics.write(record)

    def _log(self, result: StepResult, mean_loss: float) -> dict[str, float]:
        record = step_record(result, mean_loss, self.peak * self.layout.world_size)
        self.metrics.write(record)
        return record

    def _summary(self, first: float, last: float, wall: float, meter: Throughput) -> RunSummary:
        return run_summary(
            self.config, steps=self.steps_done, first=first, last=last, wall=wall, rates=meter.rates(),
            peak=self.peak, peak_source=self.peak_source, world_size=self.env.world_size, device=str(self.env.device),
            extra={"plan": self.prepared.plan_summary, "layout": str(self.layout), "output_dir": str(self.output_dir)},
            trained=self.steps_done - self.start_step,
        )
