"""The entry point of a training run: parse-free, so tests and the CLI share it."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from contextlib import contextmanager

from gem_model.checks import check_run
from gem_model.config import RunConfig
from gem_model.distributed import init_distributed, launched_by_torchrun, teardown
from gem_model.errors import RunInterrupted
from gem_model.plugins import GemPluginManager
from gem_model.resolve import Components, resolve_components
from gem_model.results import RunSummary
from gem_model.train import resume
from gem_model.train.lock import OutputDirRefused, OutputLock
from gem_model.train.outputs import output_dir
from gem_model.train.run import Run


@contextmanager
def started_run(
    config: RunConfig, pm: GemPluginManager | None = None, components: Components | None = None
) -> Iterator[Run]:
    """The run of ``config``, built but not trained: every component resolved and every constraint
    checked before any process group (``components``: resolved and checked already, by ``gem-train
    run``), then the group joined, the output directory locked by rank 0 for the whole run
    (:mod:`gem_model.train.lock`) and the :class:`Run` made. The group is left and the lock let go on
    exit; the group cleanly when the block ended or stopped with :class:`RunInterrupted` (every rank
    stopped after the same step) or :class:`OutputDirRefused` (every rank learnt it in one collective)."""
    pm = pm if pm is not None else GemPluginManager()
    launched = launched_by_torchrun()
    world = int(os.environ.get("WORLD_SIZE", "1")) if launched else 1
    if components is None:
        components = resolve_components(config, pm)
        check_run(config, components, world, process_group=launched)
    resume.check_before_build(config, world, pm)
    env = init_distributed(config.trainer.device, timeout_s=config.trainer.collective_timeout_s)
    held = OutputLock(output_dir(config))
    clean = False
    try:
        refusal = held.acquire() if env.is_main else None
        if refusal is not None and not env.distributed:
            raise refusal
        note = held.took_over()
        if note is not None:
            print(f"[{config.name}] {note}", flush=True)
        yield Run(config, pm, components, env, refusal=refusal)
        clean = True
    except RunInterrupted:
        clean = True  # every rank stopped after the same step and wrote the checkpoint together
        raise
    except OutputDirRefused:
        clean = True  # every rank learnt rank 0's refusal in the same start-up all-reduce
        raise
    finally:
        try:
            teardown(env, clean=clean)
        finally:
            held.release()


def train(config: RunConfig, pm: GemPluginManager | None = None, components: Components | None = None) -> RunSummary:
    """Resolve every component (before any process group), join the group, train, leave cleanly.

    The run's objects hold its process groups in reference cycles. Left to the interpreter's exit, a
    gloo group's threads are torn down with it, which aborts the process now and then (SIGABRT,
    "terminate called without an active exception"): so the run is dropped and its cycles collected
    here, after the group was left; the groups' destructors then join their threads. A caller that
    passed ``components`` drops them and collects likewise (``gem-train run`` does)."""
    with started_run(config, pm, components) as run:
        summary = run.fit()
    del run
    gc.collect()
    return summary
