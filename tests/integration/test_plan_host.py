"""`loomtrain plan`'s host figures: RAM per node at start-up and while saving, checkpoint size,
save time at a stated storage bandwidth (launcher/planning/host_model.py)."""

from __future__ import annotations

import json
import os
import re

import pytest
from launch import run_loomtrain
from loomtrain.launcher.cli import plan
from loomtrain.launcher.config_loader import load_config
from loomtrain.launcher.planning import host_model as hm
from loomtrain.launcher.planning import memory_model as mm
from loomtrain.model.flops import param_count

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPT70B = os.path.join(ROOT, "configs", "gpt-70b.yaml")
GiB = 1024**3


def test_70b_plan_prints_host_ram_per_node_and_fits_an_8_gpu_1_tb_node():
    out = run_loomtrain("plan", GPT70B, timeout=300)
    text = out.stdout
    assert "world 64 = tp 8 x dp 8" in text
    assert "host RAM per node (8 ranks; 8 nodes; 1 TB per node)" in text
    startup = re.search(r"^  start-up +([\d.]+) GiB", text, re.M)
    save = re.search(r"^  save or resume +([\d.]+) GiB", text, re.M)
    assert startup and save, text
    # Shards plus one full parameter: tens of GiB per node, where a full fp32 model per rank
    # would be 8 x 276 GB.
    assert 8 * hm.HOST_PROCESS_GIB < float(startup.group(1)) < 64
    assert "building the full fp32 model on every rank would need 2.03 TiB" in text
    assert "start-up fits a node with 8 GPUs and 1 TB of RAM" in text
    assert re.search(r"^  size +770\.9 GiB", text, re.M), text
    assert "save at 1 GB/s per node: synchronous 1.7 min (all 8 nodes writing); async blocks training" in text
    assert re.search(r"^  resume +5\.7 min +\(each rank reads 40\.2 GiB at 1 GB/s per node", text, re.M), text


def test_host_figures_follow_the_layout_and_the_flags():
    run = load_config(GPT70B, [], world_size=64)
    p = mm.make_plan(run, 64, "h100", storage_gbps=2.0, gpus_per_node=4, node_ram_gib=512)
    h = p.host
    n = param_count(run.model)
    assert (h.ranks_per_node, h.nodes) == (4, 16)
    assert h.checkpoint_bytes == 12 * n
    assert h.checkpoint_bytes_per_rank == pytest.approx(12 * p.params.per_rank / 8)
    assert h.save_sync_s == pytest.approx(12 * n / (16 * 2e9))
    assert h.save_async_blocked_s == pytest.approx(h.checkpoint_bytes_per_rank / (hm.HOST_COPY_GBPS * 1e9))
    # ZeRO 1: a resume reads the TP shard's weights whole and its DP partition of the moments
    assert run.parallel.zero_stage == 1
    assert h.resume_bytes_per_rank == pytest.approx(4 * p.params.per_rank + 8 * p.params.per_rank / 8)
    assert h.resume_s == pytest.approx(max(4 * h.resume_bytes_per_rank / 2e9, h.resume_bytes_per_rank / 1.4e9))
    assert h.largest_param == 32000 * 8192  # the embedding (and the untied output layer)
    assert h.startup_per_node == pytest.approx(4 * (hm.HOST_PROCESS_GIB * GiB + 4 * h.largest_param * (1 + 2 / 8)))
    assert h.startup_fits and h.node_ram == 512 * GiB
    data = mm.make_plan(run, 64, "h100").as_dict()["host"]
    assert data["startup_fits"] is True and data["checkpoint_bytes"] == 12 * n


def test_small_node_says_it_does_not_fit_and_bad_flags_are_one_line(capsys):
    rc = plan.main([GPT70B, "--node-ram-gib", "16"])
    out = capsys.readouterr().out
    assert "start-up DOES NOT FIT a node with 8 GPUs and 16 GiB of RAM" in out
    assert "saving needs" in out and rc == 0  # the GPUs still fit; the host line says what does not
    rc = plan.main([GPT70B, "--storage-gbps", "0"])
    assert rc == 2 and "--storage-gbps must be positive, got 0.0" in capsys.readouterr().err


def test_plan_json_carries_the_host_figures(capsys):
    rc = plan.main([GPT70B, "--json"])
    data = json.loads(capsys.readouterr().out)
    assert rc == 0 and data["host"]["ranks_per_node"] == 8 and data["host"]["storage_bps"] == 1e9
