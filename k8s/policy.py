"""loomtrain's own rules for its rendered Kubernetes manifests (used by k8s/check.py).

`project_rules(docs, repo)` and `security_rules(docs)` take the objects that `kubectl kustomize`
renders and return (where, "[rule id] message") pairs. What one object's fields alone decide is
checkov's (k8s/checkov/: pod security, services and Ray's dashboard kept inside the cluster behind
its token, ReadWriteMany claims); here is what needs loomtrain's knowledge or several objects at
once: the run config fits the Ray cluster, pods outlive a save, run directories and TensorBoard sit
on storage that lasts, references resolve, credentials come from Secrets, Guaranteed QoS.
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
IRSA_ANNOTATION = "eks.amazonaws.com/role-arn"
SECURITY_RULES = {
    "requests-equal-limits": "requests == limits for every resource a container asks for (Guaranteed QoS: "
    "a training pod is the last the kubelet evicts)",
    "no-inline-credentials": "no credential value in the manifests: no literal env value, entrypoint or "
    "runtime-env variable named like a key, secret, token or password, and no Secret with data; pods read "
    "them from a Secret created outside the manifests (envFrom / secretKeyRef)",
}
Findings = Iterator[tuple[str, str]]
Messages = Iterator[str]  # the findings of a rule about one object, which the caller names


# --- walking the objects -------------------------------------------------------
def name_of(obj: dict) -> str:
    return f"{obj.get('kind')}/{(obj.get('metadata') or {}).get('name')}"


def ray_cluster_specs(obj: dict) -> Iterator[tuple[str, dict]]:
    spec = obj.get("spec") or {}
    if obj.get("kind") == "RayCluster":
        yield name_of(obj), spec
    elif obj.get("kind") == "RayJob" and spec.get("rayClusterSpec"):
        yield name_of(obj), spec["rayClusterSpec"]


def ray_groups(cspec: dict) -> list[tuple[str, dict]]:
    """("head" or "worker group 'NAME'", pod template) of a Ray cluster's pods."""
    groups = [("head", (cspec.get("headGroupSpec") or {}).get("template") or {})]
    return groups + [
        (f"worker group {g.get('groupName')!r}", g.get("template") or {}) for g in cspec.get("workerGroupSpecs") or []
    ]


def pod_templates(obj: dict) -> Iterator[tuple[str, str, dict]]:
    """(where, role, pod template) for every pod the object makes; role is
    'head', 'worker' (Ray pods), 'submitter' or 'pod'."""
    kind, spec = obj.get("kind"), obj.get("spec") or {}
    if kind in WORKLOADS and spec.get("template"):
        yield name_of(obj), "pod", spec["template"]
    elif kind == "CronJob":
        yield name_of(obj), "pod", ((spec.get("jobTemplate") or {}).get("spec") or {}).get("template") or {}
    elif kind == "Pod":
        yield name_of(obj), "pod", obj
    for cwhere, cspec in ray_cluster_specs(obj):
        for label, tpl in ray_groups(cspec):
            yield f"{cwhere} {label}", label.split()[0], tpl
    if kind == "RayJob" and spec.get("submitterPodTemplate"):
        yield f"{name_of(obj)} submitter", "submitter", spec["submitterPodTemplate"]


def containers(pod_spec: dict) -> list[dict]:
    return [c for key in ("initContainers", "containers", "ephemeralContainers") for c in pod_spec.get(key) or []]


def _ray_container(pod: dict) -> dict:
    return (pod.get("containers") or [{}])[0]


def quantity(value: Any) -> Fraction:
    """A Kubernetes resource quantity ("500m", "4Gi", "1e3", 8) as a number."""
    m = re.fullmatch(r"([+-]?[0-9.]+)(?:([eE][+-]?[0-9]+)|(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E))?", str(value).strip())
    if not m:
        raise ValueError(f"not a quantity: {value!r}")
    if m.group(2):
        return Fraction(m.group(1)) * Fraction(10) ** int(m.group(2)[1:])
    binary = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
    decimal = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
    suffix = m.group(3) or ""
    scale = Fraction(1024) ** binary[suffix] if suffix in binary else Fraction(10) ** decimal[suffix]
    return Fraction(m.group(1)) * scale


def _limit(container: dict, resource: str) -> Fraction:
    try:
        return quantity(((container.get("resources") or {}).get("limits") or {}).get(resource, 0))
    except ValueError:
        return Fraction(0)


def _mounts(pod: dict, container: dict) -> list[tuple[str, dict]]:
    """(mount path, volume) of each of the container's mounts."""
    volumes = {v.get("name"): v for v in pod.get("volumes") or []}
    return [(m.get("mountPath", ""), volumes.get(m.get("name")) or {}) for m in container.get("volumeMounts") or []]


def _under(path: str, root: str) -> bool:
    root = root.rstrip("/") or "/"
    return path == root or path.startswith(root + "/") or root == "/"


def _inside(path: str, mount: str) -> str:
    """`path` (under `mount`) as a path inside the mounted volume."""
    return "/" if path == mount else str(Path("/") / Path(path).relative_to(mount))


def _tensorboards(by_kind: dict) -> Iterator[tuple[str, dict, dict, str | None]]:
    """(where, pod, container, --logdir) of each TensorBoard container of the Deployments."""
    for name, dep in by_kind.get("Deployment", {}).items():
        for _, _, tpl in pod_templates(dep):
            for c in (tpl.get("spec") or {}).get("containers") or []:
                argv = [str(a) for a in (c.get("command") or []) + (c.get("args") or [])]
                if any(Path(a).name == "tensorboard" for a in argv):
                    logdir = next((a.split("=", 1)[1] for a in argv if a.startswith("--logdir=")), None)
                    if logdir is None and "--logdir" in argv[:-1]:
                        logdir = argv[argv.index("--logdir") + 1]
                    yield f"Deployment/{name}", tpl.get("spec") or {}, c, logdir


# --- project rules ---------------------------------------------------------------
def project_rules(docs: list[dict], repo: Path) -> list[tuple[str, str]]:
    by_kind: dict[str, dict[str, dict]] = {}
    for obj in docs:
        by_kind.setdefault(obj.get("kind"), {})[(obj.get("metadata") or {}).get("name")] = obj
    out = [*_references(docs, by_kind), *_images(docs, repo), *_configmaps(by_kind.get("ConfigMap", {}))]
    for obj in docs:
        for where, role, tpl in pod_templates(obj):
            pod = tpl.get("spec") or {}
            shm = [v for p, v in _mounts(pod, _ray_container(pod)) if p == "/dev/shm"]
            if role in ("head", "worker") and not any((v.get("emptyDir") or {}).get("medium") == "Memory" for v in shm):
                shm_why = "(NCCL and Ray's object store outgrow the default 64 MiB)"
                out.append((where, f"[dev-shm] mount an emptyDir with medium: Memory at /dev/shm {shm_why}"))
    rayjobs = list(by_kind.get("RayJob", {}).values())
    for job in rayjobs:
        out += _rayjob(job, by_kind)
    for cluster in by_kind.get("RayCluster", {}).values() if rayjobs else []:
        spec = {k: v for k, v in (cluster.get("spec") or {}).items() if k != "suspend"}
        diff = _first_difference(spec, (rayjobs[0].get("spec") or {}).get("rayClusterSpec") or {}, "spec")
        if diff:
            out.append(
                (
                    name_of(cluster),
                    f"[cluster-shapes-match] differs from {name_of(rayjobs[0])}'s "
                    f"rayClusterSpec at {diff}: the interactive cluster must have the job's shape",
                )
            )
    return out


def _first_difference(a: Any, b: Any, path: str) -> str | None:
    if isinstance(a, dict) and isinstance(b, dict):
        keys = sorted(set(a) | set(b), key=str)
        return next(filter(None, (_first_difference(a.get(k), b.get(k), f"{path}.{k}") for k in keys)), None)
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return next(filter(None, (_first_difference(x, y, f"{path}[{i}]") for i, (x, y) in enumerate(zip(a, b)))), None)
    return None if a == b else f"{path} ({a!r} vs {b!r})"


def _references(docs: list[dict], by_kind: dict) -> Findings:
    for obj in docs:
        for where, _, tpl in pod_templates(obj):
            yield from ((where, f"[references-resolve] {m}") for m in _pod_references(tpl.get("spec") or {}, by_kind))
    labels = [(t.get("metadata") or {}).get("labels") or {} for o in docs for _, r, t in pod_templates(o) if r == "pod"]
    for name, svc in by_kind.get("Service", {}).items():
        selector = (svc.get("spec") or {}).get("selector") or {}
        if selector and not any(all(lab.get(k) == v for k, v in selector.items()) for lab in labels):
            yield (
                f"Service/{name}",
                f"[references-resolve] selector {selector} matches no pod template in the manifests",
            )


def _pod_references(pod: dict, by_kind: dict) -> Messages:
    sa = pod.get("serviceAccountName")
    if sa and sa not in by_kind.get("ServiceAccount", {}):
        yield f"serviceAccountName {sa!r}: no such ServiceAccount in the manifests"
    for vol in pod.get("volumes") or []:
        vname, cm, pvc = vol.get("name"), vol.get("configMap"), vol.get("persistentVolumeClaim")
        target = by_kind.get("ConfigMap", {}).get((cm or {}).get("name"))
        if cm is not None and target is None and not cm.get("optional"):
            yield f"volume {vname!r}: no ConfigMap {cm.get('name')!r} in the manifests"
        for item in (cm.get("items") or []) if target else []:
            if item.get("key") not in (target.get("data") or {}):
                yield f"volume {vname!r}: ConfigMap {cm['name']!r} has no key {item.get('key')!r}"
        if pvc is not None and pvc.get("claimName") not in by_kind.get("PersistentVolumeClaim", {}):
            yield f"volume {vname!r}: no PersistentVolumeClaim {pvc.get('claimName')!r} in the manifests"
    declared = {vol.get("name") for vol in pod.get("volumes") or []}
    for c in containers(pod):
        for m in c.get("volumeMounts") or []:
            if m.get("name") not in declared:
                yield f"container {c.get('name')!r} mounts volume {m.get('name')!r}, which the pod does not declare"


def _images(docs: list[dict], repo: Path) -> Findings:
    """The loomtrain image is this checkout's version, its CUDA variant where a GPU is asked for, and the
    Ray clusters run the Ray it installs. (A tag at all, not latest: checkov's CKV_K8S_14.)"""
    version = re.search(r'^version\s*=\s*"([^"]+)"', (repo / "pyproject.toml").read_text(), re.M).group(1)
    dockerfile = (repo / "k8s" / "image" / "Dockerfile").read_text()
    ray_version = re.search(r"^ARG RAY_VERSION=(\S+)", dockerfile, re.M).group(1)
    for obj in docs:
        for where, _, tpl in pod_templates(obj):
            yield from ((where, m) for c in containers(tpl.get("spec") or {}) for m in _image(c, version))
        for cwhere, cspec in ray_cluster_specs(obj):
            if str(cspec.get("rayVersion")) != ray_version:
                got = f"rayVersion {cspec.get('rayVersion')!r}"
                yield (
                    cwhere,
                    f"[ray-version] {got} is not the Ray the image installs ({ray_version}, k8s/image/Dockerfile)",
                )


def _image(c: dict, version: str) -> Messages:
    image = str(c.get("image") or "")
    name, _, tag = image.partition("@")[0].rpartition("/")[2].partition(":")
    if name != "loomtrain" or tag in ("", "latest"):
        return
    if not tag.startswith(f"{version}-"):
        yield (
            f"[image-version] image {image!r} is not the version this checkout builds "
            f"({version}-cpu or {version}-gpu, pyproject.toml)"
        )
    if _limit(c, GPU) > 0 and not tag.endswith("-gpu"):
        yield (
            f"[image-variant] container {c.get('name')!r} requests {GPU} but runs {image!r}, "
            "not the CUDA image (tag ...-gpu)"
        )


def _configmaps(configmaps: dict[str, dict]) -> Findings:
    for name, cm in configmaps.items():
        data = cm.get("data") or {}
        for key, text in data.items():
            if not key.endswith((".yaml", ".yml")):
                continue
            try:
                layer = yaml.safe_load(text) or {}
            except yaml.YAMLError as exc:
                yield f"ConfigMap/{name}", f"[extends-resolve] {key}: not YAML: {str(exc).splitlines()[0]}"
                continue
            bases = layer.get("extends") if isinstance(layer, dict) else None
            for base in [bases] if isinstance(bases, str) else list(bases or []):
                if str(base) not in data:
                    why = "which is not in this ConfigMap (the mounted folder has only its keys)"
                    yield f"ConfigMap/{name}", f"[extends-resolve] {key} extends {base!r}, {why}"


# --- the RayJob: entrypoint, config, world size ----------------------------------
def _rayjob(job: dict, by_kind: dict) -> Findings:
    where, cspec = name_of(job), (job.get("spec") or {}).get("rayClusterSpec")
    cfg, name, messages = _job_config(job, by_kind)
    if cfg is not None:
        messages += _elastic_sizes(name, cfg, cspec) if cfg.ray.elastic else _world_size(name, cfg, cspec)
        messages += _grace_period(name, cfg, cspec)
    yield from ((where, message) for message in messages)
    if cfg is None:
        return
    if cfg.run.storage:  # a URI (the config checks it): run.dir is each pod's own, what must last is in the store
        yield from _tensorboard_follows_storage(where, cfg.run.storage, by_kind)
    else:
        yield from _run_dir(where, cfg.run.dir, cspec, by_kind)
    yield from _storage_credentials(where, cfg, cspec, by_kind)


def _job_config(job: dict, by_kind: dict) -> tuple[Any, str, list[str]]:
    """The RunConfig the RayJob's driver runs (None if there is none to size a cluster with), its
    config file's name, and what is wrong with its entrypoint and config."""
    spec, rule = job.get("spec") or {}, "[entrypoint-runs-loomtrain]"
    entrypoint = str(spec.get("entrypoint") or "")
    try:
        argv = shlex.split(entrypoint)
    except ValueError as exc:
        return None, "", [f"{rule} cannot parse the entrypoint: {exc}"]
    if argv[:2] != ["loomtrain", "train"] or len(argv) < 3 or argv[2].startswith("-") or "=" in argv[2]:
        usage = "`loomtrain train CONFIG [key=value ...] --ray`"
        return None, "", [f"{rule} the entrypoint must be {usage}, got {entrypoint!r}"]
    out = []
    if "--ray" not in argv:
        out.append(f"{rule} the entrypoint lacks --ray: without it the driver trains alone on the head pod")
    config_path, overrides = argv[2], tuple(a for a in argv[3:] if "=" in a and not a.startswith("-"))
    name = Path(config_path).name
    if not spec.get("rayClusterSpec"):
        return None, name, out  # runs on a cluster chosen by clusterSelector: nothing to size here
    head = ray_groups(spec["rayClusterSpec"])[0][1].get("spec") or {}
    data = None
    for path, vol in _mounts(head, _ray_container(head)):
        cm = (vol.get("configMap") or {}).get("name")
        if cm and str(Path(config_path).parent) == path.rstrip("/"):
            data = (by_kind.get("ConfigMap", {}).get(cm) or {}).get("data") or {}
    if data is None or name not in data:
        out.append(
            f"[config-in-configmap] the entrypoint's config {config_path!r} is not a key of a "
            "ConfigMap mounted at its folder in the head pod"
        )
        return None, name, out
    cfg = _load_config(tuple(sorted(data.items())), name, overrides)
    if isinstance(cfg, str):
        out.append(f"[config] {name} with {' '.join(overrides) or 'no overrides'}: {cfg}")
        return None, name, out
    return cfg, name, out


def _grace_period(name: str, cfg: Any, cspec: dict) -> Messages:
    """On SIGTERM the ranks finish the step and save: the Ray pods must be given that long."""
    from loomtrain.launcher.planning.grace import grace_period_s

    try:
        need = grace_period_s(cfg)
    except ValueError as exc:  # a config the plan cannot size is reported by the other rules
        yield f"[grace-period] cannot estimate the save time of {name}: {exc}"
        return
    for label, tpl in ray_groups(cspec):
        have = (tpl.get("spec") or {}).get("terminationGracePeriodSeconds")
        if have is None or int(have) < need:
            got = f"has terminationGracePeriodSeconds {have}"
            got = "sets no terminationGracePeriodSeconds (Kubernetes' default: 30 s)" if have is None else got
            yield (
                f"[grace-period] the {label} pod {got}; on SIGTERM {name} finishes a step and saves a "
                f"checkpoint, which needs >= {need} s (launcher/planning/grace.py)"
            )


@functools.lru_cache(maxsize=64)
def _load_config(data: tuple[tuple[str, str], ...], name: str, overrides: tuple[str, ...]) -> Any:
    """The RunConfig the driver will build from the mounted ConfigMap, or the loader's one-line
    error: the project's own loader, as the driver runs it (the extends chain resolved inside the
    ConfigMap's files, then the entrypoint's overrides, then validation at ray.num_workers)."""
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
    groups = [("head", cspec.get("headGroupSpec") or {}, 1)]
    for g in cspec.get("workerGroupSpecs") or []:
        pods = int(g.get(count, g.get("replicas", g.get("minReplicas", 0))) or 0) * int(g.get("numOfHosts", 1) or 1)
        groups.append((g.get("groupName", "?"), g, pods))
    rows = []
    for label, group, pods in groups:
        ray, params = _ray_container((group.get("template") or {}).get("spec") or {}), group.get("rayStartParams") or {}
        cpus = quantity(params["num-cpus"]) if "num-cpus" in params else _limit(ray, "cpu")
        gpus = quantity(params["num-gpus"]) if "num-gpus" in params else _limit(ray, GPU)
        rows.append((label, pods, cpus, gpus))
    return rows


def _slots(rows: list, use_gpu: bool, cpus_per_worker: int) -> Fraction:
    """How many Ray Train workers the pods hold: one per GPU, or one per cpus_per_worker CPUs."""
    return sum((n * (gpus if use_gpu else cpus // cpus_per_worker) for _, n, cpus, gpus in rows), Fraction(0))


def _elastic_sizes(name: str, cfg: Any, cspec: dict) -> list[str]:
    """Elastic workers (ray.min_workers < ray.num_workers): the worker groups at minReplicas
    must hold the smallest group, and at maxReplicas the largest (a lost pod that is not
    replaced costs speed, not the run)."""
    r, out = cfg.ray, []
    for count, workers, what in (
        ("minReplicas", r.least_workers, f"down to ray.min_workers={r.least_workers}"),
        ("maxReplicas", r.num_workers, f"up to ray.num_workers={r.num_workers}"),
    ):
        fits = _slots(_ray_pods(cspec, count), r.use_gpu, r.cpus_per_worker)
        if fits < workers:
            out.append(
                f"[world-size] {name} runs elastic workers {what}, but the worker groups at {count} fit "
                f"only {int(fits)} (set the groups' {count} to hold {workers} workers)"
            )
    return out


def _world_size(name: str, cfg: Any, cspec: dict) -> list[str]:
    n, cpw, use_gpu, out = cfg.ray.num_workers, cfg.ray.cpus_per_worker, cfg.ray.use_gpu, []
    rows = [r for r in _ray_pods(cspec) if r[1] > 0]
    gpus, cpu_slots = _slots(rows, True, cpw), _slots(rows, False, cpw)
    if use_gpu and gpus != n:
        shown = " + ".join(f"{c} pod(s) of group {g!r} x {int(gp)} GPU(s)" for g, c, _, gp in rows if gp) or "no GPUs"
        out.append(
            f"[world-size] {name} runs ray.num_workers={n} workers with one GPU each, but the Ray cluster "
            f"has {shown} = {int(gpus)} GPUs (GPUs per worker pod x worker pods must equal the world size)"
        )
    out += [
        f"[world-size] group {g!r}: {int(gp)} GPUs need {int(gp)} x ray.cpus_per_worker={cpw} CPUs "
        f"per pod, it has {float(cpus):g}"
        for g, _, cpus, gp in rows
        if use_gpu and gp and cpus < gp * cpw
    ]
    if not use_gpu and gpus:
        out.append(
            f"[world-size] {name} has ray.use_gpu false, but the Ray cluster requests {int(gpus)} GPUs that "
            "would sit idle"
        )
    if not use_gpu and cpu_slots < n:
        out.append(
            f"[world-size] {name} runs ray.num_workers={n} workers x ray.cpus_per_worker={cpw} CPU(s), but "
            f"the Ray cluster fits only {int(cpu_slots)}"
        )
    return out


# --- where the run's files live ---------------------------------------------------
def _run_dir(where: str, run_dir: str, cspec: dict, by_kind: dict) -> Findings:
    """run.dir is on a PVC in every Ray pod, and a TensorBoard reads that folder of the claim."""
    claims = set()
    for label, tpl in ray_groups(cspec):
        pod = tpl.get("spec") or {}
        hits = [
            (p, v["persistentVolumeClaim"].get("claimName"))
            for p, v in _mounts(pod, _ray_container(pod))
            if v.get("persistentVolumeClaim") and _under(run_dir, p)
        ]
        if not hits:
            lost = f"mounted in the {label} pod: checkpoints and logs would die with the pod"
            yield where, f"[run-dir-on-pvc] run.dir={run_dir!r} is not on a PersistentVolumeClaim {lost}"
        claims |= {(claim, _inside(run_dir, mount)) for mount, claim in hits}
    for claim, rel in claims if by_kind.get("PersistentVolumeClaim") else []:
        if claim not in by_kind["PersistentVolumeClaim"]:
            continue  # reported by references-resolve
        for tb, pod, c, logdir in _tensorboards(by_kind):
            on_claim = [
                mount
                for mount, vol in _mounts(pod, c)
                if (vol.get("persistentVolumeClaim") or {}).get("claimName") == claim
                and logdir
                and _under(logdir, mount)
            ]
            if not any(_under(rel, _inside(logdir, mount)) for mount in on_claim):
                what = f"the run directory {rel} on PVC {claim!r} that {where} writes"
                yield tb, f"[tensorboard-reads-runs] --logdir={logdir} does not cover {what}"


def _tensorboard_follows_storage(where: str, storage: str, by_kind: dict) -> Findings:
    """run.storage is a URI: the logging rank mirrors TensorBoard's files to {run.storage}/tb/
    (launcher/observe/mirror.py), so a TensorBoard of the manifests must read a prefix of it."""
    for tb, _, _, logdir in _tensorboards(by_kind):
        if not (logdir and f"{storage.rstrip('/')}/".startswith(f"{logdir.rstrip('/')}/")):
            what = f"run.storage={storage}, where {where} mirrors its TensorBoard files ({storage.rstrip('/')}/tb/)"
            yield tb, f"[tensorboard-reads-runs] --logdir={logdir} does not cover {what}"


def _reads_s3_credentials(pod: dict, container: dict, by_kind: dict) -> bool:
    """The container gets S3 credentials from a Secret (envFrom, or AWS_ACCESS_KEY_ID and
    AWS_SECRET_ACCESS_KEY from secretKeyRef), or the pod's ServiceAccount carries an IAM role."""
    if any((src.get("secretRef") or {}).get("name") for src in container.get("envFrom") or []):
        return True
    from_secrets = {e.get("name") for e in container.get("env") or [] if (e.get("valueFrom") or {}).get("secretKeyRef")}
    account = by_kind.get("ServiceAccount", {}).get(pod.get("serviceAccountName")) or {}
    irsa = IRSA_ANNOTATION in ((account.get("metadata") or {}).get("annotations") or {})
    return irsa or {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= from_secrets


def _storage_credentials(where: str, cfg: Any, cspec: dict, by_kind: dict) -> Findings:
    """Every pod that reads or writes the run's s3:// locations gets credentials: the Ray head
    (the driver) and workers (the ranks), and a TensorBoard reading an s3:// logdir."""
    locations = [("run.storage", cfg.run.storage), ("ray.storage", cfg.ray.storage), ("data.path", cfg.data.path)]
    locations += [(f"data.sources[{i}].path", src.path) for i, src in enumerate(cfg.data.sources)]
    s3 = [(key, value) for key, value in locations if str(value or "").startswith("s3://")]
    how = (
        "give it envFrom: [{secretRef: {name: loomtrain-s3}}] (`kubectl create secret generic loomtrain-s3 "
        "--from-literal=AWS_ACCESS_KEY_ID=... --from-literal=AWS_SECRET_ACCESS_KEY=...`), or a ServiceAccount "
        f"with {IRSA_ANNOTATION}"
    )
    for label, tpl in ray_groups(cspec) if s3 else []:
        pod = tpl.get("spec") or {}
        if not _reads_s3_credentials(pod, _ray_container(pod), by_kind):
            yield where, f"[storage-credentials] {s3[0][0]}={s3[0][1]}: the {label} pod gets no S3 credentials; {how}"
    for tb, pod, c, logdir in _tensorboards(by_kind):
        if str(logdir or "").startswith("s3://") and not _reads_s3_credentials(pod, c, by_kind):
            lacks = f"container {c.get('name')!r} gets no S3 credentials"
            yield tb, f"[storage-credentials] --logdir={logdir}: {lacks}; {how}"


# --- security rules ------------------------------------------------------------------
def security_rules(docs: list[dict]) -> list[tuple[str, str]]:
    out = []
    for obj in docs:
        out += _inline_credentials(obj)
        for where, _, tpl in pod_templates(obj):
            out += [(where, m) for c in containers(tpl.get("spec") or {}) for m in _requests_equal_limits(c)]
    return out


def _requests_equal_limits(c: dict) -> Findings:
    """Guaranteed QoS (that cpu and memory are limited at all is checkov's CKV_K8S_11 and CKV_K8S_13)."""
    req, lim = (c.get("resources") or {}).get("requests") or {}, (c.get("resources") or {}).get("limits") or {}
    for key in sorted(set(req) | set(lim)):
        try:
            same = key in req and key in lim and quantity(req[key]) == quantity(lim[key])
        except ValueError:  # not a quantity: the schema check reports it
            same = req.get(key) == lim.get(key)
        if not same:
            yield (
                f"[requests-equal-limits] container {c.get('name')!r}: {key} request {req.get(key)!r} != limit "
                f"{lim.get(key)!r}"
            )


# An environment variable that holds a credential, by its name (AWS_SECRET_ACCESS_KEY, HF_TOKEN, ...).
CREDENTIAL_NAME = re.compile(
    r"(^|_)(SECRET|PASSWORD|PASSWD|TOKEN|ACCESS_KEY|ACCOUNT_KEY|API_KEY|CONNECTION_STRING|CREDENTIALS?)(_|$)",
    re.IGNORECASE,
)
# A URI that carries its user and password (s3://KEY:SECRET@bucket, https://user:pw@host).
URI_WITH_PASSWORD = re.compile(r"[a-zA-Z][a-zA-Z0-9+.-]*://[^/\s:@]+:[^/\s@]+@")


def _inline_credentials(obj: dict) -> Findings:
    """A credential written into the manifests: a container env value, a Secret's data, a RayJob's
    entrypoint or runtime environment. Anyone who reads the repository, or the objects in the
    cluster, would read it; pods take credentials from a Secret made outside the manifests."""
    rule = "[no-inline-credentials]"
    fix = "put it in a Secret made outside the manifests (kubectl create secret) and read it with envFrom/secretKeyRef"
    where, spec = name_of(obj), obj.get("spec") or {}
    if obj.get("kind") == "Secret" and (obj.get("data") or obj.get("stringData")):
        keys = ", ".join(sorted({*(obj.get("data") or {}), *(obj.get("stringData") or {})}))
        yield where, f"{rule} a Secret with values ({keys}) in the manifests: create it with kubectl"
    for pwhere, _, tpl in pod_templates(obj):
        for c in containers(tpl.get("spec") or {}):
            for e in c.get("env") or []:
                if CREDENTIAL_NAME.search(str(e.get("name") or "")) and str(e.get("value") or ""):
                    yield pwhere, f"{rule} container {c.get('name')!r} sets {e.get('name')} to a literal; {fix}"
    if obj.get("kind") != "RayJob":
        return
    entrypoint = str(spec.get("entrypoint") or "")
    try:
        words = shlex.split(entrypoint)
    except ValueError:
        words = entrypoint.split()
    for name, eq, value in (word.partition("=") for word in words):
        if eq and value and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) and CREDENTIAL_NAME.search(name):
            yield where, f"{rule} the entrypoint sets {name}; {fix}"
    if URI_WITH_PASSWORD.search(entrypoint):
        yield where, f"{rule} the entrypoint holds a URI with a password; {fix}"
    try:
        runtime_env = yaml.safe_load(str(spec.get("runtimeEnvYAML") or "")) or {}
    except yaml.YAMLError:
        runtime_env = {}  # the schema check is not this rule's
    env_vars = runtime_env.get("env_vars") if isinstance(runtime_env, dict) else None
    for name, value in env_vars.items() if isinstance(env_vars, dict) else []:
        if CREDENTIAL_NAME.search(str(name)) and str(value or ""):
            yield where, f"{rule} runtimeEnvYAML's env_vars set {name}; {fix}"
