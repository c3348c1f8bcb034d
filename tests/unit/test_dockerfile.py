"""The components' image (k8s/image/Dockerfile) installs what pyproject.toml declares: this
package with its `gpu` extra (vLLM, exactly as pinned there) and `kfp`, and nothing beside
pyproject's own requirements; its base images are pinned; its tag is the pipelines' default.

The image is not built here (no Docker daemon, and the `gpu` extra must never be installed on
a CPU machine); the Dockerfile is parsed, and its own build step re-checks the installed
versions against pyproject.toml.
"""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import InvalidRequirement, Requirement

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "k8s" / "image" / "Dockerfile"
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# `pip install`, `pip3 install`, `uv pip install`, `python -m pip install`.
INSTALLERS = ("pip", "pip3")


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined; heredoc bodies skipped."""
    out: list[tuple[str, str]] = []
    lines = iter(text.splitlines())
    pending = ""
    for line in lines:
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line.rstrip("\\").rstrip() + " " if line.endswith("\\") else line
        if line.endswith("\\"):
            continue
        word, _, rest = pending.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        heredoc = re.search(r"<<-?'?(\w+)'?", rest)
        if heredoc:  # the body is a script's text, not instructions
            for body in lines:
                if body.strip() == heredoc.group(1):
                    break
        pending = ""
    return out


def expand(value: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), value)


def install_targets(text: str) -> tuple[list[str], list[str]]:
    """(extras of the local project installs, named requirements) of every pip install."""
    args: dict[str, str] = {}
    project_extras: list[str] = []
    named: list[str] = []
    for word, rest in instructions(text):
        if word == "ARG" and "=" in rest:
            key, _, value = rest.partition("=")
            args[key.strip()] = value.strip().strip('"')
        if word != "RUN":
            continue
        for command in re.split(r"&&|;", expand(rest, args)):
            tokens = shlex.split(command)
            starts = [
                i
                for i in range(len(tokens) - 1)
                if tokens[i] in INSTALLERS and tokens[i + 1] == "install"
            ]
            for i in starts:
                skip_value = ""
                for token in tokens[i + 2 :]:
                    if skip_value in ("-r", "--requirement"):
                        named.append(f"{skip_value} {token}")  # a list pyproject does not govern
                        skip_value = ""
                    elif skip_value:
                        skip_value = ""
                    elif token in ("--python", "-r", "--requirement", "-c", "--index-url"):
                        skip_value = token
                    elif token.startswith("-"):
                        continue
                    elif token == "." or token.startswith((".[", "/", "./")):
                        extras = re.search(r"\[(.*)\]", token)
                        project_extras += extras.group(1).split(",") if extras else []
                        project_extras.append("<project>")
                    else:
                        named.append(token)
    return project_extras, named


def problems(text: str) -> list[str]:
    """What makes this Dockerfile install something other than pyproject's gpu image."""
    extras, named = install_targets(text)
    found: list[str] = []
    if "<project>" not in extras:
        found.append("the package itself is not installed from the build context")
    for extra in ("gpu", "kfp"):
        if extra not in extras:
            found.append(f"the `{extra}` extra is not installed")
    for extra in extras:
        if extra != "<project>" and extra not in PROJECT["optional-dependencies"]:
            found.append(f"unknown extra {extra!r}")
    declared = PROJECT["dependencies"] + [
        r for reqs in PROJECT["optional-dependencies"].values() for r in reqs
    ]
    declared_norm = {str(Requirement(r)) for r in declared}
    for text_req in named:
        # A package named on its own would bypass (or fight) pyproject's pins, e.g. a second
        # vllm or torch; only pyproject's exact requirement strings are allowed.
        try:
            normalized = str(Requirement(text_req))
        except InvalidRequirement:
            normalized = text_req
        if normalized not in declared_norm:
            found.append(f"installs {text_req!r}, which pyproject.toml does not declare")
    return found


def test_the_dockerfile_installs_the_gpu_extra_and_nothing_else():
    assert problems(DOCKERFILE.read_text()) == []


def test_the_gpu_extra_is_what_the_image_gets():
    extras, named = install_targets(DOCKERFILE.read_text())
    gpu = [Requirement(r) for r in PROJECT["optional-dependencies"]["gpu"]]
    assert [r.name for r in gpu] == ["vllm"], "update this test with the new gpu extra"
    assert "gpu" in extras
    # Nothing installs a vllm or torch of its own beside the extra's pin.
    assert not [r for r in named if Requirement(r).name in {"vllm", "torch"}]


@pytest.mark.parametrize(
    "edit, expected",
    [
        (
            lambda t: t.replace("ARG REPLAYRL_EXTRAS=gpu,kfp,s3", "ARG REPLAYRL_EXTRAS=kfp,s3"),
            "`gpu`",
        ),
        (
            lambda t: t.replace("ARG REPLAYRL_EXTRAS=gpu,kfp,s3", "ARG REPLAYRL_EXTRAS=gpu,s3"),
            "`kfp`",
        ),
        (
            lambda t: t + "\nRUN uv pip install --python /opt/venv/bin/python vllm==0.32.0\n",
            "vllm==0.32.0",
        ),
        (lambda t: t + "\nRUN pip install torch && pip install kfp==2.17.3\n", "'torch'"),
        (
            lambda t: t.replace('".[${REPLAYRL_EXTRAS}]"', "replayrl"),
            "not installed from the build",
        ),
        (lambda t: t + "\nRUN pip install -r requirements-gpu.txt\n", "requirements-gpu.txt"),
    ],
)
def test_a_drifting_dockerfile_is_caught(edit, expected):
    text = edit(DOCKERFILE.read_text())
    assert text != DOCKERFILE.read_text()
    found = problems(text)
    assert any(expected in p for p in found), found


def test_base_images_are_pinned():
    args = {}
    froms = []
    for word, rest in instructions(DOCKERFILE.read_text()):
        if word == "ARG" and "=" in rest:
            key, _, value = rest.partition("=")
            args[key] = value
        if word == "FROM":
            froms.append(expand(rest.split()[0], args))
    stages = {
        rest.split()[-1]
        for w, rest in instructions(DOCKERFILE.read_text())
        if w == "FROM" and " AS " in rest
    }
    external = [f for f in froms if f not in stages]
    assert external and any(f.startswith("nvidia/cuda:") for f in external)
    for image in external:
        name = image.split("/")[-1]
        assert re.search(r":[\w][\w.-]*$|@sha256:[0-9a-f]{64}$", name), f"{image} is not pinned"
        assert not name.endswith(":latest"), image


def test_the_cuda_base_matches_the_wheels_cuda_and_names_its_minimum_driver():
    from replayrl.policy.gpu import IMAGE_CUDA, MINIMUM_DRIVER, minimum_driver, version_tuple

    args = dict(
        rest.partition("=")[::2]
        for word, rest in instructions(DOCKERFILE.read_text())
        if word == "ARG" and "=" in rest
    )
    base = re.fullmatch(r"nvidia/cuda:(\d+\.\d+)\.\d+-[\w.-]+", args["CUDA_BASE"])
    assert base, f"CUDA_BASE {args['CUDA_BASE']} is not an nvidia/cuda:X.Y.Z-... tag"
    cuda = base.group(1)
    # The start-up check's table knows the base's CUDA, and it is the image's (the wheels').
    assert cuda in MINIMUM_DRIVER
    assert version_tuple(cuda)[0] == version_tuple(IMAGE_CUDA)[0], (
        f"the base is CUDA {cuda} but the torch wheel vLLM pins is built for {IMAGE_CUDA}"
    )
    assert cuda == IMAGE_CUDA
    # The Dockerfile and the README state that minimum.
    driver = minimum_driver(cuda)
    assert f"driver >= {driver}" in DOCKERFILE.read_text()
    assert driver in (ROOT / "README.md").read_text()


def test_the_default_image_is_tagged_with_the_package_version():
    from replayrl.kfp import DEFAULT_IMAGE

    repository, _, tag = DEFAULT_IMAGE.rpartition(":")
    assert tag == PROJECT["version"], (
        f"DEFAULT_IMAGE {DEFAULT_IMAGE} does not carry the package version {PROJECT['version']}"
    )
    # The build command in the Dockerfile's header produces exactly that image.
    assert f"-t {DEFAULT_IMAGE} ." in DOCKERFILE.read_text()


def test_the_build_context_keeps_what_the_install_reads():
    ignore = [line for line in (ROOT / ".dockerignore").read_text().splitlines() if line]
    rules = [line for line in ignore if not line.startswith("#")]
    assert rules[0] == "*"  # an allow-list: .venv, runs, .git never reach the daemon
    for needed in ("!pyproject.toml", "!README.md", "!src/"):
        assert needed in ignore
    copied = [rest for word, rest in instructions(DOCKERFILE.read_text()) if word == "COPY"]
    assert "pyproject.toml README.md ./" in copied and "src ./src" in copied
