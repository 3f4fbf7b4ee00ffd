"""A third-party-style profile plugin (named in GEM_PLUGINS by the profile tests): one section made
from the measured steps and the core's sections, and one ``gem-train profile`` subcommand."""

from __future__ import annotations

import argparse

from gem_model.api import ProfileCommand, ProfileContext, ProfileSection, ProfileTable, Recommendation, hookimpl

SEEN: list[ProfileContext] = []


@hookimpl
def gem_profile_section_names() -> list[str]:
    return ["third_party"]


@hookimpl
def gem_profile_sections(profile: ProfileContext) -> list[ProfileSection]:
    SEEN.append(profile)
    steps = profile.measured.step_seconds if profile.measured else []
    return [ProfileSection(
        "third_party", "a third party's section",
        summary={"steps": len(steps), "core_sections": sorted(profile.sections)},
        tables=[ProfileTable("steps", ["step", "seconds"], [[i, s] for i, s in enumerate(steps)])],
        recommendations=[Recommendation("nothing at all", 0.5, "patience", "a test's number")],
    )]  # fmt: skip


def _add(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--greeting", default="hello")


def _run(args: argparse.Namespace, plugins: object) -> int:
    print(f"{args.greeting} from a plugin's profile command")
    return 0


@hookimpl
def gem_profile_commands() -> list[ProfileCommand]:
    return [ProfileCommand("hello", "say hello", _add, _run)]
