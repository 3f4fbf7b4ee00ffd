"""Show on a CPU that a change leaves the Gluon attention kernels' compiled code as it was.

``dump`` compiles every Gluon attention config for sm_90 (Triton needs no GPU for that) and writes two
files a config: ``<name>.sass``, the cubin's instructions as ``nvdisasm`` prints them with the
instruction addresses taken out, and ``<name>.json``, its registers a thread, spill stack and shared
bytes. ``compare`` reads two such dumps and lists the configs whose code or resources differ, and those
that one side lacks. Around a refactor of the kernels::

    TRITON_INTERPRET=0 python -m gem_kernels.build_identity dump /tmp/before   # at the old commit
    TRITON_INTERPRET=0 python -m gem_kernels.build_identity dump /tmp/after    # at the new one
    python -m gem_kernels.build_identity compare /tmp/before /tmp/after        # exit 0: all identical

The configs are each pass's: the forward's ``CONFIGS`` (``ws_*`` ones by the warp-specialized kernel),
``DQ_CONFIGS``, ``DKDV_CONFIGS`` and the ``dk``/``dv`` configs that can store their ``ds`` tiles, at head
dims 128/128, 64/64 and 64/128, with and without targets: 168 builds with today's tables. Names read
``fwd_m64n64_128x128_t1`` (pass, config, head dims, targets), with ``_store`` for a stored-``ds`` build;
``--only REGEX`` keeps the names it matches (in ``compare`` too: a partial dump against a whole one).
Triton's cache serves a build whose kernel source and options it has seen; a changed kernel compiles
afresh. ``compare`` exits 0 when every config is identical, 1 on any difference or missing config, 2 on
bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

HEAD_DIMS = ((128, 128), (64, 64), (64, 128))
"""The (q/k, v) head dims every config is built at."""
RESOURCES = ("registers", "stack_bytes", "shared_bytes")
"""The fields of a ``.json`` that ``compare`` checks."""


@dataclass(frozen=True)
class Build:
    """One Gluon attention build: a pass, its config, head dims, targets or not, and for ``dkdv`` whether
    it stores its ``ds`` tiles."""

    kind: Literal["fwd", "dq", "dkdv"]
    config: str
    dim_qk: int
    dim_v: int
    targets: bool
    store_ds: bool = False

    @property
    def name(self) -> str:
        name = f"{self.kind}_{self.config}_{self.dim_qk}x{self.dim_v}_t{int(self.targets)}"
        return name + ("_store" if self.store_ds else "")


@dataclass(frozen=True)
class DumpResult:
    """What a ``dump`` wrote: the builds' names, those that failed (name: the error) and its seconds."""

    written: list[str]
    failed: dict[str, str]
    seconds: float


@dataclass(frozen=True)
class Comparison:
    """Two dumps side by side: the configs alike in both, those that differ (name: what differs), and
    those without both their files on one side."""

    identical: list[str] = field(default_factory=list)
    different: dict[str, list[str]] = field(default_factory=dict)
    missing_in_a: list[str] = field(default_factory=list)
    missing_in_b: list[str] = field(default_factory=list)

    @property
    def same(self) -> bool:
        return not (self.different or self.missing_in_a or self.missing_in_b)


def builds(only: str | None = None) -> list[Build]:
    """Every Gluon attention build, or those whose name ``only`` (a regular expression) matches."""
    from gem_kernels import attention_gluon as ag

    every: list[Build] = []
    for dim_qk, dim_v in HEAD_DIMS:
        for targets in (True, False):
            every += [Build("fwd", c, dim_qk, dim_v, targets) for c in ag.CONFIGS]
            every += [Build("dq", c, dim_qk, dim_v, targets) for c in ag.DQ_CONFIGS]
            every += [Build("dkdv", c, dim_qk, dim_v, targets) for c in ag.DKDV_CONFIGS]
            every += [Build("dkdv", c, dim_qk, dim_v, targets, store_ds=True) for c in ag.DKDV_CONFIGS
                      if ag.stores_ds(c)]  # fmt: skip
    return every if only is None else [b for b in every if _pattern(only).search(b.name)]


def _pattern(only: str) -> re.Pattern[str]:
    try:
        return re.compile(only)
    except re.error as e:
        raise ValueError(f"--only {only!r} is not a regular expression: {e}") from None


def find_nvdisasm() -> str:
    """``nvdisasm``: where ``TRITON_NVDISASM_PATH`` points (as Triton reads it), else the one the installed
    Triton ships in ``triton/backends/nvidia/bin``."""
    from gem_kernels.compile_report import bundled_tool

    looked = [p for p in (os.environ.get("TRITON_NVDISASM_PATH"), bundled_tool("nvdisasm")) if p]
    for path in looked:
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    raise FileNotFoundError("nvdisasm not found (no executable at " + " or ".join(looked) + "); install "
                            "Triton with its NVIDIA backend or set TRITON_NVDISASM_PATH")  # fmt: skip


def strip_addresses(sass: str) -> str:
    """``nvdisasm -c`` output without instruction addresses (``/*0a30*/``), comments, debug section
    headers and blank lines: what stays is the same text wherever the same code was built."""
    lines = []
    for line in sass.splitlines():
        line = re.sub(r"/\*[0-9a-f]{4,}\*/", "", line).rstrip()
        if line.strip() and not line.strip().startswith(("//", ".section .debug")):
            lines.append(line)
    return "\n".join(lines) + "\n"


def dump_one(build: Build, outdir: Path, nvdisasm: str) -> str | None:
    """Compile ``build`` and write its ``.sass`` and ``.json`` into ``outdir``; the error, if it failed."""
    from gem_kernels.compile_report import build_gluon, cubin_usage, run_on_cubin

    try:
        compiled = build_gluon(build.config, build.dim_qk, build.dim_v, targets=build.targets,
                               dq=build.kind == "dq", dkdv=build.kind == "dkdv", store_ds=build.store_ds).compiled  # fmt: skip
        cubin = compiled.asm["cubin"]
        sass = run_on_cubin([nvdisasm, "-c"], cubin, check=True).stdout
    except subprocess.CalledProcessError as e:
        return f"nvdisasm failed ({e.returncode}): {e.stderr.strip()[:500]}"
    except Exception as e:  # a config that no longer compiles is reported, the others still dumped
        return f"{type(e).__name__}: {str(e)[:500]}"
    (outdir / f"{build.name}.sass").write_text(strip_addresses(sass))
    resources = {**cubin_usage(cubin), "shared_bytes": compiled.metadata.shared}
    (outdir / f"{build.name}.json").write_text(json.dumps(resources, indent=1, sort_keys=True) + "\n")
    return None


def dump(outdir: str | Path, only: str | None = None, jobs: int = 1,
         progress: Callable[[str, str | None], None] | None = None) -> DumpResult:  # fmt: skip
    """Compile the builds ``only`` selects (all without it) in ``jobs`` processes and write their files
    into ``outdir`` (created; it must hold no earlier dump). ``progress(name, error)`` hears of each build
    as it finishes. Needs Triton compiling, not interpreting (``TRITON_INTERPRET`` unset or 0)."""
    from gem_kernels.availability import interpreter_enabled

    if jobs < 1:
        raise ValueError(f"--jobs must be at least 1, not {jobs}")
    selected = builds(only)
    if not selected:
        raise ValueError(f"--only {only!r} matches no build (names read like {builds()[0].name})")
    out = Path(outdir)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"{out} is a file, not a directory")
    earlier = [*out.glob("*.sass"), *out.glob("*.json")] if out.exists() else []
    if earlier:
        raise FileExistsError(f"{out} already holds a dump ({len(earlier)} .sass/.json files): pick a new "
                              "directory or empty this one")  # fmt: skip
    if interpreter_enabled():
        raise RuntimeError("TRITON_INTERPRET is on: the interpreter replaces the kernels dump compiles; "
                           "run with TRITON_INTERPRET=0")  # fmt: skip
    nvdisasm = find_nvdisasm()
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    failed: dict[str, str] = {}

    def record(name: str, error: str | None) -> None:
        if error is not None:
            failed[name] = error
        if progress is not None:
            progress(name, error)

    if jobs == 1:
        for build in selected:
            record(build.name, dump_one(build, out, nvdisasm))
    else:
        with ProcessPoolExecutor(jobs) as pool:
            futures = {pool.submit(dump_one, build, out, nvdisasm): build.name for build in selected}
            for future in as_completed(futures):
                record(futures[future], future.result())
    written = [b.name for b in selected if b.name not in failed]
    return DumpResult(written, failed, time.perf_counter() - start)


def _files(directory: Path, label: str) -> tuple[set[str], set[str]]:
    """The names with a ``.sass`` and those with a ``.json`` file in a dump directory."""
    if not directory.is_dir():
        raise FileNotFoundError(f"{label}: {directory} is not a directory")
    sass = {p.stem for p in directory.glob("*.sass")}
    resources = {p.stem for p in directory.glob("*.json")}
    if not sass and not resources:
        raise FileNotFoundError(f"{label}: {directory} holds no dump (no .sass or .json files)")
    return sass, resources


def _resources(path: Path) -> dict[str, object]:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not JSON: {e}") from None
    return {key: data.get(key) for key in RESOURCES}


def _sass_difference(a: str, b: str) -> str:
    """Where two SASS texts part: the first line that differs, or which one is longer."""
    lines_a, lines_b = a.splitlines(), b.splitlines()
    for i, (line_a, line_b) in enumerate(zip(lines_a, lines_b)):
        if line_a != line_b:
            return f"sass line {i + 1}: {line_a.strip()!r} in A, {line_b.strip()!r} in B"
    return f"sass: {len(lines_a)} lines in A, {len(lines_b)} in B"


def compare(a_dir: str | Path, b_dir: str | Path, only: str | None = None) -> Comparison:
    """Compare two dumps: each config's SASS text and its registers, spill stack and shared bytes. A
    config lacking its ``.sass`` or ``.json`` on one side is missing there, and not compared. ``only``
    (a regular expression) keeps the names it matches: a partial dump against a whole one."""
    a, b = Path(a_dir), Path(b_dir)
    (sass_a, json_a), (sass_b, json_b) = _files(a, "A"), _files(b, "B")
    names = sass_a | json_a | sass_b | json_b
    if only is not None:
        names = {name for name in names if _pattern(only).search(name)}
    complete_a, complete_b = sass_a & json_a & names, sass_b & json_b & names
    result = Comparison(missing_in_a=sorted(names - complete_a), missing_in_b=sorted(names - complete_b))
    for name in sorted(complete_a & complete_b):
        differences = []
        text_a, text_b = (a / f"{name}.sass").read_text(), (b / f"{name}.sass").read_text()
        if text_a != text_b:
            differences.append(_sass_difference(text_a, text_b))
        used_a, used_b = _resources(a / f"{name}.json"), _resources(b / f"{name}.json")
        differences += [f"{key} {used_a[key]} in A, {used_b[key]} in B" for key in RESOURCES
                        if used_a[key] != used_b[key]]  # fmt: skip
        if differences:
            result.different[name] = differences
        else:
            result.identical.append(name)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gem_kernels.build_identity", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    commands = parser.add_subparsers(dest="command", required=True)
    dumping = commands.add_parser("dump", help="compile the Gluon attention builds and write their SASS")
    dumping.add_argument("outdir", type=Path)
    dumping.add_argument("--only", metavar="REGEX", help="only the builds whose name this matches")
    dumping.add_argument("--jobs", type=int, default=1, help="processes compiling at once (default 1)")
    comparing = commands.add_parser("compare", help="compare two dumps; exit 1 on any difference")
    comparing.add_argument("a", type=Path)
    comparing.add_argument("b", type=Path)
    comparing.add_argument("--only", metavar="REGEX", help="only the configs whose name this matches")
    args = parser.parse_args(argv)
    try:
        if args.command == "dump":
            result = dump(args.outdir, args.only, args.jobs,
                          progress=lambda name, error: print(name, error or "ok", flush=True))  # fmt: skip
            print(f"dumped {len(result.written)} builds into {args.outdir} in {result.seconds:.1f} s"
                  + (f"; {len(result.failed)} failed: {', '.join(sorted(result.failed))}" if result.failed else ""))  # fmt: skip
            return 1 if result.failed else 0
        comparison = compare(args.a, args.b, args.only)
    except (ValueError, RuntimeError, OSError) as e:
        print(f"build_identity: error: {e}", file=sys.stderr)
        return 2
    for name, differences in comparison.different.items():
        print(f"DIFFERENT {name}: " + "; ".join(differences))
    for side, names in (("A", comparison.missing_in_a), ("B", comparison.missing_in_b)):
        for name in names:
            print(f"MISSING in {side} ({args.a if side == 'A' else args.b}): {name}")
    print(f"{len(comparison.identical)} identical, {len(comparison.different)} different, "
          f"{len(comparison.missing_in_a)} missing in A, {len(comparison.missing_in_b)} missing in B")  # fmt: skip
    return 0 if comparison.same else 1


if __name__ == "__main__":
    sys.exit(main())
