"""The GPU start-up check's pure parts: the CUDA -> minimum driver table, driver version
comparison and parsing, and the one line a step that asked for GPUs fails (or warns) with
for each thing it can find. The check in a real component body on this CPU machine is in
tests/pipeline/test_gpu_guard.py."""

from __future__ import annotations

import pytest

from replayrl.errors import ReplayRLError
from replayrl.policy import gpu
from replayrl.policy.gpu import Found

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "cuda,driver",
    [
        ("12.8", "570.26"),
        ("12.8.1", "570.26"),
        ("12.9", "575.51.03"),
        ("13.0", "580.65.06"),
        ("13.0.1", "580.65.06"),
        # a newer minor than the table knows: its major's newest entry, a lower bound
        ("13.2", "580.65.06"),
        # older than anything in the table, or another major: unknown
        ("12.6", None),
        ("11.8", None),
    ],
)
def test_minimum_driver_of_a_cuda_release(cuda, driver):
    assert gpu.minimum_driver(cuda) == driver


def test_the_image_cuda_is_in_the_table():
    assert gpu.minimum_driver(gpu.IMAGE_CUDA) == "580.65.06"


@pytest.mark.parametrize(
    "found,needed,older",
    [
        ("575.57.08", "580.65.06", True),
        ("570.124.06", "580.65.06", True),
        ("580.65.06", "580.65.06", False),
        ("580.65.6", "580.65.06", False),  # parts are numbers, not strings
        ("580.82.07", "580.65.06", False),
        ("570.124.06", "570.26", False),  # 124 > 26, though "1" < "2" as text
        ("570.26", "570.124.06", True),
        ("1000.1", "580.65.06", False),
        ("580", "580.65.06", True),
    ],
)
def test_driver_versions_compare_part_by_part_as_numbers(found, needed, older):
    assert gpu.driver_older(found, needed) is older


def test_a_malformed_version_is_refused():
    with pytest.raises(ValueError):
        gpu.version_tuple("580.65.06-beta")


@pytest.mark.parametrize(
    "text,version",
    [
        (
            "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.65.06  Sun Jul 27 06:54:38 UTC 2025\n"
            "GCC version:  gcc version 13.3.0 (Ubuntu 13.3.0-6ubuntu2~24.04)\n",
            "580.65.06",
        ),
        (
            "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.124.06  Release Build  "
            "(dvs-builder@U16-I3-B03-4-3)  Thu Feb 20 01:38:59 UTC 2025\n",
            "570.124.06",
        ),
        ("something else entirely\n", None),
    ],
)
def test_the_driver_version_is_read_from_proc(text, version):
    assert gpu.proc_driver_version(text) == version


CPU_BUILD = Found(
    torch_version="2.13.0+cpu", torch_cuda=None, available=False, device_count=0, driver=None
)


def test_a_cpu_build_without_a_driver_says_so_in_one_line():
    line = gpu.problem(1, CPU_BUILD)
    assert line is not None and "\n" not in line
    assert line.startswith("This step asked for 1 GPU but CUDA is not usable")
    assert "torch 2.13.0+cpu is a CPU build (torch.version.cuda is None)" in line
    assert "NVIDIA driver: none found" in line
    # a CPU build has no CUDA of its own: the image's CUDA and its driver are named
    assert f"CUDA {gpu.IMAGE_CUDA} needs driver >= 580.65.06" in line
    assert "kubernetes.*_gpus to 0" in line


def test_a_cuda_build_on_a_too_old_driver_names_both_versions():
    found = Found(
        torch_version="2.14.0+cu130",
        torch_cuda="13.0",
        available=False,
        device_count=0,
        driver="570.124.06",
    )
    line = gpu.problem(2, found)
    assert "asked for 2 GPUs" in line
    assert (
        "torch 2.14.0+cu130 is built for CUDA 13.0 but torch.cuda.is_available() is False" in line
    )
    assert "NVIDIA driver 570.124.06 is older than the 580.65.06 it needs" in line


def test_a_cuda_build_whose_driver_is_new_enough_reports_the_driver_found():
    found = Found("2.14.0+cu130", "13.0", available=False, device_count=0, driver="580.82.07")
    line = gpu.problem(1, found)
    assert "NVIDIA driver 580.82.07;" in line and "older" not in line


def test_fewer_gpus_than_requested_is_a_problem_and_enough_is_none(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    one = Found("2.14.0+cu130", "13.0", available=True, device_count=1, driver="580.82.07")
    line = gpu.problem(2, one)
    assert "asked for 2 GPUs but torch sees 1 (CUDA_VISIBLE_DEVICES=0)" in line
    assert gpu.problem(1, one) is None


def test_a_usable_gpu_on_an_old_driver_gets_one_warning_line():
    old = Found("2.14.0+cu130", "13.0", available=True, device_count=1, driver="575.57.08")
    warning = gpu.driver_warning(old)
    assert warning is not None and "\n" not in warning
    assert "575.57.08 is older than 580.65.06, the minimum for CUDA 13.0" in warning
    assert gpu.problem(1, old) is None  # usable (e.g. forward compatibility): a warning only
    new = Found("2.14.0+cu130", "13.0", available=True, device_count=1, driver="580.65.06")
    assert gpu.driver_warning(new) is None
    assert gpu.driver_warning(CPU_BUILD) is None


def test_the_requested_count_comes_from_the_pod_environment():
    assert gpu.requested_gpus({}) == 0
    assert gpu.requested_gpus({gpu.REQUIRE_GPU_ENV: ""}) == 0
    assert gpu.requested_gpus({gpu.REQUIRE_GPU_ENV: "2"}) == 2
    with pytest.raises(ReplayRLError, match="must be a GPU count"):
        gpu.requested_gpus({gpu.REQUIRE_GPU_ENV: "yes"})


def test_asking_for_no_gpu_checks_nothing():
    gpu.require_cuda(0)  # no probe: passes on any machine


def test_asking_for_a_gpu_on_this_machine_fails_with_what_it_found():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a usable GPU")
    with pytest.raises(ReplayRLError) as e:
        gpu.require_cuda(1)
    assert f"torch {torch.__version__}" in str(e.value) and "\n" not in str(e.value)


def test_replayrl_run_without_cuda_warns_of_nothing(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a usable GPU")
    gpu.warn_if_old_driver()
    assert capsys.readouterr().err == ""


def test_a_cuda_the_table_does_not_know_is_named_without_a_driver_minimum():
    found = Found("2.5.0+cu118", "11.8", available=False, device_count=0, driver="520.61.05")
    line = gpu.problem(1, found)
    assert "NVIDIA driver 520.61.05. Run it on a node" in line
    assert "a driver for CUDA 11.8" in line and ">=" not in line
