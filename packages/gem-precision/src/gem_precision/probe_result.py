"""What the precision probe (:mod:`gem_precision.probe`) is asked and what it answers: its options
(:class:`ProbeOptions`, with the cheapest-first :data:`DEFAULT_ORDER`), the measures of one scheme on
one linear and the report of one linear, what a :data:`Ranker` is told of each linear, and the result
(:class:`ProbeResult`) with its table, its ``precision:`` block and its JSON form."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import yaml

from gem_model.api import ConfigError, PrecisionConfig, PrecisionScheme

# cheapest first; schemes missing from the order are tried after these, in registry order
DEFAULT_ORDER: tuple[str, ...] = ("mxfp8", "fp8_rowwise", "fp8_tensorwise", "bf16", "fp32")


@dataclass(frozen=True)
class ProbeOptions:
    batches: int = 4
    schemes: tuple[str, ...] | None = None
    """Candidate scheme names; None: every registered scheme."""
    order: tuple[str, ...] = DEFAULT_ORDER
    max_rel_err: float = 0.1
    max_loss_change: float = 0.005
    """Largest accepted ``|Δloss| / loss`` when only the module is converted."""
    max_samples: int | None = None
    """Samples per batch (None: ``data.global_batch_size``). The probe keeps every linear's input and
    output of a batch and recomputes the loss per (module, scheme): at ~220k tokens a batch that is
    tens of GB and minutes, so the profile's section reads a sample of the batch."""
    loss_until_pass: bool = False
    """Recompute the loss only where it decides the recommendation: per module, the schemes in
    ``order`` whose relative error passes, up to the first that passes both tests. The others get
    ``loss_delta`` NaN (not measured). False: every (module, scheme), for the full table."""

    def check(self) -> None:
        problems: list[tuple[str, object, str]] = []
        if self.batches < 1:
            problems.append(("--batches", self.batches, "must be at least 1"))
        if self.max_samples is not None and self.max_samples < 1:
            problems.append(("--max-samples", self.max_samples, "must be at least 1"))
        if self.schemes is not None and not self.schemes:
            problems.append(("--schemes", self.schemes, "name at least one scheme"))
        for flag, value in (("--max-rel-err", self.max_rel_err), ("--max-loss-change", self.max_loss_change)):
            if not value >= 0.0:  # also rejects NaN
                problems.append((flag, value, "must be a number >= 0"))
        if problems:
            raise ConfigError(problems)


@dataclass
class SchemeMeasure:
    """One scheme on one module."""

    rel_err: float
    sqnr_db: float
    """``10 log10(||y_ref||² / ||y - y_ref||²)``; inf when the output is exact."""
    loss_delta: float
    """Mean loss over the batches with only this module converted, minus the float32 loss."""
    error: str | None = None
    """Why the scheme could not convert or run this module (then it is never recommended)."""

    def passes(self, options: ProbeOptions, baseline_loss: float) -> bool:
        if self.error is not None:
            return False
        loss_change = abs(self.loss_delta) / max(abs(baseline_loss), 1e-12)
        return self.rel_err <= options.max_rel_err and loss_change <= options.max_loss_change


@dataclass
class ModuleReport:
    fqn: str
    in_features: int
    out_features: int
    measures: dict[str, SchemeMeasure]
    recommended: str | None = None
    """The first passing scheme of ``order``; None: none passed, the module stays float32 (``exclude``)."""
    rows: int = 0
    """Rows of its input per probed batch (tokens for a block's linears, samples for the towers')."""
    current: str | None = None
    """The scheme the probed config gives it (None: left as is, float32 inside)."""
    order: list[str] = field(default_factory=list)
    """The candidates in the order its recommendation was picked in (``options.order``, or the ranker's)."""


@dataclass(frozen=True)
class ProbedLinear:
    """What a :data:`Ranker` is told of one linear."""

    fqn: str
    in_features: int
    out_features: int
    rows: int
    """Rows of its input per probed batch."""
    current: str | None
    """The config's scheme for it (None: left as is)."""


Ranker = Callable[[list["ProbedLinear"], dict[str, PrecisionScheme]], dict[str, list[str]]]
"""Given every probed linear and the candidate schemes (cheapest first by ``options.order``), per
linear the candidates its recommendation is picked from, in order: the first that passes the
thresholds. A candidate its list leaves out is measured but never recommended for it; a linear left
out of the answer picks in ``options.order``. :class:`gem_precision.pays.SpeedRanker` ranks by the
time each scheme's linear takes on the device."""


@dataclass
class ProbeResult:
    config_name: str
    batches: int
    baseline_loss: float
    schemes: list[str]
    """Candidates, cheapest first (the order recommendations are picked in)."""
    options: ProbeOptions
    modules: list[ModuleReport]
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    """The recommended ``precision`` section."""
    samples: int = 0
    """Samples of each probed batch."""

    def recommendations(self) -> dict[str, str | None]:
        return {m.fqn: m.recommended for m in self.modules}

    def yaml(self) -> str:
        """The recommended ``precision:`` block, loadable by :func:`gem_model.config_io.load_config`."""
        section = self.precision.model_dump(mode="json")
        if not section["scheme"]["options"]:
            section["scheme"] = section["scheme"]["name"]
        head = (
            f"# gem-train profile precision: {self.config_name}, {self.batches} batch(es), "
            f"rel err <= {self.options.max_rel_err:g}, |dloss|/loss <= {self.options.max_loss_change:g}\n"
        )
        return head + yaml.safe_dump({"precision": section}, sort_keys=False)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["precision"] = self.precision.model_dump(mode="json")
        # strict JSON has no Infinity or NaN: null means exact (SQNR) or not measured (an error)
        for module in data["modules"]:
            for measure in module["measures"].values():
                for key in ("rel_err", "sqnr_db", "loss_delta"):
                    if not math.isfinite(measure[key]):
                        measure[key] = None
        return data

    def table(self) -> str:
        opts = self.options
        lines = [
            f"precision probe of {self.config_name!r}: {self.batches} batch(es), float32 loss {self.baseline_loss:.4f}",
            f"cells: rel err, SQNR dB, dloss/loss with only that module converted; '*' = over a threshold "
            f"(rel err {opts.max_rel_err:g}, |dloss|/loss {opts.max_loss_change:g})",
        ]
        name_w = max([len("module"), *(len(m.fqn) for m in self.modules)])
        cell_w = 21
        header = f"{'module':<{name_w}}  {'in x out':>9}  " + "".join(f"{s:<{cell_w}}" for s in self.schemes)
        lines += ["", header + "recommended", "-" * (len(header) + 11)]
        for m in self.modules:
            cells = "".join(f"{_cell(m.measures[s], opts, self.baseline_loss):<{cell_w}}" for s in self.schemes)
            shape = f"{m.in_features}x{m.out_features}"
            lines.append(f"{m.fqn:<{name_w}}  {shape:>9}  {cells}{m.recommended or 'fp32 (exclude)'}")
        counts = Counter(m.recommended or "exclude" for m in self.modules)
        lines += ["", "recommended: " + ", ".join(f"{n} x{c}" for n, c in counts.most_common())]
        return "\n".join(lines)


def _cell(m: SchemeMeasure, options: ProbeOptions, baseline: float) -> str:
    if m.error is not None:
        return "error"
    sqnr = "inf" if math.isinf(m.sqnr_db) else f"{m.sqnr_db:.1f}"
    mark = "" if m.passes(options, baseline) else "*"
    return f"{m.rel_err:.1e} {sqnr:>4} {m.loss_delta / max(abs(baseline), 1e-12):+.2%}{mark}"
