"""Time and peak memory of the next-item sampled softmax (shared negatives), old vs new.

The big config of a GEM run on one H200: 512 sequences of power-law lengths up to 4096 (mean ~500,
so ~256k predicted positions), D = 1024, 128 negatives per sample, L2 normalisation, the queries in
bf16 (the activations), the item embeddings in fp32 (the tables). ``old`` is the loss as it was
before ``gem_model.model.next_item`` (the batch padded to its longest sequence, in fp32, one bmm);
``new`` is :func:`gem_model.model.next_item.next_item_loss` with its default bucketing, and the
``growth=`` / ``chunk=`` rows vary its two constants. ``grouped_gemms`` times only the three GEMMs a
grouped GEMM (``torch._grouped_mm``, no padding at all; bf16 out, as torch 2.11 requires) would run,
as a floor for that design.
Each row: forward + backward (mean of ``--iters`` after warm-up, CUDA events) and the peak of
allocated memory above the inputs.

    PYTHONPATH=packages/gem-model/src python benchmarks/next_item_loss.py --out-json /tmp/next_item.json
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch
import torch.nn.functional as F

from gem_model.jagged import offsets_of, positions_in_sequence, sequence_ids
from gem_model.model import next_item, next_item_plan


def old_loss(query, items, negatives, lengths, item_ids, negative_ids, k: int, l2: bool, temperature: float,
             per_position: bool = False):
    """The loss as ``GemModel.next_item_loss`` computed it before (shared negatives: padded to the batch max)."""
    offsets = offsets_of(lengths)
    pos = positions_in_sequence(lengths, offsets)
    owner = sequence_ids(lengths, pos.numel())
    rows = torch.nonzero(pos < (lengths[owner] - 1)).squeeze(1)
    b = lengths.numel()
    q, p = query[rows].float(), items[rows + 1].float()
    n = negatives.float().reshape(rows.numel() if per_position else b, k, q.shape[1])
    if l2:
        q, p, n = (F.normalize(z, dim=-1, eps=1e-6) for z in (q, p, n))
    pos_logit = (q * p).sum(-1, keepdim=True)
    o, j = owner[rows], pos[rows]
    if per_position:
        neg_logit, ids = torch.bmm(n, q[:, :, None]).squeeze(-1), negative_ids.reshape(rows.numel(), k)
    else:
        padded = q.new_zeros(b, int(lengths.max()) - 1, q.shape[1]).index_put((o, j), q)
        neg_logit, ids = torch.bmm(padded, n.transpose(1, 2))[o, j], negative_ids.reshape(b, k)[o]
    neg_logit = neg_logit.masked_fill(ids == item_ids[rows + 1][:, None], float("-inf"))
    logits = torch.cat([pos_logit, neg_logit], 1) / temperature
    return (torch.logsumexp(logits, 1) - logits[:, 0]).sum()


def power_law_lengths(batch: int, max_len: int, mean: float, g: torch.Generator) -> torch.Tensor:
    """``batch`` lengths in [2, max_len] with P(n) ~ n^-a, ``a`` chosen so that the mean is about ``mean``."""
    n = torch.arange(2, max_len + 1, dtype=torch.float64)
    lo, hi = 0.0, 3.0
    for _ in range(60):
        a = (lo + hi) / 2
        pmf = n.pow(-a)
        lo, hi = (a, hi) if float((pmf * n).sum() / pmf.sum()) > mean else (lo, a)
    return n[torch.multinomial(pmf / pmf.sum(), batch, replacement=True, generator=g)].long()


def measure(fn: Callable[[], torch.Tensor], iters: int) -> tuple[float, float]:
    """(ms per forward + backward, peak MiB allocated above what was allocated before)."""
    for _ in range(2):
        fn().backward()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn().backward()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn().backward()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters, peak


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--max-len", type=int, default=4096)
    p.add_argument("--mean-len", type=float, default=500)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--negatives", type=int, default=128)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--skip-old", action="store_true")
    p.add_argument("--out-json")
    args = p.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    lengths = power_law_lengths(args.batch, args.max_len, args.mean_len, g)
    b, k, d, total = args.batch, args.negatives, args.dim, int(lengths.sum())
    rows = int((lengths - 1).sum())
    query = torch.randn(total, d, device=dev, dtype=torch.bfloat16).requires_grad_()
    items = (0.1 * torch.randn(total, d, device=dev)).requires_grad_()
    negatives = (0.1 * torch.randn(b * k, d, device=dev)).requires_grad_()
    item_ids = torch.randint(10**6, (total,), device=dev)
    negative_ids = torch.randint(10**6, (b * k,), device=dev)
    lengths = lengths.to(dev)
    print(f"B={b} D={d} K={k} rows={total} predicted={rows} max_len={int(lengths.max())} torch {torch.__version__}")

    def new() -> torch.Tensor:
        return next_item.next_item_loss(query, items, negatives, lengths, item_ids, negative_ids, num_negatives=k,
                                        per_position=False, l2_normalize=True, temperature=0.05)[0]

    # correctness on this device: the new loss and gradients against the old, fp32 queries at a smaller size
    small = slice(0, int(offsets_of(lengths)[64]))
    q32 = query[small].detach().float().requires_grad_()
    args32 = (items[small].detach().clone().requires_grad_(), negatives[: 64 * k].detach().clone().requires_grad_(),
              lengths[:64], item_ids[small], negative_ids[: 64 * k])
    got = next_item.next_item_loss(q32, *args32, num_negatives=k, per_position=False, l2_normalize=True, temperature=0.05)[0]
    grads = torch.autograd.grad(got, [q32, *args32[:2]])
    want = old_loss(q32, *args32, k, True, 0.05)
    ref = torch.autograd.grad(want, [q32, *args32[:2]])
    rel = [float((x - y).abs().max() / y.abs().max()) for x, y in zip(grads, ref)]
    print(f"fp32 on cuda: loss {got.item():.6f} vs old {want.item():.6f}; grad rel err {rel}")
    bf = new().item()
    ref_bf = old_loss(query, items, negatives, lengths, item_ids, negative_ids, k, True, 0.05).item() if not args.skip_old else bf
    print(f"bf16 big config: loss {bf:.4f} vs old (fp32 GEMM) {ref_bf:.4f}, rel {abs(bf - ref_bf) / abs(ref_bf):.2e}")

    results = {}

    def row(name: str, fn: Callable[[], torch.Tensor]) -> None:
        ms, mib = measure(fn, args.iters)
        results[name] = {"ms": ms, "peak_mib": mib}
        print(f"{name:28s} {ms:9.2f} ms {mib:10.0f} MiB")

    if not args.skip_old:
        row("old (padded to max, fp32)", lambda: old_loss(query, items, negatives, lengths, item_ids, negative_ids, k, True, 0.05))
    row("new", new)
    defaults = (next_item_plan.BUCKET_GROWTH, next_item_plan.CHUNK_ELEMENTS)
    for growth in (1.5, 2.0):
        next_item_plan.BUCKET_GROWTH = growth
        row(f"new growth={growth}", new)
    next_item_plan.BUCKET_GROWTH = defaults[0]
    for chunk in (1 << 24, 1 << 26, 1 << 27, 1 << 28):
        next_item_plan.CHUNK_ELEMENTS = chunk
        row(f"new chunk=2^{chunk.bit_length() - 1}", new)
    next_item_plan.CHUNK_ELEMENTS = defaults[1]

    if hasattr(torch, "_grouped_mm"):
        offs = offsets_of(lengths)[1:].to(torch.int32)
        nb = negatives.detach().to(torch.bfloat16).view(b, k, d)
        qd = query.detach()
        gl = torch.randn(total, k, device=dev, dtype=torch.bfloat16)

        def grouped() -> torch.Tensor:
            out = torch._grouped_mm(qd, nb.transpose(1, 2), offs=offs)
            torch._grouped_mm(gl, nb, offs=offs)
            torch._grouped_mm(qd.t(), gl, offs=offs)
            return out.sum().requires_grad_()

        try:
            row("grouped_gemms (3 GEMMs only)", grouped)
        except RuntimeError as e:
            print("grouped_mm failed:", str(e).splitlines()[0])

    # where the time of the default goes: the host plan (with its sync), the forward, the backward
    import time

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.iters):
        plan = next_item.plan_chunks(lengths, d)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    for _ in range(args.iters):
        loss = new()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    for _ in range(args.iters):
        new().backward()
    torch.cuda.synchronize()
    t3 = time.perf_counter()
    plan_ms, fwd_ms = (t1 - t0) / args.iters * 1e3, (t2 - t1) / args.iters * 1e3
    print(f"{len(plan.chunks)} chunks, {plan.slot_rows.numel() / plan.rows:.3f} slots per row; wall ms: plan {plan_ms:.2f}, "
          f"forward {fwd_ms:.2f} (plan included), forward + backward {(t3 - t2) / args.iters * 1e3:.2f}")
    results["wall_ms"] = {"plan": plan_ms, "forward": fwd_ms, "forward_backward": (t3 - t2) / args.iters * 1e3}
    del loss
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        new().backward()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))
    # per-position negatives at MovieLens-1M's shape (the HSTU recipe): 128 sequences of <= 200, D = 50
    lens = torch.clamp(torch.randint(20, 400, (128,), generator=g), max=200)
    n_rows, n_pred = int(lens.sum()), int((lens - 1).sum())
    pp = [torch.randn(n_rows, 50, device=dev).requires_grad_(), torch.randn(n_rows, 50, device=dev).requires_grad_(),
          torch.randn(n_pred * k, 50, device=dev).requires_grad_(), lens.to(dev),
          torch.randint(3706, (n_rows,), device=dev), torch.randint(3706, (n_pred * k,), device=dev)]
    print(f"per position: B=128 D=50 K={k} predicted={n_pred}")
    row("per-position old", lambda: old_loss(*pp, k, True, 0.05, per_position=True))
    row("per-position new", lambda: next_item.next_item_loss(*pp, num_negatives=k, per_position=True, l2_normalize=True,
                                                             temperature=0.05)[0])
    if args.out_json:
        with open(args.out_json, "w") as f:
            json.dump({"config": vars(args), "rows": total, "predicted": rows, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
