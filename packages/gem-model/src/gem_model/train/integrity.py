"""Checkpoint integrity: a manifest with a checksum per file, written last, verified before loading.

:meth:`~gem_model.train.checkpoint.Checkpointer.save` writes a checkpoint into
``step_N.partial/``, then ``manifest.json`` (every file's size and SHA-256), then renames the
folder to ``step_N/``. A resume verifies the newest checkpoint's manifest before any tensor is
read; a checkpoint with no manifest (a save that never finished), a missing, truncated or damaged
file, or an unreadable manifest is reported file by file and passed over
(:func:`gem_model.train.resume.choose`), and the newest checkpoint that verifies is loaded instead,
saying so.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

MANIFEST = "manifest.json"
PARTIAL = ".partial"
_CHUNK = 1 << 20


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(directory: Path) -> None:
    """Record every file of ``directory`` (size, SHA-256) in its ``manifest.json``, durably, last."""
    entries = {
        str(p.relative_to(directory)): {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in _files(directory)
    }
    target = directory / MANIFEST
    with target.open("w") as fh:
        json.dump({"files": entries}, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())


def verify(directory: Path) -> list[str]:
    """What is wrong with the checkpoint ``directory``, one line per file; empty when it verifies."""
    manifest = directory / MANIFEST
    if not manifest.is_file():
        return [f"{manifest.name}: missing (the save never finished, or it predates manifests)"]
    try:
        entries = json.loads(manifest.read_text()).get("files")
    except (ValueError, AttributeError, UnicodeDecodeError):
        entries = None
    if not isinstance(entries, dict) or not entries:
        return [f"{manifest.name}: unreadable or empty"]
    problems = []
    for name, entry in sorted(entries.items()):
        path = directory / name
        if not path.is_file():
            problems.append(f"{name}: missing")
            continue
        size = path.stat().st_size
        if size != entry.get("bytes"):
            problems.append(f"{name}: {size} bytes, the manifest says {entry.get('bytes')} (truncated or grown)")
        elif _sha256(path) != entry.get("sha256"):
            problems.append(f"{name}: its SHA-256 differs from the manifest's (damaged)")
    return problems


def step_dirs(root: Path) -> list[Path]:
    """The checkpoint folders under ``root`` that a save finished renaming, oldest first."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_") and not p.name.endswith(PARTIAL))
