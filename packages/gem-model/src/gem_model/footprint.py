"""What a config's own sizes need in memory, estimated before the run is built, against the device.

A run whose tables or activations cannot fit stops before any process group or table exists, with
exit 2 and each component's share, instead of the allocator's traceback minutes later. The estimate
is a lower bound per process, so that it never refuses a run that would fit:

- tables: ``rows x embedding_dim x 4`` bytes, spread evenly over the processes (a planner cannot do
  better); their optimizer state: one float per row (``rowwise_adagrad``), two per element (``adam``),
  none (``sgd``);
- dense parameters with their gradients and AdamW's two moments (16 bytes per parameter), counted
  from the model's sizes;
- activations of the first global batch (its real lengths, as the source gives them), shared over
  the data-parallel ranks: what each HSTU block keeps for backward per token, and the next-item loss's
  negatives, in the run's activation dtype. Under an activation policy other than the default (one
  that recomputes or compresses), only the blocks' inputs at one byte a value: what no policy can
  drop. A kernel's own workspace (e.g. a dense attention's ``n x n`` scores) is not counted.

On ``configs/h200-large.yaml`` the estimate is 74.9 GB (tables 24.6, dense state 1.2, activations
49.0), where the H200 profile of 2026-12-01 measured a 77.9 GB peak (``benchmarks/results/profile.md``).

With ``model.table_init: host`` every process also draws the whole tables in host memory first;
that is checked against the host's memory too.

The device's memory: a GPU's total memory; the CPU's available memory (``MemAvailable``), shared by
this host's processes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from gem_model.config import RunConfig
    from gem_model.data.batch import FeatureSpec

Problem = tuple[str, object, str]

GB = 1e9
FP32 = 4


@dataclass(frozen=True)
class Part:
    path: str
    """The config field that sizes it (where the error points)."""
    what: str
    bytes: float


def table_rows(spec: FeatureSpec) -> dict[str, int]:
    from gem_model.data.batch import ACTION_TABLE, ITEM_TABLE

    rows = {ITEM_TABLE: spec.num_items, ACTION_TABLE: spec.num_actions}
    rows.update({f"t_{p.name}": p.num_embeddings for p in spec.pooled})
    return rows


def dense_parameters(config: RunConfig, spec: FeatureSpec) -> int:
    """The dense parameters of the model's sizes (linears and norms; biases of the bias options)."""
    mc = config.model
    d, h, dqk, dv = mc.embedding_dim, mc.num_heads, mc.attention_dim, mc.value_dim
    uvqk = h * (2 * dv + 2 * dqk)
    block = d * uvqk + uvqk + h * dv * d + d + 2 * h * dv + 2 * d
    block += (2 * mc.max_seq_len - 1) * mc.relative_position_bias + mc.time_bias_buckets * mc.relative_time_bias
    mixer = 4 * d * d + 4 * d * d + 4 * d  # attention projections and a 2-layer MLP of width 2d
    features = len(spec.pooled) + int(spec.num_dense > 0)
    tokens = 2 + (features if mc.use_side_features else 0)
    total = mc.num_blocks * block + mc.max_seq_len * d * mc.position_embedding
    total += mixer * (mc.cross_layers + (mc.interaction_layers if mc.use_side_features else 0))
    total += tokens * d * mc.mlp_hidden + mc.mlp_hidden * len(spec.tasks) if spec.tasks else 0
    return total


def activation_bytes_per_token(config: RunConfig, dtype_bytes: int) -> int:
    """What one HSTU block keeps for backward per token: its input and norm, the uvqk projection
    before and after silu, the attention output, the gated norm and the output projection's input."""
    mc = config.model
    uvqk = mc.num_heads * (2 * mc.value_dim + 2 * mc.attention_dim)
    return mc.num_blocks * dtype_bytes * (2 * mc.embedding_dim + 2 * uvqk + 3 * mc.num_heads * mc.value_dim)


@dataclass(frozen=True)
class MemoryShape:
    """What the estimate needs to know of a run besides its config."""

    spec: FeatureSpec
    world_size: int
    dp_degree: int
    local_processes: int
    """The run's processes on this host, which share its memory."""
    first_lengths: torch.Tensor | None
    """The history lengths of the first global batch (None: the source could not say yet)."""
    bf16_activations: bool
    plain_activations: bool = True
    """Whether the activation policy keeps what each block saves (the default policy, no overrides)."""


def estimate(config: RunConfig, shape: MemoryShape) -> list[Part]:
    """The per-process parts of the run's memory (see the module doc)."""
    spec, world = shape.spec, max(shape.world_size, 1)
    d = config.model.embedding_dim
    rows = table_rows(spec)
    biggest = max(rows, key=lambda t: rows[t])
    spread = f"over {world} processes" if world > 1 else "on one process"
    parts = [Part("data.source", f"tables {sum(rows.values()) * d * FP32 / GB:.3g} GB {spread} (the largest, "
                  f"{biggest}: {rows[biggest]:,} x {d})", sum(rows.values()) * d * FP32 / world)]  # fmt: skip
    per_row = {"rowwise_adagrad": FP32, "adam": 2 * d * FP32, "sgd": 0}[config.trainer.sparse_optimizer]
    if per_row:
        parts.append(Part("trainer.sparse_optimizer", f"the tables' {config.trainer.sparse_optimizer} state",
                          sum(rows.values()) * per_row / world))  # fmt: skip
    parts.append(Part("model", "dense parameters, gradients and AdamW state", 16.0 * dense_parameters(config, spec)))
    if shape.first_lengths is not None:
        parts.append(_activations(config, shape, shape.first_lengths))
    return parts


def _activations(config: RunConfig, shape: MemoryShape, first_lengths: torch.Tensor) -> Part:
    spec, mc, dp = shape.spec, config.model, max(shape.dp_degree, 1)
    lengths = first_lengths.clamp(max=spec.max_history)
    tokens = float(lengths.sum()) + lengths.numel() * (int(mc.use_candidate) + int(mc.context_token))
    dtype_bytes = 2 if shape.bf16_activations else 4
    per_rank = tokens / dp
    negatives = float((lengths - 1).clamp(min=0).sum()) if spec.negatives_per_position else float(lengths.numel())
    negative_bytes = negatives * spec.num_negatives * (mc.embedding_dim * dtype_bytes + FP32) / dp
    if shape.plain_activations:
        per_token, kept = activation_bytes_per_token(config, dtype_bytes), "what each block saves"
    else:  # a policy recomputes or compresses: the blocks' inputs, one byte a value, stay
        per_token, kept = mc.num_blocks * mc.embedding_dim, "the blocks' inputs under the activation policy"
    total = per_rank * per_token + negative_bytes
    return Part("data.global_batch_size", f"activations of the first batch ({per_rank:,.0f} tokens per data-parallel "
                f"rank, {mc.num_blocks} blocks: {kept}; the next-item loss's negatives)", total)  # fmt: skip


def device_memory(config: RunConfig, local_processes: int) -> tuple[float, str] | None:
    """(bytes one process may use, what they are) on the run's device; None where it cannot be told."""
    import torch

    want = config.trainer.device
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            return None  # the device check reports it
        index = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
        props = torch.cuda.get_device_properties(index)
        return float(props.total_memory), f"the {props.name}'s {props.total_memory / GB:.3g} GB"
    host = host_memory()
    if host is None:
        return None
    share = host / max(local_processes, 1)
    who = f"{local_processes} processes' share, {share / GB:.3g} GB" if local_processes > 1 else f"{host / GB:.3g} GB"
    return share, f"this host's available memory ({who})"


def host_memory() -> float | None:
    """Bytes of memory available on this host (Linux ``MemAvailable``), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def memory_problems(config: RunConfig, shape: MemoryShape) -> list[Problem]:
    """The run's memory against the device's: a problem naming the largest part and every part's share."""
    problems: list[Problem] = []
    parts = estimate(config, shape)
    budget = device_memory(config, shape.local_processes)
    need = sum(p.bytes for p in parts)
    if budget is not None and need > budget[0]:
        top = max(parts, key=lambda p: p.bytes)
        each = "; ".join(f"{p.what}: {p.bytes / GB:.3g} GB" for p in sorted(parts, key=lambda p: -p.bytes))
        problems.append((top.path, f"{need / GB:.3g} GB", f"the run needs at least {need / GB:.3g} GB per process, "
                         f"more than {budget[1]}: {each}. Shrink the largest, or spread the run over more "
                         "processes (the tables and the batch divide over them)"))  # fmt: skip
    problems += _host_draw_problems(config, shape)
    return problems


def _host_draw_problems(config: RunConfig, shape: MemoryShape) -> list[Problem]:
    """``table_init: host`` draws the whole tables in every process's host memory before they are placed."""
    import torch

    on_gpu = config.trainer.device == "cuda" or (config.trainer.device == "auto" and torch.cuda.is_available())
    if config.model.table_init != "host" or not on_gpu:
        return []  # on the CPU the tables' share above is already host memory
    host = host_memory()
    local = max(shape.local_processes, 1)
    tables = sum(table_rows(shape.spec).values()) * config.model.embedding_dim * FP32 * local
    if host is None or tables <= host:
        return []
    return [("model.table_init", "host", f"every process draws the whole tables in host memory first: "
             f"{tables / GB:.3g} GB for {local} process(es) on this host, which has {host / GB:.3g} GB "
             "available; set model.table_init=device (the tables are then drawn on the GPU)")]  # fmt: skip
