"""Run configuration: one frozen dataclass per concern, loaded from YAML plus overrides.

Every knob is documented once, here, where it is defined: what it does, its unit, what
0/None means, and the paper's value where one exists ("Efficient RL Training for LLMs with
Experience Replay", Arnal et al. 2026; "Asymmetric REINFORCE" by the same authors).

Loading rejects unknown keys and names the nearest valid one; cross-field rules fail at load
with a message that says how to fix the config. This module knows nothing about models,
storage or trackers; it only reads YAML text and (in `default_cache_dir`) one environment
variable.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from replayrl.errors import ReplayRLError

# Hugging Face hub names (replayrl.policy.hub downloads them; loading a config only checks them).
HF_PREFIX = "hf://"
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}")
DATA_SUFFIXES = (".parquet", ".jsonl")


def hub_id(name: str | None) -> str | None:
    """The hub repository `name` refers to, or None when it is a local path, a URI or
    "tiny". `owner/name` that exists as a local path stays a path; `hf://` forces the hub."""
    if not name or name == "tiny":
        return None
    if name.startswith(HF_PREFIX):
        repo = name[len(HF_PREFIX) :]
        if not _REPO_ID.fullmatch(repo):
            raise ReplayRLError(
                f"{name!r} is not a Hugging Face repository id: write hf://owner/name."
            )
        return repo
    if "://" in name or name.startswith(("/", ".", "~")) or Path(name).exists():
        return None
    if name.lower().endswith((*DATA_SUFFIXES, ".json", ".csv")):
        return None  # a data file's name, e.g. data/train.parquet
    return name if _REPO_ID.fullmatch(name) else None


ARMS = ("replay", "on-policy", "replay-plain")
# model.vocab_size's default, replayrl.policy.tokenizer.VOCAB_SIZE (not imported: this module must
# not pull in transformers).
TINY_VOCAB_SIZE = 264
# A Kubernetes object name (DNS subdomain, RFC 1123), e.g. a service account's.
_K8S_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


@dataclass(frozen=True)
class ModelConfig:
    # "tiny" builds the byte-level Qwen2 demo model in code (no download) and warm-starts it
    # on the task; a Hugging Face hub id (`Qwen/Qwen3-0.6B`, or `hf://Qwen/Qwen3-0.6B`) is
    # downloaded once, when the lineage is opened, into its checkpoint v0 (HF_TOKEN for gated
    # repos; the commit it resolved to goes to the lineage's params as hub.model_revision);
    # anything else is a checkpoint directory in the Hugging Face layout (local path, file://
    # or s3:// URI).
    source: str = "tiny"
    # Hub ids only: the branch, tag or commit to download. None = the repository's default
    # branch, resolved to a commit when the lineage is opened.
    revision: str | None = None
    # Tiny model shape (only used when source == "tiny"). ~0.6M parameters at these values.
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    # Rows of the tiny model's embedding (and tied output) matrix: the byte tokenizer's 259
    # tokens padded to this size; a sampled id past them decodes to "<|unused|>". At least
    # 264 (the default: the tokens rounded up to a multiple of 8). configs/shapes-cpu.yaml
    # sets Qwen2.5's 151936 to run the real vocabulary's memory and time on the tiny model.
    vocab_size: int = TINY_VOCAB_SIZE
    # Supervised warm start of the tiny model, so RL has a reward signal to work with.
    # Stops at the first evaluation whose greedy pass@1 reaches the target, or after
    # warm_start_max_steps. Its evaluations use validation prompts held out of the training
    # pool (the last 1/8 of task.num_train, at most 128; the warm start trains on the rest),
    # never the evaluation prompts. 0 steps = no warm start (RL from a random model: no signal).
    warm_start_max_steps: int = 3000
    warm_start_lr: float = 3e-3
    warm_start_batch_size: int = 128
    warm_start_eval_every: int = 50
    warm_start_target_pass1: float = 0.25
    # Where the warm-started tiny model is cached across runs. None = $REPLAYRL_CACHE or
    # ~/.cache/replayrl.
    cache_dir: str | None = None


@dataclass(frozen=True)
class TaskConfig:
    # "chain_sum" (reasoning-gym, procedurally generated, offline), "chain_sum_steps" (the
    # same sums written out step by step: longer completions, so generation costs more per
    # rollout; see replayrl.policy.problems), "gsm8k" or "math" (both from `path`). "math" reads
    # OpenR1-Math-220k / MATH rows (problem, solution, optional answer; the gold answer is
    # `answer`, else the solution's last \boxed{}) and grades the completion's last
    # \boxed{} with math-verify.
    name: str = "chain_sum"
    # Parquet/JSONL file (local path or s3:// URI) for the file tasks "gsm8k" and "math", or
    # a Hugging Face dataset id (`open-r1/OpenR1-Math-220k`, or `hf://…`) with the config and
    # split below: downloaded once, when the lineage is opened, into
    # <lineage>/inputs/dataset.parquet, which every later step reads (hub.dataset_revision
    # in the lineage's params records the commit).
    path: str | None = None
    # Hub datasets only: the config (None = the card's default config) and split to read,
    # and the branch, tag or commit (None = the default branch).
    dataset_config: str | None = None
    dataset_split: str = "train"
    revision: str | None = None
    # Distinct training prompts drawn from, and held-out prompts evaluated on. Never overlap.
    num_train: int = 4000
    num_eval: int = 256
    # Task-specific options passed to the generator, e.g. chain_sum's min_digits/max_digits.
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RolloutConfig:
    # Prompts per iteration; R (fresh rollouts per iteration) = prompts * samples_per_prompt.
    prompts_per_iteration: int = 16
    # G: completions sampled per prompt (one GRPO group). Paper: 16 (App. 10.2).
    samples_per_prompt: int = 8
    # Upper bound on generated tokens per completion; a completion cut here has
    # finish_reason "length".
    max_new_tokens: int = 6
    temperature: float = 1.0
    # Nucleus sampling of training rollouts: must stay 1.0 (off). With top_p < 1 the behaviour
    # log-probs are renormalised over the nucleus while the trainer's log-probs are of the
    # full softmax (at the same temperature), so the ratio of a fresh row is at most 1 and
    # the update is biased. Evaluation samples at top_p 1.0 too.
    top_p: float = 1.0
    # "transformers" (CPU, tests) or "vllm" (GPU, the `gpu` extra).
    backend: str = "transformers"
    # Rollouts generated per forward batch; bounds memory, not results.
    batch_size: int = 512
    # vLLM only: the engine's dtype. "auto" follows vLLM, which runs a float32 checkpoint
    # (ours are float32) in bfloat16: behaviour log-probs then differ from the float32
    # trainer's by ~1e-2 (GRPO's clip absorbs it). "float32" matches the trainer to ~1e-4.
    vllm_dtype: str = "auto"
    # vLLM only: fraction of the GPU's memory the engine may take (weights + KV cache), in
    # (0, 1]. None = what the layout allows: 0.9 where the engine has the GPU to itself (the
    # generate and evaluate pods of kubernetes.layout "step", and distributed training, whose
    # processes end before generation); where the trainer shares the process and the GPU
    # (the inline engine, a "task" pod), 0.9 minus the trainer's resident memory (float32
    # weights, gradients and AdamW's two moments, 16 bytes per parameter of the checkpoint)
    # over the GPU's memory, and an error when that leaves less than 0.1.
    vllm_gpu_memory_utilization: float | None = None
    # vLLM only: GPUs one engine is split over (tensor parallelism), at most the GPUs of the
    # pods that generate and evaluate (kubernetes.generate_gpus, evaluate_gpus). Above 1 only
    # in kubernetes.layout "step": the inline engine and "task" pods give the engine the
    # trainer's new weights in place, by reference, which needs the engine's one worker in
    # this process; tensor-parallel workers run in processes of their own.
    tensor_parallel_size: int = 1


@dataclass(frozen=True)
class BufferConfig:
    # N: capacity in rollouts. FIFO: generation pushes, the oldest rows fall out.
    # Strict on-policy is N = R. Staleness horizon x = S·N / R in gradient steps (the
    # paper's unit: N over the R / S fresh rollouts per gradient step); a FIFO row is used
    # at ages 0 .. x - 1 gradient steps when N is a multiple of R.
    capacity: int = 512
    # δ in [0, 1]: keep the freshest (1-δ)·N rows plus the freshest δ·N correct rows not
    # already kept. 0 = plain FIFO (the default); the paper tried 0, 0.2 and 0.5, both δ > 0
    # beating the plain buffer (§5.5).
    positive_bias: float = 0.0
    # Drop rows generated more than K policy versions ago, i.e. K iterations, not gradient
    # steps: retention runs once per iteration, before its S steps, so a row kept at K
    # versions is used at ages up to K·S + S - 1 gradient steps. None = no limit (the paper, §3.1).
    max_staleness: int | None = None
    # Sampling inside one gradient step's batch: with replacement or not (the paper's batches
    # have no repeats, §3.1). Rows are never removed by sampling, so they are reused across steps.
    sample_with_replacement: bool = False
    # Bin-packing: data files are rewritten to about this size once there are at least
    # compact_min_files of them.
    target_file_bytes: int = 64 * 2**20
    compact_min_files: int = 16
    # Files no longer referenced are deleted after this grace period (seconds), so a
    # reader pinned to an older version keeps working for that long.
    vacuum_grace_s: float = 3600.0


@dataclass(frozen=True)
class TrainConfig:
    # "grpo" (clipped ratio against the stored behaviour log-probs, group-normalised
    # advantage) or "asymre" (no ratio; advantage r - (group mean + delta_v)).
    loss: str = "grpo"
    # S: gradient steps per iteration.
    steps_per_iteration: int = 4
    # B: rollouts per gradient step. Replay ratio y = S·B / R (mean uses of a rollout).
    batch_size: int = 64
    # AdamW. On the tiny CPU task 1e-4 learns; 1e-3 collapses (EOS stops being emitted).
    lr: float = 1e-4
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    # Gradient-norm clip; 0 = off.
    grad_clip: float = 1.0
    # GRPO ratio clip: [1 - clip_eps, 1 + clip_eps]. Paper: 0.2 (App. 10.2).
    clip_eps: float = 0.2
    # AsymRE baseline shift δV (advantage = r - (mean + delta_v)). Paper: -0.1 (App. 10.2).
    delta_v: float = -0.1
    # Truncated importance weight for asymre, min(ratio, is_cap); None = off (the paper, App. 10.2).
    is_cap: float | None = None
    # Checkpoints kept besides v0 (the warm start); older ones are deleted once a newer
    # one is complete. 0 = keep all.
    keep_checkpoints: int = 2
    # How gradient steps run. "none": in this process (the default; the inline engine keeps
    # the model in memory). "ddp": accelerate DistributedDataParallel over num_processes
    # processes, one per GPU (gloo CPU processes where there is no GPU), each holding a whole
    # replica of the model and its optimizer state. The global batch B is the same either
    # way: each process takes ~B / num_processes rows, and the step equals one process's.
    distributed: str = "none"
    # Processes for "ddp", at most the GPUs of the train pod (kubernetes.train_gpus).
    num_processes: int = 1
    # Micro-batches: one gradient step's B rows are cut (rows sorted by length, longest
    # first) into micro-batches of at most micro_batch_size rows and micro_batch_tokens
    # padded tokens (rows x the longest row); gradients accumulate, weighted by completion
    # tokens, so the step equals the full-batch step whatever the cut. 0 = no limit. Memory
    # grows with the micro-batch, not with B; lower micro_batch_tokens when a step runs out
    # of memory. A row longer than micro_batch_tokens is a micro-batch of its own.
    micro_batch_size: int = 0
    micro_batch_tokens: int = 16384
    # Completion tokens whose logits (tokens x vocabulary, float32) exist at once: log-probs,
    # loss and the output layer's gradient are computed chunk by chunk, never as a full
    # (rows x tokens x vocabulary) tensor. 1024 tokens of a 151,936-token vocabulary take
    # ~0.6 GB per chunk.
    logprob_chunk_tokens: int = 1024
    # Training precision. "auto": bfloat16 on a GPU, float32 on the CPU. "bfloat16": the
    # forward runs under bf16 autocast (TF32 matmuls elsewhere) while weights, gradients and
    # AdamW moments stay float32 and log-softmax runs in float32; GPU only. "float32": plain
    # float32 everywhere (the CPU path, and the reference the bf16 path is checked against).
    dtype: str = "auto"
    # Recompute each decoder layer's activations in backward instead of keeping them: about
    # a third more compute for activations of one layer instead of all; for long sequences
    # or large micro-batches.
    activation_checkpointing: bool = False
    # k: a full checkpoint (weights, optimizer state, RNG state and the buffer versions it
    # pairs with) is written every k iterations and at the end of every run or Kubeflow task;
    # in between, the trainer keeps the policy in memory and iterations commit only their
    # rows and metrics. After a crash the lineage rewinds to the last full checkpoint (the
    # buffer is restored to its paired version) and redoes the iterations after it, which
    # end exactly where an uninterrupted run ends on CPU. 1 = a checkpoint every iteration
    # (the most I/O, nothing redone after a crash). Larger k saves checkpoint I/O (a 0.5B
    # model with AdamW state is ~6 GB) at the price of up to k - 1 iterations redone after a
    # crash. Distributed training ("ddp"/"fsdp") checkpoints every iteration regardless: its
    # processes do not outlive one iteration yet. Not part of the config hash.
    checkpoint_every: int = 10


@dataclass(frozen=True)
class EvalConfig:
    # Evaluate every k iterations (and after the first and last). 0 = only at the end.
    every: int = 10
    # Held-out prompts evaluated (at most task.num_eval).
    num_prompts: int = 256
    # pass@k from `num_samples` sampled completions per prompt (unbiased estimator).
    pass_k: int = 4
    num_samples: int = 8
    temperature: float = 1.0
    # Nucleus of the sampled completions (pass@k, sample accuracy, entropy). The paper
    # evaluates pass@k at temperature 1 with top-p 0.95 (§5.1); 1.0 = the full distribution.
    # Evaluation only: training rollouts must sample the full softmax (rollout.top_p).
    top_p: float = 1.0
    # pass@1 at the paper's evaluation settings (§5.1: temperature 0.1, top-p 0.95), logged
    # as eval/pass1_sampled beside the greedy eval/pass1: the mean over `num_samples` sampled
    # completions per prompt at this temperature and `pass1_top_p`. null = not evaluated
    # (one generation pass fewer per evaluation).
    pass1_temperature: float | None = None
    pass1_top_p: float = 0.95


@dataclass(frozen=True)
class AsyncConfig:
    # The asynchronous split (the paper's setting): W generation workers and T trainers run
    # side by side, coordinated only through the durable buffer and published weights, instead
    # of generate -> train -> generate. `replayrl run --engine async` turns it on. Versions are
    # then gradient steps: a row's policy_version is the gradient step of the published
    # weights that generated it, and its staleness at use is the trainer's step minus that.
    # A separate lineage from the synchronous one (the default name says "async").
    enabled: bool = False
    # W: generation workers (processes here; parallel accelerator tasks on Kubeflow). Each
    # generates batches of R = prompts_per_iteration x samples_per_prompt rows.
    workers: int = 1
    # T: trainers, data-parallel replicas that split every batch of B rows (one process
    # each; one Kubeflow trainer task asks for kubernetes.train_gpus x T accelerators).
    trainers: int = 1
    # Weights are published (a weights-only copy plus a version pointer) every this many
    # gradient steps; workers pick up the newest between batches. The paper: "every few".
    publish_every: int = 4
    # Back-pressure. The trainer waits until the buffer holds min_rows rows (None = B).
    min_rows: int | None = None
    # Workers pause while more rows than this were never used by a gradient step. None =
    # N / y with the sync engine's replay ratio y = S·B / R (the unused rows of a FIFO buffer
    # whose workers keep pace with y), and 2R for the on-policy queue.
    max_unused_rows: int | None = None
    # One segment (a `replayrl run --engine async` call, one Kubeflow async_segment run) stops
    # after this many gradient steps or seconds, whichever comes first; None = no limit (run to
    # `iterations` x S gradient steps in all).
    segment_steps: int | None = None
    segment_seconds: float | None = None


@dataclass(frozen=True)
class TrackingConfig:
    # MLflow tracking URI. None = $MLFLOW_TRACKING_URI if set, else
    # sqlite:///<run root>/mlflow.db for a local run root.
    uri: str | None = None
    experiment: str = "replayrl"


@dataclass(frozen=True)
class StorageConfig:
    # Run root: file:// URI or local path (the embedded default) or s3://bucket/prefix.
    # One lineage lives under <run_root>/<lineage>/.
    run_root: str = "runs"
    # The lineage name; None = "<task>-<arm>-s<seed>".
    lineage: str | None = None


def _default_gpu_tolerations() -> list[dict[str, Any]]:
    return [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]


@dataclass(frozen=True)
class KubernetesConfig:
    # Pod settings of the Kubeflow pipelines. `replayrl compile --config FILE` bakes them into
    # the pipeline YAML; they decide where steps run, never what they compute, so they are not
    # part of the config hash, and the inline engine ignores them.
    # "Accelerator steps" are a task of iterations, v0's evaluation, and in the step layout
    # generate, train and evaluate; opening a lineage, compact, recording an iteration and
    # the exit task (releasing the lineage) run on CPU.
    # Extended resource requested for accelerators.
    accelerator_type: str = "nvidia.com/gpu"
    # Accelerators per pod of each step; 0 runs that step on CPU only.
    generate_gpus: int = 1
    train_gpus: int = 1
    evaluate_gpus: int = 1
    # CPU and memory requests (Kubernetes quantities) of accelerator steps and of CPU steps.
    gpu_step_cpu: str = "4"
    gpu_step_memory: str = "32Gi"
    cpu_step_cpu: str = "1"
    cpu_step_memory: str = "4Gi"
    # Tolerations of accelerator steps: mappings with key, operator, value, effect (as in a
    # pod spec). The default tolerates the usual GPU node taint. [] = none.
    gpu_tolerations: list[dict[str, Any]] = field(default_factory=_default_gpu_tolerations)
    # Node labels accelerator steps must match, e.g. {nvidia.com/gpu.product: NVIDIA-H100-80GB-HBM3}.
    # {} = any node that has the accelerator.
    gpu_node_selector: dict[str, Any] = field(default_factory=dict)
    # Size limit of the memory-backed /dev/shm of accelerator steps (the container default of
    # 64 MiB is too small for NCCL and data loaders). "" = no /dev/shm volume.
    shm_size: str = "16Gi"
    # Size limit of a disk-backed scratch volume (an emptyDir) mounted at /scratch on
    # accelerator steps, where checkpoint downloads and the cache go ($REPLAYRL_CACHE =
    # /scratch/replayrl) instead of the container's writable layer; a pod that writes more is
    # evicted. A 0.5B model's full checkpoint is ~6 GB, and a task keeps a few. "" = no volume
    # (downloads go to ~/.cache/replayrl in the container).
    scratch_size: str = "100Gi"
    # Secret with AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, set as env on every step.
    # None = no secret (e.g. workload identity).
    s3_secret: str | None = "replayrl-s3"
    # Secret with MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD / MLFLOW_TRACKING_TOKEN;
    # optional: pods start without it. None = not mounted.
    mlflow_secret: str | None = "replayrl-mlflow"
    # Secret with HF_TOKEN, for a model.source or task.path that names a gated or private
    # Hugging Face repository; optional, and set only on the task that opens a lineage (the
    # one that downloads). None = not mounted.
    hf_secret: str | None = "replayrl-hf"
    # ConfigMap with AWS_ENDPOINT_URL, AWS_REGION and MLFLOW_TRACKING_URI, set as env;
    # optional: missing keys are left unset. None = not mounted.
    endpoints_config_map: str | None = "replayrl-endpoints"
    # Kubernetes service account the pipeline's pods run as. Not in the pipeline YAML: `replayrl
    # submit` and `schedule` set it on each run and recurring run (from a local --config; a
    # config given as a URI is read only by the pipeline, so they use this default). The
    # default is the account k8s/base/rbac.yaml creates, with the rights KFP's launcher and
    # Argo's executor need. None or "" = KFP's default account of the namespace
    # (`pipeline-runner` standalone, `default-editor` in a Kubeflow profile namespace).
    service_account: str | None = "replayrl-pipeline-runner"
    # Retries of the idempotent steps (generate, compact, train, evaluate): the first after
    # retry_backoff_s, then doubling. 0 = no retries. Opening is not retried (a run that finds
    # the lineage busy must stop, not start the next iteration a minute later), nor is
    # recording, the commit point.
    retries: int = 2
    retry_backoff_s: int = 60
    # Wall-clock limit of one pod (activeDeadlineSeconds). 0 = none.
    gpu_step_timeout_s: int = 6 * 3600
    cpu_step_timeout_s: int = 3600
    # How long a lineage's lease outlives its last renewal. A running task renews it every
    # third of this (a heartbeat); a run that ends releases it in its exit task, whatever
    # happened; a run killed without that (a deleted pod, a terminated workflow) leaves its
    # lineage busy for at most this long. The same run takes its own expired lease back, so
    # a long wait for the next pod (a GPU node scaling up) costs nothing unless another run
    # wants the lineage meanwhile.
    lease_ttl_s: int = 600
    # KFP caching of step outputs. Off: a step's output lives in storage, not in KFP, so a
    # cached step would skip real work.
    caching: bool = False
    # KFP pipeline root of the runs, e.g. "s3://my-bucket/kfp-artifacts": where KFP keeps each
    # step's small Metrics and Markdown artifacts (the buffer, checkpoints and state.json live
    # under the run root, never here). Compiled into the YAML, whose run form in the KFP UI
    # offers it, and sent with every run and recurring run by `replayrl submit` / `schedule`
    # (a KFP backend reads a run's root only from the run request). Where the namespace's
    # kfp-launcher ConfigMap has no s3 `providers` entry (a Kubeflow profile's has none), KFP
    # opens an s3:// root with the AWS SDK's defaults in the step's environment: the
    # replayrl-s3 keys or workload identity, AWS_REGION, virtual-hosted addressing. None = the
    # KFP install's default (kfp-launcher's defaultPipelineRoot, else
    # minio://mlpipeline/v2/artifacts in KFP's own store).
    pipeline_root: str | None = None
    # How a pipeline lays out the iterations. "task": one accelerator pod runs
    # `iterations_per_task` iterations with long-lived workers (one generation engine, the
    # trainer with its optimizer in memory, the buffer mirrored in memory) and ends with a
    # full checkpoint; pod start, imports, engine start and checkpoint download are paid once
    # per task. "step": one pod per step per iteration (generate, compact, train, evaluate,
    # record), each loading the newest checkpoint; every iteration writes a full checkpoint.
    layout: str = "task"
    # Iterations one "task" pod runs. replay_loop runs ceil(iterations / iterations_per_task)
    # tasks; a replay_iteration (recurring) run advances the lineage by one task. Larger
    # values spread the per-task start-up over more iterations; a crash redoes at most the
    # iterations since the task's last full checkpoint (train.checkpoint_every).
    iterations_per_task: int = 10


@dataclass(frozen=True)
class RunConfig:
    # Which arm this run is. "on-policy" is derived from the replay settings by
    # `apply_arm` (same model, data, seed and gradient steps; N = R = S·B). "replay-plain"
    # is the replay settings with buffer.positive_bias = 0 (a plain FIFO, δ = 0), to
    # separate replay's effect from positive-bias retention's.
    arm: str = "replay"
    seed: int = 0
    # Total iterations of generate -> compact -> train -> evaluate.
    iterations: int = 300
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    buffer: BufferConfig = field(default_factory=BufferConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    asynchronous: AsyncConfig = field(default_factory=AsyncConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    kubernetes: KubernetesConfig = field(default_factory=KubernetesConfig)

    # Derived quantities, named as in the paper.
    @property
    def rollouts_per_iteration(self) -> int:
        """R: fresh rollouts generated per iteration."""
        return self.rollout.prompts_per_iteration * self.rollout.samples_per_prompt

    @property
    def replay_ratio(self) -> float:
        """y = S·B / R: mean number of times a rollout is used."""
        return self.train.steps_per_iteration * self.train.batch_size / self.rollouts_per_iteration

    @property
    def staleness_horizon(self) -> float:
        """x = S·N / R in gradient steps: the paper's horizon, N over the R / S fresh
        rollouts per gradient step. A plain FIFO's rows are used at ages 0 .. x - 1 gradient
        steps (replayrl.core.staleness). N = 512, R = 128, S = 4 -> x = 16."""
        return self.train.steps_per_iteration * self.buffer.capacity / self.rollouts_per_iteration

    @property
    def lineage(self) -> str:
        mode = "async-" if self.asynchronous.enabled else ""
        return self.storage.lineage or f"{self.task.name}-{mode}{self.arm}-s{self.seed}"

    @property
    def total_gradient_steps(self) -> int:
        """Gradient steps of the whole lineage: iterations x S (the asynchronous engine counts
        in gradient steps; an "iteration" of it is S of them)."""
        return self.iterations * self.train.steps_per_iteration

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def flat(self) -> dict[str, Any]:
        """Dotted keys -> values, e.g. {"buffer.capacity": 512}, for MLflow params."""
        out: dict[str, Any] = {}

        def walk(prefix: str, value: Any) -> None:
            if isinstance(value, dict) and prefix.split(".")[-1] != "options":
                for k, v in value.items():
                    walk(f"{prefix}.{k}" if prefix else k, v)
            else:
                out[prefix] = value

        walk("", self.to_dict())
        return out

    def config_hash(self) -> str:
        """Hash of everything that changes results: not where they are stored or tracked or
        which pods run them, and not `iterations`, so a finished lineage can be extended by
        raising it."""
        d = self.to_dict()
        d.pop("storage")
        d.pop("tracking")
        d.pop("kubernetes")
        d.pop("iterations")
        # The asynchronous split: off (the default) leaves every synchronous lineage's hash as
        # it was; on, how long one segment runs does not change what is computed.
        if not d["asynchronous"]["enabled"]:
            d.pop("asynchronous")
        else:
            for key in ("segment_steps", "segment_seconds"):
                d["asynchronous"].pop(key)
        # When a checkpoint is written, and how a step is cut into micro-batches and chunks,
        # do not change what is computed (beyond float summation order).
        for key in HASH_EXEMPT_TRAIN_KEYS:
            d["train"].pop(key)
        # Nor how much GPU memory the vLLM engine takes, over how many GPUs. The memory share
        # was hashed before it was known not to matter: it is hashed at its old default, so
        # lineages created then keep their hash.
        d["rollout"].pop("tensor_parallel_size")
        d["rollout"]["vllm_gpu_memory_utilization"] = 0.5
        # Knobs added after lineages existed: at their default they leave the hash of an
        # existing lineage unchanged, so it can be resumed.
        for section, key, default in HASH_DEFAULTS_OMITTED:
            if d[section].get(key) == default:
                d[section].pop(key)
        blob = json.dumps(d, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:12]

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


HASH_EXEMPT_TRAIN_KEYS = (
    "checkpoint_every",
    "micro_batch_size",
    "micro_batch_tokens",
    "logprob_chunk_tokens",
    "activation_checkpointing",
)
HASH_DEFAULTS_OMITTED = (
    ("train", "dtype", "auto"),
    ("model", "vocab_size", TINY_VOCAB_SIZE),
    # Evaluation knobs added later: at their defaults, lineages keep the hash they had.
    ("eval", "top_p", 1.0),
    ("eval", "pass1_temperature", None),
    ("eval", "pass1_top_p", 0.95),
    # Hugging Face hub names.
    ("model", "revision", None),
    ("task", "dataset_config", None),
    ("task", "dataset_split", "train"),
    ("task", "revision", None),
)


SECTIONS: dict[str, type] = {
    f.name: f.default_factory  # type: ignore[misc]
    for f in dataclasses.fields(RunConfig)
    if f.default_factory is not dataclasses.MISSING
}


def _nearest(key: str, valid: list[str]) -> str:
    match = difflib.get_close_matches(key, valid, n=1, cutoff=0.4)
    return f" Did you mean '{match[0]}'?" if match else f" Valid keys: {', '.join(sorted(valid))}."


def _coerce(value: Any, annotation: Any, where: str) -> Any:
    """Check `value` against a dataclass field annotation; convert int -> float and str
    numbers from --set; raise ReplayRLError naming the key and the expected type."""
    tp = annotation
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        non_none = [a for a in args if a is not type(None)]
        return _coerce(value, non_none[0], where)
    if tp is Any:
        return value
    if origin is dict or tp is dict:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise ReplayRLError(f"{where} must be a mapping, got {value!r}.")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        raise ReplayRLError(f"{where} must be true or false, got {value!r}.")
    if tp is int:
        if isinstance(value, bool):
            raise ReplayRLError(f"{where} must be an integer, got {value!r}.")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                pass
        raise ReplayRLError(f"{where} must be an integer, got {value!r}.")
    if tp is float:
        if isinstance(value, bool):
            raise ReplayRLError(f"{where} must be a number, got {value!r}.")
        if isinstance(value, int | float):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ReplayRLError(f"{where} must be a number, got {value!r}.")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, int | float) and not isinstance(value, bool):
            return str(value)
        raise ReplayRLError(f"{where} must be a string, got {value!r}.")
    return value


def _build(cls: type, data: Any, where: str) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ReplayRLError(f"'{where or 'config'}' must be a mapping of keys, got {data!r}.")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        dotted = f"{where}.{key}" if where else str(key)
        if key not in fields:
            raise ReplayRLError(f"Unknown config key '{dotted}'.{_nearest(str(key), list(fields))}")
        if key in SECTIONS and cls is RunConfig:
            kwargs[key] = _build(SECTIONS[key], value, key)
        else:
            kwargs[key] = _coerce(value, hints[key], dotted)
    return cls(**kwargs)


def _set_dotted(tree: dict[str, Any], dotted: str, raw: str) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ReplayRLError(f"--set {dotted}: '{part}' is not a section.")
        node = child
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    node[parts[-1]] = value


def parse_overrides(items: list[str] | None) -> list[tuple[str, str]]:
    out = []
    for item in items or []:
        if "=" not in item:
            raise ReplayRLError(f"--set expects section.key=value, got '{item}'.")
        key, raw = item.split("=", 1)
        out.append((key.strip(), raw.strip()))
    return out


def load_config(
    path: str | os.PathLike[str] | None = None,
    *,
    overrides: list[str] | None = None,
    arm: str | None = None,
    text: str | None = None,
) -> RunConfig:
    """Load a RunConfig from a YAML file (or YAML `text`), apply `--set` overrides, choose the
    arm, and validate. Raises ReplayRLError with the fix for anything a user got wrong."""
    if text is None and path is not None:
        p = Path(path)
        if not p.is_file():
            raise ReplayRLError(
                f"Config file '{path}' does not exist; pass a YAML file such as configs/tiny-cpu.yaml."
            )
        text = p.read_text()
    try:
        tree = yaml.safe_load(text) if text else {}
    except yaml.YAMLError as e:
        where = f"'{path}'" if path else "config text"
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ReplayRLError(f"Malformed YAML in {where}{at}: {getattr(e, 'problem', e)}.") from None
    if tree is None:
        tree = {}
    if not isinstance(tree, dict):
        raise ReplayRLError(
            "The config must be a YAML mapping of sections (model, task, rollout, ...)."
        )
    for key, raw in parse_overrides(overrides):
        _set_dotted(tree, key, raw)
    if arm is not None:
        tree["arm"] = arm
    cfg = _build(RunConfig, tree, "")
    cfg = apply_arm(cfg)
    validate(cfg)
    return cfg


def apply_arm(cfg: RunConfig) -> RunConfig:
    """Derive the strict on-policy arm from the replay settings.

    Same model, data, seed and gradient steps (S, B); fresh rollouts per iteration R = S·B
    (as many as the gradient steps consume) and capacity N = R, so each row is used exactly
    once. Positive bias and staleness limits do not apply. The plain replay arm is the
    replay settings with positive bias δ = 0.
    """
    if cfg.arm not in ARMS:
        raise ReplayRLError(f"Unknown arm '{cfg.arm}'. Choose one of: {', '.join(ARMS)}.")
    if cfg.arm == "replay":
        return cfg
    if cfg.arm == "replay-plain":
        return dataclasses.replace(cfg, buffer=dataclasses.replace(cfg.buffer, positive_bias=0.0))
    consumed = cfg.train.steps_per_iteration * cfg.train.batch_size
    g = cfg.rollout.samples_per_prompt
    if consumed % g:
        raise ReplayRLError(
            f"On-policy arm needs S·B = {consumed} rollouts to be whole groups of "
            f"rollout.samples_per_prompt = {g}; change train.batch_size or rollout.samples_per_prompt."
        )
    return dataclasses.replace(
        cfg,
        rollout=dataclasses.replace(cfg.rollout, prompts_per_iteration=consumed // g),
        buffer=dataclasses.replace(
            cfg.buffer, capacity=consumed, positive_bias=0.0, max_staleness=None
        ),
    )


def validate(cfg: RunConfig) -> None:
    """Cross-field rules; each message says how to fix the config."""
    r, b, tr = cfg.rollout, cfg.buffer, cfg.train

    def positive(value: float, name: str) -> None:
        if value <= 0:
            raise ReplayRLError(f"{name} must be > 0, got {value}.")

    positive(cfg.iterations, "iterations")
    positive(r.prompts_per_iteration, "rollout.prompts_per_iteration")
    positive(r.samples_per_prompt, "rollout.samples_per_prompt")
    positive(r.max_new_tokens, "rollout.max_new_tokens")
    positive(r.temperature, "rollout.temperature")
    positive(r.batch_size, "rollout.batch_size")
    positive(b.capacity, "buffer.capacity")
    positive(tr.steps_per_iteration, "train.steps_per_iteration")
    positive(tr.batch_size, "train.batch_size")
    positive(tr.lr, "train.lr")
    if not 0 < r.top_p <= 1:
        raise ReplayRLError(f"rollout.top_p must be in (0, 1], got {r.top_p}.")
    if r.top_p != 1:
        # The sampler's log-probs would be those of the nucleus, renormalised, while the
        # trainer's are of the full softmax: the ratio of a fresh row would sit below 1.
        raise ReplayRLError(
            f"rollout.top_p={r.top_p} is refused: training rollouts sampled from a nucleus "
            "carry log-probs renormalised over it while the trainer's use the full softmax, "
            "which biases every ratio of the update; set rollout.top_p=1.0 (temperature applies)."
        )
    if r.backend not in ("transformers", "vllm"):
        raise ReplayRLError(f"rollout.backend must be 'transformers' or 'vllm', got '{r.backend}'.")
    if tr.distributed == "fsdp":
        raise ReplayRLError(
            "train.distributed=fsdp was removed: it was never shown to match one process. "
            "Use ddp (one whole replica per GPU; a 0.5B-7B policy with its AdamW state fits "
            "one GPU), or none."
        )
    if tr.distributed not in ("none", "ddp"):
        raise ReplayRLError(f"train.distributed must be 'none' or 'ddp', got '{tr.distributed}'.")
    positive(tr.num_processes, "train.num_processes")
    if tr.distributed == "none" and tr.num_processes > 1:
        raise ReplayRLError(
            f"train.num_processes={tr.num_processes} needs train.distributed=ddp; set it, "
            "or set train.num_processes=1."
        )
    if r.vllm_gpu_memory_utilization is not None and not 0 < r.vllm_gpu_memory_utilization <= 1:
        raise ReplayRLError(
            "rollout.vllm_gpu_memory_utilization must be in (0, 1], or null for what the "
            f"layout allows; got {r.vllm_gpu_memory_utilization}."
        )
    for name in ("micro_batch_size", "micro_batch_tokens"):
        if getattr(tr, name) < 0:
            raise ReplayRLError(
                f"train.{name} must be >= 0 (0 = no limit), got {getattr(tr, name)}."
            )
    positive(tr.logprob_chunk_tokens, "train.logprob_chunk_tokens")
    if tr.dtype not in ("auto", "float32", "bfloat16"):
        raise ReplayRLError(
            f"train.dtype must be 'auto', 'float32' or 'bfloat16', got '{tr.dtype}'."
        )
    validate_tensor_parallel(cfg)
    if tr.loss not in ("grpo", "asymre"):
        raise ReplayRLError(f"train.loss must be 'grpo' or 'asymre', got '{tr.loss}'.")
    if not 0 <= b.positive_bias <= 1:
        raise ReplayRLError(f"buffer.positive_bias must be in [0, 1], got {b.positive_bias}.")
    if b.max_staleness is not None and b.max_staleness < 0:
        raise ReplayRLError("buffer.max_staleness must be >= 0, or null for no limit.")
    if not 0 < tr.clip_eps < 1:
        raise ReplayRLError(f"train.clip_eps must be in (0, 1), got {tr.clip_eps}.")
    if tr.is_cap is not None and tr.is_cap <= 0:
        raise ReplayRLError("train.is_cap must be > 0, or null to turn it off.")
    if tr.is_cap is not None and tr.loss != "asymre":
        raise ReplayRLError(
            "train.is_cap only applies to train.loss=asymre (GRPO clips its ratio); set it to null."
        )
    if tr.grad_clip < 0:
        raise ReplayRLError("train.grad_clip must be >= 0 (0 turns it off).")
    positive(tr.checkpoint_every, "train.checkpoint_every")
    positive(cfg.kubernetes.iterations_per_task, "kubernetes.iterations_per_task")
    if cfg.kubernetes.layout not in ("task", "step"):
        raise ReplayRLError(
            f"kubernetes.layout must be 'task' or 'step', got '{cfg.kubernetes.layout}'."
        )
    sa = cfg.kubernetes.service_account
    if sa and (len(sa) > 253 or not _K8S_NAME.fullmatch(sa)):
        raise ReplayRLError(
            f"kubernetes.service_account must be a Kubernetes name (lowercase letters, digits, "
            f"'-' and '.', e.g. replayrl-pipeline-runner), got {sa!r}; null = the namespace's "
            f"default account."
        )
    if tr.keep_checkpoints < 0:
        raise ReplayRLError("train.keep_checkpoints must be >= 0 (0 keeps all).")
    rollouts = cfg.rollouts_per_iteration
    if b.capacity < rollouts:
        raise ReplayRLError(
            f"buffer.capacity ({b.capacity}) is smaller than the fresh rollouts per iteration "
            f"R = rollout.prompts_per_iteration × rollout.samples_per_prompt = {rollouts}: the "
            f"newest rows would be dropped before use. Set buffer.capacity >= {rollouts}."
        )
    if tr.batch_size > b.capacity:
        raise ReplayRLError(
            f"train.batch_size ({tr.batch_size}) exceeds buffer.capacity ({b.capacity}); "
            f"a batch cannot be drawn. Lower train.batch_size or raise buffer.capacity."
        )
    if tr.batch_size > rollouts and not b.sample_with_replacement:
        raise ReplayRLError(
            f"train.batch_size ({tr.batch_size}) exceeds the fresh rollouts per iteration "
            f"R = {rollouts}: the first iteration's buffer holds only R rows, so a batch cannot "
            f"be drawn without replacement. Lower train.batch_size to <= {rollouts}, raise "
            f"rollout.prompts_per_iteration, or set buffer.sample_with_replacement: true."
        )
    if cfg.arm == "on-policy" and b.capacity != tr.steps_per_iteration * tr.batch_size:
        raise ReplayRLError(
            "On-policy arm needs buffer.capacity = S·B; let --arm on-policy derive it."
        )
    if cfg.task.name in ("gsm8k", "math") and not cfg.task.path:
        raise ReplayRLError(
            f"task.name is {cfg.task.name!r} but task.path is not set; point it at a Parquet or "
            "JSONL file."
        )
    if cfg.model.revision is not None and hub_id(cfg.model.source) is None:
        raise ReplayRLError(
            f"model.revision applies to a Hugging Face hub id only; model.source "
            f"{cfg.model.source!r} is not one. Remove model.revision."
        )
    t = cfg.task
    if hub_id(t.path) is None and (
        t.revision is not None or t.dataset_config is not None or t.dataset_split != "train"
    ):
        raise ReplayRLError(
            f"task.revision, task.dataset_config and task.dataset_split apply to a Hugging Face "
            f"dataset id only; task.path {t.path!r} is not one. Remove them."
        )
    if cfg.task.num_eval <= 0 or cfg.task.num_train <= 0:
        raise ReplayRLError("task.num_train and task.num_eval must be > 0.")
    if cfg.task.num_train < r.prompts_per_iteration:
        raise ReplayRLError(
            f"task.num_train ({cfg.task.num_train}) is smaller than rollout.prompts_per_iteration "
            f"({r.prompts_per_iteration}); raise task.num_train."
        )
    e = cfg.eval
    if e.every < 0:
        raise ReplayRLError("eval.every must be >= 0 (0 = only at the end).")
    positive(e.num_prompts, "eval.num_prompts")
    positive(e.num_samples, "eval.num_samples")
    if not 1 <= e.pass_k <= e.num_samples:
        raise ReplayRLError(
            f"eval.pass_k ({e.pass_k}) must be between 1 and eval.num_samples ({e.num_samples})."
        )
    for name, value in (("eval.top_p", e.top_p), ("eval.pass1_top_p", e.pass1_top_p)):
        if not 0 < value <= 1:
            raise ReplayRLError(f"{name} must be in (0, 1], got {value}.")
    if e.pass1_temperature is not None:
        positive(e.pass1_temperature, "eval.pass1_temperature")
    m = cfg.model
    if m.source == "tiny" and m.vocab_size < TINY_VOCAB_SIZE:
        raise ReplayRLError(
            f"model.vocab_size ({m.vocab_size}) leaves no room for the byte tokenizer's "
            f"tokens; set it to at least {TINY_VOCAB_SIZE}."
        )
    if m.source != "tiny" and m.vocab_size != TINY_VOCAB_SIZE:
        raise ReplayRLError(
            f"model.vocab_size only applies to model.source=tiny; a checkpoint "
            f"('{m.source}') brings its own vocabulary. Remove model.vocab_size."
        )
    if cfg.model.source == "tiny" and cfg.model.hidden_size % cfg.model.num_heads:
        raise ReplayRLError("model.hidden_size must be divisible by model.num_heads.")
    if cfg.model.source == "tiny" and cfg.model.num_heads % cfg.model.num_kv_heads:
        raise ReplayRLError("model.num_heads must be divisible by model.num_kv_heads.")
    validate_async(cfg)


def validate_async(cfg: RunConfig) -> None:
    """The asynchronous split's settings (`asynchronous`), when it is on."""
    a = cfg.asynchronous
    if not a.enabled:
        return
    for name in ("workers", "trainers", "publish_every"):
        if getattr(a, name) < 1:
            raise ReplayRLError(f"asynchronous.{name} must be >= 1, got {getattr(a, name)}.")
    if cfg.train.batch_size < a.trainers:
        raise ReplayRLError(
            f"train.batch_size ({cfg.train.batch_size}) is below asynchronous.trainers "
            f"({a.trainers}): each of the T data-parallel trainers takes a share of every batch."
        )
    if cfg.arm == "replay-plain":
        raise ReplayRLError(
            "The asynchronous engine runs the replay and on-policy arms; for plain replay use "
            "--arm replay with --set buffer.positive_bias=0."
        )
    if cfg.train.distributed != "none":
        raise ReplayRLError(
            "The asynchronous engine's trainer keeps its model in one process: set "
            "train.distributed: none."
        )
    for name in ("min_rows", "max_unused_rows", "segment_steps"):
        value = getattr(a, name)
        if value is not None and value < 1:
            raise ReplayRLError(f"asynchronous.{name} must be >= 1 or null, got {value}.")
    if a.segment_seconds is not None and a.segment_seconds <= 0:
        raise ReplayRLError(
            f"asynchronous.segment_seconds must be > 0 or null, got {a.segment_seconds}."
        )
    if cfg.arm == "on-policy" and cfg.train.batch_size % cfg.rollout.samples_per_prompt:
        raise ReplayRLError(
            f"The asynchronous on-policy queue hands out whole groups: train.batch_size "
            f"({cfg.train.batch_size}) must be a multiple of rollout.samples_per_prompt "
            f"({cfg.rollout.samples_per_prompt})."
        )
    if async_min_rows(cfg) > async_max_unused_rows(cfg) + cfg.rollouts_per_iteration:
        raise ReplayRLError(
            f"asynchronous.min_rows ({async_min_rows(cfg)}) exceeds max_unused_rows "
            f"({async_max_unused_rows(cfg)}) + one batch (R = {cfg.rollouts_per_iteration}): "
            "workers would pause before the trainer could start. Raise max_unused_rows."
        )
    if async_max_unused_rows(cfg) < cfg.train.batch_size:
        raise ReplayRLError(
            f"asynchronous.max_unused_rows ({async_max_unused_rows(cfg)}) is below "
            f"train.batch_size ({cfg.train.batch_size}): the on-policy queue could never fill "
            "a batch. Raise it."
        )
    if async_min_rows(cfg) > cfg.buffer.capacity:
        raise ReplayRLError(
            f"asynchronous.min_rows ({async_min_rows(cfg)}) exceeds buffer.capacity "
            f"({cfg.buffer.capacity}): the trainer would wait forever. Lower it."
        )


def async_min_rows(cfg: RunConfig) -> int:
    """Rows the buffer must hold before the asynchronous trainer takes a step."""
    return cfg.asynchronous.min_rows or cfg.train.batch_size


def async_max_unused_rows(cfg: RunConfig) -> int:
    """Rows never used by a gradient step above which asynchronous workers pause."""
    a = cfg.asynchronous
    if a.max_unused_rows is not None:
        return a.max_unused_rows
    if cfg.arm == "on-policy":
        return 2 * cfg.rollouts_per_iteration
    return max(int(cfg.buffer.capacity / cfg.replay_ratio), cfg.rollouts_per_iteration)


def validate_tensor_parallel(cfg: RunConfig) -> None:
    """rollout.tensor_parallel_size: >= 1; above 1 only for vLLM, in the "step" layout, on
    pods with at least that many GPUs."""
    r, k = cfg.rollout, cfg.kubernetes
    tp = r.tensor_parallel_size
    if tp < 1:
        raise ReplayRLError(f"rollout.tensor_parallel_size must be >= 1, got {tp}.")
    if tp == 1:
        return
    if r.backend != "vllm":
        raise ReplayRLError(
            f"rollout.tensor_parallel_size={tp} needs rollout.backend=vllm (the transformers "
            "backend runs on one device); set it to 1."
        )
    if k.layout != "step":
        raise ReplayRLError(
            f"rollout.tensor_parallel_size={tp} needs kubernetes.layout: step. The inline engine "
            "and task pods give the vLLM engine the trainer's new weights in place, which only "
            "works with its one worker in the trainer's process; set tensor_parallel_size: 1, "
            "or run one pod per step (each generate and evaluate pod starts its engine from "
            "the checkpoint)."
        )
    for name in ("generate_gpus", "evaluate_gpus"):
        gpus = getattr(k, name)
        if gpus < tp:
            raise ReplayRLError(
                f"rollout.tensor_parallel_size={tp} splits the vLLM engine over {tp} GPUs, but "
                f"kubernetes.{name} is {gpus}: raise kubernetes.{name} to {tp}, or lower "
                "tensor_parallel_size."
            )


def config_from_dict(data: dict[str, Any]) -> RunConfig:
    """Rebuild a RunConfig from `to_dict()` output (e.g. a stored config.yaml)."""
    cfg = _build(RunConfig, data, "")
    validate(cfg)
    return cfg


def default_cache_dir(cfg: RunConfig) -> Path:
    if cfg.model.cache_dir:
        return Path(cfg.model.cache_dir).expanduser()
    env = os.environ.get("REPLAYRL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "replayrl"


def tracking_uri_from_env() -> str | None:
    return os.environ.get("MLFLOW_TRACKING_URI") or None


def kfp_connection_from_env() -> dict[str, str | None]:
    """Kubeflow Pipelines connection settings from the environment, for `replayrl submit`
    and `schedule` when no flag is given: KF_PIPELINES_ENDPOINT (the variable kfp.Client
    itself reads), KF_PIPELINES_TOKEN, KF_PIPELINES_NAMESPACE, KF_PIPELINES_COOKIES."""
    env = os.environ
    return {
        "host": env.get("KF_PIPELINES_ENDPOINT") or None,
        "token": env.get("KF_PIPELINES_TOKEN") or None,
        "namespace": env.get("KF_PIPELINES_NAMESPACE") or None,
        "cookies": env.get("KF_PIPELINES_COOKIES") or None,
    }
