"""Shared by the k8s tests: the repository paths and k8s/check.py loaded as a module
(k8s/ is not a package: check.py is also a command-line script)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

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


def installed_kubectl() -> str:
    """kubectl to render with, and checkov for the checkov check, each installed on first use
    (k8s/get-kubectl.sh, k8s/get-checkov.sh); a tool that cannot be had fails the test."""
    try:
        check.find_checkov(install=True)
        return check.find_kubectl(install=True)
    except check.SetupError as exc:
        pytest.fail(str(exc))
