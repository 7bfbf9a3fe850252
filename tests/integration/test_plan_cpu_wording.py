"""`plan --gpu cpu` speaks of this machine: CPU ranks and its own RAM, not "1 GPU and 1 TB"."""

from __future__ import annotations

import re

from loomtrain.launcher.cli import plan
from loomtrain.launcher.planning import memory_model as mm
from source_tree import ROOT


def test_plan_on_cpu_names_ranks_and_this_machines_ram(capsys):
    plan.main([str(ROOT / "configs" / "tiny.yaml"), "--gpu", "cpu"])
    out = capsys.readouterr().out
    ram = f"{round(mm.host_memory_gib(), 1):g} GiB"
    assert f"host RAM per node (1 rank; 1 node; {ram} per node)" in out, out
    assert re.search(rf"start-up (fits|DOES NOT FIT) a node with 1 rank and {re.escape(ram)} of RAM", out), out
    assert "GPU" not in out.split("host RAM per node")[1] and "1 TB" not in out, out


def test_plan_on_cpu_takes_node_ram_when_given(capsys):
    plan.main([str(ROOT / "configs" / "tiny.yaml"), "--gpu", "cpu", "--node-ram-gib", "64"])
    out = capsys.readouterr().out
    assert "1 node; 64 GiB per node)" in out and "a node with 1 rank and 64 GiB of RAM" in out, out
