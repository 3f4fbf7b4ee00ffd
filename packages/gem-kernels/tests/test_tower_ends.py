"""A GEM model whose sequence tower's two ends run gem-kernels' ``triton`` kernels (``sequence_input``,
``sequence_pool``) against the same model on gem-model's ``torch`` ones: the same losses and parameter
gradients (float32, tolerance 1e-4 relative), with and without the context token. CPU, Triton's interpreter."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("triton")

from gem_kernels.sequence_input import TritonSequenceInput
from gem_kernels.sequence_pool import TritonSequencePool
from gem_model.testing import fake_run_context, random_jagged_batch


@pytest.mark.parametrize("context_token", [False, True])
def test_triton_ends_train_like_torch_ends(tmp_path, context_token):
    torch.manual_seed(7)
    flag = str(context_token).lower()
    run = fake_run_context("model.max_seq_len=17", f"model.context_token={flag}", f"model.scale_item_input={flag}",
                           output_dir=tmp_path)  # fmt: skip
    model = run.model  # the GemModel itself (inline_single), on gem-model's torch ends
    assert (model.input_kernel.name, model.pool_kernel.name) == ("torch", "torch")
    fused = copy.deepcopy(model)
    fused.input_kernel, fused.pool_kernel = TritonSequenceInput(), TritonSequencePool()
    batch = random_jagged_batch(5, max_len=15, seed=3)
    losses = []
    for m in (model, fused):
        m.eval()
        out = m(batch)
        loss = out.task_loss_sum + out.next_item_loss_sum
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(model.named_parameters(), fused.parameters(), strict=True):
        if p.grad is None:
            assert q.grad is None, name
            continue
        scale = max(p.grad.abs().max().item(), 1e-6)
        assert (q.grad - p.grad).abs().max().item() <= 1e-4 * scale, name
