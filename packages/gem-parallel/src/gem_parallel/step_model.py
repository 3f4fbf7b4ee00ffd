"""A whole step's time on any layout, calibrated on one GPU's measured profile.

``gem-train profile`` measures a config's steps on one process and splits their time by kind
(``step_time`` section: attention, GEMMs, pointwise, embeddings, loss kernels on CUDA; host ops on
the CPU; and idle time). From that, per rank of a layout (:meth:`StepModel.predict`):

- **dense compute** = the measured seconds per token of attention, GEMMs, pointwise and loss work,
  times this rank's tokens (the global batch's tokens over ``dp x cp``), over ``tp`` (a tp rank
  computes its heads only);
- **embeddings** = the measured seconds per sample of the lookups, times this rank's samples (the
  global batch over ``dp``; a sharded table's lookups are spread over its group, as many per rank
  on average);
- **idle** = the measured host overhead per step (on CUDA: the unprofiled step's, without the
  profiler's own host cost), the same for every layout: launches do not shrink with the batch;
- **communication** = :mod:`gem_parallel.cost`'s estimate from the stated link bandwidths, all of
  it exposed (no overlap with compute).

The step is their sum, and the scaling efficiency is the one-GPU step of the same config over
``world_size`` times the layout's step (``gem-train profile``'s definition: N-GPU tokens/s over N
times one GPU's). What the model leaves out is listed in docs/parallel.md.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gem_model.api import ConfigError, ParallelDims, RunConfig

if TYPE_CHECKING:
    from gem_parallel.cost import StepCost
    from gem_parallel.workload import Workload

DENSE_KINDS = ("attention", "gemm", "pointwise", "loss")
SAME_AS_PROFILE = ("model", "kernels", "precision", "activation", "data.source", "trainer.compile")
"""What the per-token and per-sample times depend on: the profile must be of the same run in these."""


@dataclass(frozen=True)
class Prediction:
    """One rank's predicted step on a layout, in seconds, and what it means for throughput."""

    world_size: int
    dense_compute: float
    embeddings: float
    idle: float
    communication: float
    step_seconds: float
    tokens_per_s: float
    one_gpu_step_seconds: float
    """The same config's predicted step on one GPU (the whole global batch)."""
    scaling_efficiency: float
    """``one_gpu_step_seconds / (world_size x step_seconds)``: N-GPU tokens/s over N x one GPU's."""
    calibration: str
    """Where the per-token times come from (the profile's path and device)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class StepModel:
    """Per-token, per-sample and per-step times measured on one GPU (:meth:`from_profile`)."""

    dense_seconds_per_token: float
    embedding_seconds_per_sample: float
    idle_seconds: float
    tokens_per_sample: float
    measured_step_seconds: float
    """The profile's step on one GPU (unprofiled where the profile measured one)."""
    measured_batch: int
    source: str

    @classmethod
    def from_profile(cls, path: str | Path, config: RunConfig, *, where: str = "parallel.planner.options.profile") -> StepModel:
        """Read ``path`` (a ``gem-train profile`` output folder or its ``profile.json``). A
        :class:`ConfigError` at ``where`` says why it cannot calibrate ``config``: no such file, no
        step-time section, a profile of more than one process, or of another run (naming the fields)."""
        file = Path(path)
        file = file / "profile.json" if file.is_dir() else file
        try:
            data = json.loads(file.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError([(where, str(path), f"cannot read a gem-train profile there: {exc}")]) from None
        sections = {s["name"]: s.get("summary") or {} for s in data.get("sections", [])}
        step = sections.get("step_time", {})
        if not step.get("steps"):
            raise ConfigError([(where, str(path), "has no measured steps (the step_time section): run gem-train profile with it")])
        world = int(sections.get("mfu", {}).get("world_size") or sections.get("communication", {}).get("world_size") or 1)
        if world != 1:
            raise ConfigError([(where, str(path), f"is a profile of {world} processes; the calibration needs one GPU's")])
        differ = _differences(data.get("config", {}), config.model_dump(mode="json"))
        if differ:
            raise ConfigError([(where, str(path), f"is a profile of another run: {'; '.join(differ)}")])
        n = int(step["steps"])
        seconds = step["seconds"]
        batch = int(data["config"]["data"]["global_batch_size"])
        wall = statistics.fmean(step["step_seconds"])
        mfu = sections.get("mfu", {})
        if mfu.get("tokens_per_s"):
            tokens = float(mfu["tokens_per_s"]) * wall
        elif sections.get("sequences", {}).get("tokens_per_batch_mean"):
            tokens = float(sections["sequences"]["tokens_per_batch_mean"])
        else:
            raise ConfigError([(where, str(path), "has neither an mfu nor a sequences section to count tokens with")])
        idle = float(step.get("idle_without_profiler", seconds["idle"] / n))
        measured = float(step.get("unprofiled_step_seconds", wall))
        return cls(
            dense_seconds_per_token=sum(float(seconds[k]) for k in DENSE_KINDS) / n / tokens,
            embedding_seconds_per_sample=float(seconds["embeddings"]) / n / batch,
            idle_seconds=idle,
            tokens_per_sample=tokens / batch,
            measured_step_seconds=measured,
            measured_batch=batch,
            source=f"{file} ({data.get('device', '?')})",
        )

    def compute_seconds(self, dims: ParallelDims, w: Workload) -> float:
        """Dense compute, lookups and idle time of one rank's step on ``dims`` (no communication)."""
        dense, emb = self._parts(dims, w)
        return dense + emb + self.idle_seconds

    def predict(self, cost: StepCost, w: Workload) -> Prediction:
        """The step of ``cost``'s layout: :meth:`compute_seconds` plus its communication."""
        dims = cost.dims
        dense, emb = self._parts(dims, w)
        step = dense + emb + self.idle_seconds + cost.comm_seconds
        one = self.compute_seconds(ParallelDims(dp_shard=1, sparse=1), w)
        tokens = self.tokens_per_sample * w.global_batch_size
        return Prediction(
            world_size=dims.world_size, dense_compute=dense, embeddings=emb, idle=self.idle_seconds,
            communication=cost.comm_seconds, step_seconds=step, tokens_per_s=tokens / step, one_gpu_step_seconds=one,
            scaling_efficiency=one / (dims.world_size * step), calibration=self.source,
        )  # fmt: skip

    def _parts(self, dims: ParallelDims, w: Workload) -> tuple[float, float]:
        samples = w.global_batch_size / dims.dp_degree
        tokens = samples * self.tokens_per_sample / dims.cp
        return self.dense_seconds_per_token * tokens / dims.tp, self.embedding_seconds_per_sample * samples


def _differences(profiled: dict[str, Any], here: dict[str, Any]) -> list[str]:
    """``field (profile -> this run)`` for each field of :data:`SAME_AS_PROFILE` that differs."""
    out = []
    for path in SAME_AS_PROFILE:
        a, b = profiled, here
        for key in path.split("."):
            a, b = (a or {}).get(key), (b or {}).get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += [f"{path}.{k} ({a.get(k)!r} -> {b.get(k)!r})" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        elif a != b:
            out.append(f"{path} ({a!r} -> {b!r})")
    return out
