"""The end-of-run report: the summary and the plugins' sections as one printed table.

The types live in the leaf module :mod:`gem_model.results`; they are re-exported here too.
"""

from __future__ import annotations

from gem_model.results import ReportSection, RunSummary

__all__ = ["ReportSection", "RunSummary", "format_sections"]


def format_sections(sections: list[ReportSection]) -> str:
    width = max((len(label) for s in sections for label, _ in s.rows), default=10)
    lines: list[str] = []
    for s in sections:
        lines.append(f"== {s.title} " + "=" * max(0, 60 - len(s.title)))
        lines += [f"  {label:<{width}}  {value}" for label, value in s.rows]
    return "\n".join(lines)
