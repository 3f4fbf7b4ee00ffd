"""A profile report as rich terminal tables, ``profile.json`` and one self-contained HTML page.

:func:`write_outputs` writes all of them (and the PNGs of :mod:`gem_model.profiling.plots` when
matplotlib is installed) into a directory; ``gem-train report RUN_DIR`` calls it again on the JSON.
"""

from __future__ import annotations

import base64
import html
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table as RichTable

from gem_model.profiling.report import ProfileReport, ProfileSection
from gem_model.terminal import console_for

JSON_NAME, HTML_NAME = "profile.json", "profile.html"


def cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1e6 else f"{value:,.0f}"
    return str(value)


def print_report(report: ProfileReport, console: Console | None = None) -> None:
    """The report's tables; ``console``: where (default: stdout, each table at a width that fits it
    where stdout is not a terminal: :mod:`gem_model.terminal`)."""
    text = console or Console()
    text.print(f"[bold]profile of {report.config_name}[/bold] on {report.device}, {report.created}")
    for section in report.sections:
        text.rule(section.title)
        for t in section.tables:
            table = RichTable(title=t.title, title_justify="left")
            for c in t.columns:
                table.add_column(c, overflow="fold")
            for row in t.rows:
                table.add_row(*(cell(v) for v in row))
            (console or console_for(table)).print(table)
        for note in section.notes:
            text.print(f"  [dim]{note}[/dim]")


def _html_section(section: ProfileSection, plot: Path | None) -> str:
    parts = [f"<h2>{html.escape(section.title)}</h2>"]
    if plot is not None:
        data = base64.b64encode(plot.read_bytes()).decode()
        parts.append(f'<img alt="{html.escape(section.name)}" src="data:image/png;base64,{data}">')
    for t in section.tables:
        head = "".join(f"<th>{html.escape(c)}</th>" for c in t.columns)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(cell(v))}</td>" for v in row) + "</tr>" for row in t.rows)
        parts.append(f"<table><caption>{html.escape(t.title)}</caption><tr>{head}</tr>{body}</table>")
    parts += [f"<p class=note>{html.escape(n)}</p>" for n in section.notes]
    return "\n".join(parts)


def to_html(report: ProfileReport, plots: dict[str, Path]) -> str:
    style = ("body{font-family:sans-serif;max-width:1000px;margin:auto}table{border-collapse:collapse;margin:1em 0}"
             "td,th{border:1px solid #ccc;padding:2px 8px;text-align:left}caption{text-align:left;font-weight:bold}"
             ".note{color:#666}")  # fmt: skip
    title = f"profile of {html.escape(report.config_name)}"
    head = f"<p>{html.escape(report.device)}, {html.escape(report.created)}: <code>{html.escape(report.command)}</code></p>"
    body = "\n".join(_html_section(s, plots.get(s.name)) for s in report.sections)
    return f"<!doctype html><html><head><meta charset=utf-8><title>{title}</title><style>{style}</style></head>" \
        f"<body><h1>{title}</h1>{head}\n{body}</body></html>\n"


def write_outputs(report: ProfileReport, out_dir: Path, *, json_too: bool = True) -> dict[str, Path]:
    """``profile.json`` (unless ``json_too`` is False), the PNGs and ``profile.html`` in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    if json_too:
        written["json"] = out_dir / JSON_NAME
        written["json"].write_text(report.to_json())
    try:
        from gem_model.profiling.plots import write_plots

        plots = write_plots(report, out_dir)
    except ImportError as exc:
        print(f"gem-train: no plots: {exc}")
        plots = {}
    written.update({f"plot:{k}": v for k, v in plots.items()})
    written["html"] = out_dir / HTML_NAME
    written["html"].write_text(to_html(report, plots))
    return written


def load_report(run_dir: Path) -> ProfileReport:
    path = run_dir / JSON_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: run `gem-train profile -c CONFIG --out {run_dir}` first")
    return ProfileReport.from_json(path.read_text())
