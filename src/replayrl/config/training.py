"""The replay buffer and the trainer's sections, each knob with its help, each section with
its own `check()` (see replayrl.config.schema for the conventions)."""

from __future__ import annotations

from dataclasses import dataclass, field

from replayrl.config.ranges import check_ranges
from replayrl.errors import ReplayRLError


@dataclass(frozen=True)
class BufferConfig:
    """The replay buffer: a durable FIFO table of rollouts that gradient steps sample from."""

    capacity: int = field(
        default=512,
        metadata={
            "range": "(0, inf)",
            "help": "N: capacity in rollouts. FIFO: generation pushes, the oldest rows fall "
            "out. Strict on-policy is N = R (the on-policy arm derives N = R = S·B). Staleness "
            "horizon x = S·N / R in gradient steps (the paper's unit: N over the R / S fresh "
            "rollouts per gradient step); a FIFO row is used at ages 0 .. x - 1 gradient "
            "steps when N is a multiple of R. At least R.",
        },
    )
    positive_bias: float = field(
        default=0.0,
        metadata={
            "range": "[0, 1]",
            "help": "δ in [0, 1]: keep the freshest (1-δ)·N rows plus the freshest δ·N correct "
            "rows not already kept. 0 = plain FIFO (the default); the paper tried 0, 0.2 and "
            "0.5, both δ > 0 beating the plain buffer (§5.5).",
        },
    )
    max_staleness: int | None = field(
        default=None,
        metadata={
            "range": "[0, inf)",
            "null": "for no limit",
            "help": "K: drop rows generated more than K policy versions ago, i.e. K "
            "iterations, not gradient steps: retention runs once per iteration, before its S "
            "steps, so a row kept at K versions is used at ages up to K·S + S - 1 gradient "
            "steps. None = no limit (the paper, §3.1).",
        },
    )
    sample_with_replacement: bool = field(
        default=False,
        metadata={
            "help": "Sampling inside one gradient step's batch: with replacement or not (the "
            "paper's batches have no repeats, §3.1). Rows are never removed by sampling, so "
            "they are reused across steps."
        },
    )
    sample_mode: str | None = field(
        default=None,
        metadata={
            "help": 'Sampling across the gradient steps\' batches. "uniform": each batch is '
            "drawn on its own, so a row can recur in the next batch (the paper's default, "
            '§3.1). "epoch": without replacement across batches: no row is drawn twice '
            "until every row has been drawn once (a pass; a new pass starts when one runs "
            "out). The synchronous loops make their passes over an iteration's S batches "
            "(pinned version); the asynchronous trainer over the rows in its buffer, "
            "starting a new pass on restart. The paper found it inconclusive (Fig. 18). "
            'null = by arm: "epoch" for the on-policy arm (each row used exactly once), '
            '"uniform" for the replay arms. Not with sample_with_replacement.',
        },
    )
    target_file_bytes: int = field(
        default=64 * 2**20,
        metadata={
            "range": "[1, inf)",
            "help": "Bin-packing: data files are rewritten to about this size (bytes) once "
            "there are at least buffer.compact_min_files of them.",
        },
    )
    compact_min_files: int = field(
        default=16,
        metadata={
            "range": "[1, inf)",
            "help": "Data files the buffer holds before compaction rewrites them to about "
            "buffer.target_file_bytes each.",
        },
    )
    vacuum_grace_s: float = field(
        default=3600.0,
        metadata={
            "range": "[0, inf)",
            "help": "Files no longer referenced are deleted after this grace period "
            "(seconds), so a reader pinned to an older version keeps working for that long.",
        },
    )

    def check(self) -> None:
        check_ranges(self, "buffer")
        if self.sample_mode not in (None, "uniform", "epoch"):
            raise ReplayRLError(
                f'buffer.sample_mode must be "uniform", "epoch" or null (by arm), got '
                f"{self.sample_mode!r}."
            )
        if self.sample_mode == "epoch" and self.sample_with_replacement:
            raise ReplayRLError(
                'buffer.sample_mode: "epoch" draws no row twice before every row was drawn, '
                "which contradicts buffer.sample_with_replacement: true; drop one of them."
            )

    def sampling(self, arm: str) -> str:
        """The sample mode of `arm`: buffer.sample_mode, or by arm when null ("epoch" for
        on-policy, "uniform" for the replay arms)."""
        if self.sample_mode is not None:
            return self.sample_mode
        return "epoch" if arm == "on-policy" else "uniform"


ADAMW = "AdamW's "
MICRO = (
    "Micro-batches: one gradient step's B rows are cut (rows sorted by length, longest first) "
    "into micro-batches of at most train.micro_batch_size rows and train.micro_batch_tokens "
    "padded tokens (rows x the longest row); gradients accumulate, weighted by completion "
    "tokens, so the step equals the full-batch step whatever the cut. Memory grows with the "
    "micro-batch, not with B. Not part of the config hash. "
)


@dataclass(frozen=True)
class TrainConfig:
    """Gradient steps: S steps of B rollouts per iteration, the loss and its optimizer."""

    loss: str = field(
        default="grpo",
        metadata={
            "help": '"grpo" (clipped ratio against the stored behaviour log-probs, '
            'group-normalised advantage) or "asymre" (no ratio; advantage r - (group mean + '
            "delta_v))."
        },
    )
    steps_per_iteration: int = field(
        default=4, metadata={"range": "(0, inf)", "help": "S: gradient steps per iteration."}
    )
    batch_size: int = field(
        default=64,
        metadata={
            "range": "(0, inf)",
            "help": "B: rollouts per gradient step. Replay ratio y = S·B / R (mean uses of a "
            "rollout). At most buffer.capacity, and at most R unless "
            "buffer.sample_with_replacement.",
        },
    )
    lr: float = field(
        default=1e-4,
        metadata={
            # Above 1 AdamW's update overflows or diverges at once: refused at load.
            "range": "(0, 1]",
            "help": ADAMW + "learning rate. On the tiny CPU task 1e-4 learns; 1e-3 collapses "
            "(EOS stops being emitted).",
        },
    )
    weight_decay: float = field(
        default=0.0, metadata={"range": "[0, inf)", "help": ADAMW + "weight decay."}
    )
    adam_beta1: float = field(default=0.9, metadata={"range": "[0, 1)", "help": ADAMW + "beta1."})
    adam_beta2: float = field(default=0.999, metadata={"range": "[0, 1)", "help": ADAMW + "beta2."})
    grad_clip: float = field(
        default=1.0, metadata={"range": "[0, inf)", "help": "Gradient-norm clip; 0 = off."}
    )
    clip_eps: float = field(
        default=0.2,
        metadata={
            "range": "(0, 1)",
            "help": "GRPO ratio clip: [1 - clip_eps, 1 + clip_eps], in (0, 1). Paper: 0.2 "
            "(App. 10.2).",
        },
    )
    delta_v: float = field(
        default=-0.1,
        metadata={
            "help": "AsymRE baseline shift δV (advantage = r - (mean + delta_v)). Paper: -0.1 "
            "(App. 10.2)."
        },
    )
    is_cap: float | None = field(
        default=None,
        metadata={
            "range": "(0, inf)",
            "null": "to turn it off",
            "help": "Truncated importance weight for asymre, min(ratio, is_cap); > 0. None = "
            "off (the paper, App. 10.2). train.loss=asymre only (GRPO clips its ratio).",
        },
    )
    keep_checkpoints: int = field(
        default=2,
        metadata={
            "range": "[0, inf)",
            "help": "Checkpoints kept besides v0 (the warm start); older ones are deleted once "
            "a newer one is complete. 0 = keep all.",
        },
    )
    distributed: str = field(
        default="none",
        metadata={
            "help": 'How gradient steps run. "none": in this process (the default; the inline '
            'engine keeps the model in memory). "ddp": DistributedDataParallel over '
            "train.num_processes processes, one per GPU (gloo CPU processes where there is no "
            "GPU), each holding a whole replica of the model and its optimizer state; this "
            "process is rank 0, and the others live for the run or Kubeflow task. "
            "The global batch B is the same either way: each process takes ~B / num_processes "
            'rows, and the step equals one process\'s. "fsdp": PyTorch FSDP2 over '
            "train.num_processes processes: each holds 1/num_processes of the parameters, "
            "gradients and AdamW state (float32), gathering one decoder layer at a time; the "
            "same step as one process (checked on CPU: 2 ranks' parameters within 7e-5 of one "
            "process's after 4 steps at lr 1e-2). For policies whose weights, gradients and AdamW state "
            "(16 bytes per parameter: 122 GB for 7.6B) do not fit one GPU. Its checkpoints "
            "hold the usual Hugging Face weights and the optimizer state sharded "
            "(torch.distributed.checkpoint), which loads on any number of processes."
        },
    )
    num_processes: int = field(
        default=1,
        metadata={
            "range": "(0, inf)",
            "help": 'Processes for "ddp" or "fsdp", at most the GPUs of the train pod '
            "(kubernetes.train_gpus). Above 1 needs train.distributed=ddp or fsdp.",
        },
    )
    micro_batch_size: int = field(
        default=0,
        metadata={
            "range": "[0, inf)",
            "help": MICRO + "Rows per micro-batch at most; 0 = no limit.",
        },
    )
    micro_batch_tokens: int = field(
        default=16384,
        metadata={
            "range": "[0, inf)",
            "help": MICRO + "Padded tokens per micro-batch at most; 0 = no limit. Lower it when "
            "a step runs out of memory. A row longer than this is a micro-batch of its own.",
        },
    )
    logprob_chunk_tokens: int = field(
        default=1024,
        metadata={
            "range": "(0, inf)",
            "help": "Completion tokens whose logits (tokens x vocabulary, float32) exist at "
            "once: log-probs, loss and the output layer's gradient are computed chunk by "
            "chunk, never as a full (rows x tokens x vocabulary) tensor. 1024 tokens of a "
            "151,936-token vocabulary take ~0.6 GB per chunk. Not part of the config hash.",
        },
    )
    dtype: str = field(
        default="auto",
        metadata={
            "help": 'Training precision. "auto": bfloat16 on a GPU, float32 on the CPU. '
            '"bfloat16": the forward runs under bf16 autocast (TF32 matmuls elsewhere) while '
            "weights, gradients and AdamW moments stay float32 and log-softmax runs in "
            'float32; GPU only. "float32": plain float32 everywhere (the CPU path, and the '
            "reference the bf16 path is checked against)."
        },
    )
    activation_checkpointing: bool = field(
        default=False,
        metadata={
            "help": "Recompute each decoder layer's activations in backward instead of keeping "
            "them: about a third more compute for activations of one layer instead of all; for "
            "long sequences or large micro-batches. Not part of the config hash."
        },
    )
    checkpoint_every: int = field(
        default=10,
        metadata={
            "range": "(0, inf)",
            "help": "k: a full checkpoint (weights, optimizer state, RNG state and the buffer "
            "versions it pairs with) is written every k iterations and at the end of every run "
            "or Kubeflow task; in between, the trainer keeps the policy in memory and "
            "iterations commit only their rows and metrics. After a crash the lineage rewinds "
            "to the last full checkpoint (the buffer is restored to its paired version) and "
            "redoes the iterations after it, which end exactly where an uninterrupted run ends "
            "on CPU. 1 = a checkpoint every iteration (the most I/O, nothing redone after a "
            "crash). Larger k saves checkpoint I/O (a 0.5B model with AdamW state is ~6 GB) at "
            "the price of up to k - 1 iterations redone after a crash. Distributed training "
            '("ddp", "fsdp") keeps its processes for the run or task and honours k too. Not '
            "part of the config hash.",
        },
    )

    def check(self) -> None:
        check_ranges(self, "train")
        self._check_distributed()
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ReplayRLError(
                f"train.dtype must be 'auto', 'float32' or 'bfloat16', got '{self.dtype}'."
            )
        self._check_loss()

    def _check_distributed(self) -> None:
        if self.distributed not in ("none", "ddp", "fsdp"):
            raise ReplayRLError(
                f"train.distributed must be 'none', 'ddp' or 'fsdp', got '{self.distributed}'."
            )
        if self.distributed == "none" and self.num_processes > 1:
            raise ReplayRLError(
                f"train.num_processes={self.num_processes} needs train.distributed=ddp or fsdp "
                "(fsdp when the policy's weights, gradients and AdamW state, 16 bytes per "
                "parameter, do not fit one GPU); set one, or set train.num_processes=1."
            )

    def _check_loss(self) -> None:
        if self.loss not in ("grpo", "asymre"):
            raise ReplayRLError(f"train.loss must be 'grpo' or 'asymre', got '{self.loss}'.")
        if self.is_cap is not None and self.loss != "asymre":
            raise ReplayRLError(
                "train.is_cap only applies to train.loss=asymre (GRPO clips its ratio); set it "
                "to null."
            )
