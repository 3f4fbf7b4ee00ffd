"""The docs' training commands, followed in order in one clone, never meet another run's
checkpoints: any two that write into the same output directory are the same run (the same
identity by meaning, on the same number of processes). Read from the docs, not run: the walk that
runs them is ``test_readme_walk``'s; this one fails the moment an example would collide."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from gem_model.config_io import load_config
from gem_model.plugins import GemPluginManager
from gem_model.train.identity import identity
from gem_model.train.outputs import output_dir

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted(ROOT.glob("examples/*/README.md"))]
COMMAND = re.compile(r"(bash scripts/train\.sh|gem-train run|python -m gem_model run|torchrun [^`\n]*?-m gem_model run)([^`\n]*)")
LAUNCH_VALUES = {"--nproc", "--nnodes", "--node-rank", "--rdzv-endpoint", "--rdzv-id", "--max-restarts", "--nproc-per-node"}


def commands() -> list[tuple[str, int, str]]:
    """(file, line, command) of every training command the docs show, in order."""
    found = []
    for doc in DOCS:
        for number, line in enumerate(doc.read_text().splitlines(), 1):
            for match in COMMAND.finditer(line):
                found.append((doc.name, number, match.group(0)))
    return found


def parse(command: str) -> tuple[str | None, list[str], int] | None:
    """(config file, overrides, processes) of ``command``; None for a template (``-c CONFIG``, ``N``)."""
    words = shlex.split(command, comments=True)
    config, overrides, nproc, nnodes = None, [], 1, 1
    words = words[words.index("run") + 1 :] if "run" in words else words[2:]  # after `gem_model run`, `train.sh`
    head = command.split(" -m gem_model run")[0]
    if head.startswith("torchrun"):
        per_node = re.search(r"--nproc-per-node[ =](\d+)", head)
        nproc = int(per_node.group(1)) if per_node else 1
    i = 0
    while i < len(words):
        word = words[i]
        if word in ("-c", "--config", *LAUNCH_VALUES) and i + 1 == len(words):
            return None  # a mention in prose ("loadable by `gem-train run -c`")
        if word in ("-c", "--config"):
            config = words[i + 1]
            i += 2
        elif word in LAUNCH_VALUES:
            value = words[i + 1]
            if not value.isdigit() and word in ("--nproc", "--nnodes"):
                return None
            nproc = int(value) if word == "--nproc" else nproc
            nnodes = int(value) if word == "--nnodes" else nnodes
            i += 2
        elif word.startswith("-"):
            i += 1
        else:
            overrides.append(word)
            i += 1
    if config is not None and not (ROOT / config).is_file():
        return None  # a template or a file a step before writes (CONFIG, "$0", tuned.yaml)
    return config, overrides, nproc * nnodes


@pytest.fixture(scope="module")
def pm() -> GemPluginManager:
    return GemPluginManager()


def test_the_docs_show_the_commands_this_test_reads():
    shown = [c for _, _, c in commands()]
    assert "bash scripts/train.sh -c configs/tiny.yaml trainer.steps=50" in shown
    assert any(c.startswith("torchrun --nproc-per-node 2 -m gem_model run") for c in shown)


def test_no_two_training_commands_of_the_docs_share_a_directory_unless_they_are_one_run(pm):
    default = ("README.md", 0, "bash scripts/train.sh")  # the README's first command
    seen: dict[Path, tuple[str, dict, int]] = {}
    collisions = []
    for doc, number, command in [default, *commands()]:
        parsed = parse(command)
        if parsed is None:
            continue
        config_file, overrides, world = parsed
        config = load_config(ROOT / config_file if config_file else None, overrides)
        out = output_dir(config)
        run = (identity(config.model_dump(mode="json"), pm), world)
        where = f"{doc}:{number}: {command}"
        if out in seen and (seen[out][1], seen[out][2]) != run:
            collisions.append(f"{where}\n  writes into {out} like {seen[out][0]}, but is another run")
        seen.setdefault(out, (where, *run))
    assert not collisions, "\n".join(collisions)


@pytest.mark.parametrize(
    "command",
    ["gem-train run -c configs/tiny.yaml precision.scheme=bf16", "torchrun --nproc-per-node 2 -m gem_model run"],
)
def test_the_check_can_fail(pm, command):
    """Without a name of their own, these would meet the default run's checkpoints."""
    config_file, overrides, world = parse(command)
    here = load_config(ROOT / config_file if config_file else None, overrides)
    default = load_config(None, [])
    assert output_dir(here) == output_dir(default)
    assert (identity(here.model_dump(mode="json"), pm), world) != (identity(default.model_dump(mode="json"), pm), 1)
