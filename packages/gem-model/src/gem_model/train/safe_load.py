"""Reading a checkpoint without running any of its code.

``torch.distributed.checkpoint`` keeps a checkpoint's index (``.metadata``) as a pickle and loads
every non-tensor value with ``torch.load(weights_only=False)``: a pickle can name any callable, so a
crafted checkpoint would run code the moment it is read. Here the index goes through
:class:`MetadataUnpickler`, which builds only DCP's own metadata classes, torch's dtype, layout and
memory-format constants and plain Python values, and refuses anything else before it is called;
non-tensor values load with ``weights_only=True`` (tensors, numbers, strings, lists, dicts, tuples);
tensors already do. A refusal is :class:`~gem_model.errors.UnsafeCheckpointError` naming the file
(``gem-train`` exits 2), and nothing of the file has run.
"""

from __future__ import annotations

import collections
import io
import pathlib
import pickle
import re
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from gem_model.errors import UnsafeCheckpointError

_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name): getattr(dcp_metadata, name)
    for name in (
        "Metadata", "StorageMeta", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING",
    )
}  # fmt: skip
_METADATA_CLASSES[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = _StorageInfo
_METADATA_CLASSES.update(
    {
        ("torch", "Size"): torch.Size,
        ("torch.serialization", "_get_layout"): torch.serialization._get_layout,  # a lookup by name
        ("collections", "OrderedDict"): collections.OrderedDict,
        ("pathlib", "PosixPath"): pathlib.PosixPath,  # the checkpoint_id DCP keeps
        ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
    }
)
_CONSTANT_TYPES = (torch.dtype, torch.layout, torch.memory_format)


class MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's checkpoint index and nothing else: every global the pickle names is looked up
    in an allow-list before anything is called."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = _METADATA_CLASSES.get((module, name))
        if allowed is not None:
            return allowed
        if module == "torch" and isinstance(getattr(torch, name, None), _CONSTANT_TYPES):
            return getattr(torch, name)  # torch.float32, torch.strided, torch.contiguous_format
        raise pickle.UnpicklingError(f"it names {module}.{name}, which a checkpoint's index never holds")


def _refuse(path: Path, exc: object) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"{path} is refused and nothing of it was run or loaded: {exc}. A checkpoint holds tensors, "
        "plain values and DCP's index only; one naming any other code was crafted or damaged. Remove it, "
        "or choose another trainer.output_dir"
    )


def read_metadata(directory: Path) -> Metadata:
    """The DCP index of the checkpoint ``directory``, read through :class:`MetadataUnpickler`."""
    path = directory / ".metadata"
    try:
        with path.open("rb") as fh:
            metadata = MetadataUnpickler(fh).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as exc:
        raise _refuse(path, exc) from None
    if not isinstance(metadata, Metadata):
        raise _refuse(path, TypeError(f"it holds a {type(metadata).__name__}, not DCP's Metadata"))
    return metadata


class SafeReader(FileSystemReader):
    """DCP's file reader with the index read by :func:`read_metadata`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise UnsafeCheckpointError(f"{self.path}: per-rank metadata files are not read by this run")
        metadata = read_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner with non-tensor values read by ``torch.load(weights_only=True)``."""

    def __init__(self, directory: Path, **kwargs: Any):
        super().__init__(**kwargs)
        self.directory = directory

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        key = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            raise _refuse(self.directory, f"the value of {key}: {_named_global(exc)}") from None
        if self.flatten_state_dict:  # as DefaultLoadPlanner.load_bytes places it
            set_element(self.original_state_dict, self.mappings[key], loaded)
        else:
            self.state_dict[key] = loaded


def _named_global(exc: BaseException) -> str:
    """torch's weights_only refusal, in a line: the global the value names (its message goes on to
    suggest ``weights_only=False``, which is exactly what must not happen here)."""
    found = re.search(r"GLOBAL ([\w.]+)", str(exc))
    if found:
        return f"it names {found.group(1)}, which a checkpoint's values never hold"
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


class _WholeLoadPlanner(_EmptyStateDictLoadPlanner, SafeLoadPlanner):
    """Every value of a checkpoint, rebuilt from its index, read as :class:`SafeLoadPlanner` reads."""


def read_whole(directory: Path) -> dict[str, Any]:
    """Every value of the checkpoint ``directory`` (sharded tables whole), in this process, without
    a process group and without running any of its code."""
    state: dict[str, Any] = {}
    _load_state_dict(
        state, storage_reader=SafeReader(str(directory)), planner=_WholeLoadPlanner(None, directory), no_dist=True
    )
    return state
