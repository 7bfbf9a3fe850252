"""The README's install resolves with plain pip, quickly, in a fresh venv.

A new `python3 -m venv` (with the pip it brings) resolves the README's test command's installs,
in dry-run (`pip install --dry-run`: nothing is installed), as one resolution: the torch pin of
its first `pip install` and the project with its dev extra of the second. The bounds in
pyproject.toml keep pip's resolver from backtracking (it had backtracked for 5-10 minutes,
once into ResolutionImpossible); this fails if it takes more than 5 minutes again, or if pip
reports that it is backtracking. CI runs the install itself (.ci/run), with the same checks on
the real install (no backtracking, a time limit per install); there this test does not repeat it
as a dry run (a minute of pip's CPU on CI's two cores) and says so as its skip reason.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time

import pytest
from source_tree import ROOT

pytestmark = pytest.mark.slow

LIMIT_S = 300
CI_MARKER = "<!-- ci: the test command -->"


def readme_installs() -> list[list[str]]:
    """The arguments of each `pip install` step of the README's test command."""
    readme = (ROOT / "README.md").read_text()
    block = re.search(re.escape(CI_MARKER) + r"\n```bash\n(.*?)\n```", readme, re.S).group(1)
    steps = [shlex.split(step) for step in block.strip().split(" && ")]
    return [words[2:] for words in steps if words[:2] == ["pip", "install"]]


def test_readme_install_resolves_with_plain_pip_in_a_fresh_venv(tmp_path):
    checked = os.environ.get("LOOMTRAIN_CI_CHECKED_INSTALL")
    if checked:
        pytest.skip(f".ci/run installed the README's test command for real: {checked}")
    installs = readme_installs()
    assert installs == [["torch==2.13.0"], ["-e", ".[dev]"]], installs
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    pip = [str(venv / "bin" / "python"), "-m", "pip"]
    version = subprocess.run([*pip, "--version"], capture_output=True, text=True, check=True).stdout.split()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    start = time.monotonic()
    proc = subprocess.run(
        [*pip, "install", "--dry-run", "--disable-pip-version-check", *[a for words in installs for a in words]],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=LIMIT_S + 60,
    )
    took = time.monotonic() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"pip {version}: {out[-4000:]}"
    assert "Would install" in out and "loomtrain-0.1.0" in out, out[-2000:]
    assert "backtracking" not in out and "looking at multiple versions" not in out, out[-4000:]
    assert took < LIMIT_S, f"pip {version} took {took:.0f} s to resolve"
    print(f"\npip {version} resolved the README's install in {took:.0f} s")
