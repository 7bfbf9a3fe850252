"""The container image recipe (k8s/image/Dockerfile), checked statically:
docker cannot run where the tests run, so the file itself is read."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "k8s" / "image" / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined, comments dropped."""
    out, buf = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        buf += line.rstrip("\\").strip() + " " if line.rstrip().endswith("\\") else line.strip()
        if not line.rstrip().endswith("\\"):
            word, _, rest = buf.partition(" ")
            out.append((word.upper(), rest.strip()))
            buf = ""
    return out


def args_defaults() -> dict[str, str]:
    return dict(re.match(r"(\w+)=?(.*)", a).groups() for i, a in instructions() if i == "ARG")


def stages() -> list[tuple[str, str]]:
    """(image, stage name) of every FROM, with build args at their defaults."""
    defaults = args_defaults()
    out = []
    for i, rest in instructions():
        if i == "FROM":
            image, _, name = rest.partition(" AS ")
            image = re.sub(r"\$\{(\w+)\}", lambda m: defaults[m.group(1)], image)
            out.append((image.strip(), name.strip()))
    return out


def test_base_images_are_pinned_cuda_for_gpu_slim_for_cpu():
    named = {name: image for image, name in stages() if name}
    assert set(named) == {"base-cpu", "base-gpu"}
    for image in named.values():
        repo, _, tag = image.rpartition(":")
        assert repo and tag and tag != "latest" and re.search(r"\d+\.\d+\.\d+", tag), f"{image} is not pinned"
    assert named["base-cpu"].startswith("python:") and "-slim" in named["base-cpu"]
    assert named["base-gpu"].startswith("nvidia/cuda:") and "cudnn" in named["base-gpu"]


def test_variant_is_a_build_arg_choosing_the_base():
    assert args_defaults()["VARIANT"] == "cpu"
    final_image, final_name = stages()[-1]
    assert final_image == "base-cpu"  # FROM base-${VARIANT}, at its default
    assert "FROM base-${VARIANT}" in DOCKERFILE.read_text()


def test_installs_the_project_from_pyproject_with_pinned_torch_and_ray():
    runs = [rest for i, rest in instructions() if i == "RUN"]
    install = [r for r in runs if "pip install" in r and "/src" in r]
    assert install and "--mount=type=bind,target=/src" in install[0]  # the build context: pyproject.toml
    assert "ray[train,default]==${RAY_VERSION}" in install[0] and "torch==${TORCH_VERSION}" in install[0]
    assert "loomtrain --help" in install[0]  # the console script exists in the image
    defaults = args_defaults()
    assert re.search(r'"ray\[[^"]*\]>=', (REPO / "pyproject.toml").read_text())  # the project depends on Ray
    assert re.fullmatch(r"\d+\.\d+\.\d+", defaults["RAY_VERSION"])
    assert re.fullmatch(r"\d+\.\d+\.\d+", defaults["TORCH_VERSION"])
    # nothing fetched outside a package manager
    assert not [rest for i, rest in instructions() if i == "ADD"]
    assert not any(re.search(r"\b(curl|wget)\s+\S*https?://", r) for r in runs)


def test_runs_as_a_numeric_non_root_user():
    users = [rest for i, rest in instructions() if i == "USER"]
    assert users, "no USER: the image would run as root"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0  # numeric, so runAsNonRoot can verify it
    after = [i for i, _ in instructions()[[i for i, _ in instructions()].index("USER") :]]
    assert "RUN" not in after  # nothing runs as root after dropping to the user
    manifests = "\n".join(p.read_text() for p in (REPO / "k8s" / "base").glob("*.yaml"))
    assert f"runAsUser: {uid}" in manifests


def test_ray_version_matches_the_manifests():
    ray = args_defaults()["RAY_VERSION"]
    for name in ("rayjob.yaml", "raycluster.yaml"):
        assert f'rayVersion: "{ray}"' in (REPO / "k8s" / "base" / name).read_text()


def test_build_context_keeps_out_what_the_image_does_not_need():
    ignored = (DOCKERFILE.parent / "Dockerfile.dockerignore").read_text().split()
    for path in (".git", ".venv", "runs", "tests"):
        assert path in ignored
