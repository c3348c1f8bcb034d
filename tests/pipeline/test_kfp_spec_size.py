"""The spec-size cap (`MAX_SPEC_BYTES`) measured against the Argo Workflow a KFP 2.15 backend
makes of a compiled pipeline, not guessed.

A KFP backend compiles the pipeline spec into one Argo Workflow (its argocompiler,
backend/src/v2/compiler/argocompiler in kubeflow/pipelines 2.15.0), and Argo refuses a
Workflow over 1 MiB. `workflow_bytes` estimates that Workflow's size, as compact JSON, from
the argocompiler's structure:

- `spec.arguments`: each component's spec once per distinct container (`components-<hash>`,
  the hash of its executor container; DAG components by name), each container once
  (`implementations-<hash>`), and each component's Kubernetes config
  (`kubernetes-<component>`, per component name: not shared);
- one DAG template per DAG component, and in it, per task, a driver task carrying the task's
  spec as JSON (`task`) plus an executor task (container components) or a DAG task (DAG
  components), with the parameters `containerDriverTask`, `containerExecutorTask`,
  `dagDriverTask` and `dagTask` give them (pod metadata and retry parameters included);
- the fixed templates (the container and DAG drivers, one executor/impl template pair per
  variant: retried or not, by pod-metadata counts), `SYSTEM_TEMPLATE_BYTES` each;
- the run's status, written while it runs: one node per driver and executor pod and per
  DAG, `NODE_BYTES` each, and each container driver's `pod-spec-patch` output (the executor
  container with its command, which holds the component's source, and the pod settings).

The fixed sizes are estimates (the Go structs with their field names and this project's
values); the per-component and per-task parts are the spec's own JSON, measured.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import yaml
from kfp import compiler

from replayrl.config import KubernetesConfig
from replayrl.kfp.pipelines import MAX_SPEC_BYTES, replay_loop_pipeline

pytestmark = pytest.mark.pipeline
ARGO_LIMIT_BYTES = 1024 * 1024
# A system template: the container driver (its ~20 arguments), the DAG driver, or an
# executor template with its impl template (the launcher init container, seven emptyDir
# volumes and mounts, resources, pod-metadata and retry parameters).
SYSTEM_TEMPLATE_BYTES = 4 * 1024
# One node of the Workflow's status: id, name, displayName, type, phase, times, template
# name, boundary, children, progress, resourcesDuration, host node name, small outputs.
NODE_BYTES = 900


def _json(value) -> int:
    return len(json.dumps(value, separators=(",", ":"), sort_keys=True))


def _placeholder(kind: str, key: str) -> str:
    return "{{workflow.parameters." + f"{kind}-{key}" + "}}"


def workflow_bytes(path: Path) -> dict[str, int]:
    """The estimated size of the Argo Workflow for the compiled pipeline at `path`:
    {"spec": bytes, "status": bytes at the run's end, "total": both}."""
    spec, platform = yaml.safe_load_all(path.read_text())
    executors = spec["deploymentSpec"]["executors"]
    k8s = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    components = {"root": spec["root"], **spec["components"]}

    def key_of(name: str) -> str:
        label = components[name].get("executorLabel")
        if label and "container" in executors[label]:
            container = json.dumps(executors[label]["container"], sort_keys=True)
            return hashlib.sha256(container.encode()).hexdigest()
        return name

    arguments: dict[str, int] = {}
    for name, component in components.items():
        arguments.setdefault(f"components-{key_of(name)}", _json(component))
        label = component.get("executorLabel")
        if label:
            arguments.setdefault(f"implementations-{key_of(name)}", _json(executors[label]))
            if label in k8s:
                arguments[f"kubernetes-{name}"] = _json(k8s[label])
    size = sum(len(k) + v + 20 for k, v in arguments.items())

    variants: set[tuple] = set()
    status = 0
    nodes = 0
    for component in components.values():
        if "dag" not in component:
            continue
        size += 200  # the template: name, inputs (parent-dag-id), dag
        nodes += 1
        for task_name, task in component["dag"]["tasks"].items():
            ref = task["componentRef"]["name"]
            driver = {
                "name": f"{task_name}-driver",
                "template": "system-container-driver",
                "depends": " && ".join(f"{d}.Succeeded" for d in task.get("dependentTasks", [])),
                "arguments": {
                    "parameters": [
                        {"name": "component", "value": _placeholder("components", key_of(ref))},
                        {"name": "task", "value": json.dumps(task, separators=(",", ":"))},
                        {"name": "task-name", "value": task_name},
                        {"name": "parent-dag-id", "value": "{{inputs.parameters.parent-dag-id}}"},
                    ]
                },
            }
            out = "{{tasks." + task_name + "-driver.outputs.parameters.%s}}"
            label = components[ref].get("executorLabel")
            if label:
                params = driver["arguments"]["parameters"]
                params.append(
                    {"name": "container", "value": _placeholder("implementations", key_of(ref))}
                )
                if label in k8s:
                    params.append(
                        {"name": "kubernetes-config", "value": _placeholder("kubernetes", ref)}
                    )
                metadata = k8s.get(label, {}).get("podMetadata", {})
                extra = [
                    {"name": f"pod-metadata-key-{i}", "value": key}
                    for i, key in enumerate(
                        [*metadata.get("annotations", {}), *metadata.get("labels", {})]
                    )
                ]
                extra += [
                    {"name": f"pod-metadata-val-{i}", "value": "x" * 20} for i in range(len(extra))
                ]
                retry = task.get("retryPolicy")
                if retry:
                    extra += [{"name": f"retry-{k}", "value": str(v)} for k, v in retry.items()]
                second = {
                    "name": task_name,
                    "template": "retry-system-container-executor",
                    "depends": f"{task_name}-driver.Succeeded",
                    "when": out % "cached-decision" + " != true",
                    "arguments": {
                        "parameters": [
                            {"name": "pod-spec-patch", "value": out % "pod-spec-patch"},
                            {
                                "name": "cached-decision",
                                "value": out % "cached-decision",
                                "default": "false",
                            },
                            *extra,
                        ]
                    },
                }
                variants.add(
                    (
                        bool(retry),
                        len(metadata.get("annotations", {})),
                        len(metadata.get("labels", {})),
                    )
                )
                # the driver's pod-spec-patch output: the container and the pod settings
                status += _json(executors[label]) + _json(k8s.get(label, {})) + 2 * NODE_BYTES
            else:
                second = {
                    "name": task_name,
                    "template": ref,
                    "depends": f"{task_name}-driver.Succeeded",
                    "when": out % "condition" + " != false",
                    "arguments": {
                        "parameters": [
                            {"name": "parent-dag-id", "value": out % "execution-id"},
                            {"name": "condition", "value": out % "condition"},
                        ]
                    },
                }
                status += 2 * NODE_BYTES
            size += _json(driver) + _json(second)
    size += SYSTEM_TEMPLATE_BYTES * (2 + len(variants))
    size += 1024  # metadata, podMetadata, serviceAccountName, entrypoint, the run's parameters
    status += nodes * NODE_BYTES
    return {"spec": size, "status": status, "total": size + status}


@pytest.fixture(scope="module")
def growing(tmp_path_factory) -> list[tuple[int, int, dict[str, int]]]:
    """replay_loop in the step layout (one pod per step: the largest spec per iteration) for
    growing iteration counts: (iterations, YAML bytes, Workflow estimate)."""
    tmp = tmp_path_factory.mktemp("size")
    out = []
    for iterations in (1, 3, 6):
        path = tmp / f"loop-{iterations}.yaml"
        pipeline = replay_loop_pipeline(iterations=iterations, k8s=KubernetesConfig(layout="step"))
        compiler.Compiler().compile(pipeline, str(path))
        out.append((iterations, path.stat().st_size, workflow_bytes(path)))
    return out


def test_a_spec_at_the_cap_makes_a_workflow_that_fits_argos_limit(growing):
    (_, y1, w1), (_, y3, w3), (_, y6, w6) = growing
    # The Workflow grows linearly with the iterations, like the YAML.
    assert w1["total"] < w3["total"] < w6["total"] and y1 < y3 < y6
    per_yaml_byte = (w6["total"] - w3["total"]) / (y6 - y3)
    assert per_yaml_byte == pytest.approx((w3["total"] - w1["total"]) / (y3 - y1), rel=0.05)
    at_cap = w6["total"] + per_yaml_byte * (MAX_SPEC_BYTES - y6)
    # What MAX_SPEC_BYTES' comment states: ~1.9 bytes of Workflow (with its status at the
    # run's end) per byte of YAML, ~2.5-3x for a small pipeline (the fixed templates), and a
    # spec at the cap making a Workflow of about half Argo's limit.
    assert 1.6 < per_yaml_byte < 2.2, per_yaml_byte
    assert 2.4 < w1["total"] / y1 < 3.2
    assert at_cap < 0.55 * ARGO_LIMIT_BYTES, at_cap
    # ... while a spec 2.5 times the cap would not fit
    assert w6["total"] + per_yaml_byte * (2.5 * MAX_SPEC_BYTES - y6) > ARGO_LIMIT_BYTES


def test_the_estimate_counts_what_the_spec_holds(growing):
    """Not a constant: six iterations' Workflow holds six copies of each step's task (the
    one-iteration pipeline also holds what every run has: opening, v0's evaluation, the exit
    task, the shared sub-pipelines' DAGs)."""
    (_, _, w1), _, (_, _, w6) = growing
    fixed = 8 * SYSTEM_TEMPLATE_BYTES
    assert w6["spec"] - fixed > 3.5 * (w1["spec"] - fixed)
    assert w6["status"] > 4 * w1["status"]
