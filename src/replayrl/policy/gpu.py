"""Whether this process can use the GPUs its step asked for, and which NVIDIA driver the
image's CUDA needs.

A Kubeflow pod of an accelerator step carries `REPLAYRL_REQUIRE_GPU=<count>` (set by
`replayrl.kfp.pods`), and every component body calls `check_pod()` before it reads or
downloads anything. Without the check, a pod whose CUDA is not usable (a CPU build of torch,
no NVIDIA container runtime, a driver too old for the wheel's CUDA) would train on its CPU
for hours while holding a GPU. With it, the step stops in seconds with one line that says
what was found, e.g.:

    This step asked for 1 GPU but CUDA is not usable: torch 2.13.0+cpu is a CPU build
    (torch.version.cuda is None); NVIDIA driver: none found (...); CUDA 13.0 needs driver
    >= 580.65.06. Run it on a node ...

(one line in the pod's log). When CUDA is usable but the driver is older than the minimum
(a forward-compatibility package can make that work), it prints one warning line and goes
on; `replayrl run` does the same on a machine with CUDA (`warn_if_old_driver`).

`MINIMUM_DRIVER` is the minimum Linux driver of each CUDA release (from NVIDIA's CUDA
toolkit release notes); `IMAGE_CUDA` is the CUDA of the torch wheel that the project image's
vLLM pins (k8s/image/Dockerfile's CUDA base must match it; tests/unit/test_dockerfile.py
checks that). Knows nothing about steps, pods or configs; torch is imported only to probe.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from replayrl.errors import ReplayRLError

# Set on the pods of accelerator steps to the number of GPUs they requested.
REQUIRE_GPU_ENV = "REPLAYRL_REQUIRE_GPU"
# CUDA (major.minor) of the torch wheel in the project image: vllm 0.33 pins torch 2.14,
# whose PyPI wheels are built for CUDA 13.0.
IMAGE_CUDA = "13.0"
# CUDA release (major.minor) -> the oldest Linux x86_64 driver that runs it.
MINIMUM_DRIVER = {"12.8": "570.26", "12.9": "575.51.03", "13.0": "580.65.06"}
PROC_DRIVER_VERSION = Path("/proc/driver/nvidia/version")


def version_tuple(text: str) -> tuple[int, ...]:
    """'580.65.06' -> (580, 65, 6); '13.0' -> (13, 0). Raises ValueError on anything else."""
    if not re.fullmatch(r"\d+(\.\d+)*", text.strip()):
        raise ValueError(f"not a dotted version: {text!r}")
    return tuple(int(part) for part in text.strip().split("."))


def minimum_driver(cuda_version: str) -> str | None:
    """The oldest driver that runs CUDA `cuda_version` ('13.0', '12.8.1', ...), or None for a
    major version the table does not know. A minor release newer than the table's newest of
    its major gets that one's driver: a lower bound (CUDA minor-version compatibility runs
    it there, without the features that need the newer driver).

    >>> minimum_driver("12.8.1"), minimum_driver("13.1"), minimum_driver("11.8")
    ('570.26', '580.65.06', None)
    """
    major, minor = version_tuple(cuda_version)[:2]
    known = [
        (version_tuple(cuda), driver)
        for cuda, driver in MINIMUM_DRIVER.items()
        if version_tuple(cuda)[0] == major and version_tuple(cuda)[1] <= minor
    ]
    return max(known)[1] if known else None


def driver_older(found: str, needed: str) -> bool:
    """Whether driver `found` is older than `needed`, compared part by part as numbers
    ('575.57.08' < '580.65.06'; '580.65.6' == '580.65.06')."""
    return version_tuple(found) < version_tuple(needed)


def driver_version() -> str | None:
    """The NVIDIA kernel driver's version: from `nvidia-smi`, else from
    /proc/driver/nvidia/version; None when neither is there (no GPU, or a container started
    without the NVIDIA runtime)."""
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run(
                [smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
            ).stdout
        except (OSError, subprocess.SubprocessError):
            out = ""
        first = out.strip().splitlines()[0].strip() if out.strip() else ""
        if re.fullmatch(r"\d+(\.\d+)+", first):
            return first
    try:
        return proc_driver_version(PROC_DRIVER_VERSION.read_text())
    except OSError:
        return None


def proc_driver_version(text: str) -> str | None:
    """The driver version in /proc/driver/nvidia/version's text, e.g. 580.65.06 from
    "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.65.06  Sun Jul 27 06:54:38 UTC 2025"
    (the open kernel modules say "Open Kernel Module for x86_64  580.65.06 ...")."""
    match = re.search(r"Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)", text)
    return match.group(1) if match else None


@dataclass(frozen=True)
class Found:
    """What this process can see of CUDA (see `probe`)."""

    torch_version: str
    torch_cuda: str | None  # torch.version.cuda: None for a CPU build
    available: bool  # torch.cuda.is_available()
    device_count: int
    driver: str | None  # `driver_version()`

    @classmethod
    def probe(cls) -> Found:
        import torch

        available = bool(torch.cuda.is_available())
        return cls(
            torch_version=torch.__version__,
            torch_cuda=torch.version.cuda,
            available=available,
            device_count=torch.cuda.device_count() if available else 0,
            driver=driver_version(),
        )

    @property
    def cuda(self) -> str:
        """The CUDA whose driver minimum applies: the torch wheel's, else the image's."""
        return self.torch_cuda or IMAGE_CUDA


def _gpus(n: int) -> str:
    return f"{n} GPU" if n == 1 else f"{n} GPUs"


def problem(requested: int, found: Found) -> str | None:
    """Why a step that asked for `requested` GPUs cannot use them, as one line; None when
    it can."""
    if found.available and found.device_count >= requested:
        return None
    needed = minimum_driver(found.cuda)
    driver_needed = f"driver >= {needed}" if needed else f"a driver for CUDA {found.cuda}"
    fix = (
        f"Run it on a node with an NVIDIA GPU and {driver_needed} (kubernetes.accelerator_type, "
        "kubernetes.gpu_node_selector) in the replayrl image, or set this step's "
        "kubernetes.*_gpus to 0 to run it on CPU."
    )
    if found.available:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        shown = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
        return (
            f"This step asked for {_gpus(requested)} but torch sees {found.device_count}"
            f"{shown}. Request no more GPUs than the pod gets (kubernetes.*_gpus)."
        )
    if found.torch_cuda is None:
        build = f"torch {found.torch_version} is a CPU build (torch.version.cuda is None)"
    else:
        build = (
            f"torch {found.torch_version} is built for CUDA {found.torch_cuda} but "
            "torch.cuda.is_available() is False"
        )
    if found.driver is None:
        driver = (
            "NVIDIA driver: none found (no nvidia-smi, no /proc/driver/nvidia/version: no GPU "
            "in the pod, or no NVIDIA container runtime)"
        )
    elif needed and driver_older(found.driver, needed):
        driver = f"NVIDIA driver {found.driver} is older than the {needed} it needs"
    else:
        driver = f"NVIDIA driver {found.driver}"
    parts = [build, driver] + ([f"CUDA {found.cuda} needs driver >= {needed}"] if needed else [])
    return (
        f"This step asked for {_gpus(requested)} but CUDA is not usable: {'; '.join(parts)}. {fix}"
    )


def driver_warning(found: Found) -> str | None:
    """One line when CUDA is usable but the driver is older than its CUDA's minimum (it runs
    through a forward-compatibility package, or will fail at the first newer call)."""
    needed = minimum_driver(found.cuda)
    if not found.available or found.driver is None or needed is None:
        return None
    if not driver_older(found.driver, needed):
        return None
    return (
        f"NVIDIA driver {found.driver} is older than {needed}, the minimum for CUDA "
        f"{found.cuda} (torch {found.torch_version}); upgrade the node's driver if CUDA calls fail."
    )


def requested_gpus(environ: dict[str, str] | None = None) -> int:
    """The GPUs this pod asked for (`REPLAYRL_REQUIRE_GPU`); 0 when the variable is unset."""
    raw = (os.environ if environ is None else environ).get(REQUIRE_GPU_ENV, "").strip()
    if not raw:
        return 0
    if not raw.isdigit():
        raise ReplayRLError(f"{REQUIRE_GPU_ENV} must be a GPU count such as 1, got {raw!r}.")
    return int(raw)


def require_cuda(count: int) -> None:
    """Raise a one-line ReplayRLError unless CUDA can serve `count` GPUs here; print one
    warning line on stderr when it can but the driver is older than its CUDA's minimum."""
    if count <= 0:
        return
    found = Found.probe()
    reason = problem(count, found)
    if reason:
        raise ReplayRLError(reason)
    _warn(driver_warning(found))


def check_pod() -> None:
    """`require_cuda` for the GPUs this pod asked for; nothing when it asked for none."""
    require_cuda(requested_gpus())


def warn_if_old_driver() -> None:
    """Where CUDA is usable (e.g. `replayrl run` on a GPU machine), one warning line when the
    driver is older than its CUDA's minimum; nothing (and no probe) without CUDA."""
    import torch

    if torch.cuda.is_available():
        _warn(driver_warning(Found.probe()))


def _warn(line: str | None) -> None:
    if line:
        print(f"replayrl: warning: {line}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- the process's CUDA settings

ALLOC_CONF_ENV = "PYTORCH_CUDA_ALLOC_CONF"
# Large blocks grow in place instead of new segments: the memory the trainer's activations
# held can serve AdamW's state and the next wake of vLLM without fragmentation.
EXPANDABLE_SEGMENTS = "expandable_segments:True"


def cuda_env(
    environ: dict[str, str] | os._Environ[str],
    *,
    cache_dir: str | Path,
    vllm_sleep_mode: bool,
) -> dict[str, str]:
    """The variables a GPU process sets before CUDA starts, those the user has not set
    already: vLLM's and torch's compile caches under `cache_dir` (a pod's scratch volume,
    a local run's cache), so engines and compiled kernels are built once per volume rather
    than under a home directory or the container's writable layer; and
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, unless the process builds a vLLM engine
    with sleep mode (`vllm_sleep_mode`): vLLM's sleep-mode allocator refuses to start with
    expandable segments on ("Expandable segments are not compatible with memory pool",
    torch issue 147851), so a process that trains and generates keeps the default allocator
    and empties torch's cache before the engine wakes instead. Returns what was set."""
    root = Path(cache_dir)
    wanted = {
        "VLLM_CACHE_ROOT": str(root / "vllm"),
        "TORCHINDUCTOR_CACHE_DIR": str(root / "torchinductor"),
        "TRITON_CACHE_DIR": str(root / "triton"),
    }
    if not vllm_sleep_mode:
        wanted[ALLOC_CONF_ENV] = EXPANDABLE_SEGMENTS
    added = {k: v for k, v in wanted.items() if not environ.get(k)}
    environ.update(added)
    return added


def visible_gpu_memory() -> tuple[int, int] | None:
    """(GPUs this process sees, total bytes of the first); None without CUDA. Reads the
    device properties only (no allocation, no CUDA context beyond torch's lazy init)."""
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.device_count(), int(torch.cuda.get_device_properties(0).total_memory)
