"""k8s/check.py refuses what must be filled in before an apply: an image with no registry or owner
(the overlays' `loomtrain:0.1.0-cpu` would be pulled from Docker Hub's official namespace) and a
placeholder such as the s3 overlay's YOUR_BUCKET; `--templates` checks the repository's overlays
as the templates they are, and an overlay filled in the way docs/kubernetes.md says passes."""

from __future__ import annotations

import os

import pytest
from k8s_support import K8S, check, installed_kubectl

pytestmark = pytest.mark.slow

S3 = K8S / "overlays" / "s3"


@pytest.fixture(scope="module")
def kubectl():
    return installed_kubectl()


def test_the_shipped_s3_overlay_is_refused_until_filled_in(kubectl, capsys):
    assert check.main([str(S3)]) == 1
    out = capsys.readouterr().out
    assert "k8s/overlays/s3: 10 problem(s)" in out, out
    assert "spec.entrypoint: YOUR_BUCKET is a placeholder" in out
    assert "command[1]: YOUR_BUCKET is a placeholder" in out  # TensorBoard's --logdir
    assert "image 'loomtrain:0.1.0-cpu' names no registry or owner" in out
    assert check.main(["--templates", str(S3)]) == 0  # as a template it passes every other check
    assert capsys.readouterr().out.strip() == "k8s/overlays/s3: ok"


def test_an_overlay_filled_in_as_the_guide_says_passes(tmp_path, kubectl):
    """newName under images: (the guide's step 2) and the bucket's sed: nothing left to fill in."""
    copy = tmp_path / "s3"
    copy.mkdir()
    for p in S3.iterdir():
        text = p.read_text().replace("YOUR_BUCKET", "my-bucket")
        if p.name == "kustomization.yaml":
            text = text.replace("  - ../cpu-small\n", f"  - {os.path.relpath(S3.parent / 'cpu-small', copy)}\n")
            text += "images:\n  - name: loomtrain\n    newName: registry.example.com/me/loomtrain\n"
        (copy / p.name).write_text(text)
    docs = check.render(copy, kubectl)
    assert check.placeholder_rules(docs) == []
    images = {v for d in docs for path, v in check._strings(d) if path.endswith(".image")}
    assert images == {"registry.example.com/me/loomtrain:0.1.0-cpu"}


def test_placeholder_rules_name_the_field():
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p"},
        "spec": {"containers": [{"name": "c", "image": "REGISTRY/loomtrain:1", "args": ["s3://YOUR_BUCKET/x"]}]},
    }
    found = [(p.where, p.message) for p in check.placeholder_rules([pod])]
    assert found == [
        ("Pod/p", "spec.containers[0].image: REGISTRY is a placeholder: fill it in (docs/kubernetes.md)"),
        ("Pod/p", "spec.containers[0].args[0]: YOUR_BUCKET is a placeholder: fill it in (docs/kubernetes.md)"),
    ]
    pod["spec"]["containers"][0].update(image="ghcr.io/me/loomtrain@sha256:abc", args=[])
    assert check.placeholder_rules([pod]) == []
