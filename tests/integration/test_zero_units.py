"""Engine pieces checked without processes: activation checkpointing, the test fault plugin's grammar,
SkipGuard; and in a fresh interpreter, the deferred compile of DeepSpeed's Muon modules."""

from __future__ import annotations

import math

import fault_plugin
import pytest
import torch
from loomtrain.launcher.training.activation_checkpointing import apply_activation_checkpointing
from loomtrain.launcher.training.nonfinite import NonFiniteError, SkipGuard
from loomtrain.model import ModelConfig, Transformer


def test_activation_checkpointing_same_outputs_grads_and_names():
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=3, n_heads=4, max_seq_len=16, dropout=0.1)
    ref, ck = Transformer(cfg, seed=1), Transformer(cfg, seed=1)
    names = [n for n, _ in ck.named_parameters()]
    apply_activation_checkpointing(apply_activation_checkpointing(ck))  # idempotent
    assert [n for n, _ in ck.named_parameters()] == names
    tokens = torch.randint(0, 64, (2, 16))
    outs = []
    for model in (ref, ck):
        torch.manual_seed(7)  # same dropout masks; recomputation must replay them
        out = model(tokens)
        out.float().square().mean().backward()
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    for (n, a), b in zip(ref.named_parameters(), ck.parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-6), n
    # Inference paths run the plain forward (no grad; KV cache in generate).
    with torch.no_grad():
        assert torch.equal(ref.eval()(tokens), ck.eval()(tokens))
    assert ck.generate(tokens[:, :4], 3).shape == (2, 7)


def test_fault_plugin_parses_one_grammar_and_strikes_only_where_planned():
    plan = fault_plugin.parse("nan:0:2, nan:0:4-6,raise:1:3,delay:1:0.5,signal:0:16:SIGINT,ckpt_pause:10:120")
    assert sorted(plan) == ["checkpoint_publish", "loss", "step"]
    assert [f.steps for f in plan["loss"]] == [range(2, 3), range(4, 7), range(3, 4)]
    assert fault_plugin.parse("") == {}
    with pytest.raises(ValueError, match="LOOMTRAIN_PLUGIN_FAULTS: cannot read 'nan:0'"):
        fault_plugin.parse("nan:0")
    with pytest.raises(ValueError, match="cannot read 'explode:1:2'"):
        fault_plugin.parse("explode:1:2")
    one = torch.tensor(1.0)
    assert fault_plugin.striking("loss", 3, 0) == []  # off unless planned
    with fault_plugin.planned("nan:0:3,nan:0:5-6,raise:1:4"):
        loss_at = fault_plugin.loss_at
        assert math.isnan(loss_at(one, 3, 0)) and math.isnan(loss_at(one, 6, 0))
        assert loss_at(one, 3, 1) == 1 and loss_at(one, 4, 0) == 1
        with pytest.raises(fault_plugin.FaultInjected, match="rank 1 raises in the middle of step 4"):
            loss_at(one, 4, 1)
        assert fault_plugin.striking("step", 3, 0) == []  # nothing planned at that point
    assert fault_plugin.striking("loss", 3, 0) == []


class _Engine:
    def __init__(self):
        self.skipped_steps = 0
        self.optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)


def test_skip_guard_counts_and_stops():
    eng = _Engine()
    guard = SkipGuard(eng, max_consecutive=2, precision="bf16")
    assert guard.after_step(1, 1.0) is False
    eng.skipped_steps += 1
    assert guard.after_step(2, float("nan")) is True
    assert guard.after_step(3, 1.0) is False  # a good step resets the run of skips
    eng.skipped_steps += 1
    guard.after_step(4, float("nan"))
    eng.skipped_steps += 1
    with pytest.raises(NonFiniteError, match=r"max_consecutive_skips=2: optimizer steps 4-5"):
        guard.after_step(5, float("nan"))


def test_skip_guard_fp16_scaler_skips_do_not_stop_and_own_path_skips():
    eng = _Engine()
    guard = SkipGuard(eng, max_consecutive=1, precision="fp16")
    eng.skipped_steps += 1
    assert guard.after_step(1, 2.5) is True  # loss scaler overflow with a finite loss: no stop
    # The fp32 ZeRO-0 path: a non-finite norm turns the client step into a counted no-op.
    p = eng.optimizer.param_groups[0]["params"][0]
    p.grad = torch.ones(1)
    with guard.step(float("inf")):
        eng.optimizer.step()
        assert eng.optimizer.overflow is True
    assert p.item() == 0.0 and eng.optimizer.overflow is False
    with guard.step(1.0):
        eng.optimizer.step()
    assert p.item() == pytest.approx(-0.1)


class _FusedEngine:
    def __init__(self):
        self.skipped_steps = 0
        self.weight = torch.nn.Parameter(torch.zeros(2))
        self.optimizer = torch.optim.AdamW([self.weight], lr=0.1, weight_decay=0.0, fused=True)


def test_skip_guard_on_the_device_with_a_fused_optimizer(monkeypatch):
    """fp32 ZeRO 0 with the fused AdamW: a non-finite norm skips the update inside the kernel
    (weights, moments and Adam's step count unchanged) with nothing read back; the skips reach
    the engine's count and a run of max_consecutive stops the run at the next read."""
    eng = _FusedEngine()
    guard = SkipGuard(eng, max_consecutive=2, precision="fp32")
    reads = []
    real_tolist = torch.Tensor.tolist

    def counted(t):
        reads.append(t)
        return real_tolist(t)

    def take(step: int, norm: float) -> None:
        eng.weight.grad = torch.ones(2)
        with guard.step(torch.tensor(norm, dtype=torch.float64), step):
            eng.optimizer.step()
        assert not hasattr(eng.optimizer, "found_inf")

    take(1, 1.0)
    after_good = eng.weight.detach().clone()
    assert not torch.equal(after_good, torch.zeros(2))
    take(2, float("nan"))
    assert torch.equal(eng.weight.detach(), after_good)  # skipped in the kernel
    assert eng.optimizer.state[eng.weight]["step"].item() == 1
    take(3, 1.0)  # a good step ends the run of skips
    take(4, float("inf"))
    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    assert guard.after_step(4, 1.0) is False and reads == []  # between reads: nothing read back
    guard.read()
    assert len(reads) == 1 and guard.skipped_steps == 2
    assert guard.after_step(4, 1.0) is False
    take(5, float("nan"))  # steps 4-5: two in a row
    take(6, 1.0)
    guard.read()
    assert guard.skipped_steps == 3
    with pytest.raises(NonFiniteError, match=r"max_consecutive_skips=2: optimizer steps 4-5"):
        guard.after_step(6, 2.0)


def test_deepspeeds_muon_modules_load_without_torch_inductor_and_compile_at_first_call():
    """A ZeRO or bf16 engine imports DeepSpeed's Muon modules (for isinstance checks): with their
    `@torch.compile` deferred, a start imports no torch._inductor (~3 CPU-s per rank); Muon's
    functions stay compiled functions, compiled when first called."""
    import subprocess
    import sys

    from launch import child_env

    code = """
import sys
from loomtrain.launcher.training.engine import import_muon_compiled_on_first_call
import_muon_compiled_on_first_call()
from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
from deepspeed.runtime.zero.muon.original_muon import muon_update
from deepspeed.runtime import compiler
import torch
assert "torch._inductor.compile_fx" not in sys.modules, "inductor imported"
assert muon_update.__name__ == "muon_update" and compiler.compile() is torch.compile
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], env=child_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
