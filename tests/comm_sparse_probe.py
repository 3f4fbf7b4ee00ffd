"""A GEM_PLUGINS module for the sparse-dist run of test_comm_through_planner.py: gem-comm's
``sparse_dist`` pipeline, unchanged, plus a record of where torchrec's input distribution stands
around each stage, written after every step to ``$SPARSE_PROBE_DIR/rank<r>.json``. Registered as
``sparse_dist_probe``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, ClassVar

from gem_comm.sparse_dist import SparseDistPipeline
from gem_model import hookimpl


class ProbedSparseDist(SparseDistPipeline):
    name: ClassVar[str] = "sparse_dist_probe"

    def setup(self, **kwargs: Any) -> None:
        super().setup(**kwargs)
        self.records: list[dict[str, Any]] = []

    def _state(self) -> dict[str, Any]:
        tr = self.torchrec
        nxt = tr.contexts[1] if len(tr.contexts) > 1 else None
        return {
            "queued": len(tr.batches),
            # batch i's data all-to-alls, in flight until its forward takes them
            "current_requests": sorted(tr.contexts[0].input_dist_tensors_requests),
            # batch i+1's splits all-to-all, started before batch i's forward
            "next_splits_started": bool(nxt is not None and nxt.fused_splits_awaitables),
            # batch i+1's data all-to-alls, started between batch i's forward and backward
            "next_requests": sorted(nxt.input_dist_tensors_requests) if nxt is not None else [],
        }

    def forward_and_loss(self, batch: Any) -> object:
        before = self._state()
        out = super().forward_and_loss(batch)
        forwards = sorted(f"{type(m.forward).__name__}:{m.forward.name}" for m in self.torchrec._pipelined_modules)
        lookup = batch.lookup_sequence  # what the sequence lookup's input dist was given: the even bags
        self.records.append({"before_forward": before, "after_forward": self._state(), "forwards": forwards,
                             "batch_size": batch.batch_size, "lookup_stride": lookup.stride() if lookup else None})
        return out

    def backward(self, loss: Any) -> None:
        super().backward(loss)
        self.records[-1]["after_backward"] = self._state()

    def optimizer_step(self) -> None:
        super().optimizer_step()
        out = Path(os.environ["SPARSE_PROBE_DIR"]) / f"rank{self.layout.rank}.json"
        out.write_text(json.dumps(self.records))


@hookimpl
def gem_register_train_pipelines():
    return [ProbedSparseDist]
