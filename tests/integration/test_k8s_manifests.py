"""The Kubernetes manifests (k8s/), checked offline: no cluster, no network.

Each kustomization (base, overlays cpu-small and gpu) is rendered with
`kubectl kustomize` and must pass every check of k8s/check.py: yamllint,
strict built-in schemas (kubernetes-validate), strict KubeRay CRD schemas,
the project rules and the security policy. Further tests pin down what the
issue asks of the overlays, independently of check.py's own rule code.
kubectl comes from k8s/get-kubectl.sh (npm registry); the KubeRay CRDs are the
repository's own copy in k8s/crds/kuberay-v1.7.0/ ($LOOMTRAIN_KUBERAY_CRDS overrides it).
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import pytest
import yaml
from k8s_support import K8S, REPO, check, installed_kubectl

TARGETS = {
    "base": K8S / "base",
    "cpu-small": K8S / "overlays" / "cpu-small",
    "gpu": K8S / "overlays" / "gpu",
    "s3": K8S / "overlays" / "s3",
}


@pytest.fixture(scope="module")
def kubectl():
    return installed_kubectl()


@pytest.fixture(scope="module")
def crds():
    try:
        return check.crds_dir()
    except check.SetupError as exc:
        pytest.fail(str(exc))


@pytest.fixture(scope="module")
def results(kubectl, crds):
    return check.check_many(TARGETS.values(), kubectl, crds)


@pytest.fixture(scope="module")
def rendered(kubectl):
    return {name: check.render(path, kubectl) for name, path in TARGETS.items()}


def by_kind(docs, kind):
    return [d for d in docs if d["kind"] == kind]


def one(docs, kind):
    (obj,) = by_kind(docs, kind)
    return obj


def test_overlays_exist_as_the_issue_lists():
    assert sorted(p.name for p in (K8S / "overlays").iterdir() if p.is_dir()) == ["cpu-small", "gpu", "s3"]


@pytest.mark.parametrize("name", TARGETS)
def test_kustomization_renders_and_passes_every_check(results, name):
    problems = results[TARGETS[name]]
    assert problems == [], "\n".join(map(str, problems))


@pytest.mark.parametrize("name", ["cpu-small", "gpu"])
def test_overlay_has_every_piece(rendered, name):
    docs = rendered[name]
    kinds = sorted({(d["apiVersion"], d["kind"]) for d in docs})
    assert kinds == [
        ("apps/v1", "Deployment"),
        ("ray.io/v1", "RayCluster"),
        ("ray.io/v1", "RayJob"),
        ("v1", "ConfigMap"),
        ("v1", "PersistentVolumeClaim"),
        ("v1", "Service"),
        ("v1", "ServiceAccount"),
    ]
    job = one(docs, "RayJob")
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:2] == ["loomtrain", "train"]
    from loomtrain.launcher.cli.train import build_parser

    args = build_parser().parse_args(argv[2:])  # the real CLI accepts it
    assert args.ray and args.config.startswith("/etc/loomtrain/configs/")
    assert any(o.startswith("run.dir=/mnt/loomtrain/runs/") for o in args.overrides)
    assert one(docs, "PersistentVolumeClaim")["spec"]["accessModes"] == ["ReadWriteMany"]
    tb = one(docs, "Deployment")
    assert "tensorboard" in tb["spec"]["template"]["spec"]["containers"][0]["command"]
    assert one(docs, "Service")["spec"]["type"] == "ClusterIP"
    for spec in (job["spec"]["rayClusterSpec"], one(docs, "RayCluster")["spec"]):
        assert spec["headGroupSpec"]["serviceType"] == "ClusterIP"  # the dashboard stays inside
        pods = [spec["headGroupSpec"]["template"]["spec"]] + [g["template"]["spec"] for g in spec["workerGroupSpecs"]]
        for pod in pods:
            shm = [v for v in pod["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"]
            assert shm and any(
                m["mountPath"] == "/dev/shm" and m["name"] == shm[0]["name"]
                for m in pod["containers"][0]["volumeMounts"]
            )
            assert pod["securityContext"]["runAsNonRoot"] is True
            assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
            sc = pod["containers"][0]["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]
            res = pod["containers"][0]["resources"]
            assert res["requests"] == res["limits"]
    # the standing cluster is created suspended: applying the overlay does not book the hardware twice
    assert one(docs, "RayCluster")["spec"]["suspend"] is True


def _cluster_gpus_and_workers(spec):
    gpus = pods = 0
    for group in spec["workerGroupSpecs"]:
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        gpus_per_pod = int(limits.get("nvidia.com/gpu", 0))
        pods += group["replicas"]
        gpus += group["replicas"] * gpus_per_pod
    return pods, gpus


def _config_of(job, tmp_path, docs, world_size):
    """The config the RayJob's entrypoint runs, loaded by the project's loader
    from a copy of the ConfigMap (so `extends` resolves as in the pod)."""
    from loomtrain.launcher.config_loader import load_config

    argv = shlex.split(job["spec"]["entrypoint"])
    config, overrides = argv[2], [a for a in argv[3:] if "=" in a]
    assert Path(config).parent == Path("/etc/loomtrain/configs")
    for key, text in one(docs, "ConfigMap")["data"].items():
        (tmp_path / key).write_text(text)
    return Path(config).name, load_config(tmp_path / Path(config).name, overrides, world_size=world_size)


def test_gpu_overlay_gpus_match_the_world_size_of_its_config(rendered, tmp_path):
    docs = rendered["gpu"]
    job = one(docs, "RayJob")
    name, cfg = _config_of(job, tmp_path, docs, world_size=8)
    assert name == "gpt-1b.yaml" and cfg.ray.use_gpu and cfg.parallel.tp == 2
    pods, gpus = _cluster_gpus_and_workers(job["spec"]["rayClusterSpec"])
    gpus_per_pod = gpus // pods
    assert gpus_per_pod == 8  # nodes of 8 GPUs
    assert gpus_per_pod * pods == cfg.ray.num_workers == 8  # GPUs per worker pod x worker pods = world size
    limits = job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"][
        "limits"
    ]
    assert check.policy.quantity(limits["cpu"]) >= gpus_per_pod * cfg.ray.cpus_per_worker
    assert job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["image"].endswith(
        "-gpu"
    )


def test_cpu_small_runs_tiny_on_two_cpu_workers(rendered, tmp_path):
    docs = rendered["cpu-small"]
    job = one(docs, "RayJob")
    name, cfg = _config_of(job, tmp_path, docs, world_size=2)  # validates the batch split over dp=2
    assert name == "tiny.yaml" and not cfg.ray.use_gpu
    pods, gpus = _cluster_gpus_and_workers(job["spec"]["rayClusterSpec"])
    assert (pods, gpus, cfg.ray.num_workers) == (2, 0, 2)
    # elastic: one worker pod may be lost (min 1 of 2), and the groups' replica bounds say so
    group = job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
    assert (cfg.ray.least_workers, group["minReplicas"], group["maxReplicas"]) == (1, 1, 2)
    cpu = job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"][
        "limits"
    ]["cpu"]
    assert check.policy.quantity(cpu) == cfg.ray.cpus_per_worker  # one Ray Train worker per pod
    assert cfg.run.dir.startswith("/mnt/loomtrain/")


@pytest.mark.parametrize("name,world", [("cpu-small", 2), ("gpu", 8), ("s3", 2)])
def test_ray_pods_are_given_the_time_a_sigterm_save_takes(rendered, tmp_path, name, world):
    """On SIGTERM every rank finishes its step and saves: the pods' grace period covers that."""
    from loomtrain.launcher.planning.grace import grace_period_s, sizing_plan

    docs = rendered[name]
    job = one(docs, "RayJob")
    _, cfg = _config_of(job, tmp_path, docs, world_size=world)
    assert cfg.ray.num_workers == world  # the plan sizes the grace period for the config's Ray workers
    need = grace_period_s(cfg)
    assert need > 30 + sizing_plan(cfg).host.save_sync_s  # more than Kubernetes' default alone would give
    cspec = job["spec"]["rayClusterSpec"]
    for tpl in [cspec["headGroupSpec"]["template"], *(g["template"] for g in cspec["workerGroupSpecs"])]:
        assert tpl["spec"]["terminationGracePeriodSeconds"] >= need
    cluster = one(docs, "RayCluster")["spec"]
    assert cluster["workerGroupSpecs"][0]["template"]["spec"]["terminationGracePeriodSeconds"] >= need


def ray_pods(docs):
    """(where, pod spec) of every Ray pod: the job's cluster and the interactive one."""
    specs = [("RayJob", one(docs, "RayJob")["spec"]["rayClusterSpec"]), ("RayCluster", one(docs, "RayCluster")["spec"])]
    for kind, spec in specs:
        yield f"{kind} head", spec["headGroupSpec"]["template"]["spec"]
        for group in spec["workerGroupSpecs"]:
            yield f"{kind} {group['groupName']}", group["template"]["spec"]


def test_s3_overlay_keeps_checkpoints_and_data_in_the_bucket_with_no_shared_volume(rendered, tmp_path):
    docs = rendered["s3"]
    text = yaml.safe_dump_all(docs)
    # no shared volume: no claim at all, nothing ReadWriteMany, no pod mounts one
    assert not by_kind(docs, "PersistentVolumeClaim") and "ReadWriteMany" not in text
    assert "persistentVolumeClaim" not in text
    # the run: checkpoints, Ray's pointers and the token shards in the bucket; run.dir on the pod's own disk
    job = one(docs, "RayJob")
    _, cfg = _config_of(job, tmp_path, docs, world_size=2)
    assert cfg.run.storage == "s3://YOUR_BUCKET/runs/tiny"
    assert cfg.ray.storage == "s3://YOUR_BUCKET/runs/tiny/ray"
    assert cfg.data.path == "s3://YOUR_BUCKET/data/tiny"
    assert cfg.run.dir.startswith("/mnt/loomtrain/")
    for where, pod in ray_pods(docs):
        ray = pod["containers"][0]
        (mount,) = [m for m in ray["volumeMounts"] if cfg.run.dir.startswith(m["mountPath"] + "/")]
        (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
        assert set(volume) == {"name", "emptyDir"}, where
        # credentials: from the Secret the user creates, in every pod that reaches the bucket
        assert ray["envFrom"] == [{"secretRef": {"name": "loomtrain-s3"}}], where
    # TensorBoard follows every run's mirror ({run.storage}/tb/) in the bucket, with the same Secret
    tb = one(docs, "Deployment")["spec"]["template"]["spec"]
    (container,) = tb["containers"]
    assert container["command"][:3] == ["tensorboard", "--logdir=s3://YOUR_BUCKET/runs", "--load_fast=false"]
    assert f"{cfg.run.storage}/tb".startswith("s3://YOUR_BUCKET/runs/")
    assert container["envFrom"] == [{"secretRef": {"name": "loomtrain-s3"}}]
    assert "volumes" not in tb and "volumeMounts" not in container
    # no credential in the manifests: no Secret object, no key names, no literal values
    assert not by_kind(docs, "Secret")
    assert "AWS_SECRET_ACCESS_KEY" not in text and "AWS_ACCESS_KEY_ID" not in text
    assert all(
        "env" not in c for d in docs for _, _, t in check.policy.pod_templates(d) for c in t["spec"]["containers"]
    )


def test_the_bucket_is_named_in_one_file_and_the_overlay_takes_yours(kubectl, crds, tmp_path):
    """The overlay's one place for the bucket (storage.yaml); the header's sed command makes a
    consistent overlay that passes every check and names only the new bucket."""
    overlay = K8S / "overlays" / "s3"
    naming = [p.name for p in overlay.iterdir() if "YOUR_BUCKET" in _without_comments(p.read_text())]
    assert naming == ["storage.yaml"]
    header = (overlay / "kustomization.yaml").read_text()
    assert "sed -i 's/YOUR_BUCKET/my-bucket/g' k8s/overlays/s3/storage.yaml" in header
    copy = tmp_path / "s3"
    copy.mkdir()
    for p in overlay.iterdir():
        text = p.read_text().replace("YOUR_BUCKET", "my-bucket")
        (copy / p.name).write_text(
            text.replace("  - ../cpu-small\n", f"  - {os.path.relpath(overlay.parent / 'cpu-small', copy)}\n")
        )
    problems = check.check(copy, kubectl, crds)
    assert problems == [], "\n".join(map(str, problems))
    text = yaml.safe_dump_all(check.render(copy, kubectl))
    assert "YOUR_BUCKET" not in text and text.count("s3://my-bucket/") == 4


def _without_comments(text: str) -> str:
    return "\n".join(line.split("#", 1)[0] for line in text.splitlines())


def test_credentials_written_into_a_rayjob_are_refused():
    """no-inline-credentials beyond container env (tested by the broken manifests): the entrypoint,
    a URI with a password, the runtime environment."""
    job = {
        "apiVersion": "ray.io/v1",
        "kind": "RayJob",
        "metadata": {"name": "j"},
        "spec": {
            "entrypoint": "AWS_SECRET_ACCESS_KEY=abc loomtrain train /c/t.yaml run.storage=s3://k:pw@b/r --ray",
            "runtimeEnvYAML": "env_vars:\n  HF_TOKEN: hf_abc\n  AWS_ENDPOINT_URL: http://minio:9000\n",
        },
    }
    found = [m for _, m in check.policy.security_rules([job]) if m.startswith("[no-inline-credentials]")]
    assert len(found) == 3
    assert "entrypoint sets AWS_SECRET_ACCESS_KEY" in found[0] and "URI with a password" in found[1]
    assert "env_vars set HF_TOKEN" in found[2]  # the endpoint is no secret
    job["spec"] = {"entrypoint": "loomtrain train /c/t.yaml run.storage=s3://b/r train.lr=1e-3 --ray"}
    assert not [m for _, m in check.policy.security_rules([job]) if "no-inline-credentials" in m]


def readme_gpt_7b_recipe() -> str:
    """The overlay the Kubernetes guide gives for gpt-7b on the GPU overlay."""
    guide = (REPO / "docs" / "kubernetes.md").read_text()
    m = re.search(r"```yaml\n(# my-gpt-7b/kustomization.yaml\n.*?)```", guide, re.S)
    assert m, "docs/kubernetes.md lost its gpt-7b overlay"
    return m.group(1)


@pytest.mark.parametrize("nodes", [4, 3])
def test_scaling_the_gpu_overlay_to_gpt_7b(tmp_path, kubectl, crds, nodes):
    """The README's recipe: gpt-7b (32 workers) needs 4 nodes of 8 GPUs; 3 are refused."""
    recipe = readme_gpt_7b_recipe()
    assert recipe.count("value: 4}") == 6 and "  - ../k8s/overlays/gpu\n" in recipe
    recipe = recipe.replace("../k8s/overlays/gpu", os.path.relpath(K8S / "overlays" / "gpu", tmp_path))
    (tmp_path / "kustomization.yaml").write_text(recipe.replace("value: 4}", f"value: {nodes}}}"))
    problems = check.check(tmp_path, kubectl, crds)
    if nodes == 4:
        assert problems == [], "\n".join(map(str, problems))
    else:
        assert [p.message for p in problems] == [
            "[world-size] gpt-7b.yaml runs ray.num_workers=32 workers with one GPU each, but the Ray cluster has "
            "3 pod(s) of group 'workers' x 8 GPU(s) = 24 GPUs "
            "(GPUs per worker pod x worker pods must equal the world size)"
        ]


def test_configmap_holds_every_config_and_their_extends(rendered):
    cm = one(rendered["base"], "ConfigMap")
    assert cm["metadata"]["name"].startswith("loomtrain-configs-")  # content hash: a changed config rolls out
    repo_configs = {p.name: p.read_text() for p in (REPO / "configs").glob("*.yaml")}
    assert cm["data"] == repo_configs, "list every configs/*.yaml in configs/Kustomization"
    for key, text in cm["data"].items():
        bases = (yaml.safe_load(text) or {}).get("extends") or []
        for base in [bases] if isinstance(bases, str) else bases:
            assert base in cm["data"], f"{key} extends {base}, missing from the ConfigMap"
    # every reference to it in the pods follows the hashed name
    for doc in rendered["base"]:
        for _, _, tpl in check.policy.pod_templates(doc):
            for vol in tpl["spec"].get("volumes", []):
                if "configMap" in vol:
                    assert vol["configMap"]["name"] == cm["metadata"]["name"]


def test_every_k8s_yaml_file_is_lint_clean():
    # not the broken cases (wrong on purpose), nor the vendored KubeRay CRDs (upstream's bytes, unmodified)
    files = [
        p
        for p in K8S.rglob("*")
        if p.is_file() and p.suffix in (".yaml", ".yml") and not {"broken", "crds"} & set(p.relative_to(K8S).parts)
    ]
    files.append(REPO / "configs" / "Kustomization")
    assert len(files) > 10
    problems = check.lint(files)
    assert problems == [], "\n".join(map(str, problems))


def test_strict_schema_closes_objects_as_the_api_server_does():
    schema = {
        "type": "object",
        "properties": {
            "spec": {"type": "object", "properties": {"a": {"type": "string", "nullable": True}}},
            "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
            "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        },
    }
    strict = check.strict_schema(schema)
    assert strict["additionalProperties"] is False
    assert strict["properties"]["spec"]["additionalProperties"] is False
    assert strict["properties"]["spec"]["properties"]["a"]["type"] == ["string", "null"]
    assert "additionalProperties" not in strict["properties"]["free"]
    assert strict["properties"]["labels"]["additionalProperties"] == {"type": "string"}
    assert "additionalProperties" not in schema  # the input is left alone


def test_missing_crds_say_how_to_get_them(monkeypatch, tmp_path):
    monkeypatch.setenv(check.CRDS_ENV, str(tmp_path))
    with pytest.raises(check.SetupError) as err:
        check.crds_dir()
    message = str(err.value)
    assert check.CRDS_ENV in message and "Helm chart" in message and "kuberay-operator" in message


def test_missing_kubectl_says_how_to_get_it(monkeypatch, tmp_path):
    monkeypatch.setenv(check.KUBECTL_ENV, str(tmp_path / "no-kubectl"))
    with pytest.raises(check.SetupError, match="LOOMTRAIN_KUBECTL"):
        check.find_kubectl()
    monkeypatch.delenv(check.KUBECTL_ENV)
    monkeypatch.setenv("LOOMTRAIN_TOOLS_DIR", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(check.SetupError, match="get-kubectl.sh"):
        check.find_kubectl()


def test_missing_checkov_says_how_to_get_it(monkeypatch, tmp_path):
    monkeypatch.setenv(check.CHECKOV_ENV, str(tmp_path / "no-checkov"))
    with pytest.raises(check.SetupError, match="LOOMTRAIN_CHECKOV"):
        check.find_checkov()
    monkeypatch.delenv(check.CHECKOV_ENV)
    monkeypatch.setenv("LOOMTRAIN_TOOLS_DIR", str(tmp_path))
    with pytest.raises(check.SetupError, match=r"checkov not found .*bash k8s/get-checkov.sh"):
        check.find_checkov()


def test_crds_default_to_the_vendored_copy_inside_the_repository(monkeypatch):
    """A lone clone has everything the checks read: the CRDs of the KubeRay version k8s/ targets,
    with the README that names their version, source and license, and the license text."""
    monkeypatch.delenv(check.CRDS_ENV, raising=False)
    crds = check.crds_dir()
    assert crds == K8S / "crds" / f"kuberay-{check.KUBERAY_VERSION}" and crds.is_relative_to(REPO)
    assert {p.name for p in crds.glob("*.yaml")} == {"ray.io_rayjobs.yaml", "ray.io_rayclusters.yaml"}
    readme = (crds / "README.md").read_text()
    assert check.KUBERAY_VERSION in readme and "Apache" in readme and "github.com/ray-project/kuberay" in readme
    assert "Apache License" in (crds / "LICENSE").read_text()
    for path in crds.glob("*.yaml"):
        crd = yaml.safe_load(path.read_text())
        assert crd["kind"] == "CustomResourceDefinition" and crd["spec"]["group"] == "ray.io"


def test_every_skipped_checkov_check_is_justified():
    """checkov runs all of its Kubernetes checks but those k8s/checkov/config.yaml skips, each
    under a comment saying why it does not apply."""
    config = check.CHECKOV_CONFIG.read_text().splitlines()
    skipped = yaml.safe_load("\n".join(config))["skip-check"]
    assert skipped and all(re.fullmatch(r"CKV2?_K8S_\d+", c) for c in skipped)
    for rule in skipped:
        (line,) = [i for i, text in enumerate(config) if text.strip() == f"- {rule}"]
        while config[line - 1].strip().startswith("- CKV"):  # checks skipped for one reason share its comment
            line -= 1
        assert config[line - 1].strip().startswith("#"), f"skipped check {rule} needs a comment saying why"
    assert not {"CKV_K8S_16", "CKV_K8S_20", "CKV_K8S_23", "CKV_K8S_31"} & set(skipped)


# Pod Security "restricted"'s controls (and the service-account token), as checkov's checks.
RESTRICTED = [
    "CKV_K8S_16", "CKV_K8S_17", "CKV_K8S_18", "CKV_K8S_19", "CKV_K8S_20", "CKV_K8S_23", "CKV_K8S_25",
    "CKV_K8S_26", "CKV_K8S_28", "CKV_K8S_31", "CKV_K8S_37", "CKV_K8S_38",
]  # fmt: skip


def test_every_rule_has_a_broken_manifest_that_it_rejects():
    expected = "\n".join(p.read_text() for p in (K8S / "tests" / "broken").glob("*/kustomization.yaml"))
    rules = set(check.policy.SECURITY_RULES) | set(re.findall(r'"\[([a-z-]+)\] ', (K8S / "policy.py").read_text()))
    assert len(rules) >= 15  # (the regex still finds them all)
    for rule in sorted(rules):
        assert f"[{rule}]" in expected, f"no broken manifest in k8s/tests/broken exercises rule {rule}"
    ours = [yaml.safe_load(p.read_text())["metadata"]["id"] for p in (K8S / "checkov" / "policies").glob("*.yaml")]
    assert len(ours) >= 6
    for rule in RESTRICTED + ours:  # checkov's checks, and the policies written for it here
        assert f"# expect: checkov [{rule}]" in expected, f"no broken manifest makes checkov report {rule}"
