"""torchrec qcomms for the embedding all-to-all on 2 gloo processes: what FBGEMM's CPU codecs run.

bf16 and fp16 halve the floating-point bytes of the all-to-all (forward embeddings and backward
gradients) and give the fp32 lookup's values to 16-bit rounding (bf16: relative 2**-8).
"""

from __future__ import annotations

import pytest
import torch

from gem_comm.quantized import QuantizedComm
from gem_model.distributed import DistEnv


@pytest.mark.multiprocess
def test_qcomms_cut_embedding_all_to_all_bytes(spawned):
    r = spawned(2)[0]["embedding"]
    fp32 = r["fp32"]["measured"]["embedding.all_to_all.bytes"]
    assert fp32 > 0
    for name, tol in (("bf16", 2**-7), ("fp16", 2**-10)):
        assert fp32 / r[name]["measured"]["embedding.all_to_all.bytes"] >= 1.8
        ref, got = r["fp32"]["pooled"], r[name]["pooled"]
        assert not torch.equal(ref, got)
        assert torch.allclose(ref, got, rtol=tol, atol=1e-6), (name, (ref - got).abs().max())


def test_fp8_is_refused_on_the_cpu_where_fbgemm_has_no_codec():
    comm = QuantizedComm(QuantizedComm.Config(embedding_backward="fp8", fp8_quantize_dim=8))
    comm.setup(DistEnv(0, 1, 0, torch.device("cpu"), None))
    with pytest.raises(ValueError, match="embedding_backward 'fp8' cannot run on the CPU"):
        comm.embedding_qcomms()
    unset = QuantizedComm(QuantizedComm.Config(embedding_forward="fp8", fp8_quantize_dim=8))  # no device known yet
    assert unset.embedding_qcomms().fp8_quantize_dim == 8


def test_qcomms_config_follows_the_options():
    from torchrec.distributed.fbgemm_qcomm_codec import CommType

    qc = QuantizedComm(QuantizedComm.Config(embedding_forward="fp16", embedding_backward="bf16")).embedding_qcomms()
    assert (qc.forward_precision, qc.backward_precision) == (CommType.FP16, CommType.BF16)
    with pytest.raises(ValueError, match="extra"):
        QuantizedComm.Config(embeding_forward="bf16")
