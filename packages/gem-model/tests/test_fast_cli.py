"""`gem-train --help` and every subcommand's help answer without importing torch, torchrec or a plugin,
and overrides may come anywhere on the command line."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from gem_model.cli import build_parser, main, parse_args

HELPS = [
    ["--help"], ["run", "--help"], ["plan", "--help"], ["config", "--help"], ["plugins", "--help"],
    ["profile", "--help"], ["report", "--help"], ["tune", "--help"], ["data", "--help"], ["data", "convert", "--help"],
    ["run", "--no-such-option"],
]  # fmt: skip
HEAVY = ("torch", "torchrec", "fbgemm_gpu", "pyarrow", "gem_kernels", "gem_precision", "gem_parallel", "gem_comm")

SCRIPT = f"""
import contextlib, io, sys
from gem_model.cli import main
for argv in {HELPS!r}:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            main(argv)
        except SystemExit:
            pass
    heavy = [m for m in {HEAVY!r} if m in sys.modules]
    print(argv, "usage:" in out.getvalue(), heavy)
"""


def test_help_of_every_command_imports_no_torch_and_no_plugin():
    env = {k: v for k, v in os.environ.items() if k not in ("GEM_DISABLE_PLUGIN_AUTOLOAD", "GEM_PLUGINS")}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == len(HELPS)
    for argv, line in zip(HELPS, lines, strict=True):
        assert line == f"{argv} True []", line  # it printed its usage, and nothing heavy was imported


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "a.b=1", "--nproc", "2", "c.d=2", "-c", "x.yaml", "e.f=3"],
        ["run", "-c", "x.yaml", "a.b=1", "c.d=2", "--nproc", "2", "e.f=3"],
        ["run", "--nproc", "2", "a.b=1", "c.d=2", "e.f=3", "-c", "x.yaml"],
    ],
)
def test_overrides_before_between_and_after_the_options(argv):
    args = parse_args(build_parser(), argv)
    assert args.overrides == ["a.b=1", "c.d=2", "e.f=3"] and args.nproc == 2 and args.config == "x.yaml"


def test_a_stray_word_is_still_an_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "a.b=1", "--json", "oops"])
    assert exit_.value.code == 2 and "unrecognized arguments: oops" in capsys.readouterr().err
