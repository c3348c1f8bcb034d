"""The sections of what a run learns: the model, the task, rollout sampling and evaluation.

Each knob carries its documentation as data, `field(default=..., metadata={"help": ...})`:
what it does, its unit, what 0/None means, and the paper's value where one exists
("Efficient RL Training for LLMs with Experience Replay", Arnal et al. 2026; "Asymmetric
REINFORCE" by the same authors). `replayrl config explain` prints it and
docs/configuration.md is generated from it. A numeric knob's allowed values are metadata too
(`"range": "(0, 1]"`, checked by replayrl.config.ranges, which also refuses NaN and ±inf in
every float). Each section checks its own fields in `check()`; rules across sections live in
replayrl.config.run. The buffer and training sections are in
replayrl.config.training, the asynchronous split in replayrl.config.asynchronous, where and
how a run executes in replayrl.config.infra.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from replayrl.config.ranges import check_ranges
from replayrl.errors import ReplayRLError

# task.prompt_format's values (replayrl.policy.prompts renders them), and the arguments of
# apply_chat_template that replayrl sets itself, which task.chat_template_args may not override.
PROMPT_FORMATS = ("plain", "chat")
RESERVED_CHAT_TEMPLATE_ARGS = frozenset(
    {
        "conversation",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "chat_template",
        "return_dict",
        "return_tensors",
        "padding",
        "truncation",
        "max_length",
        "tokenizer_kwargs",
    }
)
# Hugging Face hub names (replayrl.policy.hub downloads them; loading a config only checks them).
HF_PREFIX = "hf://"
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}")
DATA_SUFFIXES = (".parquet", ".jsonl")
# model.vocab_size's default, replayrl.policy.tokenizer.VOCAB_SIZE (not imported: this package
# must not pull in transformers).
TINY_VOCAB_SIZE = 264


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


TINY_SHAPE = "Tiny model shape (model.source=tiny only; ~0.6M parameters at the defaults): "


@dataclass(frozen=True)
class ModelConfig:
    """The policy: the tiny demo model built in code, a Hugging Face hub id, or a checkpoint."""

    source: str = field(
        default="tiny",
        metadata={
            "help": '"tiny" builds the byte-level Qwen2 demo model in code (no download) and '
            "warm-starts it on the task. A Hugging Face hub id (`Qwen/Qwen3-0.6B`, or "
            "`hf://Qwen/Qwen3-0.6B`) is downloaded once, when the lineage is opened, into its "
            "checkpoint v0 (HF_TOKEN for gated repos; the commit it resolved to goes to the "
            "lineage's params as hub.model_revision). Anything else is a checkpoint directory "
            "in the Hugging Face layout (local path, file:// or s3:// URI)."
        },
    )
    revision: str | None = field(
        default=None,
        metadata={
            "help": "Hub ids only: the branch, tag or commit to download. None = the "
            "repository's default branch, resolved to a commit when the lineage is opened."
        },
    )
    untie_word_embeddings: bool = field(
        default=False,
        metadata={
            "help": "Train the output embedding (lm_head) as its own matrix: a checkpoint "
            "that ties it to the input embedding (Qwen3-0.6B, Qwen2.5-0.5B, the tiny model) "
            "gets, in v0, a separate trainable copy of the same weights, and its config says "
            "tie_word_embeddings: false, so every later checkpoint and vLLM read it back "
            "untied. The paper trained Qwen3-0.6B untied (§5.1, App. 10). Costs one more "
            "vocabulary x hidden matrix in the weights and in AdamW's state (0.16B "
            "parameters for Qwen3-0.6B). false = as the checkpoint is. At false it stays out "
            "of the config hash.",
        },
    )
    paper_mu: float | None = field(
        default=None,
        metadata={
            "range": "[0, inf)",
            "null": "for the default what-if μ, 5.3",
            "help": "The paper's measured μ (generation / training cost of a rollout, §3.2) "
            "for this model: 6.84 for Qwen3-0.6B (median of 242 runs), 5.28 for Qwen2.5-7B. "
            "`replayrl experiment` and `compare` show cost units at this what-if μ beside "
            "the lineages' own measured μ (`--mu` overrides it). A label for reports: not "
            "part of the config hash.",
        },
    )
    hidden_size: int = field(
        default=128,
        metadata={
            "range": "[1, inf)",
            "help": TINY_SHAPE + "hidden size; a multiple of num_heads.",
        },
    )
    num_layers: int = field(
        default=4, metadata={"range": "[1, inf)", "help": TINY_SHAPE + "decoder layers."}
    )
    num_heads: int = field(
        default=4,
        metadata={
            "range": "[1, inf)",
            "help": TINY_SHAPE + "attention heads; a multiple of num_kv_heads.",
        },
    )
    num_kv_heads: int = field(
        default=2,
        metadata={
            "range": "[1, inf)",
            "help": TINY_SHAPE + "key/value heads (grouped-query attention).",
        },
    )
    intermediate_size: int = field(
        default=256, metadata={"range": "[1, inf)", "help": TINY_SHAPE + "MLP intermediate size."}
    )
    vocab_size: int = field(
        default=TINY_VOCAB_SIZE,
        metadata={
            "range": "[1, inf)",
            "help": "Rows of the tiny model's embedding (and tied output) matrix: the byte "
            "tokenizer's 259 tokens padded to this size; a sampled id past them decodes to "
            '"<|unused|>". At least 264 (the default: the tokens rounded up to a multiple of '
            "8). configs/shapes-cpu.yaml sets Qwen2.5's 151936 to run the real vocabulary's "
            "memory and time on the tiny model. model.source=tiny only (a checkpoint brings its "
            "own vocabulary). At its default it stays out of the config hash.",
        },
    )
    warm_start_max_steps: int = field(
        default=3000,
        metadata={
            "range": "[0, inf)",
            "help": "Supervised warm start of the tiny model, so RL has a reward signal to "
            "work with: it stops at the first evaluation whose greedy pass@1 reaches "
            "warm_start_target_pass1, or after this many steps. Its evaluations use "
            "validation prompts held out of the training pool (the last 1/8 of "
            "task.num_train, at most 128; the warm start trains on the rest), never the "
            "evaluation prompts. 0 = no warm start (RL from a random model: no signal).",
        },
    )
    warm_start_lr: float = field(
        default=3e-3,
        metadata={"range": "(0, inf)", "help": "Learning rate of the tiny model's warm start."},
    )
    warm_start_batch_size: int = field(
        default=128,
        metadata={"range": "[1, inf)", "help": "Examples per step of the tiny model's warm start."},
    )
    warm_start_eval_every: int = field(
        default=50,
        metadata={
            "range": "[1, inf)",
            "help": "Warm-start steps between greedy pass@1 evaluations on the validation "
            "prompts (each may stop the warm start).",
        },
    )
    warm_start_target_pass1: float = field(
        default=0.25,
        metadata={
            "range": "[0, 1]",
            "help": "Greedy pass@1 (validation prompts) at which the warm start stops.",
        },
    )
    cache_dir: str | None = field(
        default=None,
        metadata={
            "help": "Where the warm-started tiny model is cached across runs. None = "
            "$REPLAYRL_CACHE or ~/.cache/replayrl."
        },
    )

    def check(self) -> None:
        check_ranges(self, "model")
        if self.revision is not None and hub_id(self.source) is None:
            raise ReplayRLError(
                f"model.revision applies to a Hugging Face hub id only; model.source "
                f"{self.source!r} is not one. Remove model.revision."
            )
        if self.source == "tiny" and self.vocab_size < TINY_VOCAB_SIZE:
            raise ReplayRLError(
                f"model.vocab_size ({self.vocab_size}) leaves no room for the byte tokenizer's "
                f"tokens; set it to at least {TINY_VOCAB_SIZE}."
            )
        if self.source != "tiny" and self.vocab_size != TINY_VOCAB_SIZE:
            raise ReplayRLError(
                f"model.vocab_size only applies to model.source=tiny; a checkpoint "
                f"('{self.source}') brings its own vocabulary. Remove model.vocab_size."
            )
        if self.source == "tiny" and self.hidden_size % self.num_heads:
            raise ReplayRLError("model.hidden_size must be divisible by model.num_heads.")
        if self.source == "tiny" and self.num_heads % self.num_kv_heads:
            raise ReplayRLError("model.num_heads must be divisible by model.num_kv_heads.")


@dataclass(frozen=True)
class TaskConfig:
    """What the policy learns on: the prompts, their gold answers and the reward."""

    name: str = field(
        default="chain_sum",
        metadata={
            "help": '"chain_sum" (reasoning-gym, procedurally generated, offline), '
            '"chain_sum_steps" (the same sums written out step by step: longer completions, '
            "so generation costs more per rollout; see replayrl.policy.problems), "
            '"gsm8k" or "math" (both read from task.path). "math" reads OpenR1-Math-220k / '
            "MATH rows (problem, solution, optional answer; the gold answer is `answer`, else "
            "the solution's last \\boxed{}) and grades the completion's last \\boxed{} with "
            "math-verify."
        },
    )
    path: str | None = field(
        default=None,
        metadata={
            "help": 'Parquet/JSONL file (local path or s3:// URI) for the file tasks "gsm8k" '
            'and "math", or a Hugging Face dataset id (`open-r1/OpenR1-Math-220k`, or '
            "`hf://…`) read with task.dataset_config and task.dataset_split: downloaded once, "
            "when the lineage is opened, into <lineage>/inputs/dataset.parquet, which every "
            "later step reads (hub.dataset_revision in the lineage's params records the "
            "commit). Required by gsm8k and math."
        },
    )
    dataset_config: str | None = field(
        default=None,
        metadata={
            "help": "Hub datasets only: the config to read. None = the card's default config."
        },
    )
    dataset_split: str = field(
        default="train", metadata={"help": "Hub datasets only: the split to read."}
    )
    revision: str | None = field(
        default=None,
        metadata={
            "help": "Hub datasets only: the branch, tag or commit. None = the default branch."
        },
    )
    num_train: int = field(
        default=4000,
        metadata={
            "range": "(0, inf)",
            "help": "Distinct training prompts drawn from; never overlaps the evaluation "
            "prompts. At least rollout.prompts_per_iteration.",
        },
    )
    num_eval: int = field(
        default=256,
        metadata={
            "range": "(0, inf)",
            "help": "Held-out prompts evaluated on; never overlaps the training prompts.",
        },
    )
    options: dict[str, Any] = field(
        default_factory=dict,
        metadata={
            "help": "Task-specific options passed to the generator, e.g. chain_sum's "
            "min_digits/max_digits."
        },
    )
    prompt_format: str = field(
        default="plain",
        metadata={
            "help": "\"plain\": the policy reads the task's prompt as it is (the demo's `48 + 57 =`, "
            'or a file task\'s task.options.prompt_template filled in). "chat": that text is the '
            "user message, after task.system_prompt if set, rendered with the checkpoint "
            "tokenizer's own chat template (`apply_chat_template(..., add_generation_prompt="
            "True)` with task.chat_template_args), so a chat model reads the format it was "
            "tuned on and a new model needs no template written by hand. Needs a checkpoint "
            "whose tokenizer has a chat template (the tiny model's has none). The rollout rows "
            "store the rendered text and its token ids (replayrl.policy.prompts)."
        },
    )
    system_prompt: str | None = field(
        default=None,
        metadata={
            "help": 'prompt_format "chat" only: the system message before each prompt. None = '
            "no system message (a template may then write its own default, as Qwen2.5's does)."
        },
    )
    chat_template_args: dict[str, Any] = field(
        default_factory=dict,
        metadata={
            "help": 'prompt_format "chat" only: extra variables for the chat template, e.g. '
            "`{enable_thinking: false}` for Qwen3 (its empty think block, so a solution "
            "fits rollout.max_new_tokens)."
        },
    )

    def check(self) -> None:
        check_ranges(self, "task")
        if self.prompt_format not in PROMPT_FORMATS:
            raise ReplayRLError(
                f"task.prompt_format must be one of {', '.join(PROMPT_FORMATS)}, got "
                f"{self.prompt_format!r}."
            )
        if self.prompt_format != "chat" and (
            self.system_prompt is not None or self.chat_template_args
        ):
            raise ReplayRLError(
                "task.system_prompt and task.chat_template_args apply to task.prompt_format: chat "
                "only; set it, or remove them."
            )
        reserved = sorted(set(self.chat_template_args) & RESERVED_CHAT_TEMPLATE_ARGS)
        if reserved:
            raise ReplayRLError(
                f"task.chat_template_args may not set {reserved}: replayrl passes those to "
                "apply_chat_template itself; remove them."
            )
        if self.name in ("gsm8k", "math") and not self.path:
            raise ReplayRLError(
                f"task.name is {self.name!r} but task.path is not set; point it at a Parquet "
                "or JSONL file."
            )
        if hub_id(self.path) is None and (
            self.revision is not None
            or self.dataset_config is not None
            or self.dataset_split != "train"
        ):
            raise ReplayRLError(
                f"task.revision, task.dataset_config and task.dataset_split apply to a Hugging "
                f"Face dataset id only; task.path {self.path!r} is not one. Remove them."
            )


VLLM_ONLY = "vLLM only: "


@dataclass(frozen=True)
class RolloutConfig:
    """Generation of training rollouts: R = prompts_per_iteration x samples_per_prompt fresh
    rollouts per iteration, sampled from the current policy."""

    prompts_per_iteration: int = field(
        default=16,
        metadata={
            "range": "(0, inf)",
            "help": "Prompts per iteration; R (fresh rollouts per iteration) = prompts x "
            "samples_per_prompt. The on-policy arm derives it: S·B / samples_per_prompt.",
        },
    )
    samples_per_prompt: int = field(
        default=8,
        metadata={
            "range": "(0, inf)",
            "help": "G: completions sampled per prompt (one GRPO group). Paper: 16 (App. 10.2).",
        },
    )
    max_new_tokens: int = field(
        default=6,
        metadata={
            "range": "(0, inf)",
            "help": "Upper bound on generated tokens per completion; a completion cut here "
            'has finish_reason "length".',
        },
    )
    temperature: float = field(
        default=1.0,
        metadata={"range": "(0, inf)", "help": "Sampling temperature of training rollouts; > 0."},
    )
    top_p: float = field(
        default=1.0,
        metadata={
            "range": "(0, 1]",
            "help": "Nucleus sampling of training rollouts: must stay 1.0 (off). With top_p < 1 "
            "the behaviour log-probs are renormalised over the nucleus while the trainer's "
            "log-probs are of the full softmax (at the same temperature), so the ratio of a "
            "fresh row is at most 1 and the update is biased. Evaluation samples at top_p 1.0 "
            "too (eval.top_p).",
        },
    )
    backend: str = field(
        default="transformers",
        metadata={"help": '"transformers" (CPU, tests) or "vllm" (GPU, the `gpu` extra).'},
    )
    batch_size: int = field(
        default=512,
        metadata={
            "range": "(0, inf)",
            "help": "Rollouts generated per forward batch; bounds memory, not results.",
        },
    )
    vllm_dtype: str = field(
        default="auto",
        metadata={
            "help": VLLM_ONLY + 'the engine\'s dtype. "auto" follows vLLM, which runs a '
            "float32 checkpoint (ours are float32) in bfloat16: behaviour log-probs then "
            "differ from the float32 trainer's by ~1e-2 (GRPO's clip absorbs it). "
            '"float32" matches the trainer to ~1e-4.'
        },
    )
    vllm_gpu_memory_utilization: float | None = field(
        default=None,
        metadata={
            "range": "(0, 1]",
            "null": "for what the layout allows",
            "help": VLLM_ONLY + "fraction of the GPU's memory the engine may take (weights + "
            "KV cache), in (0, 1]. None = what the layout allows: 0.9 where the engine has the "
            'GPU to itself (the generate and evaluate pods of kubernetes.layout "step", and '
            "distributed training, whose processes end before generation); where the trainer "
            'shares the process and the GPU (the inline engine, a "task" pod), 0.9 minus the '
            "trainer's resident memory (float32 weights, gradients and AdamW's two moments, "
            "16 bytes per parameter of the checkpoint) over the GPU's memory, and an error "
            "when that leaves less than 0.1. Not part of the config hash.",
        },
    )
    vllm_sleep_level: int | None = field(
        default=None,
        metadata={
            "range": "[1, 2]",
            "null": "for what the layout allows",
            "help": VLLM_ONLY + "how the engine sleeps while the trainer has the GPU (vLLM sleep "
            "mode, CUDA only; on CPU it never sleeps). 1: its weights are copied to pinned host "
            "memory and back on wake (the model's size in vLLM's dtype each way, every "
            "iteration: 15 GB at 7B). 2: they are discarded, and the new weights are loaded in "
            "full before it wakes (from the trainer, or the checkpoint's files; after a sleep "
            "with no new weights, from the last checkpoint they were read from), so it never "
            "generates with discarded weights. None = what the layout allows: 2 where an "
            'engine sleeps (the inline engine, a kubernetes.layout "task" pod: every iteration '
            "replaces the weights anyway, so level 1's copy is never used), 1 elsewhere (its "
            "engines never sleep). Level 2 relies on vLLM restoring buffers outside the "
            "parameters (rotary caches); set 1 if a GPU run's generations look wrong after the "
            "first wake. `replayrl plan` names the level. Not part of the config hash.",
        },
    )
    tensor_parallel_size: int = field(
        default=1,
        metadata={
            "range": "[1, inf)",
            "help": VLLM_ONLY + "GPUs one engine is split over (tensor parallelism), at most "
            "the GPUs of the pods that generate and evaluate (kubernetes.generate_gpus, "
            'evaluate_gpus). Above 1 only in kubernetes.layout "step": the inline engine and '
            '"task" pods give the engine the trainer\'s new weights in place, by reference, '
            "which needs the engine's one worker in this process; tensor-parallel workers run "
            "in processes of their own. Not part of the config hash.",
        },
    )

    def check(self) -> None:
        check_ranges(self, "rollout")
        if self.top_p != 1:
            # The sampler's log-probs would be those of the nucleus, renormalised, while the
            # trainer's are of the full softmax: the ratio of a fresh row would sit below 1.
            raise ReplayRLError(
                f"rollout.top_p={self.top_p} is refused: training rollouts sampled from a "
                "nucleus carry log-probs renormalised over it while the trainer's use the full "
                "softmax, which biases every ratio of the update; set rollout.top_p=1.0 "
                "(temperature applies)."
            )
        if self.backend not in ("transformers", "vllm"):
            raise ReplayRLError(
                f"rollout.backend must be 'transformers' or 'vllm', got '{self.backend}'."
            )


@dataclass(frozen=True)
class EvalConfig:
    """Evaluation on the held-out prompts: greedy pass@1, sampled pass@k and accuracy."""

    every: int = field(
        default=10,
        metadata={
            "range": "[0, inf)",
            "help": "Evaluate every this many iterations (and after the first and last). "
            "0 = only at the end.",
        },
    )
    num_prompts: int = field(
        default=256,
        metadata={
            "range": "(0, inf)",
            "help": "Held-out prompts evaluated (at most task.num_eval).",
        },
    )
    pass_k: int = field(
        default=4,
        metadata={
            "range": "[1, inf)",
            "help": "k of pass@k, estimated (unbiased estimator) from eval.num_samples sampled "
            "completions per prompt; between 1 and num_samples.",
        },
    )
    num_samples: int = field(
        default=8,
        metadata={
            "range": "(0, inf)",
            "help": "Sampled completions per prompt behind pass@k (and pass1_sampled).",
        },
    )
    temperature: float = field(
        default=1.0,
        metadata={
            "range": "(0, inf)",
            "help": "Temperature of the sampled completions behind pass@k.",
        },
    )
    top_p: float = field(
        default=1.0,
        metadata={
            "range": "(0, 1]",
            "help": "Nucleus of the sampled completions (pass@k, sample accuracy, entropy), in "
            "(0, 1]. The paper evaluates pass@k at temperature 1 with top-p 0.95 (§5.1); 1.0 = "
            "the full distribution. Evaluation only: training rollouts must sample the full "
            "softmax (rollout.top_p).",
        },
    )
    pass1_temperature: float | None = field(
        default=None,
        metadata={
            "range": "(0, inf)",
            "null": "for no sampled pass@1",
            "help": "pass@1 at the paper's evaluation settings (§5.1: temperature 0.1, top-p "
            "0.95), logged as eval/pass1_sampled beside the greedy eval/pass1: the mean over "
            "eval.num_samples sampled completions per prompt at this temperature and "
            "eval.pass1_top_p. null = not evaluated (one generation pass fewer per evaluation).",
        },
    )
    pass1_top_p: float = field(
        default=0.95,
        metadata={
            "range": "(0, 1]",
            "help": "Nucleus of eval/pass1_sampled (see eval.pass1_temperature), in (0, 1]. "
            "Paper: 0.95 (§5.1).",
        },
    )

    def check(self) -> None:
        check_ranges(self, "eval")
        if self.pass_k > self.num_samples:
            raise ReplayRLError(
                f"eval.pass_k ({self.pass_k}) must be between 1 and eval.num_samples "
                f"({self.num_samples})."
            )
