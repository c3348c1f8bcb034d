"""The demo learns: `make run`'s config (replay arm, 300 iterations) raises held-out pass@1
above the warm start it started from, and the on-policy arm of the same config learns too.

What is asserted, for each arm, from one run on this machine (seed 0, as `make run`):
- the best held-out greedy pass@1 of the last LAST_EVALS evaluations (iterations 225, 250,
  275 and 300) is at least MARGIN (0.05) above the warm start's, measured in the same run;
- the mean of those evaluations is above the warm start (the run did not end where it began).

Why a gain over the same run's warm start, from the best of the last evaluations: the warm
start lands elsewhere on another CPU (float sums differ across instruction sets), the RL run
after it differs by CPU and by torch thread count, and one evaluation of 256 prompts moves by
0.03-0.05 from the next. The development CPU gave 0.215 -> 0.430 (+0.215, final, seed 0,
2 threads); a 2-core AMD EPYC with AVX-512 (2026-12-03, docs/results/LOG.md) gave, replay arm
unless named:

  seed, threads      warm start   final   best of last 4   mean of last 4
  0, 1 (make test)   0.316        0.387   0.438 (+0.121)   0.417 (+0.101)
  0, 2 (make run)    0.316        0.438   0.449 (+0.133)   0.419 (+0.103)
  0, 1 on-policy     0.316        0.465   0.465 (+0.148)   0.455 (+0.139)
  0, 2 on-policy     0.316        0.418   0.469 (+0.152)   0.444 (+0.128)
  1, 1               0.188        0.352   0.352 (+0.164)   0.312 (+0.125)
  1, 2               0.188        0.305   0.324 (+0.137)   0.307 (+0.119)
  2, 1               0.164        0.297   0.297 (+0.133)   0.274 (+0.110)
  2, 2               0.164        0.316   0.316 (+0.152)   0.285 (+0.121)

The final evaluation of seed 0 on one thread (`make test` runs its xdist workers on one
thread) is +0.070, so the former assertion (final - warm start >= 0.10) failed there although
the run learned. Seed 0 on a third CPU is another warm start, and other warm starts learn
less: of the 20 tiny-preset runs on record from the development CPU (seeds 0-4 and 10-14,
docs/results/tiny-cpu/run.txt and tiny-cpu-seeds10-14/run.txt, which give each run's final and
best evaluation), the weakest are on-policy: seed 11 went 0.176 -> 0.250, its best, at 300
(+0.074), seed 10 0.281 -> 0.355 at 300 with its best at 200 (so +0.074 to +0.102 over the last
four), seed 2 0.246 -> best 0.332 at 225 (+0.086); the weakest replay run was seed 2, 0.246 ->
best 0.340 at 275 (+0.094). MARGIN = 0.05 leaves 0.024 below the weakest of those 28 runs and
0.07 below the weakest run on this CPU; the mean of the last four (not on record there) was
+0.10 or more on every run above.

It still fails a run that does not learn: without weight updates (lr 0) greedy evaluation of
unchanged weights gives the warm start's pass@1 exactly, which fails both conditions, and so
does a run that unlearns. It is a floor, not a significance test: 0.05 is 1.7 binomial standard
deviations of one evaluation at pass@1 ~0.3 (0.029), so weights that drift without learning
could clear the first condition by chance; the second, on the mean of four, still asks for
the level to stay above the warm start.

These run the real preset (minutes, not milliseconds); they share the warm-start cache with
`make run` through $REPLAYRL_CACHE, so the warm start is paid once per machine. Under
pytest-xdist the two arms may run at once on two workers: the warm start is built first,
under a lock, by whichever gets there first, and the other waits for it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_config import locked_initial_policy

from replayrl.config import load_config
from replayrl.engine.inline import RunSummary, run_inline

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
PRESET = Path(__file__).parents[2] / "configs" / "tiny-cpu.yaml"
# The last evaluations looked at (eval.every 25 over 300 iterations: 225, 250, 275, 300) and
# the gain the best of them must show over the warm start (the module docstring says why).
LAST_EVALS = 4
MARGIN = 0.05


@pytest.fixture(scope="module", autouse=True)
def demo_warm_start():
    """The demo's warm start (both arms start from it), in $REPLAYRL_CACHE."""
    return locked_initial_policy(load_config(PRESET))


def assert_learned(summary: RunSummary, iterations: int) -> None:
    """The run reached its last iteration, the best of its last LAST_EVALS evaluations is
    MARGIN above the warm start's pass@1, and their mean is above the warm start's."""
    start = summary.initial_pass1
    last = [row.pass1 for row in summary.rows[-LAST_EVALS:]]
    print(
        f"{summary.arm}: pass@1 {start:.3f} -> {last[-1]:.3f}, last {LAST_EVALS}: "
        + ", ".join(f"{p:.3f}" for p in last)
        + f" in {summary.wall_seconds:.0f} s"
    )
    assert summary.rows[-1].iteration == iterations
    assert len(last) == LAST_EVALS and None not in last
    assert max(last) - start >= MARGIN, (
        f"best of the last {LAST_EVALS} evaluations {max(last):.3f} is less than {MARGIN} "
        f"above the warm start's {start:.3f}"
    )
    mean = sum(last) / LAST_EVALS
    assert mean > start, (
        f"the last {LAST_EVALS} evaluations average {mean:.3f}, not above the warm start's "
        f"{start:.3f}"
    )


def test_replay_arm_of_the_demo_learns(tmp_path):
    cfg = load_config(PRESET, overrides=[f"storage.run_root={tmp_path}"])
    assert_learned(run_inline(cfg), cfg.iterations)


def test_on_policy_arm_of_the_demo_learns(tmp_path):
    cfg = load_config(PRESET, overrides=[f"storage.run_root={tmp_path}"], arm="on-policy")
    assert_learned(run_inline(cfg), cfg.iterations)
