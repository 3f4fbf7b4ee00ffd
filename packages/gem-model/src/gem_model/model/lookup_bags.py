"""The sequence features re-split into even bags for the table lookup.

A sequence lookup (torchrec ``EmbeddingCollection``, FBGEMM's unpooled "nobag" TBE kernel on a GPU)
returns one row per id, in the order of the ids: the bags (one per sample and feature) do not change
what it returns, only how the kernel spreads the work. FBGEMM's nobag forward gives each bag one warp,
which walks the bag's ids one after another. With a few hundred samples whose histories run to thousands
of items, a few thousand warps do all the work and the longest history sets the time: on one H200 the big
config's item lookup (279k rows of 1024 floats) took 12.4 ms, where a gather of the same rows takes
1.0 ms; in 32 even bags per sample it takes 1.56 ms, and the whole training step is 1.050x faster
(``benchmarks/results/table_lookup.md``, ``e2e_ab.md``).

:func:`even_bags` hands the lookup the same ids in ``bags_per_sample`` times as many bags per feature,
each holding an equal share of the feature's ids (the last ones empty), so every bag is short and the
warps are many. The rows come back in the same order and are identical; the model keeps the batch's own
lengths (:func:`lengths_by_key`). The number of bags is the same on every rank (local batch size times
``bags_per_sample``), as the sharded lookup's all-to-all expects.
"""

from __future__ import annotations

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from gem_model.host_copy import to_device_async


def bag_sizes(length_per_key: list[int], bags: int) -> list[int]:
    """The ids per bag of each feature when its ``length_per_key`` ids are spread over ``bags`` bags:
    the fewest that fit (at least one, so a feature without ids still gets well-formed bags)."""
    if bags < 1:
        raise ValueError(f"even_bags: {bags} bags per feature; at least one is needed")
    return [max(1, -(-n // bags)) for n in length_per_key]


def even_bags(kjt: KeyedJaggedTensor, bags_per_sample: int) -> KeyedJaggedTensor:
    """``kjt``'s keys and ids (values and weights unchanged) in ``kjt.stride() * bags_per_sample`` bags per
    key; key ``k``'s ``n`` ids fill its bags in order, ``ceil(n / bags)`` to a bag.

    The lengths are built on ``kjt``'s device from the per-key counts, which a batch moved from the host
    carries (``gem_model.data.batch.kjt_to``), so no length is read back from the device.
    """
    if bags_per_sample < 1:
        raise ValueError(f"model.lookup_bags_per_sample is {bags_per_sample}; it must be at least 1")
    if kjt.variable_stride_per_key():
        raise ValueError("even_bags: the sequence KJT has a variable batch size per key, which it cannot re-split")
    bags = kjt.stride() * bags_per_sample
    counts = kjt.length_per_key()
    sizes = bag_sizes(counts, bags)
    device = kjt.lengths().device
    per_key = to_device_async(torch.tensor([counts, sizes], dtype=kjt.lengths().dtype), device)  # [2, F]
    start = torch.arange(bags, dtype=per_key.dtype, device=device) * per_key[1][:, None]  # [F, bags]
    lengths = torch.minimum((per_key[0][:, None] - start).clamp_(min=0), per_key[1][:, None])
    return KeyedJaggedTensor(
        keys=kjt.keys(),
        values=kjt.values(),
        weights=kjt.weights_or_none(),
        lengths=lengths.reshape(-1),
        stride=bags,
        length_per_key=list(counts),
        offset_per_key=kjt.offset_per_key(),
    )


def lengths_by_key(kjt: KeyedJaggedTensor) -> dict[str, torch.Tensor]:
    """Each key's lengths of ``kjt`` (views of its lengths tensor; no device work)."""
    if kjt.variable_stride_per_key():
        return {k: jt.lengths() for k, jt in kjt.to_dict().items()}
    return dict(zip(kjt.keys(), kjt.lengths().view(len(kjt.keys()), kjt.stride()), strict=True))
