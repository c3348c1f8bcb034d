"""The asynchronous split: generation workers and trainers side by side, coordinated through
the durable buffer and published weights. Each knob carries its help, the section checks its
own fields in `check()` (see replayrl.config.schema for the conventions)."""

from __future__ import annotations

from dataclasses import dataclass, field

from replayrl.config.ranges import check_ranges
from replayrl.errors import ReplayRLError


@dataclass(frozen=True)
class AsyncConfig:
    """The asynchronous split (the paper's setting): W generation workers and T trainers run
    side by side, coordinated only through the durable buffer and published weights, instead
    of generate -> train -> generate. Versions are then gradient steps: a row's
    policy_version is the gradient step of the published weights that generated it, and its
    staleness at use is the trainer's step minus that."""

    enabled: bool = field(
        default=False,
        metadata={
            "help": "Turn the asynchronous split on (`replayrl run --engine async` sets it). "
            'A separate lineage from the synchronous one (the default name says "async"). '
            "Off, no other asynchronous.* key enters the config hash."
        },
    )
    workers: int = field(
        default=1,
        metadata={
            "range": "[1, inf)",
            "help": "W: generation workers (processes here; parallel accelerator tasks on "
            "Kubeflow). Each generates batches of R = prompts_per_iteration x "
            "samples_per_prompt rows. >= 1.",
        },
    )
    trainers: int = field(
        default=1,
        metadata={
            "range": "[1, inf)",
            "help": "T: trainers, data-parallel replicas that split every batch of B rows (one "
            "process each; one Kubeflow trainer task asks for kubernetes.train_gpus x T "
            "accelerators). >= 1, at most train.batch_size.",
        },
    )
    trainer_nodes: int = field(
        default=1,
        metadata={
            "range": "[1, inf)",
            "help": "Nodes the T trainers span on Kubeflow. 1 = one trainer task, a pod with "
            "kubernetes.train_gpus x T accelerators and T processes on one host. > 1 = the "
            "trainer task is a CPU launcher that creates a Kubeflow Trainer TrainJob "
            "(runtime kubernetes.trainer_runtime) of this many nodes, each with T / "
            "trainer_nodes processes and kubernetes.train_gpus accelerators per process, "
            "waits for it and deletes it when the run ends (replayrl.kfp.trainjob); the "
            "cluster needs the Trainer controller and that runtime (docs/gpu.md). T must be "
            "a multiple of it. The one-machine engine ignores it. Not part of the config hash.",
        },
    )
    publish_every: int = field(
        default=4,
        metadata={
            "range": "[1, inf)",
            "help": "Weights are published (a weights-only copy plus a version pointer) every "
            "this many gradient steps; workers pick up the newest between batches. The paper: "
            '"every few". >= 1.',
        },
    )
    weight_transfer: str = field(
        default="broadcast",
        metadata={
            "help": "How published weights reach the workers. `broadcast` (the default): "
            "trainer rank 0 sends them in buckets (in the dtype workers load a weights-only "
            "copy in: bfloat16 on GPUs, float32 on the CPU) over a collective group of its "
            "own (NCCL on GPUs, gloo on the CPU; replayrl.policy.weight_broadcast); each "
            "worker receives into a staging buffer while it generates and applies the version "
            "between batches; a version is announced only once every worker in the group "
            "holds it (or the send timed out: then the group is re-formed and those workers "
            "load the files). `files`: every worker loads the weights-only copies the trainer "
            "publishes. The weights-only files are written either way: the evaluator, a "
            "resumed trainer, a restarted or late worker and any worker outside the group "
            "read them. Not part of the config hash.",
        },
    )
    weight_bucket_mib: float = field(
        default=256.0,
        metadata={
            "range": "(0, inf)",
            "help": "Broadcast bucket size in MiB: parameters are flattened into buckets of at "
            "most this size and sent one bucket at a time (a larger tensor alone), so the "
            "sender holds one bucket beyond the model. > 0. Not part of the config hash.",
        },
    )
    weight_timeout_s: float = field(
        default=60.0,
        metadata={
            "range": "(0, inf)",
            "help": "How long the trainer waits for one bucket's broadcast or for the "
            "workers' acknowledgements of a version. Past it (a worker stopped, killed or "
            "slow) the group is dropped and re-formed at the next publication, the version is "
            "announced anyway, and the workers that missed it load the files. Also how long "
            "a worker waits for a bucket. > 0. Not part of the config hash.",
        },
    )
    min_rows: int | None = field(
        default=None,
        metadata={
            "range": "[1, inf)",
            "null": "for B",
            "help": "Back-pressure: the trainer waits until the buffer holds this many rows. "
            "None = B (train.batch_size). At most buffer.capacity.",
        },
    )
    max_unused_rows: int | None = field(
        default=None,
        metadata={
            "range": "[1, inf)",
            "null": "for the derived default",
            "help": "Back-pressure: workers pause while more rows than this were never used by "
            "a gradient step. None = N / y with the sync engine's replay ratio y = S·B / R "
            "(the unused rows of a FIFO buffer whose workers keep pace with y), at least R, "
            "and 2R for the on-policy queue. At least train.batch_size.",
        },
    )
    segment_steps: int | None = field(
        default=None,
        metadata={
            "range": "[1, inf)",
            "null": "for no limit",
            "help": "One segment (a `replayrl run --engine async` call, one Kubeflow "
            "async_segment run) stops after this many gradient steps or "
            "asynchronous.segment_seconds, whichever comes first. None = no limit (run to "
            "`iterations` x S gradient steps in all). Not part of the config hash.",
        },
    )
    segment_seconds: float | None = field(
        default=None,
        metadata={
            "range": "(0, inf)",
            "null": "for no limit",
            "help": "One segment stops after this many seconds or asynchronous.segment_steps, "
            "whichever comes first. None = no limit on one machine. On Kubeflow a segment "
            "always has a deadline: kubernetes.gpu_step_timeout_s less a margin for its last "
            "checkpoint and evaluation (10% of it, at least 600 s, at most half), e.g. "
            "5 h 24 min for 6 h pods (none when that timeout is 0); a longer value here is cut "
            "to it. Not part of the "
            "config hash.",
        },
    )
    stall_timeout_s: float | None = field(
        default=None,
        metadata={
            "range": "(0, inf)",
            "help": "The watchdog: a role (worker, trainer, evaluator) that reports no progress "
            "for this many seconds is stopped (SIGTERM, then SIGKILL after "
            "asynchronous.stop_grace_s) and started again, within the restart budget (3 per "
            "role and segment); past it the run ends with an error. A role reports after each "
            "batch, gradient step or evaluation and every poll while it waits. None = derived "
            "from what the role measured: 10 x the slowest interval between its reports so "
            "far, at least 600 s. Not part of the config hash.",
        },
    )
    stall_startup_s: float = field(
        default=1800.0,
        metadata={
            "range": "(0, inf)",
            "help": "The watchdog's limit before a role's first progress report (its start-up: "
            "imports, loading the model, starting the generation engine). > 0. Not part of "
            "the config hash.",
        },
    )
    peer_start_timeout_s: float = field(
        default=1800.0,
        metadata={
            "range": "(0, inf)",
            "help": "Every role of a segment (each worker, the trainer, the evaluator) must "
            "start within this many seconds of the segment's start. Past it, the first role "
            "that finds another missing gives the segment up, and every role stops with one "
            "error line naming the missing one; nothing committed is lost and the next run "
            "begins a new segment. It exists for Kubeflow, where a pod's timeout starts only "
            "once a node runs it, so a role whose pod stays Pending (no free accelerator, a "
            "quota) would leave the others waiting for ever. Keep it well under "
            "kubernetes.gpu_step_timeout_s, above the time a node needs to scale up and pull "
            "the image. > 0. Not part of the config hash.",
        },
    )
    stop_grace_s: float = field(
        default=30.0,
        metadata={
            "range": "(0, inf)",
            "help": "How long a role gets to exit after SIGTERM (a watchdog stop, the segment's "
            "end, a SIGTERM or Ctrl-C of the run) before it is sent SIGKILL. > 0. Not part of "
            "the config hash.",
        },
    )

    def check(self) -> None:
        """The section's own rules, when the split is on (rules that involve other sections
        are replayrl.config.run.validate_async), whether the split is on or off."""
        check_ranges(self, "asynchronous")
        if self.weight_transfer not in ("broadcast", "files"):
            raise ReplayRLError(
                f"asynchronous.weight_transfer must be broadcast or files; got "
                f"'{self.weight_transfer}'."
            )
        if self.trainers % self.trainer_nodes:
            raise ReplayRLError(
                f"asynchronous.trainers ({self.trainers}) must be a multiple of "
                f"asynchronous.trainer_nodes ({self.trainer_nodes}): every node of the "
                f"trainer runs the same number of processes. Set trainers to a multiple of "
                f"it, or trainer_nodes to a divisor of {self.trainers}."
            )
