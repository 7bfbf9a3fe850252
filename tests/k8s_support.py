"""Shared by the k8s tests: the repository paths and k8s/check.py loaded as a module
(k8s/ is not a package: check.py is also a command-line script)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "k8s"


def load_check():
    name = "loomtrain_k8s_check"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, K8S / "check.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


check = load_check()
