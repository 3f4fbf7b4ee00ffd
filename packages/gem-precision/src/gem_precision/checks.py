"""Bit-exact comparisons that say what differs: used by the tests and by the GPU benchmark.

A failed bit-exactness check on a machine we only reach now and then must carry enough to find the
cause without running again: which tensor (data or scale), how many elements differ, the largest
difference of the decoded values, and a few examples with their input values and bytes.
"""

from __future__ import annotations

from typing import Any

import torch

Diff = dict[str, Any]


def _decode(t: torch.Tensor) -> torch.Tensor:
    """Values as float64 (fp8 and e8m0 through their torch dtypes; NaN stays NaN)."""
    if t.dtype in (torch.uint8, torch.int8, torch.int32, torch.int64):
        return t.double()
    return t.double() if t.dtype in (torch.float32, torch.float64) else t.float().double()


def _raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` as a flat integer tensor of its element width (exact comparisons)."""
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.contiguous().reshape(-1).view(width)


def compare_bits(
    what: str, got: torch.Tensor, want: torch.Tensor, *, source: torch.Tensor | None = None, examples: int = 4
) -> Diff | None:
    """None when ``got`` and ``want`` have the same shape and bytes; else what differs.

    ``source``: the quantized input, same number of rows as ``got`` (or its transpose); examples then
    show the input value at the first mismatching positions when the shapes line up.
    """
    if got.shape != want.shape or got.dtype != want.dtype:
        return {
            "what": what,
            "problem": f"shape/dtype {tuple(got.shape)} {got.dtype} vs {tuple(want.shape)} {want.dtype}",
        }
    g, w = _raw(got), _raw(want)
    bad = (g != w).nonzero().flatten()
    if bad.numel() == 0:
        return None
    gv, wv = _decode(got.reshape(-1))[bad], _decode(want.reshape(-1))[bad]
    both_nan = gv.isnan() & wv.isnan()
    diff = (gv - wv).abs().nan_to_num(nan=float("inf"))
    diff[both_nan] = 0.0  # NaN payloads differ but both are NaN
    out: Diff = {
        "what": what,
        "shape": list(got.shape),
        "mismatches": int(bad.numel()),
        "of": got.numel(),
        "nan_payload_only": int(both_nan.sum()),
        "max_abs_diff": float(diff.max()),
        "examples": [],
    }
    cols = got.shape[-1] if got.dim() else 1
    for i in bad[:examples].tolist():
        row, col = divmod(i, cols)
        ex: Diff = {
            "index": [row, col] if got.dim() == 2 else i,
            "got": float(_decode(got.reshape(-1)[i : i + 1])[0]),
            "want": float(_decode(want.reshape(-1)[i : i + 1])[0]),
            "got_bits": hex(int(g[i]) & (1 << 8 * got.element_size()) - 1),
            "want_bits": hex(int(w[i]) & (1 << 8 * want.element_size()) - 1),
        }
        if source is not None and got.dim() == 2:
            src = source if source.shape[0] == got.shape[0] else source.t()
            if row < src.shape[0] and col < src.shape[1]:
                ex["input"] = float(src[row, col])
        out["examples"].append(ex)
    return out


def compare_operands(label: str, got: Any, want: Any, *, source: torch.Tensor | None = None) -> list[Diff]:
    """Compare two quantized operands (anything with ``tensors()``: data, then scale), part by part."""
    if got is None or want is None:
        return [] if got is None and want is None else [{"what": label, "problem": "one side is missing"}]
    diffs = []
    for part, g, w in zip(("data", "scale"), got.tensors(), want.tensors()):
        d = compare_bits(f"{label}.{part}", g, w, source=source if part == "data" else None)
        if d is not None:
            diffs.append(d)
    return diffs


def summarize(diffs: list[Diff], limit: int = 6) -> str:
    """One line per differing tensor, for a log."""
    lines = []
    for d in diffs[:limit]:
        if "problem" in d:
            lines.append(f"{d['what']}: {d['problem']}")
            continue
        lines.append(
            f"{d['what']} {d['shape']}: {d['mismatches']}/{d['of']} differ "
            f"({d['nan_payload_only']} NaN payload only), max |diff| {d['max_abs_diff']:.4g}, e.g. {d['examples'][:2]}"
        )
    if len(diffs) > limit:
        lines.append(f"... and {len(diffs) - limit} more")
    return "\n".join(lines)


def check_fp8_quantization(cases: dict[str, torch.Tensor], *, software_round: bool | None) -> list[Diff]:
    """The fused fp8 quantization (rows + cols_t, row and tensor scales, e4m3) against the reference,
    bit for bit, on each named 2-d tensor. On a mismatch on CUDA, each diff also says whether the
    kernel with the other rounding path and the reference computed on the CPU agree, which tells a
    kernel fault from a device-dependent reference. ``software_round=None`` checks the kernel's
    default path (what the schemes run)."""
    from gem_precision.formats import E4M3
    from gem_precision.fp8_quant_triton import quantize_fp8_triton
    from gem_precision.fp8_reference import quantize_fp8_reference

    diffs: list[Diff] = []
    for name, t in cases.items():
        for gran in ("row", "tensor"):
            kw: dict[str, Any] = {"granularity": gran, "fmt": E4M3, "rows": True, "cols_t": True, "pad_to": 16}
            got = quantize_fp8_triton(t, software_round=software_round, **kw)
            want = quantize_fp8_reference(t, **kw)
            found = []
            for part in ("rows", "cols_t"):
                found += compare_operands(f"{name}/{gran}/{part}", getattr(got, part), getattr(want, part), source=t)
            if found and t.is_cuda:
                # the other path: hardware cast when the default was checked, else the flip
                flip = False if software_round is None else not software_round
                other = quantize_fp8_triton(t, software_round=flip, **kw)
                cpu = quantize_fp8_reference(t.cpu(), **kw)
                for d in found:
                    part = d["what"].split("/")[2].split(".")[0]

                    def count(a: Any, b: Any, part: str = part) -> int:
                        return sum(x.get("mismatches", -1) for x in compare_operands(part, a, b))

                    g, w, o, c = (getattr(p, part) for p in (got, want, other, cpu))
                    c = type(c)(*(v.to(t.device) for v in c.tensors()))
                    d["attribution"] = {
                        "kernel (other rounding) vs reference": count(o, w),
                        "kernel vs reference on CPU": count(g, c),
                        "reference on CUDA vs on CPU": count(w, c),
                    }
            diffs += found
    return diffs


def check_mx_quantization(
    cases: dict[str, torch.Tensor],
    *,
    software_round: bool,
    rows: bool = True,
    cols_t: bool = True,
    tile: tuple[int, int, int] | None = None,
) -> list[Diff]:
    """The Triton MX quantize kernel (with ``tile``, the default when None) against
    :func:`mx_reference.mx_quantize`, on each named 2-d tensor."""
    from gem_precision.mx_reference import mx_quantize
    from gem_precision.mx_triton import mx_quantize_triton

    diffs: list[Diff] = []
    for name, t in cases.items():
        got_r, got_c = mx_quantize_triton(t, rows=rows, cols_t=cols_t, software_round=software_round, tile=tile)
        if rows:
            diffs += compare_operands(f"{name}/rows", got_r, mx_quantize(t), source=t)
        if cols_t:
            diffs += compare_operands(f"{name}/cols_t", got_c, mx_quantize(t, axis=0), source=t)
    return diffs
