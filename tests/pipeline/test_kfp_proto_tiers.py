"""Every compiled pipeline parses strictly with the protos of each KFP backend release we
support (2.15, 2.16, 2.17), as that backend unmarshals it: each release's kfp-pipeline-spec
and kfp-kubernetes in a small environment of its own (`make kfp-proto-venvs`, which
`make test` builds first), running tests/pipeline/kfp_strict_parse.py. The installed kfp
SDK's own protos (newer) are checked by test_kfp_compile.py.

A field a release does not know fails that release's parse, as it fails that backend's
driver: `kubernetes.run_as_user`'s securityContext came with 2.16, so the test also shows
that the 2.15 protos refuse it (which is why the setting is off by default).
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from test_kfp_compile import COMMITTED

from replayrl.kfp.pipelines import compile_pipelines

pytestmark = pytest.mark.pipeline
ROOT = Path(__file__).parents[2]
SCRIPT = Path(__file__).with_name("kfp_strict_parse.py")
TIERS = ("2.15.0", "2.16.0", "2.17.0")


def tier_python(version: str) -> Path:
    python = ROOT / f".venv-kfp-{version}" / "bin" / "python"
    if not python.exists():
        pytest.fail(f"{python} is missing: run `make kfp-proto-venvs` (`make test` does)")
    return python


def strict_parse(version: str, paths: list[Path]) -> dict[str, str]:
    """{file: "ok" or the parse error} under the protos of KFP `version`."""
    docs = {f"{p.parent.name}/{p.name}": list(yaml.safe_load_all(p.read_text())) for p in paths}
    proc = subprocess.run(
        [str(tier_python(version)), str(SCRIPT)],
        input=json.dumps(docs),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    # the environment holds exactly the release it is named after
    assert out["versions"]["kfp-pipeline-spec"] == version
    assert out["versions"]["kfp-kubernetes"] == version
    return out["results"]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict[str, list[Path]]:
    """The committed pipelines and the step layout's with Kueue labels ("default"), and one
    with a security context ("run_as_user")."""
    from kfp import compiler

    from replayrl.config import KubernetesConfig
    from replayrl.kfp.pipelines import replay_iteration_pipeline

    tmp = tmp_path_factory.mktemp("tiers")
    step = tmp / "step.yaml"
    step.write_text(yaml.safe_dump({"kubernetes": {"layout": "step", "kueue_queue": "rl"}}))
    default = sorted(COMMITTED.glob("*.yaml"))
    default += compile_pipelines(tmp / "step", iterations=1, config_path=step)
    secured = tmp / "secured.yaml"
    k8s = KubernetesConfig(run_as_user=1000)
    compiler.Compiler().compile(replay_iteration_pipeline(k8s=k8s), str(secured))
    return {"default": default, "run_as_user": [secured]}


@pytest.mark.parametrize("version", TIERS)
def test_every_compiled_pipeline_parses_strictly_with_each_backends_protos(version, compiled):
    results = strict_parse(version, compiled["default"])
    assert len(results) == 10  # five pipelines, committed and compiled in the step layout
    assert results == dict.fromkeys(results, "ok")


@pytest.mark.parametrize("version", TIERS)
def test_a_security_context_needs_a_2_16_backend(version, compiled):
    results = strict_parse(version, compiled["run_as_user"])
    if version.startswith("2.15"):
        for name, result in results.items():
            assert 'no field named "securityContext"' in result, name
    else:
        assert results == dict.fromkeys(results, "ok")


def test_the_makefile_builds_the_tiers_test_needs():
    makefile = (ROOT / "Makefile").read_text()
    (tiers,) = re.findall(r"^KFP_PROTO_TIERS := (.+)$", makefile, re.M)
    assert tuple(tiers.split()) == TIERS
    assert re.search(r"^test: .*kfp-proto-venvs", makefile, re.M)
    assert ".venv-kfp-*/" in (ROOT / ".gitignore").read_text().splitlines()
