"""PNG plots of a profile report (matplotlib, Agg backend: the ``gem-model[report]`` extra).

Each plot reads only the report's ``series`` (so ``gem-train report`` redraws them from the JSON)
and is ``WIDTH x HEIGHT`` pixels. A section missing from the report draws no plot.
"""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path
from typing import Any

from gem_model.profiling.report import ProfileReport

WIDTH, HEIGHT, DPI = 800, 450, 100
EXTRA = "gem-model[report]"


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError(f"the profile's plots need matplotlib: pip install '{EXTRA}'") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    _pyplot().close(fig)
    return path


def _figure() -> tuple[Any, Any]:
    return _pyplot().subplots(figsize=(WIDTH / DPI, HEIGHT / DPI), dpi=DPI)


def length_histogram(report: ProfileReport, path: Path) -> Path:
    s = report.section("sequences").series
    edges, counts = s["histogram_edges"], s["histogram_counts"]
    fig, ax = _figure()
    ax.bar(edges[:-1], counts, width=[b - a for a, b in pairwise(edges)], align="edge")
    ax.set(xlabel="sequence length (tokens)", ylabel="sequences", title=f"{report.config_name}: sequence lengths")
    return _save(fig, path)


def rank_load(report: ProfileReport, path: Path) -> Path:
    loads: dict[str, list[float]] = report.section("balance").series["rank_load"]
    fig, ax = _figure()
    width = 0.8 / max(len(loads), 1)
    for i, (name, per_rank) in enumerate(loads.items()):
        ax.bar([r + i * width for r in range(len(per_rank))], [v / 1e9 for v in per_rank], width=width, label=name)
    ranks = max((len(v) for v in loads.values()), default=0)
    ax.set_xticks([r + width * (len(loads) - 1) / 2 for r in range(ranks)], [str(r) for r in range(ranks)])
    ax.set(xlabel="data-parallel rank", ylabel="training GFLOP (all batches)", title="per-rank load by balancer")
    ax.legend()
    return _save(fig, path)


def step_time(report: ProfileReport, path: Path) -> Path:
    series = report.section("step_time").series
    parts: dict[str, float] = series["breakdown_ms_per_step"]
    fig, ax = _figure()
    ax.barh(list(parts), list(parts.values()))
    ax.invert_yaxis()
    plain = series.get("unprofiled_step_ms")
    title = "step time by kind, under torch.profiler (its host cost included)"
    if plain:
        title += f"\nwithout the profiler a step took {plain:.1f} ms, under it {sum(parts.values()):.1f} ms"
    ax.set(xlabel="ms per step under the profiler", title=title)
    return _save(fig, path)


def memory(report: ProfileReport, path: Path) -> Path:
    s = report.section("memory").series
    static: dict[str, float] = s["static"]
    acts: dict[str, dict[str, float]] = s["activations"]
    policies = list(acts) or ["-"]
    fig, ax = _figure()
    bottom = [0.0] * len(policies)
    for label, value in static.items():
        ax.bar(policies, [value / 1e9] * len(policies), bottom=bottom, label=label)
        bottom = [b + value / 1e9 for b in bottom]
    ax.bar(policies, [acts[p]["saved"] / 1e9 if p in acts else 0.0 for p in policies], bottom=bottom,
           label="activations saved for backward")  # fmt: skip
    ax.set(xlabel="activation policy", ylabel="GB per rank", title="estimated memory per rank")
    ax.legend()
    return _save(fig, path)


def _ranks(report: ProfileReport) -> int:
    loads: dict[str, list[float]] = report.section("balance").series.get("rank_load", {})
    return max((len(v) for v in loads.values()), default=0)


PLOTS = {"sequences": ("lengths.png", length_histogram), "balance": ("rank_load.png", rank_load),
         "step_time": ("step_time.png", step_time), "memory": ("memory.png", memory)}  # fmt: skip


def write_plots(report: ProfileReport, out_dir: Path) -> dict[str, Path]:
    """Every plot whose section the report has, as ``out_dir/<file>.png``; section name -> path."""
    out = {}
    for section, (filename, draw) in PLOTS.items():
        if report.has(section) and report.section(section).series:  # not a section that was cut off
            if section == "balance" and _ranks(report) < 2:
                continue  # one rank has nothing to balance: a plot of it would say nothing
            out[section] = draw(report, out_dir / filename)
    return out
