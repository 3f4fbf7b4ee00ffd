"""The recommendations section: every section's suggestions, ranked by expected gain.

A gain is the fraction of its metric a change should save (step time, memory per rank, attention
work), with the numbers behind it; gains of different metrics are ranked side by side, so the
evidence column says what each one is.
"""

from __future__ import annotations

from gem_model.profiling.report import ProfileSection, ProfileTable, Recommendation


def ranked(sections: list[ProfileSection]) -> list[Recommendation]:
    out = []
    for s in sections:
        for r in s.recommendations:
            r.section = s.name
            out.append(r)
    return sorted(out, key=lambda r: -r.expected_gain)


def recommendations_section(sections: list[ProfileSection]) -> ProfileSection:
    recs = ranked(sections)
    rows = [[i + 1, r.action, f"{100 * r.expected_gain:.1f} % of {r.metric}", r.section, r.evidence]
            for i, r in enumerate(recs)]  # fmt: skip
    return ProfileSection(
        name="recommendations",
        title="recommendations, ranked by expected gain",
        summary={"count": len(recs), "actions": [r.action for r in recs]},
        tables=[ProfileTable("what to change", ["rank", "change", "expected gain", "from", "numbers"], rows)],
        notes=[] if recs else ["nothing to recommend: no section found a gain"],
    )
