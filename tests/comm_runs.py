"""Whole 2-process runs through gem-parallel's ``torchrec_ddp`` planner, as subprocesses (tests only)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from gem_model.testing import RunTimedOut, finish, start_run

HERE = Path(__file__).resolve().parent

# gem-parallel's tests/conftest.py REFERENCE overrides and test_loss_pin.py's pinned losses
REFERENCE = [
    "kernels.jagged_attention=loop", "kernels.norm_gate=loop", "precision.scheme=inline_fp32",
    "activation.policy=inline_none", "trainer.progress=false", "trainer.log_every=1",
    "data.global_batch_size=16", "data.source.options.max_len=15", "model.max_seq_len=16",
    "trainer.steps=4", "trainer.checkpoint_at_end=false", "trainer.eval_at_end=false",
    "parallel.planner=torchrec_ddp", "callbacks=[{name: comm_report}]",
]  # fmt: skip
AVX2 = "AVX2 CI machine, 4ddf59e"
SPR = "AVX-512 + AMX (Sapphire Rapids), b9cca1e"
AMD = "AVX-512 AMD EPYC (no AMX), cb0a341"
PINNED = {
    AVX2: ["0x1.1dfc7c48d3dcbp+3", "0x1.f38f95fa4d269p+2", "0x1.05a5b3d1dae60p+3", "0x1.09b4381d3dcb0p+3"],
    SPR: ["0x1.1dfc7cc52640cp+3", "0x1.f38f965a4d269p+2", "0x1.05a5b3667e252p+3", "0x1.09b43732c2350p+3"],
    AMD: ["0x1.1dfc7c18d3dcbp+3", "0x1.f38f967abd5ebp+2", "0x1.05a5b295ae608p+3", "0x1.09b438ea7b961p+3"],
}
"""The ``sequential`` pipeline's step losses on 2 processes with ``default`` (float.hex), per CPU
family (gem_model.testing.assert_pinned)."""

RUNS: dict[str, tuple[str, ...]] = {
    "overlap": ("comm.strategy=overlap",),
    "quantized": ("comm.strategy=quantized",),
    # gem-comm's sparse_dist plus a record of torchrec's pipeline contexts (comm_sparse_probe.py);
    # the attention's 5th call (block 1 of step 3) returns NaN and the core skips that update
    "sparse_dist": (
        "trainer.pipeline=sparse_dist_probe", "trainer.non_finite=skip",
        "kernels.jagged_attention={name: poison, options: {nan_from_call: 5, nan_calls: 1}}",
    ),
}  # fmt: skip
"""The runs the planner tests check, by name: overrides on top of :data:`REFERENCE`."""
SKIPPED_PINNED = {
    AVX2: [*PINNED[AVX2][:2], "0x1.0a46f24cb08d4p+3"],  # step 4 measured at dd80bdc
    SPR: [*PINNED[SPR][:2], "0x1.0a46f12234f73p+3"],
    AMD: [*PINNED[AMD][:2], "0x1.0a46f11234f73p+3"],
}
"""The ``sequential`` pipeline's step losses of the ``sparse_dist`` run's config (steps 1, 2, 4;
step 3's update skipped), measured with ``trainer.pipeline=sequential``, per CPU family."""
PLUGINS = "gem_model.testing,comm_sparse_probe"


@dataclass
class Finished:
    out: Path
    returncode: int
    stdout: str
    stderr: str


def start(out: Path, *overrides: str, plugins: str = PLUGINS) -> subprocess.Popen[str]:
    """``gem-train run`` of :data:`REFERENCE` plus ``overrides`` on 2 processes, writing into ``out``
    (the probe pipeline too); ``plugins`` (GEM_PLUGINS) may name modules of this folder, which is
    put on PYTHONPATH. Through torchrun itself, as ``gem-train run --nproc 2`` starts it, without
    the launcher's own process (its checks are tested in gem-model)."""
    path = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH", "")]))
    env = {**os.environ, "GEM_PLUGINS": plugins, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    env["SPARSE_PROBE_DIR"] = str(out)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "gem_model",
        "run",
        *REFERENCE,
        *overrides,
        f"trainer.output_dir={out}",
    ]
    return start_run(cmd, env=env)  # in a session of its own: collect it with finish (a hang shows its stacks)


def run_all(root: Path, names: list[str]) -> dict[str, Finished]:
    """The runs of :data:`RUNS` named, started at once. One that outlives its 600 s fails with its ranks'
    stacks (gem_model.testing.finish); the others still running are then ended, their stacks printed."""
    procs = {name: start(root / name, *RUNS[name]) for name in names}
    done = {}
    try:
        for name, proc in procs.items():
            run = finish(proc, timeout_s=600)
            done[name] = Finished(root / name, run.returncode, run.stdout, run.stderr)
    finally:
        for name, proc in procs.items():
            if proc.poll() is None:
                try:
                    finish(proc, timeout_s=0)
                except RunTimedOut as stopped:
                    print(f"{name}, ended with the one that timed out: {stopped}")
    return done


def step_losses(out: Path) -> list[float]:
    return [json.loads(x)["step_loss"] for x in (out / "metrics.jsonl").read_text().splitlines() if "step_loss" in x]
