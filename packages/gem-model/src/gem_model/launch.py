"""How ``gem-train run`` starts its processes: torchrun on one node, or on several with c10d rendezvous.

One node (``--nproc N``): ``torchrun --standalone --nproc-per-node N``. Several nodes (``--nnodes M``):
every node runs the same command with its own ``--node-rank``, and they meet at ``--rdzv-endpoint``
(``host:port`` of one of them, which hosts the rendezvous store), as torchrun's c10d rendezvous does::

    gem-train run -c run.yaml --nnodes 2 --node-rank 0 --nproc 8 --rdzv-endpoint node0:29500
    gem-train run -c run.yaml --nnodes 2 --node-rank 1 --nproc 8 --rdzv-endpoint node0:29500

torchrun's c10d rendezvous ignores a node rank (it is for its ``static`` backend only): it numbers the
nodes as they join, and the global ranks follow. So ``--node-rank`` is not passed to torchrun (which
would only warn that it ignores it); it names the node in the line each node prints when its
processes start (:func:`node_notice`), beside the rendezvous's own number and the global ranks the
node got. Global rank 0, wherever it landed, prints the progress and the run summary.

``examples/slurm/gem-multinode.sbatch`` does this under Slurm.
"""

from __future__ import annotations

import argparse
import os
import sys

from gem_model.errors import ConfigError


def add_launch_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", type=int, default=1, help="launch this many processes per node with torchrun")
    parser.add_argument("--nnodes", type=int, default=1, help="nodes of the run (each runs this same command)")
    parser.add_argument("--node-rank", type=int, default=0, help="this node's rank in [0, nnodes)")
    parser.add_argument("--rdzv-endpoint", help="host:port where the nodes meet (c10d rendezvous); needed with --nnodes > 1")
    parser.add_argument("--rdzv-id", default="gem", help="the rendezvous id, the same on every node of one run")
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="torchrun restarts every process this many times after one fails; each restart continues from "
        "the newest checkpoint that verifies (elastic recovery)",
    )


def launch_problems(args: argparse.Namespace) -> list[tuple[str, object, str]]:
    """Every problem of the launch options (reported with the config's, in one round)."""
    problems: list[tuple[str, object, str]] = []
    if args.nproc < 1:
        problems.append(("--nproc", args.nproc, "must be at least 1"))
    if args.nnodes < 1:
        problems.append(("--nnodes", args.nnodes, "must be at least 1"))
    if not 0 <= args.node_rank < max(args.nnodes, 1):
        problems.append(("--node-rank", args.node_rank, f"must be in [0, {args.nnodes})"))
    if args.nnodes > 1 and not args.rdzv_endpoint:
        problems.append(("--rdzv-endpoint", None, "is needed with --nnodes > 1: host:port of the rendezvous"))
    if args.max_restarts < 0:
        problems.append(("--max-restarts", args.max_restarts, "must be at least 0"))
    if args.rdzv_endpoint and ":" not in args.rdzv_endpoint:
        problems.append(("--rdzv-endpoint", args.rdzv_endpoint, "must be host:port"))
    return problems


def check_launch_args(args: argparse.Namespace) -> None:
    problems = launch_problems(args)
    if problems:
        raise ConfigError(problems)


def torchrun_env(args: argparse.Namespace) -> dict[str, str]:
    """The environment torchrun starts with. torchrun sets ``OMP_NUM_THREADS=1`` for each of several
    processes when it is unset, with a banner on every launch; the same value is set here without it."""
    env = dict(os.environ)
    if args.nproc > 1:
        env.setdefault("OMP_NUM_THREADS", "1")
    if args.nnodes > 1:
        env[NODE_RANK_ENV] = str(args.node_rank)
    return env


CUDA_ALLOCATOR = "expandable_segments:True"
"""What ``gem-train run`` gives PyTorch's CUDA caching allocator when neither ``PYTORCH_CUDA_ALLOC_CONF`` nor
``PYTORCH_ALLOC_CONF`` is set: segments that grow in place, so that the memory of one step's jagged batch
is reused by the next one's differently sized tensors instead of being split into blocks that no later
request fits. On the H100 (80 GB, 2026-12-05), two 300-step runs of ``configs/h200-large.yaml`` with
float32 lookups stopped out of memory with 9.6 GiB reserved but unallocated; with this, three such
runs finished, at the same steady step time (206.5 against 206.7 ms; ``benchmarks/results/e2e_ab.md``)."""


def set_cuda_allocator(env: dict[str, str] | os._Environ[str] = os.environ) -> None:
    """:data:`CUDA_ALLOCATOR` into ``env``, unless the user configured the allocator there. Called before
    anything touches CUDA (the allocator reads its settings once, when it starts)."""
    if "PYTORCH_CUDA_ALLOC_CONF" not in env and "PYTORCH_ALLOC_CONF" not in env:
        env["PYTORCH_CUDA_ALLOC_CONF"] = CUDA_ALLOCATOR


NODE_RANK_ENV = "GEM_NODE_RANK"
"""The ``--node-rank`` a node was started with, for :func:`node_notice` (torchrun does not use it)."""


def node_notice(env: dict[str, str] | os._Environ[str] = os.environ) -> str | None:
    """On the first process of each node of a several-node run: which node this is, which global
    ranks it got from the rendezvous, and where the progress and the summary show. None elsewhere."""
    world, local = int(env.get("WORLD_SIZE", "1")), int(env.get("LOCAL_WORLD_SIZE", "1"))
    if world <= local or env.get("LOCAL_RANK", "0") != "0":
        return None
    import socket

    first = int(env.get("RANK", "0"))
    where = (
        "progress and the run summary show here (global rank 0)"
        if first == 0
        else "progress and the run summary show on the node that holds global rank 0"
    )
    return (
        f"gem-train: node --node-rank {env.get(NODE_RANK_ENV, '?')} ({socket.gethostname()}) joined the rendezvous "
        f"as node {env.get('GROUP_RANK', '?')} of {world // local} and runs global ranks {first}-{first + local - 1}; "
        f"{where} (torchrun's c10d rendezvous numbers the nodes as they join, not by --node-rank)"
    )


def world_size(args: argparse.Namespace) -> int:
    return args.nproc * args.nnodes


def needs_torchrun(args: argparse.Namespace) -> bool:
    return args.nproc > 1 or args.nnodes > 1


def torchrun_argv(args: argparse.Namespace, run_args: list[str]) -> list[str]:
    """The command that starts this node's processes, each running ``gem_model run *run_args``."""
    argv = [sys.executable, "-m", "torch.distributed.run"]
    if args.nnodes == 1:
        argv += ["--standalone"]
    else:
        argv += [  # no --node-rank: the c10d rendezvous ignores it (see the module doc)
            f"--nnodes={args.nnodes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={args.rdzv_endpoint}",
            f"--rdzv-id={args.rdzv_id}",
        ]
    if args.max_restarts:
        argv += [f"--max-restarts={args.max_restarts}"]
    return [*argv, f"--nproc-per-node={args.nproc}", "-m", "gem_model", "run", *run_args]
