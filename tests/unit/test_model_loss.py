"""The fused output layer + cross-entropy (loomtrain.model.loss) equals logits + cross_entropy."""

import pytest
import torch
import torch.nn.functional as F
from loomtrain.model import LMHead, ModelConfig, Transformer, linear_cross_entropy
from loomtrain.model.loss import chunk_rows


def _reference(h, w, t):
    return F.cross_entropy((h @ w.t()).float(), t, ignore_index=-100)


def _inputs(n=37, d=16, v=50, dtype=torch.float64, ignored=(0, 5, 36)):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(n, d, generator=g, dtype=dtype, requires_grad=True)
    w = torch.randn(v, d, generator=g, dtype=dtype, requires_grad=True)
    t = torch.randint(0, v, (n,), generator=g)
    t[list(ignored)] = -100
    return h, w, t


@pytest.mark.parametrize("rows", [1, 7, 10, 37, 64])
def test_value_and_gradients_match_cross_entropy_for_any_chunking(rows):
    # float64 stays float64 throughout (bf16/fp16 go up to float32), so compare exactly.
    h, w, t = _inputs()
    ref = F.cross_entropy(h @ w.t(), t, ignore_index=-100)
    ref_h, ref_w = torch.autograd.grad(ref * 3.0, (h, w))
    out = linear_cross_entropy(h, w, t, rows=rows)
    got_h, got_w = torch.autograd.grad(out * 3.0, (h, w))  # grad_output != 1 scales the gradients
    assert out.dtype == torch.float64
    assert abs(out.item() - ref.item()) < 1e-12
    assert torch.allclose(got_h, ref_h, atol=1e-12) and torch.allclose(got_w, ref_w, atol=1e-12)


def test_float32_matches_and_ignored_tokens_do_not_count():
    h, w, t = _inputs(dtype=torch.float32)
    out = linear_cross_entropy(h, w, t, rows=8)
    ref = _reference(h, w, t)
    assert abs(out.item() - ref.item()) < 1e-5
    got = torch.autograd.grad(out, (h, w))
    want = torch.autograd.grad(ref, (h, w))
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-6)
    assert torch.all(got[0][[0, 5, 36]] == 0)  # ignored positions get no gradient


def test_all_ignored_gives_zero_loss_and_zero_gradients():
    h, w, t = _inputs(n=4, ignored=(0, 1, 2, 3))
    out = linear_cross_entropy(h, w, t)
    out.backward()
    assert out.item() == 0.0 and torch.all(h.grad == 0) and torch.all(w.grad == 0)


def test_bf16_autocast_matches_the_autocast_reference():
    h, w, t = _inputs(n=64, d=32, v=300, dtype=torch.float32, ignored=())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = linear_cross_entropy(h, w, t, rows=16)
        ref = F.cross_entropy((h @ w.t()).float(), t)  # logits in bf16, loss in float32
    assert abs(out.item() - ref.item()) < 1e-3
    got = torch.autograd.grad(out, (h, w))
    want = torch.autograd.grad(ref, (h, w))
    for a, b in zip(got, want):
        assert a.dtype == torch.float32
        assert (a - b).abs().max() <= 0.02 * b.abs().max()


def test_bf16_parameters_get_bf16_gradients():
    h, w, t = _inputs(n=64, d=32, v=300, dtype=torch.bfloat16, ignored=())
    out = linear_cross_entropy(h, w, t, rows=16)
    out.backward()
    assert h.grad.dtype == w.grad.dtype == torch.bfloat16
    ref_h, ref_w = torch.autograd.grad(_reference(h.float(), w.float(), t), (h, w))
    assert (w.grad.float() - ref_w).abs().max() <= 0.02 * ref_w.abs().max()


def test_no_grad_computes_only_the_loss():
    h, w, t = _inputs()
    with torch.no_grad():
        out = linear_cross_entropy(h, w, t, rows=5)
    assert not out.requires_grad
    assert abs(out.item() - F.cross_entropy(h @ w.t(), t, ignore_index=-100).item()) < 1e-6


def test_chunk_rows_bounded_by_a_memory_budget():
    assert chunk_rows(8192, "cpu") * 8192 * 4 <= 16 << 20
    assert chunk_rows(10**7, "cpu") == 64  # never fewer rows than that
    assert chunk_rows(50304, "cuda") > chunk_rows(50304, "cpu")


def test_lm_head_gives_logits_without_targets_and_the_loss_with_them():
    head = LMHead(8, 20)
    x = torch.randn(2, 3, 8)
    t = torch.randint(0, 20, (2, 3))
    logits = head(x)
    assert logits.shape == (2, 3, 20)
    assert torch.allclose(head(x, t), F.cross_entropy(logits.reshape(-1, 20), t.reshape(-1)), atol=1e-6)


@pytest.mark.parametrize("tied", [False, True])
def test_transformer_targets_equal_logits_then_cross_entropy(tied):
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=16, tie_embeddings=tied)
    model = Transformer(cfg, seed=0).double()
    tokens = torch.randint(0, 64, (3, 17), generator=torch.Generator().manual_seed(1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    logits = model(x)
    ref = F.cross_entropy(logits.reshape(-1, 64), y.reshape(-1))
    ref_grads = torch.autograd.grad(ref, list(model.parameters()))
    loss = model(x, targets=y)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    assert abs(loss.item() - ref.item()) < 1e-6
    for a, b in zip(grads, ref_grads):
        assert torch.allclose(a, b, atol=1e-10)


def test_mismatched_targets_are_refused():
    h, w, _ = _inputs()
    with pytest.raises(ValueError, match="targets"):
        linear_cross_entropy(h, w, torch.zeros(5, dtype=torch.long))


def test_fp16_gradients_survive_many_tokens_under_loss_scaling():
    # Per-token gradients / 20k tokens are below fp16's smallest subnormal (6e-8); kept
    # unnormalised until backward applies grad_output / n_valid, they reach the loss scale.
    h, w, t = _inputs(n=20000, d=8, v=32, dtype=torch.float32, ignored=())
    with torch.no_grad():
        w.mul_(0.1)
    ref_h, ref_w = torch.autograd.grad(F.cross_entropy(h.double() @ w.double().t(), t), (h, w))
    h16, w16 = h.detach().half().requires_grad_(), w.detach().half().requires_grad_()
    (linear_cross_entropy(h16, w16, t) * 1024.0).backward()  # a loss scale, as DeepSpeed's fp16
    got_h, got_w = h16.grad.double() / 1024.0, w16.grad.double() / 1024.0
    assert (got_h - ref_h).abs().max() <= 0.01 * ref_h.abs().max()
    assert (got_w - ref_w).abs().max() <= 0.01 * ref_w.abs().max()
