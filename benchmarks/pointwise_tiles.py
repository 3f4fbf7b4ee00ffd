"""Tile sizes of the fused HSTU block's pointwise kernels on the big config's shapes: each candidate's
outputs are checked equal to the shipped launch's, then every candidate is timed in interleaved rounds
(CUDA events, median and IQR) beside the shipped one.

    python benchmarks/pointwise_tiles.py --rows 200000 --rounds 15 --out tiles.json

Shapes of ``configs/h200-large.yaml`` (d = 1024, 8 heads of 128): the norm-gate backward over
``[L, 1024]`` with its gate read from, and its gradient written into, the ``u`` columns of the
``[L, 4096]`` uvqk output; the layer norm backward with the residual's gradient; the silu pass of the
``v, q, k`` columns, forward (``post = silu(pre)``) and backward (in place, ``* silu'(pre)``).
Reports GB/s by the bytes each kernel must move, so the distance to the ~3.3 TB/s copy rate shows.
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import triton
from profiling import timed_ms  # benchmarks/profiling.py, beside this script

from gem_kernels import hstu_gap_grad_rows as grad_rows
from gem_kernels import hstu_gap_saved as saved
from gem_kernels import hstu_gap_triton as gap
from gem_kernels import layer_norm_triton as ln
from gem_kernels import norm_gate_triton as ng
from gem_kernels.attention_triton_common import INTERPRET, num_programs
from gem_kernels.hstu_gap_saved import silu_quantize_rows
from gem_kernels.quantized_rows_triton import RowsOut, as_words
from gem_model.api import RowQuantization

D, WIDTH = 1024, 4096


def norm_gate_bwd(t: dict, rows_per_tile: int, warps: int, per_sm: int, stages: int | None = None,
                  e4m3: bool = False, du_sums: bool = False) -> Callable[[], tuple]:  # fmt: skip
    """The norm-gate backward; with ``e4m3`` it reads ``x`` and the gate from their e4m3 rows as 16-bit
    words (``fp8_saved``'s kept attention output and uvqk output: ``hstu_gap_triton.E4M3_ROWS_IN_NORM_GATE``);
    ``du_sums``: it also sums ``du``'s columns (the bf16 step's, ``hstu_gap_triton.U_SUMS_IN_NORM_GATE``)."""
    num_rows = t["x"].shape[0]
    if e4m3:
        x, u, x_inv, u_inv = t["x_words"], t["pre_words"], t["x_scale_inv"], t["pre_scale_inv"]
    else:
        x, u, x_inv, u_inv = t["x"], t["u"], t["mean"], t["mean"]
    tiles = triton.cdiv(num_rows, rows_per_tile)
    programs = num_programs(t["x"].device, per_sm, tiles)
    per = triton.cdiv(tiles, programs)
    dx = torch.empty_like(t["x"])
    du = t["d_pre"][:, :D]
    dw = torch.empty((programs, D), dtype=torch.float32, device=dx.device)
    db = torch.empty_like(dw)
    dus = torch.empty_like(dw) if du_sums else db

    def run() -> tuple:
        ng._norm_gate_bwd[(programs,)](
            x, u, t["w"], t["b"], t["dy"], t["mean"], t["rstd"], dx, du, dw, db, x_inv, u_inv, dus, x.stride(0),
            u.stride(0), t["dy"].stride(0), dx.stride(0), du.stride(0), num_rows, per, D=D, BLOCK_D=D,
            ROWS=rows_per_tile, INTERP=INTERPRET, num_warps=warps, SILU_GATE=True, X_E4M3=e4m3, U_E4M3=e4m3,
            STAGES=stages, DU_SUMS=du_sums,
        )
        return (dx, du, dw.sum(0), db.sum(0), dus.sum(0)) if du_sums else (dx, du, dw.sum(0), db.sum(0))

    return run


def norm_gate_fwd(t: dict, warps: int, tiles: int, stages: int | None, e4m3_rows: bool = False,
                  keep_x: bool = False, words: bool = False) -> Callable[[], tuple]:  # fmt: skip
    """The norm-gate forward; with ``e4m3_rows`` also ``y``'s e4m3 rows (``fp8_rowwise``'s producer rows, no
    column maxima); with ``keep_x`` also ``x``'s (``fp8_saved``'s kept attention output); ``words``: the
    rows stored as 16-bit words (``norm_gate_triton.E4M3_WORD_STORES``)."""
    num_rows = t["x"].shape[0]
    rows = ng._rows_per_tile(D)
    y, mean, rstd, q, q_inv = _forward_outputs(t["x"], e4m3_rows)
    xq, xq_inv = _e4m3_rows(num_rows, y.device) if keep_x else (y, mean)
    kq = as_words(q) if words and e4m3_rows else q  # the buffers as the kernel writes them
    kxq = as_words(xq) if words and keep_x else xq

    def run() -> tuple:
        ng._norm_gate_fwd[(triton.cdiv(num_rows, rows * tiles),)](
            t["x"], t["u"], t["w"], t["b"], y, mean, rstd, kq, q_inv, q_inv, kxq, xq_inv, t["x"].stride(0),
            t["u"].stride(0), y.stride(0), num_rows, 1e-5, D=D, BLOCK_D=D, ROWS=rows, TILES=tiles, INTERP=INTERPRET,
            num_warps=warps, SILU_GATE=True, QUANT=e4m3_rows, COLUMN_AMAX=False, KEEP_X=keep_x, WORDS=words,
            STAGES=stages,
        )
        out = (y, mean, rstd, q, q_inv) if e4m3_rows else (y, mean, rstd)
        return (*out, xq, xq_inv) if keep_x else out

    return run


def silu_grad_sums(t: dict, warps: int, rows_per_program: int, stages: int | None, e4m3_rows: bool = False,
                   e4m3_pre: bool = False, u_summed: bool = False) -> Callable[[], tuple]:  # fmt: skip
    """The step's last gap pass: ``silu'`` in place and the column sums (the bf16 step's ``bias_grad_in_gap``),
    with ``e4m3_rows`` also the gradient's e4m3 rows (``fp8_rowwise``'s producer rows); ``e4m3_pre``: ``pre``
    read from its e4m3 rows (``fp8_saved``); ``u_summed``: the ``u`` columns neither read nor summed (the
    bf16 step's, whose norm-gate backward sums them: ``hstu_gap_triton.U_SUMS_IN_NORM_GATE``). The timing
    includes the reduction of the programs' partial sums."""
    d_pre = t["d_pre"]
    pre, scale_inv = (t["pre_rows"], t["pre_scale_inv"]) if e4m3_pre else (t["pre"], t["pre"])
    num_rows = pre.shape[0]
    programs = triton.cdiv(num_rows, rows_per_program)
    sums = torch.empty((programs, WIDTH), dtype=torch.float32, device=pre.device)
    q = torch.empty((num_rows, WIDTH), dtype=torch.uint8, device=pre.device) if e4m3_rows else sums
    q_inv = torch.empty(num_rows, dtype=torch.float32, device=pre.device) if e4m3_rows else sums

    def run() -> tuple:
        d_pre.copy_(t["d_pre0"])  # in place: the same input every call (a copy inside the timing, for all)
        grad_rows._silu_grad_rows[(programs,)](
            d_pre, pre, scale_inv, d_pre, q, q_inv, sums, d_pre.stride(0), pre.stride(0), d_pre.stride(0), num_rows, D,
            0, 0, rows_per_program, W=WIDTH, BLOCK_W=WIDTH, ROWS=1, HAS_DQ=False, E4M3=e4m3_pre, ROWS_OUT=e4m3_rows,
            COL_SUM=True, INTERP=INTERPRET, num_warps=warps, STAGES=stages, U_SUMMED=u_summed,
        )
        return (d_pre, sums.sum(0), q, q_inv) if e4m3_rows else (d_pre, sums.sum(0))

    return run


def _e4m3_rows(num_rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty((num_rows, D), dtype=torch.uint8, device=device),
            torch.empty(num_rows, dtype=torch.float32, device=device))  # fmt: skip


def _forward_outputs(x: torch.Tensor, e4m3_rows: bool) -> tuple[torch.Tensor, ...]:
    """A norm forward's ``y``, ``mean``, ``rstd`` and its e4m3 rows and scales (``y``, ``mean`` stand in
    for those when it writes none)."""
    y = torch.empty_like(x)
    mean = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    q, q_inv = _e4m3_rows(x.shape[0], x.device) if e4m3_rows else (y, mean)
    return y, mean, torch.empty_like(mean), q, q_inv


def norm_fwd(t: dict, rows: int, warps: int, tiles: int, stages: int | None, e4m3_rows: bool = False) -> Callable[[], tuple]:
    """The block's layer norm forward; with ``e4m3_rows`` also its e4m3 rows (``fp8_rowwise``'s producer)."""
    num_rows = t["x"].shape[0]
    y, mean, rstd, q, q_inv = _forward_outputs(t["x"], e4m3_rows)

    def run() -> tuple:
        ln._norm_fwd[(triton.cdiv(num_rows, rows * tiles),)](
            t["x"], y, mean, rstd, q, q_inv, mean, t["x"].stride(0), y.stride(0), num_rows, 1e-5, D=D, BLOCK_D=D,
            ROWS=rows, TILES=tiles, QUANT=e4m3_rows, COLUMN_AMAX=False, INTERP=INTERPRET, num_warps=warps,
            STAGES=stages,
        )
        return (y, mean, rstd, q, q_inv) if e4m3_rows else (y, mean, rstd)

    return run


def norm_bwd(t: dict, rows: int, warps: int, _: int, e4m3_rows: bool = False) -> Callable[[], tuple]:
    """The layer norm backward with the residual's gradient; with ``e4m3_rows`` also the gradient's e4m3
    rows (offered to the previous block's ``out`` under ``fp8_rowwise``)."""
    num_rows = t["x"].shape[0]
    dx = torch.empty_like(t["x"])
    q, q_inv = _e4m3_rows(num_rows, dx.device) if e4m3_rows else (dx, t["mean"])

    def run() -> tuple:
        ln._norm_bwd[(triton.cdiv(num_rows, rows),)](
            t["x"], t["dy"], t["skip"], dx, t["mean"], t["rstd"], q, q_inv, t["mean"], t["x"].stride(0),
            t["dy"].stride(0), t["skip"].stride(0), dx.stride(0), num_rows, D=D, BLOCK_D=D, ROWS=rows, TILES=1,
            HAS_SKIP=True, XHAT_GIVEN=False, QUANT=e4m3_rows, COL_SUM=False, INTERP=INTERPRET, num_warps=warps,
        )
        return (dx, q, q_inv) if e4m3_rows else (dx,)

    return run


def silu(t: dict, rows: int, cols: int, warps: int, grad: bool) -> Callable[[], tuple]:
    pre = t["pre"][:, D:]
    out = t["d_pre"][:, D:] if grad else torch.empty((pre.shape[0], WIDTH - D), dtype=pre.dtype, device=pre.device)
    x = t["g_vqk"] if grad else pre
    num_rows, num_cols = pre.shape

    def run() -> tuple:
        gap._silu_columns[(triton.cdiv(num_rows, rows), triton.cdiv(num_cols, cols))](
            x, pre, pre, out, x.stride(0), pre.stride(0), out.stride(0), num_rows, num_cols,
            GRAD=grad, E4M3=False, ROWS=rows, COLS=cols, INTERP=INTERPRET, num_warps=warps,
        )
        return (out,)

    return run


def silu_quantize(t: dict, rows_per_program: int, block: int, warps: int) -> Callable[[], tuple]:
    """``fp8_saved``'s forward silu pass: ``post = silu(pre[:, D:])`` and ``pre``'s e4m3 rows, each program
    over ``rows_per_program`` whole rows, ``block`` columns at once (a narrower block reads each row
    twice, the second time from L2)."""
    pre = t["pre"]
    num_rows = pre.shape[0]
    post = torch.empty((num_rows, WIDTH - D), dtype=pre.dtype, device=pre.device)
    q, q_inv = torch.empty((num_rows, WIDTH), dtype=torch.uint8, device=pre.device), t["mean"].clone()

    def run() -> tuple:
        saved._silu_quantize[(triton.cdiv(num_rows, rows_per_program),)](
            pre, post, q, q_inv, pre.stride(0), post.stride(0), num_rows, WIDTH, D, ROWS=rows_per_program,
            BLOCK=block, ONE_CHUNK=WIDTH <= block, INTERP=INTERPRET, num_warps=warps,
        )
        return post, q, q_inv

    return run


def expand_post(t: dict, rows: int, cols: int, warps: int) -> Callable[[], tuple]:
    """``fp8_saved``'s backward expansion of ``post = silu(pre[:, D:])`` from ``pre``'s e4m3 rows (the
    gate's columns are read by the norm-gate backward itself)."""
    q, q_inv = t["pre_rows"], t["pre_scale_inv"]
    num_rows = q.shape[0]
    post = torch.empty((num_rows, WIDTH - D), dtype=torch.bfloat16, device=q.device)

    def run() -> tuple:
        saved._expand[(triton.cdiv(num_rows, rows), triton.cdiv(WIDTH - D, cols))](
            q, q_inv, post, post, post.stride(0), post.stride(0), num_rows, WIDTH, D, D, ROWS=rows, COLS=cols,
            INTERP=INTERPRET, num_warps=warps,
        )
        return (post,)

    return run


KERNELS: dict[str, tuple[Callable, tuple, list[tuple], float]] = {
    # name: (launch, shipped params, candidates, bytes per row moved)
    # the fourth: the tile loop's software pipeline (None: none; 2, 3: loads issued that many tiles ahead)
    "norm_gate_bwd": (norm_gate_bwd, (4, 4, 2, 3), list(itertools.product((2, 4), (4, 8), (2, 4, 8), (None, 2, 3))),
                      10 * D),
    # the bf16 step's launch: du's column sums too (H100, 2026-12-07, 230,000 rows: 2 rows a tile 1.038x the
    # shipped 4; raw/session52-2026-12-07/tiles_h100.json)
    "norm_gate_bwd_du_sums": (lambda t, r, w, n, st: norm_gate_bwd(t, r, w, n, st, du_sums=True), (4, 4, 2, 3),
                              list(itertools.product((2, 4), (4, 8), (2, 3), (3,))), 10 * D),
    "norm_gate_fwd": (norm_gate_fwd, (4, 4, 3), list(itertools.product((4, 8), (1, 4, 16), (None, 2, 3))), 6 * D),
    # bytes: d_pre read whole, pre's and d_pre's v, q, k columns read and written (+ the copy that resets d_pre)
    "silu_grad_sums": (silu_grad_sums, (16, 128, 3), list(itertools.product((8, 16), (64, 128), (None, 2, 3))),
                       2 * WIDTH + 4 * (WIDTH - D) + 4 * WIDTH),
    # the bf16 step's launch (u columns summed by the norm-gate backward); more rows a program leave fewer
    # partial sums to add up after it, and were no faster (H100, 2026-12-07: 1,024 rows 0.996x the shipped 128)
    "silu_grad_sums_u_summed": (lambda t, w, r, st: silu_grad_sums(t, w, r, st, u_summed=True), (16, 128, 3),
                                list(itertools.product((8, 16), (128, 256, 512, 1024), (3,))),
                                6 * (WIDTH - D) + 4 * WIDTH),
    # fp8_saved's last pass: pre's v, q, k columns read from its e4m3 rows (1 byte a value)
    "silu_grad_sums_e4m3": (lambda t, w, r, st: silu_grad_sums(t, w, r, st, e4m3_pre=True), (8, 64, 3),
                            list(itertools.product((8, 16), (64, 128), (None, 2, 3))),
                            2 * WIDTH + 3 * (WIDTH - D) + 4 * WIDTH + 4),
    # fp8_rowwise's producers (e4m3 rows beside the bf16 output; 1 byte a value more, and a scale a row)
    "silu_grad_rows_e4m3": (lambda t, w, r, st: silu_grad_sums(t, w, r, st, e4m3_rows=True), (8, 128, 3),
                            list(itertools.product((4, 8, 16), (128,), (None, 2, 3))), 2 * WIDTH + 4 * (WIDTH - D) + 5 * WIDTH),
    "norm_gate_fwd_e4m3": (lambda t, w, n, st: norm_gate_fwd(t, w, n, st, e4m3_rows=True), (4, 1, 3),
                           list(itertools.product((4, 8), (1, 4), (None, 2, 3))), 7 * D),
    # fp8_saved: the backward reading x and the gate from their e4m3 rows (1 byte a value for 2, and no
    # expansion passes before it)
    "norm_gate_bwd_e4m3": (lambda t, r, w, n, st: norm_gate_bwd(t, r, w, n, st, e4m3=True), (4, 4, 2, 3),
                           list(itertools.product((2, 4), (4, 8), (2, 4), (None, 2, 3))), 8 * D),
    # fp8_saved: the forward also writes the e4m3 rows of its input (the attention output, kept for backward);
    # under fp8_rowwise + fp8_saved it writes both rows
    "norm_gate_fwd_keep_x": (lambda t, w, n, st: norm_gate_fwd(t, w, n, st, keep_x=True), (4, 1, 3),
                             list(itertools.product((4, 8), (1, 4), (None, 2, 3))), 7 * D),
    "norm_gate_fwd_e4m3_keep_x": (lambda t, w, n, st: norm_gate_fwd(t, w, n, st, e4m3_rows=True, keep_x=True), (4, 1, 3),
                                  list(itertools.product((4, 8), (1, 4), (None, 2, 3))), 8 * D),
    # the same three with the rows stored as 16-bit words (E4M3_WORD_STORES): the tile keeps its layout
    "norm_gate_fwd_keep_x_words": (lambda t, w, n, st: norm_gate_fwd(t, w, n, st, keep_x=True, words=True), (4, 1, 3),
                                   list(itertools.product((4, 8), (1, 4), (None, 2, 3))), 7 * D),
    "norm_gate_fwd_e4m3_words": (lambda t, w, n, st: norm_gate_fwd(t, w, n, st, e4m3_rows=True, words=True), (4, 1, 3),
                                 list(itertools.product((4, 8), (1, 4), (None, 2, 3))), 7 * D),
    "norm_gate_fwd_e4m3_keep_x_words": (lambda t, w, n, st: norm_gate_fwd(t, w, n, st, e4m3_rows=True, keep_x=True,
                                                                         words=True), (4, 1, 3),
                                        list(itertools.product((4, 8), (1, 4), (None, 2, 3))), 8 * D),
    "norm_fwd_e4m3": (lambda t, r, w, n, st: norm_fwd(t, r, w, n, st, e4m3_rows=True), (2, 4, 1, None),
                      list(itertools.product((2, 4, 8), (4, 8), (1, 4), (None, 3))), 5 * D),
    "norm_bwd_e4m3": (lambda t, r, w, z: norm_bwd(t, r, w, z, e4m3_rows=True), (4, 4, 0),
                      list(itertools.product((1, 2, 4, 8), (4, 8), (0,))), 9 * D),
    "norm_fwd": (norm_fwd, (8, 4, 1, None), list(itertools.product((4, 8), (4, 8), (1, 4, 16), (None, 3))), 4 * D),
    # shipped (8, 4) until the 2026-12-02 run of this script
    "norm_bwd": (norm_bwd, (4, 4, 0), list(itertools.product((2, 4, 8, 16), (4, 8), (0,))), 8 * D),
    # fp8_saved's silu pass (pre read whole, post and pre's e4m3 rows written) and its backward expansion
    "silu_quantize": (silu_quantize, (1, 4096, 4), list(itertools.product((1, 2, 4), (1024, 4096), (4, 8, 16))),
                      2 * WIDTH + 2 * (WIDTH - D) + WIDTH + 4),
    # tiles of up to 8 values a thread (e.g. 4 x 256 on 4 warps) keep one layout; larger ones convert the
    # bytes' layout through shared memory (hstu_gap_saved.EXPAND_TILE)
    "expand_post": (expand_post, (4, 256, 4), list(itertools.product((1, 2, 4, 8, 16, 32), (256, 512, 1024), (4, 8))),
                    (WIDTH - D) + 4 + 2 * (WIDTH - D)),
    "silu_fwd": (lambda t, r, c, w: silu(t, r, c, w, False), (16, 256, 4),
                 list(itertools.product((16, 32), (256, 512, 1024), (4, 8))), 4 * (WIDTH - D)),
    "silu_bwd": (lambda t, r, c, w: silu(t, r, c, w, True), (16, 256, 4),
                 list(itertools.product((16, 32), (256, 512, 1024), (4, 8))), 6 * (WIDTH - D)),
}


def tensors(rows: int, device: torch.device) -> dict:
    g = torch.Generator(device).manual_seed(7)

    def r(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device).to(dtype)

    pre = r(rows, WIDTH)
    x = r(rows, D)
    x_rows = RowsOut.allocate(rows, D, device, RowQuantization())  # for the backward reading x's e4m3 rows
    _, mean, rstd = ng.NormGateFunction.run_forward(x, pre[:, :D], r(D, dtype=torch.float32), r(D, dtype=torch.float32),
                                                    1e-5, silu_gate=True, x_rows=x_rows)  # fmt: skip
    pre_rows, pre_scale_inv = silu_quantize_rows(pre, torch.empty((rows, WIDTH - D), dtype=pre.dtype, device=device), D)
    return {"pre": pre, "u": pre[:, :D], "x": x, "w": r(D, dtype=torch.float32), "b": r(D, dtype=torch.float32),
            "x_words": as_words(x_rows.data), "x_scale_inv": x_rows.scale_inv, "pre_words": as_words(pre_rows[:, :D]),
            "pre_scale_inv": pre_scale_inv, "pre_rows": pre_rows.view(torch.uint8),
            "dy": r(rows, D), "skip": r(rows, D), "mean": mean, "rstd": rstd,
            "d_pre": torch.empty_like(pre), "d_pre0": r(rows, WIDTH), "g_vqk": r(rows, WIDTH - D)}  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--kernels", default=",".join(KERNELS))
    p.add_argument("--smoke", action="store_true",
                   help="the shipped launch and the first candidate of each kernel, their outputs compared, "
                        "not timed (TRITON_INTERPRET=1 on a CPU; with --rows 16)")  # fmt: skip
    p.add_argument("--out")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    t = tensors(args.rows, device)
    record = {"benchmark": "pointwise_tiles", "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
              "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "command": " ".join(sys.argv), "rows": args.rows, "kernels": {}}  # fmt: skip
    for name in args.kernels.split(","):
        launch, shipped, candidates, row_bytes = KERNELS[name]
        if args.smoke:
            candidates = [shipped, next(c for c in candidates if c != shipped)]
        reference = [o.clone() for o in launch(t, *shipped)()]
        runs: dict[tuple, Callable[[], tuple]] = {}
        bad = {}
        for c in candidates:
            fn = launch(t, *c)
            out = fn()
            # row sums (and dweight/dbias over rows) may run in another order with other tiles
            err = max(float((a.float() - b.float()).norm() / b.float().norm()) for a, b in zip(out, reference))
            if err <= 1e-3:
                runs[c] = fn
            else:
                bad[str(c)] = err
        if args.smoke:  # the launches and their outputs only: no timing under the interpreter
            print(f"{name}: {len(runs)} of {len(candidates)} launches match the shipped one; differ: {bad}")
            if bad:
                return 1
            continue
        names = list(runs)
        times: dict[tuple, list[float]] = {c: [] for c in names}
        for _ in range(2):
            for c in names:
                timed_ms(runs[c])
        for r in range(args.rounds):
            for j in range(len(names)):
                c = names[(r + j) % len(names)]
                times[c].append(timed_ms(runs[c]))
        rows = []
        for c in names:
            q1, _, q3 = statistics.quantiles(times[c], n=4, method="inclusive")
            med = statistics.median(times[c])
            rows.append({"params": list(c), "shipped": c == shipped, "ms_median": med, "ms_q1": q1, "ms_q3": q3,
                         "gb_s": args.rows * row_bytes / med / 1e6})  # fmt: skip
        rows.sort(key=lambda r: r["ms_median"])
        ship = next(r for r in rows if r["shipped"])
        print(f"\n{name} (params {KERNELS[name][1]} shipped): {ship['ms_median']:.3f} ms, {ship['gb_s']:.0f} GB/s; best:")
        for row in rows[:5]:
            print(f"  {tuple(row['params'])!s:<16} {row['ms_q1']:.3f} / {row['ms_median']:.3f} / {row['ms_q3']:.3f} ms "
                  f"{row['gb_s']:>6.0f} GB/s  {ship['ms_median'] / row['ms_median']:.3f}x shipped")  # fmt: skip
        if bad:
            print(f"  outputs differ from the shipped launch (max abs): {bad}")
        record["kernels"][name] = {"shipped": list(shipped), "rows": rows, "mismatched": bad}
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
