"""Deliberately broken manifests (k8s/tests/broken/*/): each one must be
rejected, and for the right reason only.

Each case is a kustomization on top of a good overlay that adds one defect.
Its header names what must catch it, one `# expect: CHECK MESSAGE` line per
finding: every expectation must be met by some problem k8s/check.py reports,
and every problem reported must be one of the expected ones (no collateral
findings, which would hide a check that no longer bites).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from k8s_support import K8S, check, installed_kubectl

BROKEN = K8S / "tests" / "broken"
CASES = sorted(p for p in BROKEN.iterdir() if (p / "kustomization.yaml").is_file())


def expectations(case: Path) -> list[tuple[str, str]]:
    out = []
    for line in (case / "kustomization.yaml").read_text().splitlines():
        if line.startswith("# expect: "):
            check_name, _, message = line[len("# expect: ") :].partition(" ")
            out.append((check_name, message))
    return out


@pytest.fixture(scope="module")
def results():
    try:
        kubectl = installed_kubectl()
        crds = check.crds_dir()
    except check.SetupError as exc:
        pytest.fail(str(exc))
    return check.check_many(CASES, kubectl, crds)


def test_there_are_broken_cases_for_every_check():
    assert len(CASES) >= 30
    checks = {c for case in CASES for c, _ in expectations(case)}
    assert checks == {"yamllint", "render", "k8s-schema", "crd-schema", "project", "checkov", "security"}
    for case in CASES:
        assert expectations(case), f"{case.name}: no `# expect:` line"


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_broken_manifest_is_rejected_for_the_right_reason(results, case):
    problems = results[case]
    expected = expectations(case)
    shown = "\n".join(f"  {p}" for p in problems) or "  (none)"
    assert problems, f"{case.name} was accepted; expected {expected}"
    for check_name, message in expected:
        assert any(p.check == check_name and message in p.message for p in problems), (
            f"{case.name}: no {check_name} problem saying {message!r}; got:\n{shown}"
        )
    for p in problems:
        assert any(p.check == c and m in p.message for c, m in expected), (
            f"{case.name}: unexpected finding {p}\nall:\n{shown}"
        )
