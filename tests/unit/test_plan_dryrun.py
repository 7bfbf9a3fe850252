"""`loomtrain dryrun`: one cluster rank's shard, measured next to plan (shrunken gpt-1b); the
planning guide's (docs/planning.md) `plan` and `dryrun` commands run as written, shrunk to a toy of the same layout."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import torch
from launch import run_loomtrain
from loomtrain.launcher.config_loader import load_config
from loomtrain.launcher.planning import memory_model as mm
from loomtrain.launcher.planning.dryrun import build_rank_shard
from loomtrain.model import meta_transformer

ROOT = Path(__file__).resolve().parents[2]
GPT1B = ROOT / "configs" / "gpt-1b.yaml"
# gpt-1b's layout (tp 2 x dp 4, ZeRO-1, bf16, untied embeddings, RoPE, SwiGLU) at toy size.
SHRINK = [
    "model.n_layers=2",
    "model.d_model=128",
    "model.n_heads=4",
    "model.n_kv_heads=4",
    "model.vocab_size=1000",
    "train.seq_len=32",
    "train.micro_batch_size=2",
]


def test_rank_shard_has_one_ranks_shapes():
    cfg = load_config(GPT1B, [*SHRINK, "model.n_kv_heads=1"], world_size=8)
    model = build_rank_shard(cfg, torch.device("cpu"))
    plan_count = mm.count_params(meta_transformer(cfg.model), tp=2)
    assert sum(p.numel() for p in model.parameters()) == plan_count.per_rank
    assert model.tok_emb.weight.shape == (500, 128)  # 1000 rows over 2 ranks
    assert model.blocks[0].attn.wq.weight.shape == (64, 128)
    assert model.blocks[0].attn.wk.weight.shape == (32, 128)  # the one KV head, replicated
    assert model.blocks[0].attn.n_heads == 2 and model.blocks[0].attn.n_kv_heads == 1
    assert all(p.dtype == torch.bfloat16 and p.device.type == "cpu" for p in model.parameters())
    assert all(torch.isfinite(p).all() for p in model.parameters())
    # Without peers the shard still runs: logits over this rank's vocabulary slice.
    tokens = torch.randint(0, 1000, (2, 16))
    logits = model(tokens)
    assert logits.shape == (2, 16, 500)
    loss = model(tokens, targets=tokens)  # vocab-parallel loss over this rank's slice
    loss.backward()
    assert torch.isfinite(loss)


def test_a_dry_run_of_a_shrunk_model_says_so():
    """The README shrinks gpt-1b to fit a CPU; the table then describes the shrunk model, which
    the line under the headline names field by field (the config's values beside)."""
    from loomtrain.launcher.cli.dryrun import changed_model_fields

    cfg = load_config(GPT1B, ["model.n_layers=2", "train.seq_len=32"], world_size=8)
    assert changed_model_fields(str(GPT1B), cfg) == [f"model.n_layers=2 ({GPT1B}: 24)"]  # the model only
    assert changed_model_fields(str(GPT1B), load_config(GPT1B, world_size=8)) == []


def test_a_cpu_dry_run_says_up_front_how_long_it_should_take(monkeypatch):
    """A full-size CPU dry run printed nothing for minutes: before it starts it says how long
    building the shard (the seeded init draws every full parameter once) and each step (plan's
    time at the assumed MFU of the measured peak) should take."""
    from loomtrain.launcher.planning import dryrun

    cfg = load_config(GPT1B, world_size=8)
    plan = mm.make_plan(cfg, 8, "h100", 0.4)
    monkeypatch.setattr(dryrun, "init_rate", lambda: 1e8)  # values drawn per second
    line = dryrun.cpu_estimate_line(cfg, plan, 3, 1e11, 0.4)
    tokens = cfg.train.micro_batch_size * cfg.train.seq_len
    step = plan.hw_flops_per_token * tokens / plan.tp / (1e11 * 0.4)
    build = plan.params.total / 1e8
    assert line == (
        f"dryrun: on this CPU, about {dryrun._t(build)} to build the shard (the seeded init draws all "
        f"{plan.params.total / 1e6:,.0f} M parameters once) and about {dryrun._t(step)} per step x 3 "
        f"(plan at MFU 40% of the measured peak): about {dryrun._t(build + 3 * step)} in all"
    )
    assert 10 < build < 20 and step > 60  # gpt-1b on a 100 GFLOP/s CPU: minutes per step
    monkeypatch.undo()
    assert dryrun.init_rate() > 1e6  # any CPU draws a million normal values a second


# docs/planning.md's section that shows `plan` and `dryrun` on a cluster config, with their output.
README_SECTION = "## Try a cluster config here first"


def readme_section() -> str:
    text = (ROOT / "docs" / "planning.md").read_text()
    start = text.index(README_SECTION)
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else None]


def readme_blocks() -> list[list[str]]:
    """The lines of each fenced code block in the README's dry-run section."""
    return [b.splitlines() for b in re.findall(r"^```[^\n]*\n(.*?)^```", readme_section(), re.S | re.M)]


def readme_runs(verb: str) -> list[tuple[list[str], str | None]]:
    """(argv after `loomtrain`, shrunk; the headline the README shows for it, or None) for each
    `loomtrain VERB` command of the section, from its bash block and its `$ ` output lines.
    Commands that the shrinking makes the same run (a later override replaces an earlier one)
    are one run."""
    runs: dict[tuple, tuple[list[str], str | None]] = {}
    for lines in readme_blocks():
        for i, line in enumerate(lines):
            if not line.removeprefix("$ ").startswith(f"loomtrain {verb} "):
                continue
            argv = [*shlex.split(line.removeprefix("$ "), comments=True)[1:], *SHRINK]
            shown = lines[i + 1] if line.startswith("$ ") and i + 1 < len(lines) else None
            overrides = dict(a.split("=", 1) for a in argv if "=" in a and not a.startswith("-"))
            others = tuple(a for a in argv if a.split("=", 1)[0] not in overrides)
            key = (others, tuple(sorted(overrides.items())))
            runs[key] = (argv, shown or runs.get(key, (None, None))[1])
    return list(runs.values())


def layout(headline: str) -> str:
    """A headline up to what the shrinking changes (micro-batch, sequence, parameter count)."""
    return headline.split(", micro-batch")[0]


def test_readme_plan_commands_run_shrunk(capsys, monkeypatch):
    from loomtrain.launcher.cli import main

    runs = readme_runs("plan")
    assert runs and all(shown for _, shown in runs), runs  # each shown with its output
    monkeypatch.chdir(ROOT)  # the README's paths are relative to the repository root
    for argv, shown in runs:
        assert main(argv) == 0, argv  # 0: the plan fits
        out = capsys.readouterr().out.splitlines()
        assert layout(out[0]) == layout(shown)
        assert out[-1].startswith("FITS: "), out[-1]


def readme_outputs(verb: str) -> list[tuple[list[str], list[str]]]:
    """(argv after `loomtrain`, as written; the output lines shown under it) for each
    `$ loomtrain VERB` line of the section's output blocks."""
    shown = []
    for lines in readme_blocks():
        for i, line in enumerate(lines):
            if line.startswith(f"$ loomtrain {verb} "):
                rest = lines[i + 1 :]
                end = next((j for j, later in enumerate(rest) if later.startswith("$ ")), len(rest))
                shown.append((shlex.split(line[2:])[1:], rest[:end]))
    return shown


def test_readme_plan_output_is_the_real_output_full_size(capsys, monkeypatch):
    """The plan output the README shows, line for line (`...` marks lines left out), is what
    its command prints today: the full-size model is only counted on the meta device."""
    from loomtrain.launcher.cli import main

    outputs = readme_outputs("plan")
    assert outputs
    monkeypatch.chdir(ROOT)
    for argv, shown in outputs:
        assert main(argv) == 0, argv
        out = iter(capsys.readouterr().out.splitlines())
        for line in shown:
            if line.strip() not in ("", "..."):
                assert any(got == line for got in out), f"README shows a line `{argv}` no longer prints: {line}"


def gib_cells(out: str, label: str) -> list[float]:
    """The GiB figures (MiB converted) of the table row that starts with `label`."""
    row = next(line for line in out.splitlines() if line.strip().startswith(label))
    return [float(x) * (1 if unit == "GiB" else 2**-10) for x, unit in re.findall(r"([\d.]+) (GiB|MiB)", row)]


@pytest.mark.slow
def test_readme_dryrun_commands_run_shrunk():
    """One cluster rank's shard, trained here, measured next to plan: the README's commands at
    toy size (the same tp 2 x dp 4, ZeRO-1, bf16 layout)."""
    runs = readme_runs("dryrun")
    assert runs and all(shown for _, shown in runs), runs  # each shown with its output
    for argv, shown in runs:
        proc = run_loomtrain(*argv, "--steps", "2", cwd=ROOT)  # the README's paths are relative to the root
        out = proc.stdout
        headline = next(line for line in out.splitlines() if line.startswith("dryrun: "))
        assert layout(headline) == layout(shown)
        assert "model changed on the command line: " in out and "model.n_layers=2 (configs/gpt-1b.yaml: 24)" in out
        progress = [line for line in proc.stderr.splitlines() if line.startswith("dryrun: ")]
        assert progress[0].startswith("dryrun: on this CPU, about "), proc.stderr[-2000:]
        assert progress[1].startswith("dryrun: shard built in ")
        assert progress[2].startswith("dryrun: step 1/2: ") and progress[2].endswith(" (warm-up)")
        assert progress[3].startswith("dryrun: step 2/2: ")
        for label in (
            "parameters",
            "gradients (peak)",
            "optimizer states",
            "model states",
            "activations",
            "time per micro-batch step",
            "tokens/s (this rank)",
            "MFU",
            "largest micro-batch",
        ):
            assert label in out, label
        cluster, local, measured = gib_cells(out, "model states")
        # The dry run's measured model states follow the dp=1 arithmetic; the cluster rank at
        # ZeRO-1 over dp=4 holds 2 + 2 + 12/4 instead of 16 bytes per parameter.
        assert measured == pytest.approx(local, rel=0.10)
        assert cluster == pytest.approx(local * 7 / 16, rel=0.02)
