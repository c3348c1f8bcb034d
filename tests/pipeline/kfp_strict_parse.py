"""Parse compiled pipelines strictly with the KFP protos of the Python that runs this script:
one of the small environments `make kfp-proto-venvs` builds (protobuf, googleapis-common-protos,
kfp-pipeline-spec and kfp-kubernetes of one KFP release, nothing else; no PyYAML, so the
pipelines come as JSON). A KFP backend of that release unmarshals the spec the same way
(protojson, unknown fields refused: the driver's Kubernetes config and the argocompiler's
pipeline spec).

stdin: {"<name>": [pipeline spec, platform spec], ...}
stdout: {"versions": {package: version}, "results": {"<name>": "ok" or the parse error}}
"""

import importlib.metadata
import importlib.util
import json
import sys
from pathlib import Path

from google.protobuf import json_format
from kfp.pipeline_spec import pipeline_spec_pb2


def kubernetes_protos():
    """kfp-kubernetes' protos without its package __init__, which imports the kfp SDK."""
    for root in sys.path:
        path = Path(root) / "kfp" / "kubernetes" / "kubernetes_executor_config_pb2.py"
        if path.exists():
            spec = importlib.util.spec_from_file_location("kubernetes_executor_config_pb2", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
    raise SystemExit("kfp-kubernetes is not installed in this environment")


def parse(spec_doc, platform_doc, k8s_pb2):
    spec = json_format.ParseDict(spec_doc, pipeline_spec_pb2.PipelineSpec())
    json_format.ParseDict(
        json_format.MessageToDict(spec.deployment_spec),
        pipeline_spec_pb2.PipelineDeploymentConfig(),
    )
    platform = json_format.ParseDict(platform_doc, pipeline_spec_pb2.PlatformSpec())
    executors = platform.platforms["kubernetes"].deployment_spec.executors
    for label, struct in executors.items():
        try:
            json_format.ParseDict(
                json_format.MessageToDict(struct), k8s_pb2.KubernetesExecutorConfig()
            )
        except json_format.ParseError as e:
            raise json_format.ParseError(f"{label}: {e}") from None


def main():
    k8s_pb2 = kubernetes_protos()
    results = {}
    for name, (spec_doc, platform_doc) in json.load(sys.stdin).items():
        try:
            parse(spec_doc, platform_doc, k8s_pb2)
            results[name] = "ok"
        except json_format.ParseError as e:
            results[name] = str(e)
    versions = {
        p: importlib.metadata.version(p)
        for p in ("kfp-pipeline-spec", "kfp-kubernetes", "protobuf")
    }
    json.dump({"versions": versions, "results": results}, sys.stdout)


if __name__ == "__main__":
    main()
