"""The CI matrix (scripts/matrix.py): every test file runs in exactly one environment, chosen by its
folder; ``envs.py selection ENV`` prints what the matrix runs; a skip is seen, with its reason."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import matrix  # noqa: E402


def all_test_files() -> list[str]:
    found = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("__pycache__", "runs")]
        found += [str((Path(folder) / f).relative_to(ROOT)) for f in files if f.startswith("test_") and f.endswith(".py")]
    return sorted(found)


def test_every_test_file_runs_in_exactly_one_environment():
    files = all_test_files()
    assert "tests/test_ci_matrix.py" in files and any(f.startswith("packages/gem-comm/tests/") for f in files)
    selections = {name: matrix.selection(name) for name in matrix.MATRIX}
    for f in files:
        owners = [name for name, paths in selections.items() if any(Path(f).is_relative_to(p) for p in paths)]
        assert len(owners) == 1, f"{f} runs in {owners or 'no environment'}"


def test_a_package_environment_owns_its_package_and_all_the_rest():
    assert matrix.selection("core") == ["packages/gem-model/tests"]
    assert matrix.selection("core+comm") == ["packages/gem-comm/tests"]
    assert matrix.selection("all") == ["examples/gem-plugin-example/tests", "tests"]
    for name, spec in matrix.MATRIX.items():
        if name != "all":  # a package environment holds the core and at most its own package
            assert spec.packages[0] == "gem-model" and len(spec.packages) <= 2, name


def test_a_package_without_an_environment_is_named():
    with pytest.raises(SystemExit, match=r"packages/gem-new/tests: no matrix environment installs exactly "
                                         r"\['gem-model', 'gem-new'\]; add one to MATRIX"):  # fmt: skip
        matrix.owner("packages/gem-new/tests")


@pytest.mark.parametrize("name", ["core", "all"])
def test_the_selection_command_prints_what_the_matrix_runs(name):
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "envs.py"), "selection", name], capture_output=True, text=True, check=True
    ).stdout
    assert shlex.split(out) == matrix.selection(name)
    command = matrix.pytest_command(Path("python"), name, Path("j.xml"), ["-x"])
    assert command[-len(matrix.selection(name)) :] == matrix.selection(name) and "--durations=20" in command


def test_a_skip_is_read_with_its_reason(tmp_path):
    (tmp_path / "test_b.py").write_text("import pytest\n\npytest.importorskip('no_such_module_here')\n")
    (tmp_path / "test_a.py").write_text(
        "import pytest\n\ndef test_runs():\n    pass\n\n"
        "def test_needs_x():\n    pytest.skip('x is not installed')\n\n"
        "def test_fails():\n    assert False\n"
    )
    junit = tmp_path / "out.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", str(tmp_path)],
                   cwd=tmp_path, capture_output=True)  # fmt: skip
    outcome = matrix.Outcome.read(junit)
    assert (outcome.passed, outcome.failed) == (1, 1)
    skipped = sorted(outcome.skipped, key=lambda s: "test_needs_x" not in s)
    assert len(skipped) == 2, skipped
    assert "test_needs_x" in skipped[0] and "x is not installed" in skipped[0]
    assert "test_b (the whole module)" in skipped[1] and "no_such_module_here" in skipped[1]


def test_an_unreadable_report_fails_its_environment_with_the_reason(tmp_path):
    junit = tmp_path / "core.xml"
    junit.write_text("")  # what a pytest killed before writing its report, or a full disk, leaves
    outcome = matrix.Outcome.read(junit)
    assert (outcome.passed, outcome.failed) == (0, 0)
    assert "core.xml: no element found" in outcome.unreadable and "(0 bytes)" in outcome.unreadable


def test_an_environment_that_fails_is_reported_and_deleted_and_the_others_go_on(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(matrix, "ROOT", tmp_path)
    monkeypatch.setattr(matrix, "LOGS", tmp_path / ".venvs" / "logs")

    def install_and_test(name, spec, env_dir, pytest_args, out):  # stands in for the install: fills, then fails
        env_dir.mkdir(parents=True)
        (env_dir / "site-packages").write_bytes(b"0" * 1024)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(matrix, "install_and_test", install_and_test)

    def job(name, out):
        return {"env": name, "ok": True} if name == "core" else matrix.run_env(name, [], out)

    results = matrix.in_parallel(["core+comm", "core"], job, jobs=2)
    assert [r["ok"] for r in results] == [False, True]
    assert "No space left on device" in results[0]["error"] and "GiB free on the disk of" in results[0]["error"]
    assert not (tmp_path / ".venvs" / "core+comm").exists()  # deleted, its log kept
    assert "No space left on device" in (tmp_path / ".venvs" / "logs" / "core+comm.log").read_text()
    printed = capsys.readouterr().out
    assert "core+comm: FAIL" in printed and "core: pass" in printed


def test_an_environment_is_kept_when_asked(tmp_path, monkeypatch):
    monkeypatch.setattr(matrix, "ROOT", tmp_path)
    monkeypatch.setattr(matrix, "install_and_test", lambda name, spec, env_dir, args, out: env_dir.mkdir(parents=True) or {"ok": True})
    matrix.run_env("core", [], sys.stdout, keep=True)
    matrix.run_env("core+comm", [], sys.stdout)
    assert (tmp_path / ".venvs" / "core").is_dir() and not (tmp_path / ".venvs" / "core+comm").exists()
