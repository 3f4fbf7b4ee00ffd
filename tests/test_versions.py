"""Each package's version lives in one place, hatch reads it, and its changelog has an entry for it."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["gem-model", "gem-kernels", "gem-precision", "gem-parallel", "gem-comm"]


def about_version(package: str) -> str:
    text = (ROOT / "packages" / package / "src" / package.replace("-", "_") / "__about__.py").read_text()
    return re.search(r'__version__ = "([^"]+)"', text).group(1)


@pytest.mark.parametrize("package", PACKAGES)
def test_changelog_has_the_current_version(package):
    changelog = (ROOT / "packages" / package / "CHANGELOG.md").read_text()
    assert f"## {about_version(package)} " in changelog


@pytest.mark.skipif(shutil.which("hatch") is None, reason="hatch is installed in the 'all' environment only")
@pytest.mark.parametrize("package", PACKAGES)
def test_hatch_version_reads_the_package_version(package):
    proc = subprocess.run(["hatch", "version"], cwd=ROOT / "packages" / package, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == about_version(package)


@pytest.mark.skipif(shutil.which("hatch") is None, reason="hatch is installed in the 'all' environment only")
def test_bumping_one_package_leaves_the_others(tmp_path):
    copy = tmp_path / "repo"
    shutil.copytree(ROOT / "packages", copy / "packages")
    subprocess.run(["hatch", "version", "minor"], cwd=copy / "packages" / "gem-comm", check=True, capture_output=True)
    versions = {p: (copy / "packages" / p / "src" / p.replace("-", "_") / "__about__.py").read_text() for p in PACKAGES}
    assert '"0.2.0"' in versions["gem-comm"]
    assert all('"0.1.0"' in v for p, v in versions.items() if p != "gem-comm")
