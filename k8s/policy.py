"""loomtrain's rules for its rendered Kubernetes manifests (used by k8s/check.py).

`project_rules(docs, repo)` and `security_rules(docs)` take the objects that
`kubectl kustomize` renders and return (where, "[rule id] message") pairs.
The security policy is the Pod Security Standards "restricted" profile plus
a few cluster-hygiene rules; the rules it does NOT enforce are listed in
SKIPPED_SECURITY_RULES, each with its reason. It is written here rather than
taken from a scanner because most of our pods live inside KubeRay custom
resources (RayJob, RayCluster), whose pod templates the off-the-shelf
scanners on PyPI (checkov and the like) do not look into.
"""

from __future__ import annotations

import functools
import re
import shlex
import tempfile
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path
from typing import Any

import yaml

GPU = "nvidia.com/gpu"
WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job")

# --- security rules of loomtrain's own (checkov checks each pod: k8s/checkov/) -----
SECURITY_RULES = {
    "requests-equal-limits": "requests == limits for every resource a container asks for (Guaranteed QoS: "
    "a training pod is the last the kubelet evicts)",
    "cluster-ip-only": "every Service, and the Ray head service with its dashboard, ClusterIP only; no Ingress",
    "ray-token-auth": "every Ray cluster requires Ray's auth token (authOptions.mode: token): "
    "its dashboard runs any code it is sent",
    "no-inline-credentials": "no credential value in the manifests: no literal env value, entrypoint or "
    "runtime-env variable named like a key, secret, token or password, and no Secret with data; pods read "
    "them from a Secret created outside the manifests (envFrom / secretKeyRef)",
}


# --- walking the objects -------------------------------------------------------
def name_of(obj: dict) -> str:
    return f"{obj.get('kind')}/{(obj.get('metadata') or {}).get('name')}"


def ray_cluster_specs(obj: dict) -> Iterator[tuple[str, dict]]:
    spec = obj.get("spec") or {}
    if obj.get("kind") == "RayCluster":
        yield name_of(obj), spec
    elif obj.get("kind") == "RayJob" and spec.get("rayClusterSpec"):
        yield name_of(obj), spec["rayClusterSpec"]


def pod_templates(obj: dict) -> Iterator[tuple[str, str, dict]]:
    """(where, role, pod template) for every pod the object makes; role is
    'head', 'worker' (Ray pods), 'submitter' or 'pod'."""
    kind, spec = obj.get("kind"), obj.get("spec") or {}
    where = name_of(obj)
    if kind in WORKLOADS and spec.get("template"):
        yield where, "pod", spec["template"]
    elif kind == "CronJob":
        yield where, "pod", ((spec.get("jobTemplate") or {}).get("spec") or {}).get("template") or {}
    elif kind == "Pod":
        yield where, "pod", obj
    for cwhere, cspec in ray_cluster_specs(obj):
        head = cspec.get("headGroupSpec") or {}
        yield f"{cwhere} head", "head", head.get("template") or {}
        for group in cspec.get("workerGroupSpecs") or []:
            yield f"{cwhere} worker group {group.get('groupName')!r}", "worker", group.get("template") or {}
    if kind == "RayJob" and spec.get("submitterPodTemplate"):
        yield f"{where} submitter", "submitter", spec["submitterPodTemplate"]


def containers(pod_spec: dict) -> list[dict]:
    return [c for key in ("initContainers", "containers", "ephemeralContainers") for c in pod_spec.get(key) or []]


def quantity(value: Any) -> Fraction:
    """A Kubernetes resource quantity ("500m", "4Gi", "1e3", 8) as a number."""
    text = str(value).strip()
    m = re.fullmatch(r"([+-]?[0-9.]+)(?:([eE][+-]?[0-9]+)|(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E))?", text)
    if not m:
        raise ValueError(f"not a quantity: {value!r}")
    number = Fraction(m.group(1))
    if m.group(2):
        return number * Fraction(10) ** int(m.group(2)[1:])
    suffix = m.group(3) or ""
    binary = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
    decimal = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
    return number * (Fraction(1024) ** binary[suffix] if suffix in binary else Fraction(10) ** decimal[suffix])


def _limit(container: dict, resource: str) -> Fraction:
    limits = (container.get("resources") or {}).get("limits") or {}
    try:
        return quantity(limits.get(resource, 0))
    except ValueError:
        return Fraction(0)


def _mount_sources(pod_spec: dict, container: dict) -> list[tuple[str, dict]]:
    volumes = {v.get("name"): v for v in pod_spec.get("volumes") or []}
    return [(m.get("mountPath", ""), volumes.get(m.get("name")) or {}) for m in container.get("volumeMounts") or []]


def _under(path: str, root: str) -> bool:
    root = root.rstrip("/") or "/"
    return path == root or path.startswith(root + "/") or root == "/"


# --- project rules ---------------------------------------------------------------
def project_rules(docs: list[dict], repo: Path) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    by_kind: dict[str, dict[str, dict]] = {}
    for obj in docs:
        by_kind.setdefault(obj.get("kind"), {})[(obj.get("metadata") or {}).get("name")] = obj
    out += _references(docs, by_kind)
    out += _images(docs, repo)
    out += _configmaps(by_kind.get("ConfigMap", {}))
    for name, pvc in by_kind.get("PersistentVolumeClaim", {}).items():
        if "ReadWriteMany" not in ((pvc.get("spec") or {}).get("accessModes") or []):
            out.append(
                (
                    f"PersistentVolumeClaim/{name}",
                    "[pvc-rwx] accessModes must include ReadWriteMany: every Ray pod writes checkpoints and "
                    "TensorBoard reads them",
                )
            )
    for obj in docs:
        for where, role, tpl in pod_templates(obj):
            if role in ("head", "worker"):
                pod = tpl.get("spec") or {}
                ray = (pod.get("containers") or [{}])[0]
                if not any(
                    p == "/dev/shm" and (v.get("emptyDir") or {}).get("medium") == "Memory"
                    for p, v in _mount_sources(pod, ray)
                ):
                    out.append(
                        (
                            where,
                            "[dev-shm] mount an emptyDir with medium: Memory at /dev/shm (NCCL and Ray's object store "
                            "outgrow the default 64 MiB)",
                        )
                    )
    rayjobs = list(by_kind.get("RayJob", {}).values())
    for job in rayjobs:
        out += _rayjob(job, by_kind, repo)
    for cluster in by_kind.get("RayCluster", {}).values():
        if rayjobs:
            job = rayjobs[0]
            spec = {k: v for k, v in (cluster.get("spec") or {}).items() if k != "suspend"}
            diff = _first_difference(spec, (job.get("spec") or {}).get("rayClusterSpec") or {}, "spec")
            if diff:
                out.append(
                    (
                        name_of(cluster),
                        f"[cluster-shapes-match] differs from {name_of(job)}'s rayClusterSpec at {diff}: the "
                        "interactive cluster must have the job's shape",
                    )
                )
    return out


def _first_difference(a: Any, b: Any, path: str) -> str | None:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b), key=str):
            d = _first_difference(a.get(key), b.get(key), f"{path}.{key}")
            if d:
                return d
        return None
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            d = _first_difference(x, y, f"{path}[{i}]")
            if d:
                return d
        return None
    return None if a == b else f"{path} ({a!r} vs {b!r})"


def _references(docs: list[dict], by_kind: dict) -> list[tuple[str, str]]:
    out = []
    for obj in docs:
        for where, _, tpl in pod_templates(obj):
            pod = tpl.get("spec") or {}
            sa = pod.get("serviceAccountName")
            if sa and sa not in by_kind.get("ServiceAccount", {}):
                out.append(
                    (where, f"[references-resolve] serviceAccountName {sa!r}: no such ServiceAccount in the manifests")
                )
            names = set()
            for vol in pod.get("volumes") or []:
                names.add(vol.get("name"))
                cm, pvc = vol.get("configMap"), vol.get("persistentVolumeClaim")
                if cm is not None:
                    target = by_kind.get("ConfigMap", {}).get(cm.get("name"))
                    if target is None and not cm.get("optional"):
                        out.append(
                            (
                                where,
                                f"[references-resolve] volume {vol.get('name')!r}: no ConfigMap {cm.get('name')!r} in "
                                "the manifests",
                            )
                        )
                    for item in (cm.get("items") or []) if target else []:
                        if item.get("key") not in (target.get("data") or {}):
                            out.append(
                                (
                                    where,
                                    f"[references-resolve] volume {vol.get('name')!r}: ConfigMap {cm.get('name')!r} "
                                    f"has no key {item.get('key')!r}",
                                )
                            )
                if pvc is not None and pvc.get("claimName") not in by_kind.get("PersistentVolumeClaim", {}):
                    out.append(
                        (
                            where,
                            f"[references-resolve] volume {vol.get('name')!r}: no PersistentVolumeClaim "
                            f"{pvc.get('claimName')!r} in the manifests",
                        )
                    )
            for c in containers(pod):
                for m in c.get("volumeMounts") or []:
                    if m.get("name") not in names:
                        out.append(
                            (
                                where,
                                f"[references-resolve] container {c.get('name')!r} mounts volume {m.get('name')!r}, "
                                "which the pod does not declare",
                            )
                        )
    for name, svc in by_kind.get("Service", {}).items():
        selector = (svc.get("spec") or {}).get("selector") or {}
        labels = [
            ((tpl.get("metadata") or {}).get("labels") or {})
            for obj in docs
            for _, role, tpl in pod_templates(obj)
            if role == "pod"
        ]
        if selector and not any(all(lab.get(k) == v for k, v in selector.items()) for lab in labels):
            out.append(
                (
                    f"Service/{name}",
                    f"[references-resolve] selector {selector} matches no pod template in the manifests",
                )
            )
    return out


def _images(docs: list[dict], repo: Path) -> list[tuple[str, str]]:
    out = []
    version = _project_version(repo)
    ray_version = _image_ray_version(repo)
    for obj in docs:
        for where, _, tpl in pod_templates(obj):
            pod = tpl.get("spec") or {}
            for c in containers(pod):
                image = str(c.get("image") or "")
                name, tag, digest = _split_image(image)
                if not image:
                    out.append((where, f"[images-pinned] container {c.get('name')!r} has no image"))
                    continue
                if not digest and (not tag or tag == "latest"):
                    out.append(
                        (
                            where,
                            f"[images-pinned] image {image!r} is not pinned: give it an exact tag (not latest) or a "
                            "digest",
                        )
                    )
                if (
                    name.rsplit("/", 1)[-1] == "loomtrain"
                    and tag not in ("", "latest")
                    and version
                    and not tag.startswith(f"{version}-")
                ):
                    out.append(
                        (
                            where,
                            f"[image-version] image {image!r} is not the version this checkout builds ({version}-cpu "
                            f"or {version}-gpu, pyproject.toml)",
                        )
                    )
                if _limit(c, GPU) > 0 and name.rsplit("/", 1)[-1] == "loomtrain" and not tag.endswith("-gpu"):
                    out.append(
                        (
                            where,
                            f"[image-variant] container {c.get('name')!r} requests {GPU} but runs {image!r}, not the "
                            "CUDA image (tag ...-gpu)",
                        )
                    )
        for cwhere, cspec in ray_cluster_specs(obj):
            if ray_version and str(cspec.get("rayVersion")) != ray_version:
                out.append(
                    (
                        cwhere,
                        f"[ray-version] rayVersion {cspec.get('rayVersion')!r} is not the Ray the image installs "
                        f"({ray_version}, k8s/image/Dockerfile)",
                    )
                )
    return out


def _split_image(image: str) -> tuple[str, str, str]:
    name, _, digest = image.partition("@")
    last = name.rsplit("/", 1)[-1]
    tag = last.partition(":")[2] if ":" in last else ""
    return (name[: len(name) - len(tag) - 1] if tag else name), tag, digest


def _project_version(repo: Path) -> str:
    path = repo / "pyproject.toml"
    if not path.is_file():
        return ""
    try:
        import tomllib  # Python 3.11+
    except ModuleNotFoundError:  # 3.10: the one line needed, by hand
        m = re.search(r'^version\s*=\s*"([^"]+)"', path.read_text(), re.M)
        return m.group(1) if m else ""
    return tomllib.loads(path.read_text())["project"]["version"]


def _image_ray_version(repo: Path) -> str:
    path = repo / "k8s" / "image" / "Dockerfile"
    m = re.search(r"^ARG RAY_VERSION=(\S+)", path.read_text(), re.M) if path.is_file() else None
    return m.group(1) if m else ""


def _configmaps(configmaps: dict[str, dict]) -> list[tuple[str, str]]:
    out = []
    for name, cm in configmaps.items():
        data = cm.get("data") or {}
        for key, text in data.items():
            if not key.endswith((".yaml", ".yml")):
                continue
            try:
                layer = yaml.safe_load(text) or {}
            except yaml.YAMLError as exc:
                out.append((f"ConfigMap/{name}", f"[extends-resolve] {key}: not YAML: {str(exc).splitlines()[0]}"))
                continue
            bases = layer.get("extends") if isinstance(layer, dict) else None
            for base in [bases] if isinstance(bases, str) else list(bases or []):
                if str(base) not in data:
                    out.append(
                        (
                            f"ConfigMap/{name}",
                            f"[extends-resolve] {key} extends {base!r}, which is not in this ConfigMap (the mounted "
                            "folder has only its keys)",
                        )
                    )
    return out


# --- the RayJob: entrypoint, config, world size ----------------------------------
def _rayjob(job: dict, by_kind: dict, repo: Path) -> list[tuple[str, str]]:
    where = name_of(job)
    spec = job.get("spec") or {}
    entrypoint = str(spec.get("entrypoint") or "")
    try:
        argv = shlex.split(entrypoint)
    except ValueError as exc:
        return [(where, f"[entrypoint-runs-loomtrain] cannot parse the entrypoint: {exc}")]
    if argv[:2] != ["loomtrain", "train"] or len(argv) < 3 or argv[2].startswith("-") or "=" in argv[2]:
        return [
            (
                where,
                "[entrypoint-runs-loomtrain] the entrypoint must be `loomtrain train CONFIG [key=value ...] --ray`, "
                f"got {entrypoint!r}",
            )
        ]
    out = []
    if "--ray" not in argv:
        out.append(
            (
                where,
                "[entrypoint-runs-loomtrain] the entrypoint lacks --ray: without it the driver trains alone on the "
                "head pod",
            )
        )
    config_path, overrides = argv[2], [a for a in argv[3:] if "=" in a and not a.startswith("-")]
    cspec = spec.get("rayClusterSpec")
    if not cspec:
        return out  # runs on a cluster chosen by clusterSelector: nothing to size here
    head = ((cspec.get("headGroupSpec") or {}).get("template") or {}).get("spec") or {}
    head_ray = (head.get("containers") or [{}])[0]
    data = None
    for path, vol in _mount_sources(head, head_ray):
        cm = (vol.get("configMap") or {}).get("name")
        if cm and str(Path(config_path).parent) == path.rstrip("/"):
            data = (by_kind.get("ConfigMap", {}).get(cm) or {}).get("data") or {}
    name = Path(config_path).name
    if data is None or name not in data:
        return out + [
            (
                where,
                f"[config-in-configmap] the entrypoint's config {config_path!r} is not a key of a ConfigMap mounted "
                "at its folder in the head pod",
            )
        ]
    cfg = _load_config(tuple(sorted(data.items())), name, tuple(overrides))
    if isinstance(cfg, str):
        return out + [(where, f"[config] {name} with {' '.join(overrides) or 'no overrides'}: {cfg}")]
    out += _world_size(where, name, cfg, cspec)
    if _is_uri(cfg.run.storage):  # run.dir is each pod's own; what must last is in the store
        out += _tensorboard_follows_storage(where, cfg.run.storage, by_kind)
    else:
        out += _run_dir(where, cfg.run.dir, cspec, by_kind)
    out += _storage_credentials(where, cfg, cspec, by_kind)
    out += _grace_period(where, name, cfg, cspec)
    return out


def _grace_period(where: str, name: str, cfg: Any, cspec: dict) -> list[tuple[str, str]]:
    """On SIGTERM the ranks finish the step and save: the Ray pods must be given that long."""
    from loomtrain.launcher.planning.grace import grace_period_s

    try:
        need = grace_period_s(cfg)
    except ValueError as exc:  # a config the plan cannot size is reported by the other rules
        return [(where, f"[grace-period] cannot estimate the save time of {name}: {exc}")]
    tpls = [("head", (cspec.get("headGroupSpec") or {}).get("template") or {})]
    tpls += [
        (f"worker group {g.get('groupName')!r}", g.get("template") or {}) for g in cspec.get("workerGroupSpecs") or []
    ]
    out = []
    for label, tpl in tpls:
        have = (tpl.get("spec") or {}).get("terminationGracePeriodSeconds")
        if have is None or int(have) < need:
            got = (
                "sets no terminationGracePeriodSeconds (Kubernetes' default: 30 s)"
                if have is None
                else f"has terminationGracePeriodSeconds {have}"
            )
            out.append(
                (
                    where,
                    f"[grace-period] the {label} pod {got}; on SIGTERM {name} finishes a step and "
                    f"saves a checkpoint, which needs >= {need} s (launcher/planning/grace.py)",
                )
            )
    return out


@functools.lru_cache(maxsize=64)
def _load_config(data: tuple[tuple[str, str], ...], name: str, overrides: tuple[str, ...]) -> Any:
    """The RunConfig the driver will build from the mounted ConfigMap, or the
    loader's one-line error. Uses the project's own loader, as the driver runs
    it: the extends chain resolved inside the ConfigMap's files, then the
    entrypoint's overrides, then validation at world size ray.num_workers."""
    try:
        from loomtrain.launcher import config_loader as cl
    except ImportError as exc:
        return f"cannot import loomtrain to read the config: {exc}"
    with tempfile.TemporaryDirectory() as tmp:
        for key, text in data:
            (Path(tmp) / key).write_text(text)
        try:
            cfg = cl.resolve(Path(tmp) / name, overrides)  # as `loomtrain train ... --ray` does
            cl.validate(cfg, world_size=cfg.ray.num_workers)
        except (cl.ConfigError, ValueError) as exc:
            return str(exc).replace(tmp + "/", "")
    return cfg


def _ray_pods(cspec: dict, count: str = "replicas") -> list[tuple[str, int, Fraction, Fraction]]:
    """(group, pods, CPUs and GPUs Ray sees per pod) for the head and each worker group, with
    `count` worker pods per group: its replicas (what starts), minReplicas or maxReplicas."""
    rows = []
    groups = [("head", cspec.get("headGroupSpec") or {}, 1)]
    groups += [
        (
            g.get("groupName", "?"),
            g,
            int(g.get(count, g.get("replicas", g.get("minReplicas", 0))) or 0) * int(g.get("numOfHosts", 1) or 1),
        )
        for g in cspec.get("workerGroupSpecs") or []
    ]
    for label, group, count in groups:
        ray = ((((group.get("template") or {}).get("spec") or {}).get("containers")) or [{}])[0]
        params = group.get("rayStartParams") or {}
        cpus = quantity(params["num-cpus"]) if "num-cpus" in params else _limit(ray, "cpu")
        gpus = quantity(params["num-gpus"]) if "num-gpus" in params else _limit(ray, GPU)
        rows.append((label, count, cpus, gpus))
    return rows


def _elastic_sizes(where: str, name: str, cfg: Any, cspec: dict) -> list[tuple[str, str]]:
    """Elastic workers (ray.min_workers < ray.num_workers): the worker groups at minReplicas
    must hold the smallest group, and at maxReplicas the largest (a lost pod that is not
    replaced costs speed, not the run)."""
    r = cfg.ray
    out = []
    for count, workers, what in (
        ("minReplicas", r.least_workers, f"down to ray.min_workers={r.least_workers}"),
        ("maxReplicas", r.num_workers, f"up to ray.num_workers={r.num_workers}"),
    ):
        rows = _ray_pods(cspec, count)
        fits = (
            sum(c * gp for _, c, _, gp in rows)
            if r.use_gpu
            else sum(c * (cpus // r.cpus_per_worker) for _, c, cpus, _ in rows)
        )
        if fits < workers:
            out.append(
                (
                    where,
                    f"[world-size] {name} runs elastic workers {what}, but the worker groups at {count} fit only "
                    f"{int(fits)} (set the groups' {count} to hold {workers} workers)",
                )
            )
    return out


def _world_size(where: str, name: str, cfg: Any, cspec: dict) -> list[tuple[str, str]]:
    if cfg.ray.elastic:
        return _elastic_sizes(where, name, cfg, cspec)
    n, cpw, use_gpu = cfg.ray.num_workers, cfg.ray.cpus_per_worker, cfg.ray.use_gpu
    rows = [r for r in _ray_pods(cspec) if r[1] > 0]
    shown = " + ".join(f"{c} pod(s) of group {g!r} x {int(gp)} GPU(s)" for g, c, _, gp in rows if gp) or "no GPUs"
    gpus = sum(c * gp for _, c, _, gp in rows)
    out = []
    if use_gpu:
        if gpus != n:
            out.append(
                (
                    where,
                    f"[world-size] {name} runs ray.num_workers={n} workers with one GPU each, but the Ray cluster has "
                    f"{shown} = {int(gpus)} GPUs (GPUs per worker pod x worker pods must equal the world size)",
                )
            )
        for g, _, cpus, gp in rows:
            if gp and cpus < gp * cpw:
                out.append(
                    (
                        where,
                        f"[world-size] group {g!r}: {int(gp)} GPUs need {int(gp)} x ray.cpus_per_worker={cpw} CPUs "
                        f"per pod, it has {float(cpus):g}",
                    )
                )
    else:
        if gpus:
            out.append(
                (
                    where,
                    f"[world-size] {name} has ray.use_gpu false, but the Ray cluster requests {int(gpus)} GPUs that "
                    "would sit idle",
                )
            )
        slots = sum(c * (cpus // cpw) for _, c, cpus, _ in rows)
        if slots < n:
            out.append(
                (
                    where,
                    f"[world-size] {name} runs ray.num_workers={n} workers x ray.cpus_per_worker={cpw} CPU(s), but "
                    f"the Ray cluster fits only {int(slots)}",
                )
            )
    return out


def _run_dir(where: str, run_dir: str, cspec: dict, by_kind: dict) -> list[tuple[str, str]]:
    out = []
    tpls = [("head", (cspec.get("headGroupSpec") or {}).get("template") or {})]
    tpls += [
        (f"worker group {g.get('groupName')!r}", g.get("template") or {}) for g in cspec.get("workerGroupSpecs") or []
    ]
    claims = set()
    for label, tpl in tpls:
        pod = tpl.get("spec") or {}
        ray = (pod.get("containers") or [{}])[0]
        hits = [
            (p, v["persistentVolumeClaim"].get("claimName"))
            for p, v in _mount_sources(pod, ray)
            if v.get("persistentVolumeClaim") and _under(run_dir, p)
        ]
        if not hits:
            out.append(
                (
                    where,
                    f"[run-dir-on-pvc] run.dir={run_dir!r} is not on a PersistentVolumeClaim mounted in the {label} "
                    "pod: checkpoints and logs would die with the pod",
                )
            )
        for mount, claim in hits:
            claims.add((claim, str(Path("/") / Path(run_dir).relative_to(mount)) if run_dir != mount else "/"))
    for claim, rel in claims:
        if claim not in by_kind.get("PersistentVolumeClaim", {}):
            continue  # reported by references-resolve
        for name, dep in by_kind.get("Deployment", {}).items():
            for _, _, tpl in pod_templates(dep):
                pod = tpl.get("spec") or {}
                for c in pod.get("containers") or []:
                    argv = [str(a) for a in (c.get("command") or []) + (c.get("args") or [])]
                    if not any(Path(a).name == "tensorboard" for a in argv):
                        continue
                    logdir = next((a.split("=", 1)[1] for a in argv if a.startswith("--logdir=")), None)
                    if logdir is None and "--logdir" in argv[:-1]:
                        logdir = argv[argv.index("--logdir") + 1]
                    ok = False
                    for mount, vol in _mount_sources(pod, c):
                        pvc = vol.get("persistentVolumeClaim") or {}
                        if pvc.get("claimName") == claim and logdir and _under(logdir, mount):
                            tb_rel = str(Path("/") / Path(logdir).relative_to(mount)) if logdir != mount else "/"
                            ok = _under(rel, tb_rel)
                    if not ok:
                        out.append(
                            (
                                f"Deployment/{name}",
                                f"[tensorboard-reads-runs] --logdir={logdir} does not cover the run directory {rel} "
                                f"on PVC {claim!r} that {where} writes",
                            )
                        )
    return out


def _is_uri(location: str) -> bool:
    return bool(re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", str(location or "")))


def _tensorboard_args(container: dict) -> tuple[bool, str | None]:
    """(is it TensorBoard, its --logdir) for a container."""
    argv = [str(a) for a in (container.get("command") or []) + (container.get("args") or [])]
    if not any(Path(a).name == "tensorboard" for a in argv):
        return False, None
    logdir = next((a.split("=", 1)[1] for a in argv if a.startswith("--logdir=")), None)
    if logdir is None and "--logdir" in argv[:-1]:
        logdir = argv[argv.index("--logdir") + 1]
    return True, logdir


def _tensorboard_follows_storage(where: str, storage: str, by_kind: dict) -> list[tuple[str, str]]:
    """run.storage is a URI: the logging rank mirrors TensorBoard's files to {run.storage}/tb/
    (launcher/observe/mirror.py), so a TensorBoard of the manifests must read a prefix of it."""
    out = []
    for name, dep in by_kind.get("Deployment", {}).items():
        for _, _, tpl in pod_templates(dep):
            for c in (tpl.get("spec") or {}).get("containers") or []:
                is_tb, logdir = _tensorboard_args(c)
                if is_tb and not (logdir and f"{storage.rstrip('/')}/".startswith(f"{logdir.rstrip('/')}/")):
                    out.append(
                        (
                            f"Deployment/{name}",
                            f"[tensorboard-reads-runs] --logdir={logdir} does not cover run.storage={storage}, where "
                            f"{where} mirrors its TensorBoard files ({storage.rstrip('/')}/tb/)",
                        )
                    )
    return out


IRSA_ANNOTATION = "eks.amazonaws.com/role-arn"


def _reads_s3_credentials(pod: dict, container: dict, by_kind: dict) -> bool:
    """The container gets S3 credentials from a Secret (envFrom, or AWS_ACCESS_KEY_ID and
    AWS_SECRET_ACCESS_KEY from secretKeyRef), or the pod's ServiceAccount carries an IAM role."""
    if any((src.get("secretRef") or {}).get("name") for src in container.get("envFrom") or []):
        return True
    from_secrets = {e.get("name") for e in container.get("env") or [] if (e.get("valueFrom") or {}).get("secretKeyRef")}
    if {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= from_secrets:
        return True
    account = by_kind.get("ServiceAccount", {}).get(pod.get("serviceAccountName")) or {}
    return IRSA_ANNOTATION in ((account.get("metadata") or {}).get("annotations") or {})


def _storage_credentials(where: str, cfg: Any, cspec: dict, by_kind: dict) -> list[tuple[str, str]]:
    """Every pod that reads or writes the run's s3:// locations gets credentials: the Ray head
    (the driver) and workers (the ranks), and a TensorBoard reading an s3:// logdir."""
    locations = [("run.storage", cfg.run.storage), ("ray.storage", cfg.ray.storage), ("data.path", cfg.data.path)]
    locations += [(f"data.sources[{i}].path", src.path) for i, src in enumerate(cfg.data.sources)]
    s3 = [(key, value) for key, value in locations if str(value or "").startswith("s3://")]
    pods = [("head", (cspec.get("headGroupSpec") or {}).get("template") or {})]
    pods += [
        (f"worker group {g.get('groupName')!r}", g.get("template") or {}) for g in cspec.get("workerGroupSpecs") or []
    ]
    out = []
    how = (
        "give it envFrom: [{secretRef: {name: loomtrain-s3}}] (`kubectl create secret generic loomtrain-s3 "
        "--from-literal=AWS_ACCESS_KEY_ID=... --from-literal=AWS_SECRET_ACCESS_KEY=...`), or a ServiceAccount "
        f"with {IRSA_ANNOTATION}"
    )
    if s3:
        key, value = s3[0]
        for label, tpl in pods:
            pod = tpl.get("spec") or {}
            ray = (pod.get("containers") or [{}])[0]
            if not _reads_s3_credentials(pod, ray, by_kind):
                out.append(
                    (where, f"[storage-credentials] {key}={value}: the {label} pod gets no S3 credentials; {how}")
                )
    for name, dep in by_kind.get("Deployment", {}).items():
        for _, _, tpl in pod_templates(dep):
            pod = tpl.get("spec") or {}
            for c in pod.get("containers") or []:
                is_tb, logdir = _tensorboard_args(c)
                if is_tb and str(logdir or "").startswith("s3://") and not _reads_s3_credentials(pod, c, by_kind):
                    out.append(
                        (
                            f"Deployment/{name}",
                            f"[storage-credentials] --logdir={logdir}: container {c.get('name')!r} gets no S3 "
                            f"credentials; {how}",
                        )
                    )
    return out


# --- security policy --------------------------------------------------------------
def security_rules(docs: list[dict]) -> list[tuple[str, str]]:
    out = []
    for obj in docs:
        for where, _, tpl in pod_templates(obj):
            for c in containers(tpl.get("spec") or {}):
                out += _requests_equal_limits(where, f"container {c.get('name')!r}", c)
        out += _inline_credentials(obj)
        if obj.get("kind") == "Service":
            kind = (obj.get("spec") or {}).get("type", "ClusterIP")
            if kind != "ClusterIP":
                out.append(
                    (
                        name_of(obj),
                        f"[cluster-ip-only] Service type {kind} exposes it outside the cluster; use ClusterIP and "
                        "kubectl port-forward",
                    )
                )
        if obj.get("kind") == "Ingress":
            out.append((name_of(obj), "[cluster-ip-only] an Ingress exposes services outside the cluster"))
        for where, cspec in ray_cluster_specs(obj):
            head = cspec.get("headGroupSpec") or {}
            kinds = {
                head.get("serviceType") or "ClusterIP",
                ((head.get("headService") or {}).get("spec") or {}).get("type") or "ClusterIP",
            }
            for kind in sorted(kinds - {"ClusterIP"}):
                out.append(
                    (
                        where,
                        f"[cluster-ip-only] the Ray head service is {kind}: that puts the dashboard (which runs "
                        "arbitrary jobs) outside the cluster",
                    )
                )
            if head.get("enableIngress"):
                out.append((where, "[cluster-ip-only] enableIngress exposes the Ray dashboard outside the cluster"))
            if (cspec.get("authOptions") or {}).get("mode") != "token":
                out.append(
                    (
                        where,
                        "[ray-token-auth] set authOptions.mode: token: without it any pod that reaches the Ray head "
                        "can run code on the cluster",
                    )
                )
    return out


# An environment variable that holds a credential, by its name (AWS_SECRET_ACCESS_KEY, HF_TOKEN, ...).
CREDENTIAL_NAME = re.compile(
    r"(^|_)(SECRET|PASSWORD|PASSWD|TOKEN|ACCESS_KEY|ACCOUNT_KEY|API_KEY|CONNECTION_STRING|CREDENTIALS?)(_|$)",
    re.IGNORECASE,
)
# A URI that carries its user and password (s3://KEY:SECRET@bucket, https://user:pw@host).
URI_WITH_PASSWORD = re.compile(r"[a-zA-Z][a-zA-Z0-9+.-]*://[^/\s:@]+:[^/\s@]+@")


def _inline_credentials(obj: dict) -> list[tuple[str, str]]:
    """A credential written into the manifests: a container env value, a Secret's data, a RayJob's
    entrypoint or runtime environment. Anyone who reads the repository, or the objects in the
    cluster, would read it; pods take credentials from a Secret made outside the manifests."""
    rule = "[no-inline-credentials]"
    fix = "put it in a Secret made outside the manifests (kubectl create secret) and read it with envFrom/secretKeyRef"
    out = []
    where = name_of(obj)
    if obj.get("kind") == "Secret" and (obj.get("data") or obj.get("stringData")):
        keys = sorted({*(obj.get("data") or {}), *(obj.get("stringData") or {})})
        out.append((where, f"{rule} a Secret with values ({', '.join(keys)}) in the manifests: create it with kubectl"))
    for pwhere, _, tpl in pod_templates(obj):
        for c in containers(tpl.get("spec") or {}):
            for e in c.get("env") or []:
                if CREDENTIAL_NAME.search(str(e.get("name") or "")) and str(e.get("value") or ""):
                    out.append((pwhere, f"{rule} container {c.get('name')!r} sets {e.get('name')} to a literal; {fix}"))
    spec = obj.get("spec") or {}
    if obj.get("kind") == "RayJob":
        entrypoint = str(spec.get("entrypoint") or "")
        try:
            words = shlex.split(entrypoint)
        except ValueError:
            words = entrypoint.split()
        for word in words:
            name, eq, value = word.partition("=")
            if eq and value and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) and CREDENTIAL_NAME.search(name):
                out.append((where, f"{rule} the entrypoint sets {name}; {fix}"))
        if URI_WITH_PASSWORD.search(entrypoint):
            out.append((where, f"{rule} the entrypoint holds a URI with a password; {fix}"))
        try:
            runtime_env = yaml.safe_load(str(spec.get("runtimeEnvYAML") or "")) or {}
        except yaml.YAMLError:
            runtime_env = {}  # the schema check is not this rule's
        env_vars = runtime_env.get("env_vars") if isinstance(runtime_env, dict) else None
        for name, value in (env_vars or {}).items() if isinstance(env_vars, dict) else []:
            if CREDENTIAL_NAME.search(str(name)) and str(value or ""):
                out.append((where, f"{rule} runtimeEnvYAML's env_vars set {name}; {fix}"))
    return out


def _requests_equal_limits(where: str, cname: str, c: dict) -> list[tuple[str, str]]:
    res = c.get("resources") or {}
    req, lim = res.get("requests") or {}, res.get("limits") or {}
    out = []  # that cpu and memory are limited at all is checkov's (CKV_K8S_11, CKV_K8S_13)
    for key in sorted(set(req) | set(lim)):
        try:
            same = key in req and key in lim and quantity(req[key]) == quantity(lim[key])
        except ValueError:  # not a quantity: the schema check reports it
            same = req.get(key) == lim.get(key)
        if not same:
            out.append(
                (where, f"[requests-equal-limits] {cname}: {key} request {req.get(key)!r} != limit {lim.get(key)!r}")
            )
    return out
