"""The launch helpers every subprocess test uses (tests/launch.py): what a child inherits."""

from __future__ import annotations

import sys

import fault_plugin
from launch import child_env, loomtrain_cmd


def test_a_child_inherits_no_rendezvous_ray_address_or_test_fault(monkeypatch):
    inherited = ("LOOMTRAIN_TEST_FAULTS", "LOOMTRAIN_PLUGIN", "LOOMTRAIN_PLUGIN_FAULTS")
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "RAY_ADDRESS", *inherited):
        monkeypatch.setenv(key, "1")
    monkeypatch.setenv("SOME_USER_SETTING", "kept")
    env = child_env(LOOMTRAIN_TEST_FAULTS="delay:1:0.5")
    assert not {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "RAY_ADDRESS"} & env.keys()
    # only when asked for: the fault plugin and its plan (tests/fault_plugin.py)
    assert env["LOOMTRAIN_PLUGIN"] == str(fault_plugin.PLUGIN) and env["LOOMTRAIN_PLUGIN_FAULTS"] == "delay:1:0.5"
    assert not set(inherited) & child_env().keys() and "LOOMTRAIN_TEST_FAULTS" not in env
    assert env["SOME_USER_SETTING"] == "kept"
    assert (env["DS_ACCELERATOR"], env["OMP_NUM_THREADS"], env["TOKENIZERS_PARALLELISM"]) == ("cpu", "1", "false")


def test_more_than_one_rank_runs_under_torchrun_standalone():
    assert loomtrain_cmd("train", "c.yaml") == [sys.executable, "-m", "loomtrain", "train", "c.yaml"]
    two = loomtrain_cmd("train", "c.yaml", nproc=2)
    assert two[:6] == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    assert two[6:] == ["-m", "loomtrain", "train", "c.yaml"]
