"""Preflight: will a run of this pipeline start and commit in this namespace? Checked before
anything is submitted, with read-only calls.

Each check gives one line, `✓ what was found` or `✗ what is missing`, and under a ✗ one line
saying what to create or fix; `?` marks a check the caller's credentials may not make (a
Kubeflow profile's owner usually may not list nodes), which does not fail the preflight.
The checks, in order:

1. the Kubeflow Pipelines backend: its healthz version is `client.MIN_BACKEND` (2.15) or newer;
2. the namespace exists, and whether a Kubeflow Profile owns it (its label
   `app.kubernetes.io/part-of: kubeflow-profile` or a `Profile` owner reference; where the
   namespace may not be read, the owner of its `default-editor` account tells);
3. the service account the run will use: `kubernetes.service_account` when the config names
   one, else KFP's default account of the namespace (`default-editor` in a Profile
   namespace or on a multi-user backend, `pipeline-runner` standalone: `default_account`);
4. each Secret and ConfigMap the compiled pipeline's pods take as env: a required one must
   exist with every key the pods read; an optional one may be absent (pods start without it);
5. KFP's `kfp-launcher` ConfigMap, which KFP's install (standalone) or the pipelines profile
   controller (each profile namespace) writes: without it the namespace is not one KFP runs
   pipelines in;
6. nodes for the accelerator pods: a schedulable node whose allocatable `nvidia.com/gpu` (the
   pipeline's accelerator type) covers the largest pod's count, whose labels match the node
   selector and whose NoSchedule/NoExecute taints the pod's tolerations cover. Where none
   does but the cluster may add nodes (`node_scalers`: the cluster autoscaler's status
   ConfigMap in kube-system, or Karpenter NodePools), it is `?`: a pool that scales from
   zero shows no node until a pod asks for one;
7. the run root: on S3, reachable from here with this machine's credentials, and its store
   honours conditional writes (`storage.ensure_writable`, the probe every lineage runs: the
   one check that writes, two small probe objects under the run root, deleted at once);
8. the image: a well-formed reference (`pods.check_image`), pinned by digest or by a tag
   other than `latest`.

What the pipeline needs (4-6, 8) is read from the compiled YAML that will be submitted, so
a `--package` built elsewhere is checked for what it really references. Knows nothing about
steps; reads no environment variable (the Kubernetes client reads KUBECONFIG itself). The
Kubernetes API client and its read-only lookups (`kube_client`, `kube_namespace`, `Kube`) are
`replayrl.kfp.preflight_kube`.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field
from pathlib import Path

from replayrl.errors import ReplayRLError
from replayrl.kfp.preflight_kube import Kube, _Forbidden, _Unreachable, kube_client

OK, FAILED, UNCHECKED = "✓", "✗", "?"
PROFILE_LABEL = ("app.kubernetes.io/part-of", "kubeflow-profile")
PROFILE_ACCOUNT = "default-editor"  # KFP's default in a profile namespace (multi-user)
STANDALONE_ACCOUNT = "pipeline-runner"  # KFP's default in a standalone install
LAUNCHER_CONFIG_MAP = "kfp-launcher"
# The cluster autoscaler writes its status here (its --status-config-map-name default; GKE's,
# EKS's and AKS's managed autoscalers too); Karpenter (1.0+) keeps its node pools as these.
AUTOSCALER_STATUS = ("kube-system", "cluster-autoscaler-status")
KARPENTER_NODEPOOLS = ("karpenter.sh", "v1", "nodepools")


@dataclass(frozen=True)
class Check:
    status: str  # OK, FAILED or UNCHECKED
    line: str  # what was found
    fix: str = ""  # under FAILED or UNCHECKED: what to create or fix, one line

    def render(self) -> str:
        return f"{self.status} {self.line}" + (f"\n    → {self.fix}" if self.fix else "")

    @classmethod
    def failed(cls, what: str, error: ReplayRLError) -> Check:
        """A failed check from a user error, whose text is "what happened. How to fix it.":
        `what: what happened`, and the fix under it."""
        found, *fix = re.split(r"(?<=\.)\s+(?=[A-Z])", str(error), maxsplit=1)
        return cls(FAILED, f"{what}: {found}", fix[0] if fix else "")


@dataclass(frozen=True)
class Ref:
    """A Secret or ConfigMap the pods take as env: the keys they read; optional when every
    task marks it so."""

    optional: bool
    keys: frozenset[str]


@dataclass(frozen=True)
class GpuPod:
    """The accelerator pods of one shape: type, the largest count, where they may go."""

    resource: str  # e.g. nvidia.com/gpu
    count: int
    tolerations: tuple[tuple[tuple[str, str], ...], ...]  # each as sorted (field, value)
    node_selector: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Needs:
    """What a compiled pipeline needs from its namespace (`needs_of`)."""

    secrets: dict[str, Ref] = field(default_factory=dict)
    config_maps: dict[str, Ref] = field(default_factory=dict)
    images: frozenset[str] = frozenset()
    gpu_pods: tuple[GpuPod, ...] = ()


def needs_of(package: Path) -> Needs | None:
    """Read the Secrets, ConfigMaps, images and accelerator pods out of a compiled pipeline
    YAML (its deployment spec and its Kubernetes platform spec); None for an archive."""
    import yaml

    if Path(package).suffix not in (".yaml", ".yml"):
        return None
    docs = [d for d in yaml.safe_load_all(Path(package).read_text()) if isinstance(d, dict)]
    spec = docs[0] if docs else {}
    platform = next((d for d in docs[1:] if "platforms" in d), {})
    executors = (spec.get("deploymentSpec") or {}).get("executors") or {}
    pods = ((platform.get("platforms") or {}).get("kubernetes") or {}).get("deploymentSpec")
    pods = (pods or {}).get("executors") or {}
    secrets: dict[str, Ref] = {}
    config_maps: dict[str, Ref] = {}
    images: set[str] = set()
    shapes: dict[tuple, int] = {}
    for name, executor in executors.items():
        container = executor.get("container") or {}
        if container.get("image"):
            images.add(container["image"])
        pod = pods.get(name) or {}
        for ref in pod.get("secretAsEnv") or []:
            _add(secrets, _ref_name(ref, "secret"), ref, "secretKey")
        for ref in pod.get("configMapAsEnv") or []:
            _add(config_maps, _ref_name(ref, "configMap"), ref, "configMapKey")
        accelerator = (container.get("resources") or {}).get("accelerator") or {}
        resource = accelerator.get("resourceType") or accelerator.get("type")
        count = int(accelerator.get("resourceCount") or accelerator.get("count") or 0)
        if resource and count:
            tolerations = tuple(
                sorted(
                    tuple(sorted((k, str(v)) for k, v in t.items()))
                    for t in pod.get("tolerations") or []
                )
            )
            labels = ((pod.get("nodeSelector") or {}).get("labels")) or {}
            shape = (resource, tolerations, tuple(sorted((k, str(v)) for k, v in labels.items())))
            shapes[shape] = max(count, shapes.get(shape, 0))
    gpu_pods = tuple(GpuPod(s[0], n, s[1], s[2]) for s, n in sorted(shapes.items()))
    return Needs(secrets, config_maps, frozenset(images), gpu_pods)


def _ref_name(ref: dict, kind: str) -> str:
    constant = ((ref.get(f"{kind}NameParameter") or {}).get("runtimeValue") or {}).get("constant")
    return str(ref.get(f"{kind}Name") or constant or "")


def _add(into: dict[str, Ref], name: str, ref: dict, key_field: str) -> None:
    if not name:
        return
    keys = frozenset(k[key_field] for k in ref.get("keyToEnv") or [] if k.get(key_field))
    optional = bool(ref.get("optional"))
    old = into.get(name)
    if old is not None:
        optional, keys = optional and old.optional, keys | old.keys
    into[name] = Ref(optional, keys)


def _owned_by_profile(meta) -> bool:
    return any(r.kind == "Profile" for r in (meta.owner_references or []))


def is_profile_namespace(obj) -> bool:
    """A Kubeflow Profile's namespace: its label, or a Profile owner reference."""
    labels = obj.metadata.labels or {}
    return labels.get(PROFILE_LABEL[0]) == PROFILE_LABEL[1] or _owned_by_profile(obj.metadata)


def default_account(*, profile: bool, multi_user: bool) -> str:
    """KFP's default account of a run's namespace (the API server's
    DEFAULTPIPELINERUNNERSERVICEACCOUNT: `default-editor` in multi-user Kubeflow's manifests,
    `pipeline-runner` in a standalone install)."""
    return PROFILE_ACCOUNT if profile or multi_user else STANDALONE_ACCOUNT


@dataclass(frozen=True)
class Target:
    """Where and as what the run goes: namespace, the config's service account (None: the
    namespace's default), its run root, and what its compiled pipeline needs."""

    namespace: str
    service_account: str | None
    run_root: str | None
    needs: Needs | None


# ---------------------------------------------------------------- the checks


def check_backend(conn) -> tuple[Check, bool]:
    """The KFP backend's version (healthz); and whether it is multi-user."""
    from replayrl.kfp import client as kfp_client

    floor = ".".join(map(str, kfp_client.MIN_BACKEND))
    host = conn.host or "the in-cluster endpoint"
    try:
        backend = kfp_client.read_backend(kfp_client.connect(conn), conn)
    except ReplayRLError as e:
        return Check(FAILED, f"Kubeflow Pipelines at {host}: no version read", str(e)), False
    mode = "multi-user" if backend.multi_user else "single-user"
    found = kfp_client.parse_version(backend.version)
    if found is None:
        return (
            Check(
                OK,
                f"Kubeflow Pipelines at {host} ({mode}) reports version "
                f"{backend.version!r}, not a release number: cannot check it is {floor}+",
            ),
            backend.multi_user,
        )
    if found < kfp_client.MIN_BACKEND:
        return (
            Check(
                FAILED,
                f"Kubeflow Pipelines {backend.version} at {host} is older than {floor}",
                f"upgrade Kubeflow Pipelines to {floor} or newer (older drivers make the pods' "
                f"optional Secrets and ConfigMaps required)",
            ),
            backend.multi_user,
        )
    return Check(OK, f"Kubeflow Pipelines {backend.version} at {host} ({mode})"), backend.multi_user


def check_namespace(kube: Kube, target: Target, multi_user: bool) -> tuple[list[Check], bool]:
    """The namespace and the account the run uses. Returns the checks and whether the
    namespace exists (absent: the namespace checks that follow are left out)."""
    ns = target.namespace
    profile: bool | None = None
    try:
        obj = kube.namespace(ns)
    except _Forbidden:
        seen = "it may not be read here"
    else:
        if obj is None:
            return [
                Check(
                    FAILED,
                    f"namespace {ns} does not exist on {kube.host}",
                    "pass the namespace your runs go to (--namespace): your Kubeflow profile's, "
                    "or KFP's own (kubeflow) in a standalone install",
                )
            ], False
        profile = is_profile_namespace(obj)
        seen = "a Kubeflow Profile's" if profile else "no Kubeflow Profile"
    if profile is None:  # the namespace may not be read: its default-editor's owner tells
        editor = kube.service_account(PROFILE_ACCOUNT, ns)
        profile = editor is not None and _owned_by_profile(editor.metadata)
        seen += "; a Kubeflow Profile's" if profile else ""
    checks = [Check(OK, f"namespace {ns} ({seen})")]
    named = target.service_account
    account = named or default_account(profile=profile, multi_user=multi_user)
    why = "kubernetes.service_account" if named else "KFP's default account of the namespace"
    if kube.service_account(account, ns) is not None:
        return [*checks, Check(OK, f"service account {account} ({why})")], True
    base = f"kubectl apply -n {ns} -k k8s/base creates replayrl-pipeline-runner"
    if named:
        fix = f"create it ({base}), or set kubernetes.service_account: null for the default"
    elif profile:
        fix = "the namespace's Profile creates default-editor: check the Profile, or name an "
        fix += "account of the namespace in kubernetes.service_account"
    else:
        fix = "use a namespace KFP runs pipelines in (a profile's, or KFP's own), or name an "
        fix += f"account of this one in kubernetes.service_account ({base})"
    line = f"service account {account} ({why}) is not in namespace {ns}"
    checks.append(Check(FAILED, line, fix))
    return checks, True


def check_refs(kube: Kube, target: Target) -> list[Check]:
    """The Secrets and ConfigMaps the pods take as env."""
    needs, ns, checks = target.needs, target.namespace, []
    if needs is None:
        return []
    for kind, refs, read in (
        ("Secret", needs.secrets, kube.secret),
        ("ConfigMap", needs.config_maps, kube.config_map),
    ):
        for name, ref in sorted(refs.items()):
            keys = ", ".join(sorted(ref.keys))
            try:
                obj = read(name, ns)
            except _Forbidden as e:
                checks.append(
                    Check(
                        UNCHECKED,
                        f"{kind} {name}: may not be read here ({e})",
                        f"check by hand that it exists in {ns} with keys {keys}",
                    )
                )
                continue
            if obj is None and ref.optional:
                checks.append(
                    Check(OK, f"{kind} {name} is absent; optional: pods start without {keys}")
                )
                continue
            if obj is None:
                checks.append(
                    Check(
                        FAILED,
                        f"{kind} {name} (required) is not in namespace {ns}",
                        _create(kind, name, ns, ref.keys),
                    )
                )
                continue
            present = set(obj.data or {}) | set(getattr(obj, "string_data", None) or {})
            if kind == "ConfigMap":
                present |= set(obj.binary_data or {})
            missing = sorted(ref.keys - present)
            if missing and not ref.optional:
                checks.append(
                    Check(
                        FAILED,
                        f"{kind} {name} lacks key(s) {', '.join(missing)}",
                        f"add them: {_create(kind, name, ns, ref.keys)} (after deleting it)",
                    )
                )
            else:
                unset = f"; unset in pods: {', '.join(missing)}" if missing else ""
                checks.append(
                    Check(
                        OK, f"{kind} {name} ({'optional' if ref.optional else 'required'}{unset})"
                    )
                )
    return checks


def _create(kind: str, name: str, ns: str, keys) -> str:
    flags = " ".join(f"--from-literal={k}=..." for k in sorted(keys))
    what = "secret generic" if kind == "Secret" else "configmap"
    return f"kubectl -n {ns} create {what} {name} {flags}".rstrip()


def check_launcher(kube: Kube, target: Target) -> Check:
    ns = target.namespace
    try:
        obj = kube.config_map(LAUNCHER_CONFIG_MAP, ns)
    except _Forbidden as e:
        return Check(
            UNCHECKED,
            f"ConfigMap {LAUNCHER_CONFIG_MAP}: may not be read here ({e})",
            f"check by hand: kubectl -n {ns} get configmap {LAUNCHER_CONFIG_MAP}",
        )
    if obj is None:
        return Check(
            FAILED,
            f"ConfigMap {LAUNCHER_CONFIG_MAP} is not in namespace {ns}: KFP does not run "
            f"pipelines here",
            "use a namespace KFP serves: a Kubeflow profile's (its pipelines profile controller "
            "writes kfp-launcher) or KFP's own in a standalone install",
        )
    root = (obj.data or {}).get("defaultPipelineRoot")
    return Check(
        OK,
        f"ConfigMap {LAUNCHER_CONFIG_MAP}" + (f" (default pipeline root {root})" if root else ""),
    )


def check_gpu_nodes(kube: Kube, target: Target) -> list[Check]:
    if target.needs is None or not target.needs.gpu_pods:
        return [Check(OK, "accelerators: the pipeline requests none")]
    try:
        nodes = kube.nodes()
    except _Forbidden as e:
        return [
            Check(
                UNCHECKED,
                f"GPU nodes: nodes may not be listed here ({e})",
                "ask a cluster admin which nodes offer the accelerator and taints below",
            )
        ]
    return [_gpu_check(kube, pod, nodes) for pod in target.needs.gpu_pods]


def node_scalers(kube: Kube, resource: str) -> list[str]:
    """What may add nodes to the cluster, as the API shows it: the cluster autoscaler (its
    status ConfigMap), Karpenter NodePools (those whose limits do not forbid `resource`).
    Empty when neither is seen, or the caller may not read them."""
    found = []
    namespace, name = AUTOSCALER_STATUS
    with contextlib.suppress(_Forbidden):
        if kube.config_map(name, namespace) is not None:
            found.append(f"the cluster autoscaler: ConfigMap {namespace}/{name}")
    with contextlib.suppress(_Forbidden):
        pools = kube.cluster_objects(*KARPENTER_NODEPOOLS) or []
        names = [
            str((pool.get("metadata") or {}).get("name"))
            for pool in pools
            if _count(((pool.get("spec") or {}).get("limits") or {}).get(resource, 1))
        ]
        if names:
            found.append(f"Karpenter NodePools {', '.join(sorted(names))}")
    return found


def _gpu_check(kube: Kube, pod: GpuPod, nodes) -> Check:
    selector = dict(pod.node_selector)
    tolerations = [dict(t) for t in pod.tolerations]
    want = f"{pod.count} {pod.resource}" + (f" with labels {selector}" if selector else "")
    seen = []
    for node in nodes:
        have = _count((node.status.allocatable or {}).get(pod.resource) if node.status else None)
        if not have:
            continue
        name, labels = node.metadata.name, node.metadata.labels or {}
        if node.spec and node.spec.unschedulable:
            seen.append(f"{name}: cordoned")
        elif have < pod.count:
            seen.append(f"{name}: only {have}")
        elif any(labels.get(k) != v for k, v in selector.items()):
            seen.append(f"{name}: labels do not match")
        elif untolerated := [t for t in (node.spec.taints or []) if not _tolerated(t, tolerations)]:
            seen.append(
                f"{name}: taint {untolerated[0].key}={untolerated[0].value or ''}:{untolerated[0].effect}"
            )
        else:
            return Check(OK, f"node {name} offers {want} ({have} allocatable)")
    found = f" (found {'; '.join(seen[:4])})" if seen else " (no node has any)"
    if scalers := node_scalers(kube, pod.resource):
        return Check(
            UNCHECKED,
            f"no node offers {want} with taints the pods tolerate yet{found}; an autoscaler "
            f"may add one ({'; '.join(scalers)})",
            "if the GPU pods stay Pending, `kubectl describe pod` says why: check that a node "
            "pool offers this accelerator with these labels and taints, and its maximum size",
        )
    return Check(
        FAILED,
        f"no schedulable node offers {want} with taints the pods tolerate{found}",
        "fix kubernetes.gpu_tolerations / gpu_node_selector / the *_gpus counts, or add GPU "
        "nodes (a node pool that scales from zero shows none until asked: then --skip-preflight)",
    )


def _count(quantity) -> int:
    try:
        return int(float(str(quantity)))
    except (TypeError, ValueError):
        return 0


def _tolerated(taint, tolerations: list[dict[str, str]]) -> bool:
    """Kubernetes' rule (ToleratesTaint): PreferNoSchedule never blocks; an empty key with
    Exists tolerates everything; else key, effect (empty = any) and value (Equal) match."""
    if taint.effect == "PreferNoSchedule":
        return True
    for t in tolerations:
        if t.get("effect") and t["effect"] != taint.effect:
            continue
        if not t.get("key") and t.get("operator") == "Exists":
            return True
        if t.get("key") != taint.key:
            continue
        if t.get("operator") == "Exists" or t.get("value", "") == (taint.value or ""):
            return True
    return False


def check_run_root(run_root: str | None) -> Check:
    from replayrl import storage

    if not run_root:
        return Check(
            UNCHECKED,
            "run root: not known here (the config is read by the pipeline)",
            "check that its s3:// store is reachable and honours conditional writes",
        )
    if not storage.is_s3(run_root):
        return Check(
            FAILED,
            f"run root {run_root} is a path, gone with each pod",
            "pass --run-root s3://bucket/prefix (or set storage.run_root)",
        )
    try:
        storage.ensure_writable(run_root)
    except ReplayRLError as e:
        return Check.failed(f"run root {run_root}", e)
    return Check(OK, f"run root {run_root} is writable and its store honours conditional writes")


def check_images(needs: Needs | None) -> list[Check]:
    from replayrl.kfp.pods import check_image

    checks = []
    for image in sorted(needs.images if needs else ()):
        try:
            check_image(image)
        except ReplayRLError as e:
            checks.append(Check(FAILED, f"image {image} is malformed", str(e)))
            continue
        name, _, digest = image.partition("@")
        tag = name.rsplit("/", 1)[-1].partition(":")[2]
        if digest:
            checks.append(Check(OK, f"image {image} is pinned by digest"))
        elif tag and tag != "latest":
            checks.append(
                Check(
                    OK,
                    f"image {image} is pinned by tag {tag} (a tag can be pushed again; a digest cannot)",
                )
            )
        else:
            checks.append(
                Check(
                    FAILED,
                    f"image {image} is not pinned (no tag, or latest)",
                    "compile with --image name@sha256:<digest> (or at least name:<version>)",
                )
            )
    return checks


def run(
    conn, target: Target, *, kubeconfig: str | None = None, context: str | None = None
) -> list[Check]:
    """Every check, in the module docstring's order, against KFP at `conn` and the
    Kubernetes API of `kubeconfig` / `context` (None: KUBECONFIG or ~/.kube/config, else the
    pod's own account)."""
    backend, multi_user = check_backend(conn)
    checks = [backend]
    try:
        kube: Kube | None = Kube(kube_client(kubeconfig, context))
    except ReplayRLError as e:
        kube = None
        checks.append(Check(FAILED, "Kubernetes API: no client", str(e)))
    if kube is not None:
        try:
            found, exists = check_namespace(kube, target, multi_user)
            checks += found
            if exists:
                checks += check_refs(kube, target)
                checks.append(check_launcher(kube, target))
                checks += check_gpu_nodes(kube, target)
        except (_Unreachable, _Forbidden) as e:
            checks.append(
                Check(
                    FAILED,
                    f"Kubernetes API at {kube.host}: {e}",
                    "check --kubeconfig / --context and that your credentials may read the namespace",
                )
            )
    checks.append(check_run_root(target.run_root))
    checks += check_images(target.needs)
    return checks


def failures(checks: list[Check]) -> int:
    return sum(c.status == FAILED for c in checks)
