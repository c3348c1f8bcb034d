import pytest

from replayrl.core.ledger import IterationCost, iteration_metrics

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


def test_wall_clock_parts_give_coverage_and_mu_effective_charges_overheads():
    import dataclasses

    parts = {
        "startup": 1.0,  # of which engine start 0.4 and trainer load 0.2
        "generation": 2.0,
        "buffer_append": 0.5,
        "training": 1.0,
        "buffer_sample": 0.25,
        "checkpoint": 0.25,
        "commit": 0.5,
    }
    c = dataclasses.replace(
        cost(),
        parts=parts,
        wall_seconds=6.0,
        startup_detail={"engine_start": 0.4, "trainer_load": 0.2},
    )
    m, totals = iteration_metrics(c, None)
    assert m["ledger/coverage"] == pytest.approx(5.5 / 6.0)
    assert m["ledger/startup_seconds"] == 1.0 and m["ledger/evaluation_seconds"] == 0.0
    assert m["cumulative/wall_seconds"] == 6.0 and totals["wall_seconds"] == 6.0
    # generation side 2 + 0.5 + 0.4, training side 1 + 0.25 + 0.25 + 0.2, and the rest
    # (0.4 of start-up + 0.5 commit) split evenly: (3.35 / 100) / (2.15 / 200)
    assert m["ledger/mu_effective"] == pytest.approx((3.35 / 100) / (2.15 / 200))
    # without a measured wall clock there is no coverage
    m, _ = iteration_metrics(cost(), None)
    assert "ledger/coverage" not in m and "ledger/mu_effective" not in m


def test_cpu_seconds_are_logged_beside_the_wall_seconds_of_every_part():
    import dataclasses

    from replayrl.core.ledger import WALL_PARTS

    parts = {"generation": 2.0, "training": 1.0, "startup": 1.0}
    # generation waited 0.8 s for a core; training kept two threads busy
    cpu = {"generation": 1.2, "training": 1.9, "startup": 0.9, "commit": 0.1}
    c = dataclasses.replace(cost(), parts=parts, wall_seconds=5.0, cpu_parts=cpu, cpu_seconds=4.5)
    m, totals = iteration_metrics(c, None)
    for name in WALL_PARTS:
        assert m[f"ledger/{name}_cpu_seconds"] == pytest.approx(cpu.get(name, 0.0))
    assert m["ledger/total_cpu_seconds"] == 4.5
    # the wall-clock names are unchanged
    assert m["ledger/generation_seconds"] == 2.0 and m["cumulative/seconds"] == 3.0
    m, totals = iteration_metrics(c, totals)
    assert m["cumulative/cpu_seconds"] == pytest.approx(2 * (1.2 + 1.9))
    assert m["cumulative/generation_cpu_seconds"] == pytest.approx(2.4)
    assert m["cumulative/total_cpu_seconds"] == pytest.approx(9.0)
    assert totals["training_cpu_seconds"] == pytest.approx(3.8)


def test_no_cpu_metrics_when_the_cpu_clock_was_not_read():
    m, totals = iteration_metrics(cost(), None)
    assert not [k for k in m if "cpu" in k]
    assert totals["total_cpu_seconds"] == 0.0  # kept in the state all the same


def test_device_seconds_by_part_and_the_device_axis():
    import dataclasses

    c = dataclasses.replace(
        cost(), device_parts={"generation": 1.5, "training": 0.75, "evaluation": 0.25}
    )
    m, totals = iteration_metrics(c, None)
    assert m["ledger/generation_device_seconds"] == 1.5
    assert m["ledger/training_device_seconds"] == 0.75
    assert m["ledger/evaluation_device_seconds"] == 0.25
    m, totals = iteration_metrics(c, totals)
    assert m["cumulative/device_seconds"] == pytest.approx(2 * (1.5 + 0.75))
    assert m["cumulative/generation_device_seconds"] == pytest.approx(3.0)
    assert totals["training_device_seconds"] == pytest.approx(1.5)
    # the wall-clock axis is unchanged beside it
    assert m["cumulative/seconds"] == pytest.approx(6.0)


def test_no_device_metrics_on_the_cpu_and_no_axis_without_training_timed():
    m, totals = iteration_metrics(cost(), None)
    assert not [k for k in m if "device" in k]  # absent, not 0
    assert totals["generation_device_seconds"] == 0.0  # kept in the state all the same
    # Generation timed, training not (train.distributed): the part, but no device axis.
    import dataclasses

    m, totals = iteration_metrics(
        dataclasses.replace(cost(), device_parts={"generation": 1.0}), None
    )
    assert m["ledger/generation_device_seconds"] == 1.0
    assert "cumulative/device_seconds" not in m and "cumulative/generation_device_seconds" not in m
    assert totals["generation_device_seconds"] == 0.0
