"""LOOMTRAIN_PLUGIN (loomtrain.launcher.training.plugins), the one way in for hooks from outside the
package: a bad value is one line, a Ray driver hands the plugin's variables to its workers, and
the product holds no test seam of its own (the suite's faults are tests/fault_plugin.py)."""

from __future__ import annotations

import ast
import os
import sys

import pytest
from launch import QUIET, SMALLEST, TINY, one_line
from loomtrain.launcher.config_loader import load_config
from loomtrain.launcher.hooks import Hooks
from loomtrain.launcher.training import plugins
from source_tree import ROOT, parse, python_files

LIBRARY = ("launcher", "model", "parallel", "data_pipeline")
TEST_ONLY = ("LOOMTRAIN_TEST_FAULTS", "faults.ACTIVE", "checkpoint_flush", "flush_local")


def test_the_product_holds_no_fault_seam():
    """No module of the package imports a fault module or names what only tests used."""
    assert not (ROOT / "launcher" / "faults.py").exists()
    found = []
    for path in python_files():
        rel = path.relative_to(ROOT)
        if rel.parts[0] not in LIBRARY:
            continue
        text = path.read_text()
        found += [f"{rel}: {name}" for name in TEST_ONLY if name in text]
        for node in ast.walk(parse(path)):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            faulty = [n for n in names if n.split(".")[-1] in ("faults", "fault_plugin")]
            found += [f"{rel}:{node.lineno}: import {n}" for n in faulty]
    assert found == []


def test_a_bad_plugin_is_one_line_naming_the_variable_and_value(tmp_path, monkeypatch, capsys):
    from loomtrain.launcher.cli import train

    (tmp_path / "no_hooks_here.py").write_text("X = 1\n")
    cases = {
        str(tmp_path / "missing.py"): "no such file",
        str(tmp_path / "no_hooks_here.py"): "no_hooks_here has no hooks(cfg) function",
        "no_such_plugin_module": "no such file or module (give a .py file or a module name)",
    }
    monkeypatch.delitem(sys.modules, "no_hooks_here", raising=False)
    run = tmp_path / "run"
    for value, says in cases.items():
        monkeypatch.setenv("LOOMTRAIN_PLUGIN", value)
        assert train.main([str(TINY), *SMALLEST, *QUIET, f"run.dir={run}"]) == 2
        assert one_line(capsys.readouterr().err) == f"loomtrain: config error: LOOMTRAIN_PLUGIN={value}: {says}"
        assert not run.exists()  # refused before the run started: nothing left behind
    sys.modules.pop("no_hooks_here", None)


def test_a_plugin_file_is_one_module_whose_hooks_each_run_gets(tmp_path, monkeypatch):
    plugin = tmp_path / "counting_plugin.py"
    plugin.write_text(
        "from loomtrain.launcher.hooks import Hooks\nCALLS = []\n\n"
        "def hooks(cfg):\n    CALLS.append(cfg.run.name)\n    return [Hooks()]\n"
    )
    monkeypatch.setenv("LOOMTRAIN_PLUGIN", str(plugin))
    monkeypatch.delitem(sys.modules, "counting_plugin", raising=False)
    cfg = load_config(TINY, [f"run.dir={tmp_path / 'run'}"])
    try:
        first, second = plugins.hooks(cfg), plugins.hooks(cfg)
        assert [type(h) for h in first + second] == [Hooks, Hooks]
        assert sys.modules["counting_plugin"].CALLS == [cfg.run.name] * 2  # loaded once, called per run
        monkeypatch.delenv("LOOMTRAIN_PLUGIN")
        assert plugins.hooks(cfg) == []
    finally:
        sys.modules.pop("counting_plugin", None)


def test_a_ray_driver_hands_the_plugin_variables_to_its_workers(monkeypatch):
    monkeypatch.setenv("LOOMTRAIN_PLUGIN", "/plugins/p.py")
    monkeypatch.setenv("LOOMTRAIN_PLUGIN_ARGS", "a:1")
    monkeypatch.setenv("LOOMTRAIN_PLUGINX", "not ours")
    monkeypatch.setenv("LOOMTRAIN_PLUGIN_LEFT_OVER", "from an earlier run in this worker process")
    sent = plugins.forwarded_env()
    assert sent == {
        "LOOMTRAIN_PLUGIN": "/plugins/p.py",
        "LOOMTRAIN_PLUGIN_ARGS": "a:1",
        "LOOMTRAIN_PLUGIN_LEFT_OVER": "from an earlier run in this worker process",
    }
    del sent["LOOMTRAIN_PLUGIN_LEFT_OVER"]
    plugins.adopt_env(sent)  # a worker: exactly what its driver sent
    assert plugins.forwarded_env() == sent


@pytest.fixture(autouse=True)
def _no_plugin_from_outside(monkeypatch):
    for key in [k for k in os.environ if k.startswith("LOOMTRAIN_PLUGIN")]:
        monkeypatch.delenv(key)
