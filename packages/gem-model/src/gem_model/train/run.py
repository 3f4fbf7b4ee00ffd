"""A training run: built from the config and the registries, stepped through the plugin hook."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gem_model.components import PreparedModel
from gem_model.config import RunConfig
from gem_model.data.batch import Batch
from gem_model.data.loader import ShardedLoader
from gem_model.data.prefetch import StepFacts, make_feed
from gem_model.distributed import DistEnv
from gem_model.errors import CheckpointError, KernelUnavailableError, NonFiniteLossError
from gem_model.model.flops import count_flops
from gem_model.model.gem import GemModel
from gem_model.plugins import GemPluginManager
from gem_model.resolve import Components
from gem_model.train import checkpoint as ckpt
from gem_model.train.metrics import MetricsFile, StepClock, Throughput, peak_flops
from gem_model.train.optim import set_learning_rate, sparse_optimizer_spec, warmup_factor
from gem_model.train.prepare import prepare_model
from gem_model.train.progress import Progress
from gem_model.train.report import ReportSection, RunSummary, format_sections


@dataclass
class StepResult:
    """One step, reduced over all ranks."""

    step: int
    loss: float
    task_loss: float
    next_item_loss: float
    samples: int
    tokens: int
    flops: float
    seconds: float
    """Wall time since the previous step ended (see :class:`~gem_model.train.metrics.StepClock`)."""
    out_of_time: bool = False
    """``trainer.time_limit_s`` has passed on rank 0: the loop stops after this step."""


class Run:
    def __init__(self, config: RunConfig, pm: GemPluginManager, components: Components, env: DistEnv):
        self.config, self.pm, self.components, self.env = config, pm, components, env
        tc = config.trainer
        torch.manual_seed(tc.seed * 1_000 + env.rank)
        components.comm.setup(env)
        self.comm = components.comm
        self.loader = ShardedLoader(
            components.source,
            components.balancer,
            global_batch_size=config.data.global_batch_size,
            rank=env.rank,
            world_size=env.world_size,
        )
        self.spec = self.loader.spec
        self.feed = make_feed(
            self.loader, prefetch=tc.prefetch, device=env.device, facts=self._batch_facts, end=tc.steps
        )
        self.clock = StepClock()
        self._deadline: float | None = None  # perf_counter() time when trainer.time_limit_s runs out
        for kernel, path in ((components.attention, "jagged_attention"), (components.norm_gate, "norm_gate")):
            try:
                kernel.check_available(env.device)
            except KernelUnavailableError as exc:
                raise KernelUnavailableError(f"kernels.{path}: {kernel.name!r} cannot run here: {exc}") from None
        self.model = GemModel(
            config.model, self.spec, attention=components.attention, norm_gate=components.norm_gate, seed=tc.seed
        )
        self.prepared: PreparedModel
        self.prepared, self.plans = prepare_model(
            self.model,
            precision_config=config.precision,
            schemes=components.precision,
            activation_config=config.activation,
            policies=components.activation,
            compile_blocks=tc.compile,
            planner=components.planner,
            env=env,
            comm=components.comm,
            sparse_optimizer=sparse_optimizer_spec(tc),
        )
        self.dense_names = [n for n, _ in self.prepared.dense_parameters]
        self.dense_optimizer = torch.optim.AdamW(
            [p for _, p in self.prepared.dense_parameters], lr=tc.dense_lr, betas=tc.betas, weight_decay=tc.weight_decay
        )
        self.output_dir = Path(tc.output_dir.format(name=config.name))
        self.checkpointer = ckpt.Checkpointer(self.output_dir / "checkpoints", env)
        self.metrics = MetricsFile(self.output_dir / "metrics.jsonl" if env.is_main else None)
        self.peak, self.peak_source = peak_flops(env.device, config.precision.scheme.name, tc.peak_flops)
        self.start_step = 0
        self.steps_done = config.trainer.steps  # fewer when trainer.time_limit_s stops the run early
        self.last_checkpoint: Path | None = None
        latest = ckpt.latest_checkpoint(self.checkpointer.root)
        if tc.resume is None and latest is not None:  # auto: continue this run, refuse another's
            meta = ckpt.read_meta(latest)
            differs = ckpt.config_differences(meta.get("config", {}), config.model_dump(mode="json"))
            if int(meta.get("world_size", env.world_size)) != env.world_size:
                differs.insert(0, f"world size ({meta['world_size']} -> {env.world_size})")
            if differs:
                more = f" and {len(differs) - 8} more" if len(differs) > 8 else ""
                raise CheckpointError(
                    f"{self.checkpointer.root} holds checkpoints of another run ({latest.name}); its config "
                    f"differs in {', '.join(differs[:8])}{more}. Choose another trainer.output_dir, or set "
                    "trainer.resume=true to load it anyway (nothing was overwritten)"
                )
        if tc.resume is None or tc.resume:
            self.resume()
        elif latest is not None:
            raise CheckpointError(
                f"{self.checkpointer.root} holds checkpoints of an earlier run and trainer.resume=false; "
                "set trainer.resume=true (or leave it unset) to continue it, or choose another "
                "trainer.output_dir (nothing was overwritten)"
            )

    # -------------------------------------------------------------------------------------- a step

    def _batch_facts(self, batch: Batch) -> StepFacts:
        """The step's host-side facts, from the CPU batch (in the prefetch thread when there is one)."""
        lengths = batch.history_lengths()
        cand = batch.batch_size if self.config.model.use_candidate else 0
        flops = count_flops(self.config.model, self.spec, lengths).train_step
        return StepFacts(batch.batch_size, int(lengths.sum()) + cand, flops)

    def execute_step(self, step: int) -> StepResult:
        """Forward, global loss reduction (and non-finite check) before any update, backward, update.

        One host synchronisation: the read of the all-reduced loss sums. Nothing else in the step
        waits for the device; the batch was built (and, on CUDA, copied) ahead by ``self.feed``.
        """
        tc, mc = self.config.trainer, self.config.model
        self.clock.begin()
        staged = self.feed.get(step)
        batch = staged.ready()
        if tc.warmup_steps:
            self._warm_up(step)
        self.prepared.module.train()
        out = self.prepared.module(batch)
        facts = staged.facts
        late = self._deadline is not None and self.env.is_main and time.perf_counter() > self._deadline
        host = torch.tensor([facts.samples, facts.tokens, facts.flops, float(late)], dtype=torch.float64)
        losses = [out.task_loss_sum.detach(), out.next_item_loss_sum.detach(), out.next_item_count]
        local = torch.cat([torch.stack([x.double() for x in losses]), _to_device(host, self.env.device)])
        # The step's one host sync, and it has to stay: whether this step's update may be applied is
        # decided from the global loss before backward, because torchrec fuses the table optimizer
        # into backward (an update, once backward ran, cannot be undone). One read of one small
        # tensor carries the loss sums and everything the metric record needs.
        reduced = self.comm.all_reduce_sum(local).tolist()
        task_sum, next_sum, next_count, samples, tokens, total_flops, late_ranks = reduced
        task_loss = task_sum / samples
        next_loss = next_sum / max(next_count, 1.0)
        value = mc.task_weight * task_loss + mc.next_item_weight * next_loss
        if not math.isfinite(value):
            kept = self.last_checkpoint or "none written yet"
            raise NonFiniteLossError(
                f"step {step}: the loss is {value} (task {task_loss}, next-item {next_loss}); the run stopped "
                f"before applying this step's update. Last complete checkpoint: {kept}"
            )
        world = self.env.world_size
        # Normalised by global counts: DDP's gradient mean then equals the one-process gradient.
        loss = mc.task_weight * out.task_loss_sum / (samples / world) + mc.next_item_weight * (
            out.next_item_loss_sum / (max(next_count, 1.0) / world)
        )
        self.dense_optimizer.zero_grad(set_to_none=True)
        if not self.prepared.sparse_optimizer_fused:
            self.prepared.sparse_optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if tc.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_([p for _, p in self.prepared.dense_parameters], tc.grad_clip)
        self.dense_optimizer.step()
        if not self.prepared.sparse_optimizer_fused:
            self.prepared.sparse_optimizer.step()
        return StepResult(
            step, value, task_loss, next_loss, int(samples), int(tokens), total_flops, self.clock.lap(),
            out_of_time=late_ranks > 0,
        )  # fmt: skip

    def _warm_up(self, step: int) -> None:
        """Set both optimizers' rates for ``step`` (``trainer.warmup_steps``), before its forward."""
        tc = self.config.trainer
        factor = warmup_factor(step, tc.warmup_steps)
        set_learning_rate(self.dense_optimizer, tc.dense_lr * factor)
        set_learning_rate(self.prepared.sparse_optimizer, tc.sparse_lr * factor)
        if self.prepared.sparse_optimizer_fused:
            # FBGEMM takes the rate its zero_grad/step last handed it, and its lookup's forward already
            # fixes the rate that the update inside backward uses: so this comes before the forward
            self.prepared.sparse_optimizer.zero_grad()

    # --------------------------------------------------------------------------------- checkpoints

    def _state(self) -> dict[str, Any]:
        return {
            "model": self.prepared.module.state_dict(),
            "dense_optimizer": ckpt.dense_optimizer_state(self.dense_optimizer, self.dense_names),
            "sparse_optimizer": self.prepared.sparse_optimizer.state_dict(),
            # as tensors: DCP round-trips tensors reliably in every layout, plain ints not always
            "loader": {k: torch.tensor(v, dtype=torch.int64) for k, v in self.loader.state_dict().items()},
            f"rng_rank{self.env.rank}": ckpt.rng_state(),
        }

    def save_checkpoint(self, step: int) -> Path:
        """Save the state after ``step`` steps (the loader resumes at ``step``)."""
        self.loader.step = step
        meta = {"world_size": self.env.world_size, "name": self.config.name, "config": self.config.model_dump(mode="json")}
        self.last_checkpoint = self.checkpointer.save(step, self._state(), meta)
        return self.last_checkpoint

    def resume(self) -> None:
        path = ckpt.latest_checkpoint(self.checkpointer.root)
        if path is None:
            return
        ckpt.init_optimizer_state(self.dense_optimizer)
        if not self.prepared.sparse_optimizer_fused:
            self.prepared.sparse_optimizer.init_state()
        state = self._state()
        self.checkpointer.load(path, state)
        self.prepared.module.load_state_dict(state["model"])
        ckpt.load_dense_optimizer_state(self.dense_optimizer, self.dense_names, state["dense_optimizer"])
        self.prepared.sparse_optimizer.load_state_dict(state["sparse_optimizer"])
        self.loader.load_state_dict({k: int(v) for k, v in state["loader"].items()})
        ckpt.set_rng_state(state[f"rng_rank{self.env.rank}"])
        self.start_step = self.loader.step
        self.last_checkpoint = path
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
        tc = self.config.trainer
        self.pm.call("gem_run_started", run=self)
        try:
            first_loss, last_loss, wall, meter = self._loop()
            if tc.checkpoint_at_end and self.steps_done > self.start_step:
                self.save_checkpoint(self.steps_done)
            final_eval = self.evaluate(self.steps_done, ("valid", "test")) if tc.eval_at_end else {}
        finally:
            self.feed.close()
            self.metrics.close()
        summary = self._summary(first_loss, last_loss, wall, meter)
        summary.extra["eval"] = final_eval
        self.pm.call("gem_run_finished", run=self, summary=summary)
        extra: list[ReportSection] = [s for group in self.pm.call("gem_report_sections", run=self, summary=summary) for s in group]
        if self.env.is_main:
            print(format_sections([summary.section(), *extra]), flush=True)
        return summary

    def _loop(self) -> tuple[float, float, float, Throughput]:
        tc = self.config.trainer
        meter = Throughput(warmup=min(2, max(0, tc.steps - self.start_step - 1)))
        progress = Progress(tc.steps, self.start_step, tc.progress and self.env.is_main, self.config.name)
        first_loss = last_loss = float("nan")
        window: list[float] = []
        wall = time.perf_counter()
        self._deadline = None if tc.time_limit_s is None else wall + tc.time_limit_s
        self.clock.restart()
        try:
            for step in range(self.start_step, tc.steps):
                result: StepResult = self.pm.call("gem_train_step", run=self, step=step)
                meter.add(result.seconds, result.samples, result.tokens, result.flops)
                first_loss = result.loss if math.isnan(first_loss) else first_loss
                window.append(result.loss)
                stop = result.out_of_time
                last = step + 1 == tc.steps or stop
                logged = None
                if (step + 1) % tc.log_every == 0 or last:
                    last_loss = sum(window) / len(window)
                    window.clear()
                    logged = self._log(result, last_loss)
                progress.update(step, logged)
                if tc.checkpoint_every and (step + 1) % tc.checkpoint_every == 0 and not last:
                    self.save_checkpoint(step + 1)
                    self.clock.restart()  # not step time
                if tc.eval_every and (step + 1) % tc.eval_every == 0 and not last:
                    self.evaluate(step + 1, ("valid",))
                    self.clock.restart()
                if stop:
                    self.steps_done = step + 1
                    break
        finally:
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
                with self.feed.exclusive():  # the prefetch thread calls the source too
                    metrics = self.components.source.evaluate(self.model, device=self.env.device, split=split)
                out.update({f"{split}/{k}": v for k, v in (metrics or {}).items()})
        finally:
            self.model.train(was_training)
        if out:
            self.metrics.write({"step": step, **out})
        return out

    def _log(self, result: StepResult, mean_loss: float) -> dict[str, float]:
        s = max(result.seconds, 1e-12)
        record = {
            "step": result.step + 1,
            "loss": mean_loss,
            "step_loss": result.loss,
            "task_loss": result.task_loss,
            "next_item_loss": result.next_item_loss,
            "samples_per_s": result.samples / s,
            "tokens_per_s": result.tokens / s,
            "mfu": result.flops / s / (self.peak * self.env.world_size),
            "step_seconds": result.seconds,
        }
        self.metrics.write(record)
        return record

    def _summary(self, first: float, last: float, wall: float, meter: Throughput) -> RunSummary:
        rates = meter.rates()
        c = self.config
        return RunSummary(
            name=c.name,
            steps=self.steps_done,
            first_loss=first,
            last_loss=last,
            wall_seconds=wall,
            samples_per_s=rates["samples_per_s"],
            tokens_per_s=rates["tokens_per_s"],
            mfu=rates["flops_per_s"] / (self.peak * self.env.world_size),
            peak_flops=self.peak,
            peak_source=self.peak_source,
            world_size=self.env.world_size,
            device=str(self.env.device),
            components={
                "attention kernel": c.kernels.jagged_attention.name,
                "precision": c.precision.scheme.name,
                "activation": c.activation.policy.name,
                "planner": c.parallel.planner.name,
                "comm": c.comm.strategy.name,
                "data": f"{c.data.source.name}, global batch {c.data.global_batch_size}",
            },
            extra={"plan": self.prepared.plan_summary, "output_dir": str(self.output_dir)},
        )


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on ``device`` without making the host wait (pinned, so truly asynchronous)."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
