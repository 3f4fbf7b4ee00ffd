"""Storage failures, named: no space, permission denied, a read-only file system, a file in the way.

The output directory is tried before the model is built (:func:`check_writable`: a small file is
written, synced and removed), so a run that could never write its checkpoints stops at once with
exit 2. A checkpoint that fails to write later (the disk fills) is reported by
:func:`describe_failure`: the step, the path, the cause (the OS error where one is in the chain,
else the library's own message) and the free space there.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import socket
from pathlib import Path

from gem_model.errors import ConfigError

CAUSES = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.EROFS: "a read-only file system",
    errno.EEXIST: "a file is in the way",
    errno.ENOTDIR: "a file is in the way (a path component is not a directory)",
    errno.EFBIG: "a file grew past the largest size allowed",
    errno.EIO: "an input/output error of the device",
}
_PROBE_BYTES = 4096


def free_space(path: Path) -> str:
    """The free space of the file system holding ``path`` (or its nearest existing parent)."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        usage = shutil.disk_usage(probe if probe.is_dir() else probe.parent)
    except OSError as exc:
        return f"unknown ({exc.strerror})"
    return f"{_size(usage.free)} free of {_size(usage.total)}"


def _size(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _failures(exc: BaseException) -> list[tuple[int | None, BaseException]]:
    """(rank, exception) of each failure DCP's ``CheckpointException`` gathered; else ``exc`` itself."""
    failures = getattr(exc, "failures", None)
    if not isinstance(failures, dict):
        return [(None, exc)]
    found = [(rank, f[0] if isinstance(f, tuple) else f) for rank, f in sorted(failures.items())]
    return [(rank, e) for rank, e in found if isinstance(e, BaseException)] or [(None, exc)]


def os_error(exc: BaseException) -> OSError | None:
    """The first :class:`OSError` with an errno in ``exc``'s chain (causes and contexts)."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            return e
        todo += [e.__cause__, e.__context__]
    return None


def cause(exc: BaseException) -> str:
    """What went wrong, in words: the OS error's meaning where the chain has one (on the first rank
    that failed, when DCP gathered the ranks' failures)."""
    failures = _failures(exc)
    rank, first = failures[0]
    where = "" if rank is None else f"on rank {rank}{f' (and {len(failures) - 1} more)' if len(failures) > 1 else ''}: "
    oserr = os_error(first)
    if oserr is not None:
        meaning = CAUSES.get(oserr.errno or 0, oserr.strerror or "")
        name = f" ({oserr.filename})" if oserr.filename else ""
        return f"{where}{meaning} [{errno.errorcode.get(oserr.errno or 0, oserr.errno)}]{name}"
    line = (str(first).strip().splitlines() or [""])[0][:300]
    return f"{where}{type(first).__name__}: {line}"


def describe_failure(exc: BaseException, *, step: int, path: Path) -> str:
    return (
        f"the checkpoint of step {step} could not be written to {path}: {cause(exc)}; "
        f"the file system there has {free_space(path)}"
    )


def _write_probe(probe: Path) -> None:
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, b"\0" * _PROBE_BYTES)
        os.fsync(fd)
    finally:
        os.close(fd)
    probe.unlink()


def check_writable(out: Path) -> None:
    """Create ``out`` and write, sync and remove a small file in it; a failure is a
    :class:`ConfigError` on ``trainer.output_dir`` naming the path, the cause and the free space."""
    probe = out / f".writable-{socket.gethostname()}-{os.getpid()}"
    try:
        out.mkdir(parents=True, exist_ok=True)
        _write_probe(probe)
    except OSError as exc:
        with contextlib.suppress(OSError):
            probe.unlink(missing_ok=True)
        raise ConfigError(
            [
                (
                    "trainer.output_dir",
                    str(out),
                    f"cannot be written: {cause(exc)}; the file system there has {free_space(out)}. Choose a "
                    "writable trainer.output_dir (nothing was built)",
                )
            ]
        ) from None
