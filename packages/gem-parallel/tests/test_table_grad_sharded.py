"""The sequence lookup's rows as views of one gradient buffer (``gem_model.table_grad``) through torchrec's sharded
tables: FBGEMM's fused TBE on the CPU, one gloo rank. The sparse arch recognises torchrec's split output, and
the fused table update is the same, bit for bit, as with autograd's gradients by feature."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from sharded_cases import sharded_model, table_weights  # beside this file

from gem_model.api import grad_section
from gem_model.data.batch import SEQUENCE_KEYS
from gem_model.data.synthetic import SyntheticConfig, SyntheticSource
from gem_model.model import embeddings


@pytest.mark.parametrize("bags", [None, 3], ids=["own-bags", "even-bags"])
def test_one_buffer_gives_the_sharded_tables_the_same_update(tmp_path, monkeypatch, bags):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        source = SyntheticSource(SyntheticConfig(max_len=47, num_negatives=5, length_exponent=0.3))
        batch = source.make_batch(0, 6, torch.arange(6))
        models = {flag: sharded_model(source, bags) for flag in (True, False)}
        g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
        grads = None
        for flag, model in models.items():
            monkeypatch.setattr(embeddings, "ONE_GRADIENT_BUFFER", flag)
            seq, _ = model.sparse(batch.sequence, batch.pooled)
            assert all((grad_section(seq[k].values()) is not None) is flag for k in SEQUENCE_KEYS)
            if grads is None:  # fresh random gradients, the same for both
                grads = {k: torch.randn(seq[k].values().shape, generator=g) for k in SEQUENCE_KEYS}
            # the history items twice, as the model reads them (the input and the loss's positives)
            uses = [seq[k].values() for k in SEQUENCE_KEYS] + [seq[SEQUENCE_KEYS[0]].values()]
            torch.autograd.backward(uses, [grads[k] for k in SEQUENCE_KEYS] + [grads[SEQUENCE_KEYS[0]] * 0.5])
        one, by_feature = (table_weights(m) for m in models.values())
        assert one.keys() == by_feature.keys()
        for k in one:
            assert torch.equal(one[k], by_feature[k]), k
    finally:
        dist.destroy_process_group()
