"""The sequence lookup in even bags (``model.lookup_bags_per_sample``) through torchrec's sharded tables:
FBGEMM's fused TBE on the CPU, one gloo rank. The same rows come back and the fused table update is
the same, bit for bit, as with the batch's own bags."""

from __future__ import annotations

import torch
import torch.distributed as dist
from sharded_cases import sharded_model, table_weights  # beside this file

from gem_model.data.batch import SEQUENCE_KEYS
from gem_model.data.synthetic import SyntheticConfig, SyntheticSource


def test_even_bags_give_the_sharded_lookup_and_its_fused_update_the_same_numbers(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        source = SyntheticSource(SyntheticConfig(max_len=47, num_negatives=5, length_exponent=0.3))
        batch = source.make_batch(0, 6, torch.arange(6))
        whole, even = sharded_model(source, None), sharded_model(source, 3)
        before = table_weights(whole)
        assert before.keys() == table_weights(even).keys()
        assert all(torch.equal(before[k], v) for k, v in table_weights(even).items())  # the same seed: the same tables
        grads = None
        outs = {}
        for name, model in (("whole", whole), ("even", even)):
            seq, _ = model.sparse(batch.sequence, batch.pooled)
            outs[name] = seq
            if grads is None:  # fresh random gradients, the same for both
                g = torch.Generator().manual_seed(5)
                grads = {k: torch.randn(jt.values().shape, generator=g) for k, jt in seq.items()}
            torch.autograd.backward([seq[k].values() for k in grads], [grads[k] for k in grads])
        for key in SEQUENCE_KEYS:
            w, e = outs["whole"][key], outs["even"][key]
            assert torch.equal(w.values(), e.values()), key
            assert torch.equal(e.lengths(), batch.sequence[key].lengths()), key  # the batch's own bags
        after_whole, after_even = table_weights(whole), table_weights(even)
        assert any(not torch.equal(before[k], after_whole[k]) for k in before)  # the fused update ran
        for k in before:
            assert torch.equal(after_whole[k], after_even[k]), k
    finally:
        dist.destroy_process_group()
