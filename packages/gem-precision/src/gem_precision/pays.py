"""Which scheme pays for each linear on the device at hand: the speed half of the precision
recommendation. The probe's numerics (:mod:`gem_precision.probe`) are the other half, and the
device's memory has the last word (:func:`decide`).

:class:`SpeedRanker` is the probe's ranker. Once the probe knows the linears' shapes and the rows of
input each gets, it times every candidate's linear on the device (:mod:`gem_precision.gemm_rates`)
at the rows the run gives it, and orders each linear's candidates:

1. the schemes measured faster than the linear's current scheme (the config's) by at least
   :data:`MIN_SPEEDUP`, fastest first: the only ones recommended for speed;
2. the current scheme, which stays where none of them passes the numerics;
3. only when the current scheme fails the numerics: the others, fastest first.

A scheme whose backend is emulated on this device (it quantizes, then dequantizes and multiplies in
float32) is never ranked, nor one that cannot run the linear here. For a linear the config leaves as
is (float32 inside) only the faster schemes are ranked: as is, it is the numerics' reference.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch

from gem_model.api import GEMM_BITS, MemoryFit, PrecisionConfig, PrecisionScheme
from gem_precision.gemm_rates import AS_IS, LinearShape, Measure, RateTable, measure_rates
from gem_precision.precision_map import recommended_precision
from gem_precision.probe import ProbedLinear, ProbeResult

MIN_SPEEDUP = 1.02
"""A scheme is faster for a linear when its measured time is at most the current one's / this: a
timing is good to about a percent, and a smaller gain is not worth a change of numerics."""

Kind = Literal["recommended", "current", "faster", "slower", "emulated", "unavailable", "numerics", "memory"]


@dataclass(frozen=True)
class Why:
    """Where a scheme stands for one linear, and why, in words."""

    kind: Kind
    text: str


class SpeedRanker:
    """The probe's ranker by measured time on ``device`` (module doc). ``rows_scale``: the run's rows
    per probed row (a rank's samples per step over the probe's samples). ``measure``: what times
    the schemes (a stand-in in tests). ``configured``: the config's own schemes, timed too when they
    are not among the candidates (every candidate is compared with them)."""

    def __init__(
        self, device: torch.device, dtype: torch.dtype, rows_scale: float, measure: Measure = measure_rates,
        configured: dict[str, PrecisionScheme] | None = None,
    ):  # fmt: skip
        self.device, self.dtype, self.rows_scale, self.measure = device, dtype, rows_scale, measure
        self.configured = configured or {}
        self.table = RateTable(str(device), {})
        self.shapes: dict[str, LinearShape] = {}
        self.current: dict[str, str | None] = {}
        self.why: dict[str, dict[str, Why]] = {}
        self.bits: dict[str, int] = {}
        """GEMM bits of each candidate (:data:`gem_model.api.GEMM_BITS` of its ``gemm_dtype``)."""

    def __call__(self, linears: list[ProbedLinear], schemes: dict[str, PrecisionScheme]) -> dict[str, list[str]]:
        self.bits = {name: GEMM_BITS.get(s.gemm_dtype, 32) for name, s in schemes.items()}
        for lin in linears:
            self.shapes[lin.fqn] = LinearShape(
                lin.in_features, lin.out_features, max(1, round(lin.rows * self.rows_scale))
            )
            self.current[lin.fqn] = lin.current
        timed = {**{n: s for n, s in self.configured.items() if n not in schemes}, **schemes}
        self.table = self.measure(timed, list(dict.fromkeys(self.shapes.values())), self.device, self.dtype)
        return {lin.fqn: self._rank(lin.fqn, list(schemes)) for lin in linears}

    def kind(self, fqn: str, scheme: str) -> Kind | None:
        """Where ``scheme`` stands for the linear by speed (None: not ranked)."""
        why = self.why.get(fqn, {}).get(scheme)
        return None if why is None else why.kind

    def seconds(self, fqn: str, scheme: str | None) -> float | None:
        """The linear's time per step under ``scheme`` (None: as is), at the run's rows."""
        return self.table.seconds(AS_IS if scheme is None else scheme, self.shapes[fqn])

    def gain_if_all(self, scheme: str | None) -> float:
        """Seconds a step would save if every linear that can ran ``scheme`` (None: as is)."""
        saved = 0.0
        for fqn in self.shapes:
            now, then = self.seconds(fqn, self.current[fqn]), self.seconds(fqn, scheme)
            if now is not None and then is not None:
                saved += now - then
        return saved

    def _rank(self, fqn: str, names: list[str]) -> list[str]:
        current = self.current[fqn]
        now = self.seconds(fqn, current)
        why = self.why[fqn] = {}
        faster: list[tuple[float, str]] = []
        slower: list[tuple[float, str]] = []
        for name in names:
            backend, took = self.table.backends.get(name), self.seconds(fqn, name)
            if name == current:
                why[name] = Why("current", "the config's scheme")
            elif backend is None or backend.error is not None:
                why[name] = Why("unavailable", f"cannot run here: {backend.error if backend else 'not measured'}")
            elif backend.emulated:
                why[name] = Why("emulated", "emulated here")
            elif took is None:
                error = self.table.timings.get(name, {}).get(self.shapes[fqn].key)
                why[name] = Why("unavailable", f"cannot run this linear here: {error.error if error else 'not timed'}")
            elif now is None:
                why[name] = Why("slower", "the current scheme's time could not be measured: nothing is faster")
            elif took * MIN_SPEEDUP <= now:
                faster.append((took, name))
                why[name] = Why("faster", f"{now / took:.2f}x faster here")
            else:
                slower.append((took, name))
                why[name] = Why("slower", f"slower here ({now / took:.2f}x the current speed)")
        ranked = [n for _, n in sorted(faster)]
        return ranked if current is None else [*ranked, current, *(n for _, n in sorted(slower))]


@dataclass
class Decision:
    """The recommendation per linear once numerics, speed and memory have had their say."""

    recommended: dict[str, str | None]
    why: dict[str, dict[str, Why]]
    """linear -> scheme -> where it stands (``recommended``, ``current``, or why not)."""
    precision: PrecisionConfig | None
    """The ``precision:`` block to use; None: keep the config's (nothing to change, or it did not fit)."""
    seconds_now: float
    """The probed linears' time per step under the config's schemes, at the run's rows."""
    seconds_after: float
    """... and under the recommendation."""
    fit: MemoryFit | None = None
    """The recommended block's memory; None where nothing was checked."""
    not_made: list[str] = field(default_factory=list)
    """Recommendations dropped, and why, in words."""

    def why_not(self, fqn: str, bits: dict[str, int]) -> str:
        """Why the schemes with fewer GEMM bits than the linear's recommendation were not taken."""
        mine = self.why[fqn]
        chosen = self.recommended[fqn]
        limit = bits.get(chosen, 32) if chosen is not None else 32
        parts = [
            f"{s}: {w.text}"
            for s, w in mine.items()
            if bits.get(s, 32) < limit and w.kind not in ("recommended", "current")
        ]
        return "; ".join(parts)

    def scheme_summary(self, scheme: str) -> str:
        """For how many linears the scheme is recommended, and why not for the others."""
        kinds = Counter(w[scheme].kind for w in self.why.values() if scheme in w)
        chosen = sum(1 for r in self.recommended.values() if r == scheme)
        words = {"slower": "slower here", "emulated": "emulated here", "unavailable": "cannot run here",
                 "numerics": "numerics", "memory": "does not fit", "faster": "faster but another was faster",
                 "current": "the config's, replaced"}  # fmt: skip
        rest = ", ".join(f"{words[k]} x{n}" for k, n in kinds.most_common() if k in words)
        head = f"recommended for {chosen} of {len(self.recommended)}" if chosen else "not recommended"
        return f"{head}{': ' + rest if rest else ''}"


FitCheck = Callable[[PrecisionConfig], MemoryFit]


def decide(result: ProbeResult, ranker: SpeedRanker, config: PrecisionConfig, fit: FitCheck | None) -> Decision:
    """The probe's picks, with why every other candidate was not picked, checked against memory:
    a block that does not fit is not recommended; where the speed changes alone made it too big,
    the numerics changes (linears whose current scheme fails) are checked without them."""
    why = {fqn: dict(w) for fqn, w in ranker.why.items()}
    for m in result.modules:
        mine = why.setdefault(m.fqn, {})
        for s in m.order:
            measure = m.measures[s]
            if s == m.recommended:
                mine[s] = Why("recommended", mine[s].text if s in mine else "passes the numerics")
                break
            if measure.error is not None:
                mine[s] = Why("unavailable", f"cannot convert: {measure.error}")
            elif not measure.passes(result.options, result.baseline_loss):
                mine[s] = Why("numerics", _numerics(measure.rel_err, measure.loss_delta, result))
    picks = {m.fqn: m.recommended for m in result.modules}
    current = dict(ranker.current)
    decision = Decision(dict(current), why, None, _total(ranker, current), _total(ranker, current))
    speed = {f for f, s in picks.items() if s is not None and ranker.kind(f, s) == "faster"}
    numerics_only = {f: current[f] if f in speed else s for f, s in picks.items()}
    for chosen in (picks, numerics_only) if speed else (picks,):
        changed = {f: s for f, s in chosen.items() if s != current[f]}
        if not changed:
            continue
        block = recommended_precision(chosen, result.schemes, config)
        checked, problem = _check(block, fit)
        decision.fit = checked
        if problem is None:
            decision.recommended, decision.precision = chosen, block
            break
        decision.not_made.append(f"{_describe(changed)}: {problem}")
        for f, scheme in changed.items():
            if scheme is not None:
                why[f][scheme] = Why("memory", problem)
    for f, scheme in decision.recommended.items():  # a change checked again without the others, and kept
        if scheme is not None and scheme == picks[f] and why[f][scheme].kind == "memory":
            why[f][scheme] = Why("recommended", ranker.why[f][scheme].text)
    decision.seconds_after = _total(ranker, decision.recommended)
    return decision


def _check(block: PrecisionConfig, fit: FitCheck | None) -> tuple[MemoryFit | None, str | None]:
    if fit is None:
        return None, None
    try:
        checked = fit(block)
    except Exception as exc:  # a block whose step cannot run is no recommendation; say why
        return None, f"its memory could not be measured: {type(exc).__name__}: {exc}"
    return checked, None if checked.fits else checked.words()


def _numerics(rel: float, loss_delta: float, result: ProbeResult) -> str:
    opts = result.options
    if not rel <= opts.max_rel_err:
        return f"numerics: rel err {rel:.2g} > {opts.max_rel_err:g}"
    change = abs(loss_delta) / max(abs(result.baseline_loss), 1e-12)
    return f"numerics: |dloss|/loss {change:.2%} > {opts.max_loss_change:.2%}"


def _total(ranker: SpeedRanker, plan: dict[str, str | None]) -> float:
    return sum(ranker.seconds(f, s) or 0.0 for f, s in plan.items())


def _describe(changed: dict[str, str | None]) -> str:
    counts = Counter(s or "fp32 (exclude)" for s in changed.values())
    return "the map with " + ", ".join(f"{s} for {n} linear(s)" for s, n in counts.most_common())
