"""Cost of HSTU's relative attention biases in the torch ``jagged_attention`` kernel.

One HSTU block's attention, forward + backward, at MovieLens-1M's training shape (128 sequences of
the longest 200 items or fewer, 2 heads of 25 dims), without a bias, with the relative position
bias, and with position + time bias. The time bias is gathered from its table for every (query,
key) pair of the batch; its gradient is summed either by plain indexing's backward (an accumulating
``index_put_``, the ``index`` row) or by a weighted ``bincount`` (``gem_model.jagged.gather_bias``,
what the kernel uses: the ``bincount`` row). The two are checked against each other on fresh random
data before timing. (The position bias is a ``[n, n]`` matrix shared by the batch and always uses
plain indexing.)

A second table times what one model step asks of the kernel: ``--blocks`` calls on the same
sequences (one per HSTU block), forward and backward, with the kernel's layout cache
(``LayoutCache``: the bucketing, its host sync, the masks and the time-bucket ids are computed by
the first call only) and without it (every call plans again, as before the cache).

    python benchmarks/attention_bias.py --device cuda --out-json /tmp/attention_bias.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import time
from collections.abc import Callable

import torch

from gem_kernels import attention_torch
from gem_kernels.attention_torch import LayoutCache, jagged_attention_torch
from gem_model import jagged
from gem_model.api import AttentionExtras


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--max-len", type=int, default=200)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--blocks", type=int, default=8, help="calls per step in the layout-cache table")
    p.add_argument("--out-json")
    args = p.parse_args()
    device = torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    # ML-1M's users: many long histories, cut at max_len (the median user has ~96 ratings)
    lengths = torch.clamp(torch.randint(20, 2 * args.max_len, (args.batch,), generator=g), max=args.max_len)
    offsets = jagged.offsets_of(lengths).to(device)
    rows = int(lengths.sum())
    q, k, v = (torch.randn(rows, 2, 25, generator=g).to(device).requires_grad_() for _ in range(3))
    position_bias = (0.02 * torch.randn(2 * args.max_len - 1, generator=g)).to(device).requires_grad_()
    time_bias = (0.02 * torch.randn(128, generator=g)).to(device).requires_grad_()
    # rating times: bursts of seconds apart, with gaps of days between bursts
    gaps = torch.where(torch.rand(rows, generator=g) < 0.1, torch.randint(10**4, 10**7, (rows,), generator=g),
                       torch.randint(0, 120, (rows,), generator=g))
    times = torch.cumsum(gaps, 0).to(device)
    query_times = torch.cat([times[1:], times[-1:] + 60])
    grad_out = torch.randn(rows, 2, 25, generator=g).to(device)
    cases: dict[str, dict] = {
        "no bias": {},
        "position": {"position_bias": position_bias},
        "position + time": {"position_bias": position_bias, "time_bias": time_bias, "timestamps": times,
                            "query_timestamps": query_times},
    }
    plain: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = lambda table, index: table[index]  # noqa: E731
    fused = jagged.gather_bias

    def step(kw: dict, calls: int = 1, cache: LayoutCache | None = None) -> list[torch.Tensor]:
        leaves = [q, k, v, *(t for t in kw.values() if t.requires_grad)]
        out = sum(
            jagged_attention_torch(q, k, v, offsets, max_seq_len=args.max_len, alpha=1.0, cache=cache,
                                   extras=AttentionExtras(**kw))
            for _ in range(calls)
        )
        return list(torch.autograd.grad(out, leaves, grad_out))

    def timed(kw: dict, calls: int = 1, cached: bool = False) -> float:
        shared = LayoutCache() if cached else None
        for _ in range(3):
            step(kw, calls, shared)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.iters):
            step(kw, calls, shared)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - start) / args.iters * 1e3

    rows_out = []
    for name, kw in cases.items():
        for gather_name, gather in (("index", plain), ("bincount", fused)):
            if "time_bias" not in kw and gather_name == "bincount":  # only the time bias takes gather_bias
                continue
            attention_torch.gather_bias = gather  # what the kernel calls
            grads = step(kw)
            if gather_name == "index":
                reference = grads
                err = 0.0
            else:
                err = max(float((a - b).abs().max() / b.abs().max().clamp(min=1e-30)) for a, b in zip(grads, reference))
            rows_out.append({"case": name, "gather": gather_name if kw else "-", "ms": timed(kw), "max_rel_err": err})
    attention_torch.gather_bias = fused
    step_rows = []
    for case, kw in cases.items():
        plain_grads, cached_grads = step(kw, args.blocks), step(kw, args.blocks, LayoutCache())
        err = max(float((a - b).abs().max() / b.abs().max().clamp(min=1e-30)) for a, b in zip(cached_grads, plain_grads))
        step_rows.append({"case": case, "calls": args.blocks, "ms_no_cache": timed(kw, args.blocks),
                          "ms_cache": timed(kw, args.blocks, cached=True), "max_rel_err": err})
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    print(f"attention forward + backward, {args.batch} sequences, {rows} rows, {name}, {dt.date.today()}")
    print("| bias | gradient of the time bias | ms per fwd + bwd | max rel. error vs index |")
    print("|---|---|---|---|")
    for r in rows_out:
        print(f"| {r['case']} | {r['gather']} | {r['ms']:.2f} | {r['max_rel_err']:.1e} |")
    print(f"\n{args.blocks} calls on the same sequences (one model step's attention), forward + backward")
    print("| bias | ms without the layout cache | ms with it | speed-up | max rel. error |")
    print("|---|---|---|---|---|")
    for r in step_rows:
        print(f"| {r['case']} | {r['ms_no_cache']:.2f} | {r['ms_cache']:.2f} | "
              f"{r['ms_no_cache'] / r['ms_cache']:.2f}x | {r['max_rel_err']:.1e} |")
    if args.out_json:
        with open(args.out_json, "w") as fh:
            json.dump({"device": name, "date": str(dt.date.today()), "batch": args.batch, "rows": rows,
                       "torch": torch.__version__, "results": rows_out, "step": step_rows}, fh, indent=1)


if __name__ == "__main__":
    main()
