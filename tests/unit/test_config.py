import dataclasses
import re
from pathlib import Path

import pytest

from replayrl.config import RunConfig, load_config
from replayrl.errors import ReplayRLError

pytestmark = pytest.mark.unit
PRESET = Path(__file__).parents[2] / "configs" / "tiny-cpu.yaml"


def test_preset_loads_with_paper_quantities():
    cfg = load_config(PRESET)
    assert cfg.arm == "replay"
    assert cfg.rollouts_per_iteration == 128
    assert cfg.buffer.capacity == 512
    assert cfg.replay_ratio == 2.0
    # x in gradient steps: N / R = 4 iterations of S = 4 steps.
    assert cfg.staleness_horizon == 16.0


def test_on_policy_arm_is_derived_from_the_same_file():
    replay = load_config(PRESET)
    on = load_config(PRESET, arm="on-policy")
    assert on.train == replay.train  # same gradient steps, same lr
    assert on.model == replay.model and on.task == replay.task and on.seed == replay.seed
    consumed = on.train.steps_per_iteration * on.train.batch_size
    assert on.rollouts_per_iteration == consumed == on.buffer.capacity
    assert on.replay_ratio == 1.0
    assert on.lineage != replay.lineage


def test_set_overrides_are_typed():
    cfg = load_config(
        PRESET, overrides=["buffer.capacity=1024", "train.lr=3e-4", "buffer.max_staleness=null"]
    )
    assert cfg.buffer.capacity == 1024
    assert cfg.train.lr == pytest.approx(3e-4)
    assert cfg.buffer.max_staleness is None


def test_unknown_key_names_the_nearest_valid_one():
    with pytest.raises(ReplayRLError, match="buffer.capacty.*Did you mean 'capacity'"):
        load_config(PRESET, overrides=["buffer.capacty=10"])
    with pytest.raises(ReplayRLError, match="Did you mean 'rollout'"):
        load_config(text="rollouts: {}\n")


def test_wrong_type_names_the_key():
    with pytest.raises(ReplayRLError, match="train.batch_size must be an integer"):
        load_config(PRESET, overrides=["train.batch_size=many"])


def test_malformed_yaml_says_where(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  lr: [1\n")
    with pytest.raises(ReplayRLError, match="Malformed YAML.*line"):
        load_config(bad)


def test_unknown_arm():
    with pytest.raises(ReplayRLError, match="Unknown arm 'offpolicy'.*replay, on-policy"):
        load_config(PRESET, arm="offpolicy")


def test_cross_field_rule_says_how_to_fix():
    with pytest.raises(ReplayRLError, match="Set buffer.capacity >= 128"):
        load_config(PRESET, overrides=["buffer.capacity=64"])
    with pytest.raises(ReplayRLError, match="pass_k"):
        load_config(PRESET, overrides=["eval.pass_k=16"])
    with pytest.raises(ReplayRLError, match="positive_bias"):
        load_config(PRESET, overrides=["buffer.positive_bias=1.5"])
    # R = 4 x 8 = 32 fresh rows, B = 64: iteration 1 could not draw a batch.
    small_r = ["rollout.prompts_per_iteration=4", "train.steps_per_iteration=2"]
    with pytest.raises(ReplayRLError, match="Lower train.batch_size to <= 32"):
        load_config(PRESET, overrides=small_r)
    cfg = load_config(PRESET, overrides=[*small_r, "buffer.sample_with_replacement=true"])
    assert cfg.train.batch_size == 64 and cfg.rollouts_per_iteration == 32


def test_missing_file():
    with pytest.raises(ReplayRLError, match="does not exist"):
        load_config("nope.yaml")


def test_config_hash_ignores_storage_and_iterations_only_where_it_should():
    a = load_config(PRESET)
    b = load_config(PRESET, overrides=["storage.run_root=/tmp/elsewhere"])
    c = load_config(PRESET, overrides=["train.lr=2e-4"])
    assert a.config_hash() == b.config_hash()
    assert a.config_hash() != c.config_hash()
    # when checkpoints are written and how pods are laid out change no result
    d = load_config(
        PRESET,
        overrides=[
            "train.checkpoint_every=1",
            "kubernetes.iterations_per_task=3",
            "kubernetes.service_account=my-runner",
        ],
    )
    assert a.config_hash() == d.config_hash()
    # nor how a step is cut into micro-batches and log-prob chunks
    e = load_config(
        PRESET,
        overrides=[
            "train.micro_batch_size=4",
            "train.micro_batch_tokens=512",
            "train.logprob_chunk_tokens=64",
            "train.activation_checkpointing=true",
        ],
    )
    assert a.config_hash() == e.config_hash()
    assert a.config_hash() != load_config(PRESET, overrides=["train.dtype=float32"]).config_hash()


def test_service_account_defaults_to_kfps_default_and_a_config_may_name_one():
    assert load_config(PRESET).kubernetes.service_account is None
    cfg = load_config(PRESET, overrides=["kubernetes.service_account=replayrl-pipeline-runner"])
    assert cfg.kubernetes.service_account == "replayrl-pipeline-runner"


def test_knobs_added_later_keep_existing_lineages_hashes():
    """Lineages written before a knob existed resume: at its default, the hash is the one
    they recorded (these values were recorded before the memory knobs were added)."""
    assert RunConfig().config_hash() == "2f58e31afa61"
    assert load_config(PRESET).config_hash() == "52633a316496"
    # The GSM8K preset as it was then: its chat format written out by hand, prompt_format plain.
    written_out = (
        "<|im_start|>system\nPlease reason step by step, and put your final answer within "
        "\\boxed{{}}.<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    )
    gsm8k = load_config(
        PRESET.with_name("qwen2.5-0.5b-gsm8k.yaml"),
        overrides=["task.prompt_format=plain", "task.system_prompt=null"],
    )
    gsm8k = dataclasses.replace(
        gsm8k, task=dataclasses.replace(gsm8k.task, options={"prompt_template": written_out})
    )
    assert gsm8k.config_hash() == "7e979cdd5692"


@pytest.mark.parametrize(
    "override,message",
    [
        ("train.checkpoint_every=0", "train.checkpoint_every must be > 0"),
        ("kubernetes.iterations_per_task=0", "kubernetes.iterations_per_task must be > 0"),
        ("kubernetes.layout=pods", "kubernetes.layout must be 'task' or 'step'"),
        ("kubernetes.service_account=Runner_1", "kubernetes.service_account must be a"),
    ],
)
def test_cadence_and_layout_are_checked(override, message):
    with pytest.raises(ReplayRLError, match=message):
        load_config(PRESET, overrides=[override])


@pytest.mark.parametrize("top_p", ["0.95", "0.5"])
def test_nucleus_sampling_of_training_rollouts_is_refused_with_the_reason(top_p):
    with pytest.raises(ReplayRLError) as err:
        load_config(PRESET, overrides=[f"rollout.top_p={top_p}"])
    message = str(err.value)
    assert "\n" not in message
    assert f"rollout.top_p={top_p} is refused" in message
    assert "full softmax" in message and "set rollout.top_p=1.0" in message
    assert load_config(PRESET, overrides=["rollout.top_p=1.0"]).rollout.top_p == 1.0


def test_the_vllm_engines_memory_and_gpus_do_not_change_the_config_hash():
    a = load_config(PRESET)
    b = load_config(
        PRESET,
        overrides=[
            "rollout.backend=vllm",
            "rollout.vllm_gpu_memory_utilization=0.6",
            "rollout.tensor_parallel_size=2",
            "kubernetes.layout=step",
            "kubernetes.generate_gpus=2",
            "kubernetes.evaluate_gpus=2",
        ],
    )
    c = load_config(PRESET, overrides=["rollout.backend=vllm"])
    assert b.config_hash() == c.config_hash() != a.config_hash()


VLLM_STEP = ["rollout.backend=vllm", "kubernetes.layout=step"]


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["rollout.tensor_parallel_size=0"], "rollout.tensor_parallel_size must be >= 1, got 0"),
        (
            ["rollout.tensor_parallel_size=2", "kubernetes.layout=step"],
            "needs rollout.backend=vllm",
        ),
        # the task layout (and the inline engine) load new weights into the engine in place
        (
            [
                "rollout.tensor_parallel_size=2",
                "rollout.backend=vllm",
                "kubernetes.generate_gpus=2",
            ],
            "needs kubernetes.layout: step",
        ),
        (
            [*VLLM_STEP, "rollout.tensor_parallel_size=2"],
            "kubernetes.generate_gpus is 1: raise kubernetes.generate_gpus to 2",
        ),
        (
            [*VLLM_STEP, "rollout.tensor_parallel_size=2", "kubernetes.generate_gpus=2"],
            "kubernetes.evaluate_gpus is 1: raise kubernetes.evaluate_gpus to 2",
        ),
        (["rollout.vllm_gpu_memory_utilization=1.5"], "or null for what the layout allows"),
        (["rollout.vllm_gpu_memory_utilization=0"], "must be in (0, 1]"),
    ],
)
def test_vllm_engine_settings_are_checked_with_the_fix(overrides, message):
    with pytest.raises(ReplayRLError, match=re.escape(message)):
        load_config(PRESET, overrides=overrides)


def test_tensor_parallel_fits_step_pods_with_enough_gpus():
    cfg = load_config(
        PRESET,
        overrides=[
            *VLLM_STEP,
            "rollout.tensor_parallel_size=4",
            "kubernetes.generate_gpus=4",
            "kubernetes.evaluate_gpus=8",
        ],
    )
    assert cfg.rollout.tensor_parallel_size == 4
    assert load_config(PRESET).rollout.vllm_gpu_memory_utilization is None  # automatic
    explicit = load_config(PRESET, overrides=["rollout.vllm_gpu_memory_utilization=0.7"])
    assert explicit.rollout.vllm_gpu_memory_utilization == 0.7


def test_flat_params_cover_every_knob():
    flat = load_config(PRESET).flat()
    assert flat["buffer.capacity"] == 512
    assert flat["train.loss"] == "grpo"
    assert "task.options" in flat


def test_vocab_size_is_checked_and_leaves_existing_hashes_alone():
    from replayrl.config import TINY_VOCAB_SIZE
    from replayrl.policy.tokenizer import VOCAB_SIZE

    assert TINY_VOCAB_SIZE == VOCAB_SIZE  # replayrl.config cannot import it: keep them equal
    a = load_config(PRESET)
    assert a.model.vocab_size == VOCAB_SIZE
    # At its default it stays out of the hash (lineages made before it existed still match);
    # any other value is a different config.
    assert a.config_hash() == load_config(PRESET, overrides=["model.vocab_size=264"]).config_hash()
    b = load_config(PRESET, overrides=["model.vocab_size=151936"])
    assert b.model.vocab_size == 151_936 and b.config_hash() != a.config_hash()
    with pytest.raises(ReplayRLError, match="set it to at least 264"):
        load_config(PRESET, overrides=["model.vocab_size=258"])
    with pytest.raises(ReplayRLError, match="only applies to model.source=tiny"):
        load_config(PRESET, overrides=["model.source=/models/qwen", "model.vocab_size=151936"])
    load_config(PRESET, overrides=["model.source=/models/qwen"])  # the default is fine


# Recorded before the config moved into a package whose fields carry their help as metadata:
# the hash is of the values only, so documentation never changes a lineage's hash. The Qwen
# presets' values changed once since: they moved to task.prompt_format: chat (their rendered
# prompts are the ones they wrote out before). The Qwen3 preset changed again when it
# untied its word embeddings, as the paper trained it (model.untie_word_embeddings).
PRESET_HASHES = {
    ("tiny-cpu.yaml", "replay"): "52633a316496",
    ("tiny-cpu.yaml", "on-policy"): "c4b86a6f6aa2",
    ("tiny-cpu.yaml", "replay-plain"): "8361a38ee3a6",
    ("tiny-cpu-steps.yaml", "replay"): "8437fc9c9e78",
    ("shapes-cpu.yaml", "replay"): "ab01eb61a847",
    ("qwen2.5-0.5b-gsm8k.yaml", "replay"): "804e2cdcc17f",
    ("qwen2.5-0.5b-gsm8k.yaml", "on-policy"): "49bb37c91576",
    ("qwen3-0.6b-math.yaml", "replay"): "64c789874347",
}


@pytest.mark.parametrize("name,arm", sorted(PRESET_HASHES))
def test_preset_hashes_are_unchanged(name, arm):
    assert load_config(PRESET.with_name(name), arm=arm).config_hash() == PRESET_HASHES[name, arm]


def test_async_preset_hash_is_unchanged():
    cfg = load_config(PRESET, overrides=["asynchronous.enabled=true"])
    assert cfg.config_hash() == "e24f08e8e0ca"


def test_a_sharded_trainer_across_nodes_loads_and_its_nodes_must_divide_the_ranks():
    """FSDP across nodes is hybrid sharding (each rank uploads its own shard files), so it
    loads; the ranks must still split evenly over the nodes."""
    overrides = ["asynchronous.enabled=true", "train.distributed=fsdp"]
    cfg = load_config(overrides=[*overrides, "asynchronous.trainers=4",
                                 "asynchronous.trainer_nodes=2"])  # fmt: skip
    assert (cfg.asynchronous.trainer_nodes, cfg.train.distributed) == (2, "fsdp")
    with pytest.raises(ReplayRLError, match="trainer_nodes"):
        load_config(overrides=[*overrides, "asynchronous.trainers=3",
                               "asynchronous.trainer_nodes=2"])  # fmt: skip
