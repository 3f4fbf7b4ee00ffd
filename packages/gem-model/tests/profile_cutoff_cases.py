"""Profile sections that do not finish (named in GEM_PLUGINS by the cut-off tests only): one runs
until ``--section-budget`` cuts it off, one raises, one is interrupted from outside."""

from __future__ import annotations

import time

from gem_model.api import ProfileContext, ProfileSection, hookimpl


@hookimpl
def gem_profile_section_names() -> list[str]:
    return ["endless", "broken", "interrupted"]


@hookimpl
def gem_profile_sections(profile: ProfileContext) -> list[ProfileSection]:
    if profile.wants("broken"):
        raise ValueError("a section that cannot be made")
    if profile.wants("interrupted"):
        raise KeyboardInterrupt
    while profile.wants("endless"):  # until the budget's SIGALRM raises in here
        time.sleep(0.01)
    return []
