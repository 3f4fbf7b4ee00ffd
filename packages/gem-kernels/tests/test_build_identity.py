"""gem_kernels.build_identity: dumps of the Gluon attention builds' SASS and resources, and their
comparison. Gluon has no interpreter, so the dumps compile for sm_90 in a subprocess without
``TRITON_INTERPRET`` (as test_attention_gluon.py does), two small builds each, each dump with a Triton
cache of its own so that the second one compiles again rather than reading the first one's cubins."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")

from gem_kernels.build_identity import compare, dump, find_nvdisasm, main

ONLY = "^(fwd_m64n16_64x64_t0|dkdv_n64m16_64x64_t1)$"
NAMES = ["dkdv_n64m16_64x64_t1", "fwd_m64n16_64x64_t0"]


def run_cli(*args: str, cache: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(cache),
           "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # fmt: skip
    return subprocess.run([sys.executable, "-m", "gem_kernels.build_identity", *args], capture_output=True,
                          text=True, env=env, timeout=300)  # fmt: skip


@pytest.fixture(scope="module")
def dumps(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The two builds dumped twice, by the CLI, each time with an empty Triton cache."""
    pytest.importorskip("triton.backends.nvidia")
    root = tmp_path_factory.mktemp("build_identity")
    for side in ("a", "b"):
        result = run_cli("dump", str(root / side), "--only", ONLY, "--jobs", "2" if side == "a" else "1",
                         cache=root / f"cache_{side}")  # fmt: skip
        assert result.returncode == 0, result.stdout + result.stderr[-4000:]
        assert f"dumped 2 builds into {root / side}" in result.stdout, result.stdout
        assert sorted(os.listdir(root / f"cache_{side}")), "the dump compiled into its own cache"
    return root / "a", root / "b"


def test_a_dump_holds_each_builds_sass_without_addresses_and_its_resources(dumps: tuple[Path, Path]) -> None:
    a, _ = dumps
    assert sorted(os.listdir(a)) == sorted(f"{n}.{ext}" for n in NAMES for ext in ("json", "sass"))
    forward = (a / "fwd_m64n16_64x64_t0.sass").read_text()
    assert "forward_kernel:" in forward and "EXIT" in forward and "HGMMA" in forward
    assert "/*0000*/" not in forward  # addresses stripped
    assert "dkdv_kernel:" in (a / "dkdv_n64m16_64x64_t1.sass").read_text()
    for name in NAMES:
        resources = json.loads((a / f"{name}.json").read_text())
        assert set(resources) == {"registers", "stack_bytes", "shared_bytes"}
        assert 32 <= resources["registers"] <= 255 and resources["shared_bytes"] > 16 * 1024, resources


def test_the_same_source_dumped_twice_compares_identical(dumps: tuple[Path, Path]) -> None:
    comparison = compare(*dumps)
    assert comparison.same and comparison.identical == NAMES, comparison


def test_an_edited_or_missing_file_shows_in_the_comparison(dumps: tuple[Path, Path], tmp_path: Path) -> None:
    a, b = dumps
    edited = tmp_path / "edited"
    shutil.copytree(b, edited)
    sass = edited / "fwd_m64n16_64x64_t0.sass"
    lines = sass.read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if line.strip().startswith("HGMMA"))
    lines[at] = lines[at].replace("HGMMA", "NOP ; HGMMA")
    sass.write_text("\n".join(lines) + "\n")
    comparison = compare(a, edited)
    assert not comparison.same and comparison.identical == ["dkdv_n64m16_64x64_t1"], comparison
    assert list(comparison.different) == ["fwd_m64n16_64x64_t0"]
    assert comparison.different["fwd_m64n16_64x64_t0"][0].startswith(f"sass line {at + 1}:"), comparison

    resources = edited / "dkdv_n64m16_64x64_t1.json"
    resources.write_text(json.dumps({**json.loads(resources.read_text()), "registers": 255}))
    (edited / "fwd_m64n16_64x64_t0.json").unlink()  # the edited SASS is not compared without its json
    comparison = compare(a, edited)
    assert comparison.missing_in_b == ["fwd_m64n16_64x64_t0"] and comparison.missing_in_a == []
    assert list(comparison.different) == ["dkdv_n64m16_64x64_t1"] and not comparison.identical
    registers = json.loads((a / "dkdv_n64m16_64x64_t1.json").read_text())["registers"]
    assert comparison.different["dkdv_n64m16_64x64_t1"] == [f"registers {registers} in A, 255 in B"]
    # the other way round, and restricted to one name
    assert compare(edited, a).missing_in_a == ["fwd_m64n16_64x64_t0"]
    assert compare(a, edited, only="^fwd").missing_in_b == ["fwd_m64n16_64x64_t0"]
    assert compare(a, edited, only="^fwd").different == {}


def test_compare_exits_0_when_identical_1_on_a_difference_2_on_bad_input(
        dumps: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    a, b = dumps
    assert main(["compare", str(a), str(b)]) == 0
    assert "2 identical, 0 different, 0 missing in A, 0 missing in B" in capsys.readouterr().out

    partial = tmp_path / "partial"
    shutil.copytree(b, partial)
    (partial / "dkdv_n64m16_64x64_t1.sass").unlink()
    assert main(["compare", str(a), str(partial)]) == 1
    out = capsys.readouterr().out
    assert f"MISSING in B ({partial}): dkdv_n64m16_64x64_t1" in out and "1 identical" in out, out

    for bad, message in ((tmp_path / "nowhere", "is not a directory"), (tmp_path, "holds no dump")):
        assert main(["compare", str(a), str(bad)]) == 2
        err = capsys.readouterr().err
        assert f"B: {bad} {message}" in err, err
    assert main(["compare", str(a), str(b), "--only", "("]) == 2
    assert "is not a regular expression" in capsys.readouterr().err


def test_dump_refuses_bad_input_before_compiling(dumps: tuple[Path, Path], tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    a, _ = dumps
    for args, message in ((["--only", "^nothing$"], "matches no build (names read like fwd_m128n64_128x128_t1)"),
                          (["--jobs", "0"], "--jobs must be at least 1")):  # fmt: skip
        assert main(["dump", str(tmp_path / "out"), *args]) == 2
        assert message in capsys.readouterr().err
    assert main(["dump", str(a)]) == 2
    assert f"{a} already holds a dump (4 .sass/.json files)" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    # this process interprets Triton: dump says so rather than compiling nothing
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=0"):
        dump(tmp_path / "out", only=ONLY)


def test_nvdisasm_comes_from_the_installed_triton_or_says_where_it_looked(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:  # fmt: skip
    import triton

    from gem_kernels import compile_report

    monkeypatch.delenv("TRITON_NVDISASM_PATH", raising=False)
    assert Path(find_nvdisasm()) == Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    monkeypatch.setattr(compile_report, "bundled_tool", lambda name: str(tmp_path / "bin" / name))
    monkeypatch.setenv("TRITON_NVDISASM_PATH", str(tmp_path / "mine"))
    with pytest.raises(FileNotFoundError) as error:
        find_nvdisasm()
    assert f"no executable at {tmp_path / 'mine'} or {tmp_path / 'bin' / 'nvdisasm'}" in str(error.value)
