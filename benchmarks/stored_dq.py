"""The ``dq`` pass from stored ``ds`` tiles (:mod:`gem_kernels.attention_stored`) at each launch candidate.

On the big config's lengths (``attention_gluon.make_inputs("big_config")``): the key-major pass stores the
tiles once, then :func:`~gem_kernels.attention_stored.dq_from_stored` runs at each (warps, stages, programs an
SM) in rotated rounds; every candidate's ``dq`` must equal the first's before it is timed. Prints medians
(ms) with their spread and writes JSON.

    python benchmarks/stored_dq.py --rounds 5 --out stored_dq.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention_gluon import make_inputs  # beside this script
from rounds import save_results  # beside this script

CANDIDATES = ((4, 3, 2), (4, 4, 2), (4, 2, 3), (8, 3, 1), (8, 3, 2))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("stored_dq.py times a GPU; none is visible")
    import triton

    from gem_kernels import attention_stored
    from gem_kernels.attention_triton_bwd import key_major

    x = make_inputs("big_config", args.seed, torch.device("cuda"))
    options = {k: x["options"][k] for k in ("max_seq_len", "alpha", "max_attn_len")}
    plan = attention_stored.prepare(x["offsets"], x["q"].shape[1])
    stored = plan.scores(x["q"].dtype)
    if stored is None:
        raise SystemExit("the ds buffer passes attention_stored.BUDGET_BYTES")
    key_major(x["q"], x["k"], x["v"], x["grad_out"], x["offsets"], x["targets"], None, stored=stored, **options)
    before = attention_stored.LAUNCH
    outs = {c: torch.empty_like(x["q"]) for c in CANDIDATES}

    def run(c: tuple[int, int, int]) -> torch.Tensor:
        attention_stored.LAUNCH = c
        try:
            return attention_stored.dq_from_stored(stored, x["k"], x["offsets"], x["targets"],
                                                   max_seq_len=options["max_seq_len"], alpha=options["alpha"],
                                                   out=outs[c])  # fmt: skip
        finally:
            attention_stored.LAUNCH = before

    first = run(CANDIDATES[0]).clone()
    for c in CANDIDATES[1:]:
        if not torch.equal(run(c), first):
            raise SystemExit(f"launch {c}: dq differs from launch {CANDIDATES[0]}'s, refusing to time it")
    times: dict[tuple[int, int, int], list[float]] = {c: [] for c in CANDIDATES}
    for r in range(args.rounds):
        for j in range(len(CANDIDATES)):
            c = CANDIDATES[(r + j) % len(CANDIDATES)]
            times[c].append(triton.testing.do_bench(lambda c=c: run(c), warmup=25, rep=200))
    rows = []
    print(f"{'warps, stages, per SM':<24} {'ms (median)':>12} {'min-max':>16}")
    for c in CANDIDATES:
        t = times[c]
        rows.append({"launch": list(c), "ms": statistics.median(t), "min": min(t), "max": max(t), "runs": t})
        print(f"{c!s:<24} {statistics.median(t):>12.3f} {min(t):>7.3f}-{max(t):<8.3f}")
    save_results(args.out, rows, tiles=plan.tiles(), rounds=args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
