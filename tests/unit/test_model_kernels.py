"""The hand-written autograd functions of the model (CPU RMSNorm, RoPE) against the plain formulas."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from loomtrain.model.norms import RMSNorm, _RMSNormCPU
from loomtrain.model.positions import apply_rope, rope_tables


def rope_formula(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_cpu_rmsnorm_matches_f_rms_norm(dtype):
    torch.manual_seed(0)
    x = torch.randn(3, 7, 32, dtype=dtype, requires_grad=True)
    w = (torch.rand(32, dtype=dtype) + 0.5).requires_grad_()
    g = torch.randn(3, 7, 32, dtype=dtype)
    ref, out = F.rms_norm(x, (32,), w, 1e-5), _RMSNormCPU.apply(x, w, 1e-5)
    assert out.dtype == ref.dtype and torch.equal(out, ref)  # forward bitwise
    dref, dout = torch.autograd.grad(ref, (x, w), g), torch.autograd.grad(out, (x, w), g)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    for a, b in zip(dout, dref):
        assert a.dtype == b.dtype and torch.allclose(a, b, atol=tol, rtol=tol)


def test_cpu_rmsnorm_gradcheck_and_module_path():
    x = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    w = (torch.rand(8, dtype=torch.float64) + 0.5).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: _RMSNormCPU.apply(a, b, 1e-5), (x, w))
    norm = RMSNorm(8).double()
    y = norm(x)
    assert type(y.grad_fn).__name__ == "_RMSNormCPUBackward"  # the CPU path is taken
    assert torch.equal(y, F.rms_norm(x, (8,), norm.weight, norm.eps))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_rope_function_matches_formula(dtype):
    cos, sin = rope_tables(40, 16, 10000.0)  # fp32 tables, as buffers may be under bf16 weights
    x = torch.randn(2, 12, 3, 16, dtype=dtype).transpose(1, 2).requires_grad_()  # [B, H, T, D] view
    c, s = cos[5:17], sin[5:17]
    ref, out = rope_formula(x, c, s), apply_rope(x, c, s)
    assert out.dtype == dtype and torch.equal(out, ref)
    g = torch.randn_like(ref)
    assert torch.equal(torch.autograd.grad(out, x, g)[0], torch.autograd.grad(ref, x, g)[0])


def test_rope_gradcheck():
    cos, sin = rope_tables(6, 8, 100.0, dtype=torch.float64)
    x = torch.randn(2, 3, 6, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: apply_rope(t, cos, sin), (x,))
