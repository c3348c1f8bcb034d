import pytest

from replayrl.ledger import IterationCost, iteration_metrics

pytestmark = pytest.mark.unit


def cost(gen_s=2.0, train_s=1.0):
    return IterationCost(
        rollouts_generated=100,
        rollouts_trained=200,
        prompt_tokens=1000,
        generated_tokens=500,
        trained_tokens=3000,
        generation_seconds=gen_s,
        training_seconds=train_s,
        num_params=10,
    )


def test_mu_is_generation_over_training_cost_per_rollout():
    m, _ = iteration_metrics(cost(gen_s=2.0, train_s=1.0), None)
    # 2 s / 100 rollouts vs 1 s / 200 rollouts -> 0.02 / 0.005 = 4
    assert m["ledger/mu"] == pytest.approx(4.0)
    assert m["ledger/generation_flops"] == 2 * 10 * 1500
    assert m["ledger/training_flops"] == 6 * 10 * 3000


def test_totals_accumulate_and_resume_from_state():
    _, totals = iteration_metrics(cost(), None)
    m, totals = iteration_metrics(cost(), totals)
    assert m["cumulative/generated_tokens"] == 1000
    assert m["cumulative/seconds"] == pytest.approx(6.0)
    assert totals["rollouts_trained"] == 400
