"""The paper's Qwen3-0.6B preset (configs/qwen3-0.6b-math.yaml) loads with replayrl's own config
loader, carries the paper's settings with the synchronous R_iter, S, B, N its header derives,
cites the paper beside each, derives a valid on-policy arm, and makes math prompts the boxed
reward grades, in Qwen3's chat format from the tokenizer (a ChatML template built in code stands
in for Qwen3's): all without touching the network (the model and data it names live in a
bucket and are not read here).
"""

from __future__ import annotations

import io
import json
import socket
from pathlib import Path

import pytest
from chatml import chat_tokenizer

from replayrl.config import hub_id, load_config
from replayrl.core.rewards import score
from replayrl.policy.problems import load_task
from replayrl.policy.prompts import format_problems

pytestmark = pytest.mark.unit

PRESET = Path(__file__).resolve().parents[2] / "configs" / "qwen3-0.6b-math.yaml"


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to open a connection (a hub download, an S3 read) fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"the preset test tried to reach the network: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def test_the_preset_carries_the_papers_qwen3_settings(no_network):
    cfg = load_config(PRESET)
    assert cfg.arm == "replay"
    # By hub id, downloaded once per lineage when it opens (nothing here downloads).
    assert cfg.model.source == "Qwen/Qwen3-0.6B" and hub_id(cfg.model.source)
    assert (cfg.task.name, hub_id(cfg.task.path)) == ("math", "open-r1/OpenR1-Math-220k")
    assert (cfg.task.dataset_config, cfg.task.dataset_split) == ("default", "train")
    assert cfg.rollout.backend == "vllm"
    # §5.1 / App. 10.2: Adam at a constant 3.37e-7, batch 60, G = 16, temperature 1, GRPO
    # with eps 0.2 and no KL, a plain FIFO sampled without repeats in a batch.
    assert cfg.train.lr == 3.37e-7 and cfg.train.weight_decay == 0.0
    assert cfg.train.batch_size == 60
    assert cfg.rollout.samples_per_prompt == 16
    assert (cfg.rollout.temperature, cfg.rollout.top_p) == (1.0, 1.0)
    assert (cfg.train.loss, cfg.train.clip_eps) == ("grpo", 0.2)
    assert cfg.buffer.positive_bias == 0.0 and cfg.buffer.max_staleness is None
    assert cfg.buffer.sample_with_replacement is False
    # N from the paper's Qwen3-0.6B sweep.
    assert cfg.buffer.capacity in (64, 128, 256, 512, 768, 1536, 2304, 6912, 20736)
    # The header's synchronous design: R_iter = 112, S = 4, N = 768, so x = S·N/R_iter ≈ 27.4
    # gradient steps and y = S·B/R_iter ≈ 2.14, near the 2.2 the paper measured at (6, 2).
    assert (cfg.rollouts_per_iteration, cfg.train.steps_per_iteration) == (112, 4)
    assert cfg.buffer.capacity == 768
    assert cfg.staleness_horizon == pytest.approx(4 * 768 / 112)
    assert cfg.replay_ratio == pytest.approx(240 / 112)
    assert abs(cfg.replay_ratio - 2.2) < 0.1
    # The held-out set and the train prompts fit in OpenR1-Math-220k's default config.
    assert cfg.task.num_train + cfg.task.num_eval <= 93_733
    assert cfg.eval.num_prompts <= cfg.task.num_eval
    # §5.1: pass@1 at temperature 0.1, top-p 0.95; pass@k at temperature 1, top-p 0.95.
    assert (cfg.eval.pass1_temperature, cfg.eval.pass1_top_p) == (0.1, 0.95)
    assert (cfg.eval.temperature, cfg.eval.top_p) == (1.0, 0.95)


def test_the_on_policy_arm_keeps_the_papers_batch(no_network):
    cfg = load_config(PRESET, arm="on-policy")
    # S·B = 4 × 60 = 240 = 15 whole groups of 16: each rollout used once.
    assert cfg.rollouts_per_iteration == cfg.buffer.capacity == 240
    assert cfg.rollout.prompts_per_iteration == 15
    assert cfg.train.batch_size == 60 and cfg.replay_ratio == 1.0


def test_each_paper_value_cites_its_section():
    text = PRESET.read_text()
    header = text.split("\narm:")[0]
    assert "Efficient RL Training for LLMs with Experience Replay" in header
    assert "arXiv:2604.08706" in header
    assert "x = S·N/R_iter" in header and "y = S·B/R_iter" in header
    assert "6.84" in header and "Deviations from the paper" in header
    lines = text.splitlines()

    def comment_above(prefix: str) -> str:
        """The comment lines just above the first line that starts with `prefix`."""
        index = next(i for i, line in enumerate(lines) if line.strip().startswith(prefix))
        above: list[str] = []
        for line in reversed(lines[:index]):
            if not line.strip().startswith("#"):
                break
            above.insert(0, line.strip().lstrip("# "))
        return " ".join(above)

    for prefix, cited in [
        ("lr:", "constant learning rate of 3.37e-7 for Qwen3-0.6B (§5.1, App. 10.2)"),
        ("batch_size: 60", "B = 60 rollouts per gradient step (§5.1)"),
        ("samples_per_prompt:", "G = 16 (App. 10.2)"),
        ("temperature: 1.0", "temperature 1 (§5.1)"),
        ("capacity:", "Qwen3-0.6B sweep (§5.1, App. 10)"),
        ("loss:", "no KL term (App. 10.2)"),
        ("sample_with_replacement:", "no repeats (§3.1)"),
    ]:
        assert cited in comment_above(prefix), (prefix, comment_above(prefix))


def test_the_prompt_template_makes_qwen3_prompts_the_boxed_reward_grades(no_network):
    cfg = load_config(PRESET)
    rows = [
        {
            "problem": f"Compute ${i}/2$.",
            "solution": f"It is $\\boxed{{{i}/2}}$.",
            "answer": f"\\frac{{{i}}}{{2}}",
        }
        for i in range(1, cfg.task.num_eval + 21)
    ]
    data = "".join(json.dumps(row) + "\n" for row in rows).encode()
    opened: list[str] = []

    def open_file(path: str):
        opened.append(path)
        return io.BytesIO(data)

    splits = load_task(
        name=cfg.task.name,
        num_train=cfg.task.num_train,
        num_eval=cfg.task.num_eval,
        seed=cfg.seed,
        path="openr1-rows.jsonl",
        options=cfg.task.options,
        open_file=open_file,
    )
    assert (len(splits.eval), len(splits.train)) == (cfg.task.num_eval, 20)
    # The preset writes no chat format: the tokenizer's template does, with thinking off.
    assert "<|im_start|>" not in cfg.task.options["prompt_template"]
    [problem] = format_problems(
        splits.eval[:1],
        tokenizer=chat_tokenizer(),
        prompt_format=cfg.task.prompt_format,
        system_prompt=cfg.task.system_prompt,
        template_args=cfg.task.chat_template_args,
    )
    question = splits.eval[0].prompt.split("\n")[0]
    assert question.startswith("Compute $")
    # What the preset wrote out by hand before it read the template from the tokenizer.
    assert problem.prompt == (
        f"<|im_start|>user\n{question}\nPlease reason step by step, and put your final answer "
        "within \\boxed{}.<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    half = int(problem.prompt.split("$")[1].split("/")[0]) / 2
    right = f"Halve it: \\boxed{{{half}}}"
    wrong = f"Halve it: \\boxed{{{half + 1}}}"
    assert score(kind=splits.reward_kind, completion=right, answer=problem.answer).correct
    assert not score(kind=splits.reward_kind, completion=wrong, answer=problem.answer).correct


ASYNC_PRESET = PRESET.with_name("qwen3-0.6b-math-async.yaml")


def test_the_presets_name_the_papers_mu_and_untie_the_embeddings(no_network):
    sync = load_config(PRESET)
    assert sync.model.untie_word_embeddings is True  # §5.1, App. 10: trained untied
    assert sync.model.paper_mu == 6.84  # §3.2: median of 242 runs
    gsm8k = load_config(PRESET.with_name("qwen2.5-0.5b-gsm8k.yaml"))
    assert gsm8k.model.paper_mu == 5.28  # Qwen2.5-7B's, §3.2
    assert load_config(PRESET.with_name("tiny-cpu.yaml")).model.paper_mu is None


def test_the_async_preset_is_the_papers_six_two_split(no_network):
    cfg = load_config(ASYNC_PRESET)
    a = cfg.asynchronous
    assert a.enabled and (a.workers, a.trainers) == (6, 2)
    # γ = (1 + W/T)/(1 + μ) = 4/7.84 = 0.51 at the paper's μ (§3.2, Fig. 4).
    assert (1 + a.workers / a.trainers) / (1 + cfg.model.paper_mu) == pytest.approx(0.51, abs=0.005)
    # Every other setting is the synchronous preset's paper setting.
    sync = load_config(PRESET)
    for section in ("model", "task", "rollout", "buffer", "train", "eval"):
        assert getattr(cfg, section) == getattr(sync, section), section
    assert cfg.lineage != sync.lineage and cfg.config_hash() != sync.config_hash()
    # The paper's batch is not whole groups: the queue arm says how to run it.
    with pytest.raises(Exception, match="whole groups"):
        load_config(ASYNC_PRESET, arm="on-policy")
    load_config(ASYNC_PRESET, arm="on-policy", overrides=["train.batch_size=64"])


def test_the_what_if_mu_comes_from_the_preset(no_network):
    import argparse

    from replayrl.cli.analysis import _config_what_if_mu
    from replayrl.experiments.statistics import PAPER_MU

    args = argparse.Namespace(mu=None, config=str(PRESET), set=None)
    assert _config_what_if_mu(args) == 6.84
    args.set = ["model.paper_mu=5.28"]
    assert _config_what_if_mu(args) == 5.28
    args.mu = 3.0  # --mu wins
    assert _config_what_if_mu(args) == 3.0
    tiny = argparse.Namespace(mu=None, config=str(PRESET.with_name("tiny-cpu.yaml")), set=None)
    assert _config_what_if_mu(tiny) == PAPER_MU
