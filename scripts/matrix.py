"""The CI matrix: which environment owns which tests, and running the environments. Standard library only.

Ownership is by folder, so that a new test falls in exactly one environment without anyone listing it:
``packages/<pkg>/tests`` belongs to the environment of ``<pkg>`` alone with the core (``core`` for
gem-model itself), and every other test folder (``tests/``, ``examples/*/tests``) to ``all``. A test that
needs two plugin packages, or a package and the example, lives in the root ``tests/``. The owner of a
test installs everything it needs: no test is skipped where it runs, and a skip fails its environment.

Two environments run at a time on the 2-core CI machine: a single-process pytest uses one core, and
one environment's install overlaps another's tests. Each one's output is printed whole when it ends.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import threading
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from envs import ALL_PACKAGES, DATA, EXAMPLE, ROOT, log, setup

TEST_FOLDERS = ["tests", "packages/*/tests", "examples/*/tests"]
LOGS = ROOT / ".venvs" / "logs"
QUICK = "not slow and not multiprocess"


@dataclass
class MatrixEnv:
    packages: list[str]
    extras: list[str] = field(default_factory=list)
    core_alone: bool = False
    """``gem-train run`` must exit 2 naming every plugin package that is missing."""
    optional: bool = False
    """Install every package extra's requirements too (pyarrow, tensorboard, matplotlib)."""


# In the order they start, the longest first, so that the two last to run end close together
# (measured on the 2-core CI machine: all ~210 s of CPU in tests, core+parallel ~230, core ~150,
# core+kernels ~75, core+precision ~70, core+comm ~30; installs 30-120 s each).
MATRIX: dict[str, MatrixEnv] = {
    # the root tests/ and the example plugin: everything installed
    "all": MatrixEnv([*ALL_PACKAGES, EXAMPLE], extras=[*DATA, "hatch"], optional=True),
    "core+parallel": MatrixEnv(["gem-model", "gem-parallel"]),
    # gem-model's extras and the MovieLens data package: its tests of parquet, tensorboard, plots and the
    # real MovieLens-1M run here; the plugin environments hold gem-model without extras
    "core": MatrixEnv(["gem-model"], extras=[*DATA], core_alone=True, optional=True),
    "core+kernels": MatrixEnv(["gem-model", "gem-kernels"]),
    "core+precision": MatrixEnv(["gem-model", "gem-precision"]),
    "core+comm": MatrixEnv(["gem-model", "gem-comm"]),
}


def test_folders() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for pattern in TEST_FOLDERS for p in ROOT.glob(pattern) if p.is_dir())


def owner(folder: str) -> str:
    """The one environment that runs the tests under ``folder`` (a folder of :data:`TEST_FOLDERS`)."""
    parts = Path(folder).parts
    if parts[0] != "packages":
        return "all"
    wanted = ["gem-model"] if parts[1] == "gem-model" else ["gem-model", parts[1]]
    owners = [name for name, spec in MATRIX.items() if spec.packages == wanted]
    if len(owners) != 1:
        raise SystemExit(f"{folder}: no matrix environment installs exactly {wanted}; add one to MATRIX in {__file__}")
    return owners[0]


def selection(name: str) -> list[str]:
    """The pytest arguments that select what environment ``name`` runs: the test folders it owns."""
    if name not in MATRIX:
        raise SystemExit(f"unknown matrix environment {name!r}; available: {list(MATRIX)}")
    return [f for f in test_folders() if owner(f) == name]


# ------------------------------------------------------------------------------------------- results


@dataclass
class Outcome:
    """What one pytest run reported, read from its JUnit XML file."""

    passed: int = 0
    failed: int = 0
    skipped: list[str] = field(default_factory=list)
    durations: list[tuple[float, str]] = field(default_factory=list)
    unreadable: str = ""
    """Why the report could not be read (pytest killed, a full disk): the environment then fails."""

    @classmethod
    def read(cls, junit: Path) -> Outcome:
        out = cls()
        if not junit.exists():
            return out
        try:
            root = ET.parse(junit).getroot()
        except ET.ParseError as exc:
            out.unreadable = f"{junit.name}: {exc} ({junit.stat().st_size} bytes)"
            return out
        for case in root.iter("testcase"):
            module = case.get("classname", "").replace(".", "/")
            test = f"{module}.py::{case.get('name')}" if module else f"{case.get('name')} (the whole module)"
            out.durations.append((float(case.get("time") or 0), test))
            skip = case.find("skipped")
            if skip is not None:  # a module skipped at collection has its reason in the text
                reason = skip.get("message", "")
                out.skipped.append(f"{test}: {(skip.text or reason) if reason == 'collection skipped' else reason}")
            elif case.find("failure") is not None or case.find("error") is not None:
                out.failed += 1
            else:
                out.passed += 1
        return out


def pytest_command(python: Path, name: str, junit: Path, args: list[str]) -> list[str]:
    return [
        str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=20",
        f"--junitxml={junit}", *args, *selection(name),
    ]  # fmt: skip


def run_pytest(env_dir: Path, name: str, args: list[str], junit: Path, out: IO[str]) -> tuple[int, Outcome]:
    # small tensors: one thread per process is faster on the 2-core CI machine than two competing
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PATH": f"{env_dir / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    env.pop("PYTHONPATH", None)
    # bytecode, kept in the environment's folder (nothing written beside the sources): without it every
    # process the tests start (hundreds: gem-train runs, torchrun ranks) compiles again the ~2,500 modules
    # that importing torch and torchrec reads, ~9 s of CPU each time, e.g. under PYTHONDONTWRITEBYTECODE=1
    # (set on the CI machine; Docker images often set it). The first process compiles what it imports.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = str(env_dir / "pycache")
    # torch.compile's kernel cache (hundreds of MB) also lives and goes with the environment, not in /tmp
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(env_dir / "inductor"))
    junit.unlink(missing_ok=True)
    cmd = pytest_command(env_dir / "bin" / "python", name, junit, args)
    log(f"{name}: {shlex.join(cmd[1:])}", out)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    return proc.returncode, Outcome.read(junit)


# ------------------------------------------------------------------------------------------- matrix


def plugin_distributions(env_dir: Path, out: IO[str]) -> set[str]:
    text = subprocess.run([str(env_dir / "bin" / "gem-train"), "plugins"], capture_output=True, text=True, check=True).stdout
    out.write(text)
    lines = text.split("\n\n")[0].splitlines()[1:]
    # "  <distribution> <version>", each followed by its plugins, indented further
    return {line.split()[0] for line in lines if line.startswith("  ") and not line.startswith("   ")}


def check_core_alone(env_dir: Path, out: IO[str]) -> None:
    proc = subprocess.run([str(env_dir / "bin" / "gem-train"), "run"], capture_output=True, text=True)
    out.write(proc.stderr)
    wanted = [f"provided by {p}, which is not installed" for p in ALL_PACKAGES[1:]]
    if proc.returncode != 2 or not all(w in proc.stderr for w in wanted):
        raise SystemExit(f"core alone: `gem-train run` exited {proc.returncode}; expected 2 naming every provider")


def free_disk(path: Path) -> str:
    """The free space on ``path``'s file system, in words (every environment takes 1-2.1 GB)."""
    while not path.exists():
        path = path.parent
    return f"{shutil.disk_usage(path).free / 2**30:.1f} GiB free on the disk of {path}"


def run_env(name: str, pytest_args: list[str], out: IO[str], keep: bool = False) -> dict[str, object]:
    """Install environment ``name`` afresh, check its plugins, run its selection; fails on any skip.
    The environment is deleted afterwards (its log and report stay) unless ``keep``: six at once take
    ~9 GB, two at a time at most ~3.5 GB."""
    spec, env_dir = MATRIX[name], ROOT / ".venvs" / name
    try:
        return install_and_test(name, spec, env_dir, pytest_args, out)
    except (SystemExit, subprocess.CalledProcessError, OSError) as exc:
        raise SystemExit(f"{exc} ({free_disk(env_dir)})") from exc
    finally:
        if not keep:
            shutil.rmtree(env_dir, ignore_errors=True)


def install_and_test(name: str, spec: MatrixEnv, env_dir: Path, pytest_args: list[str], out: IO[str]) -> dict[str, object]:
    start = time.time()
    log(f"==== {name}: installing {' '.join(spec.packages)} into a fresh environment ({free_disk(env_dir)})", out)
    setup(env_dir, spec.packages, editable=False, extras=spec.extras, fresh=True, optional=spec.optional, out=out)
    installed = time.time()
    expected = {p for p in spec.packages if p.startswith("gem-")} | ({"gem-plugin-example"} if EXAMPLE in spec.packages else set())
    found = plugin_distributions(env_dir, out)
    if found != expected:
        raise SystemExit(f"{name}: gem-train plugins shows {sorted(found)}, expected {sorted(expected)}")
    if spec.core_alone:
        check_core_alone(env_dir, out)
    rc, outcome = run_pytest(env_dir, name, pytest_args, LOGS / f"{name}.xml", out)
    problems = [f"pytest exited {rc}"] if rc else []
    if outcome.unreadable:
        problems.append(f"pytest's report is unreadable: {outcome.unreadable}; {free_disk(env_dir)}")
    if outcome.skipped:  # a skip hides code that nothing tested: the owner must install what the test needs
        problems.append(f"{len(outcome.skipped)} test(s) skipped in the environment that owns them:")
        problems += [f"  {s}" for s in outcome.skipped]
    for p in problems:
        log(f"{name}: {p}", out)
    return {
        "env": name, "ok": not problems, "install_s": round(installed - start, 1), "test_s": round(time.time() - installed, 1),
        "passed": outcome.passed, "skipped": len(outcome.skipped), "failed": outcome.failed, "plugins": sorted(found),
        "slowest": sorted(outcome.durations, reverse=True)[:20],
    }  # fmt: skip


def in_parallel(names: list[str], job, jobs: int, prefix: str = "") -> list[dict[str, object]]:
    """``job(name, out)`` for every name, ``jobs`` at a time; each one's output, kept in
    ``.venvs/logs/<prefix><name>.log``, printed whole when it ends."""
    LOGS.mkdir(parents=True, exist_ok=True)
    lock = threading.Lock()

    def one(name: str) -> dict[str, object]:
        path = LOGS / f"{prefix}{name}.log"
        with path.open("w") as out:
            try:
                result = job(name, out)
            except (SystemExit, Exception) as exc:  # one environment's failure, reported; the others go on
                log(f"{name}: FAILED: {type(exc).__name__}: {exc}", out)
                result = {"env": name, "ok": False, "error": str(exc)}
        with lock:
            print(f"\n{'=' * 30} {name}: {'pass' if result['ok'] else 'FAIL'} ({path.relative_to(ROOT)}) {'=' * 30}")
            print(path.read_text(), flush=True)
        return result

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(one, names))


def report(results: list[dict[str, object]], wall: float, what: str) -> None:
    log(f"{'environment':<16} {'result':<7} {'install s':>10} {'tests s':>9} {'passed':>7} {'skipped':>8} {'failed':>7}")
    for r in results:
        cells = [str(r.get(k, "-")) for k in ("install_s", "test_s", "passed", "skipped", "failed")]
        log(f"{r['env']:<16} {'pass' if r['ok'] else 'FAIL':<7} {cells[0]:>10} {cells[1]:>9} {cells[2]:>7} {cells[3]:>8} {cells[4]:>7}")
    slowest = sorted(((t, f"{r['env']}: {test}") for r in results for t, test in r.get("slowest", [])), reverse=True)
    if slowest:
        log("the 20 slowest tests (setup + call + teardown):")
        for t, test in slowest[:20]:
            log(f"  {t:7.1f} s  {test}")
    log(f"{what}: {wall:.0f} s")


def matrix(only: list[str] | None, pytest_args: list[str], jobs: int = 2, keep: bool = False) -> int:
    names = only or list(MATRIX)
    unknown = [n for n in names if n not in MATRIX]
    if unknown:
        raise SystemExit(f"unknown matrix environment(s) {unknown}; available: {list(MATRIX)}")
    for folder in test_folders():
        owner(folder)  # every test folder has its environment before anything is installed
    start = time.time()
    results = in_parallel(names, lambda name, out: run_env(name, pytest_args, out, keep), jobs)
    report(results, time.time() - start, "whole matrix")
    (ROOT / ".venvs" / "matrix.json").write_text(json.dumps(results, indent=1))
    return 0 if all(r["ok"] for r in results) else 1


def quick(env_dir: Path, pytest_args: list[str], jobs: int = 2) -> int:
    """The fast tests (neither ``slow`` nor ``multiprocess``) of every environment's selection, in the one
    full environment ``env_dir`` (made with ``envs.py setup ENV --all`` when missing)."""
    if not (env_dir / "bin" / "python").exists():
        setup(env_dir, [*ALL_PACKAGES, EXAMPLE], editable=True, extras=[*DATA, "hatch"], fresh=False, optional=True)

    def job(name: str, out: IO[str]) -> dict[str, object]:
        start = time.time()
        rc, outcome = run_pytest(env_dir, name, ["-m", QUICK, *pytest_args], LOGS / f"quick-{name}.xml", out)
        return {
            "env": name, "ok": rc in (0, 5), "test_s": round(time.time() - start, 1), "passed": outcome.passed,
            "skipped": len(outcome.skipped), "failed": outcome.failed, "slowest": sorted(outcome.durations, reverse=True)[:20],
        }  # fmt: skip

    start = time.time()
    results = in_parallel(list(MATRIX), job, jobs, prefix="quick-")
    report(results, time.time() - start, f"fast tests of every environment in {env_dir}")
    return 0 if all(r["ok"] for r in results) else 1
