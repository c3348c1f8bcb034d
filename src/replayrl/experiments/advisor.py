"""`replayrl advise`: the buffer capacity and replay ratio that Theorem 4.5 of the paper
("Efficient RL Training for LLMs with Experience Replay", Arnal et al., 2026) calls optimal,
and the loop settings that realise them. Pure arithmetic; the CLI reads μ from MLflow.

The symbols (§4, per gradient step, as the paper defines them)
-------------------------------------------------------------
The theory is synchronous: every gradient step generates R fresh rollouts with the current
policy, pushes them into a FIFO buffer of capacity N, samples B of the N uniformly and
takes one gradient step. Then

- R = fresh rollouts per gradient step, B = rollouts per gradient step (the batch);
- x = N / R, the staleness horizon in gradient steps (the oldest row's age);
- y = B / R, the replay ratio (mean number of gradient steps a rollout takes part in);
- μ = (cost of generating a rollout) / (cost of training on it), so a step costs
  c = B + μ·R rollout-trainings (§3.2; measured μ: 6.84 for Qwen3-0.6B, 5.28 for Qwen2.5-7B);
- σ(age): the scale of a sample's gradient noise, non-decreasing in its staleness (e.g.
  through importance weights), and σ̄(H) = the mean of σ(1), …, σ(H);
- ρ ∈ [0, 1]: how strongly the noise of two replayed samples is correlated through the
  parameter path they both shaped (the paper bounds the correlation of samples generated
  at steps t_i, t_j by ρ·|t_i − t_j| / N). It is not a penalty per use of a rollout.

Theorem 4.4 bounds the averaged squared gradient norm with the variance term
V = σ̄²(N/R)·(1/B + 1/N + ρ/R). Per unit of compute what matters is V·c, in which R
cancels:

    V·c = σ̄²(x)·(1/y + 1/x + ρ)·(y + μ),

and Theorem 4.5 minimises it at a large budget C = (B + μR)·T: for a given x the best
replay ratio is y = sqrt(μ / (ρ + 1/x)), which leaves μ·σ̄²(x)·(sqrt(1/μ) + sqrt(ρ + 1/x))², so

    x* = argmin_{x>0} σ̄²(x)·(sqrt(1/μ) + sqrt(ρ + 1/x))²,    y* = sqrt(μ / (ρ + 1/x*)).

Closed form (App. 9.3.2). With a power law σ(age) = (age/τ)^α, α < 1/2, and σ̄ its
continuous mean, σ̄(x) = (1/x)∫₀ˣ σ = (x/τ)^α / (1 + α) (τ and 1 + α drop out of the argmin):

    y* = (−α + sqrt(α² + μρ(1 − 2α))) / ρ,    x* = y*² / (2α(μ + y*)).

We evaluate y* as μ(1 − 2α) / (α + sqrt(α² + μρ(1 − 2α))), the same number (multiply the
paper's form by its conjugate), which stays exact at ρ = 0, where the paper's form is 0/0
and its limit is y* = μ(1 − 2α)/(2α). Worked example, μ = 6.84, ρ = 0.5, α = 0.25:
y* = (−0.25 + sqrt(0.0625 + 1.71)) / 0.5 = 2.163, x* = 2.163² / (0.5·(6.84 + 2.163)) = 1.039.

The edges, handled explicitly:
- α ≥ 1/2 (noise grows at least as fast as sqrt(age)): the objective increases in x for
  every x > 0 (its stationarity condition 2αx·s·(sqrt(1/μ) + s) = 1, s = sqrt(ρ + 1/x),
  has left side > 2α ≥ 1), so its infimum is x → 0, y → 0: keep the horizon as short as
  possible. `x_star` = `y_star` = 0 then, and `closed_form` is False. (This loop's
  shortest horizon is S steps, see below, so the settings are those for x = S.)
- α = 0 (staleness does not grow the noise): the objective decreases in x for ever, there
  is no finite x*, and this advisor refuses: the buffer must then be sized by other means.
- μ = 0 (free generation): x* = y* = 0, on-policy.

Alongside the closed form we report two numerical argmins of the same objective:
`x_star_numerical` with the continuous σ̄ above (a golden-section search in log x; it must
agree with the closed form, to 1e-6 relative), and `x_star_discrete` with the paper's own
σ̄(H) = mean of σ(1..H) over whole gradient steps H ≥ 1. The discrete mean sits above the
continuous one by a factor ≈ 1 + (1 + α)/(2H), which penalises short horizons more, so
`x_star_discrete` is at least ⌊x*⌋ and exceeds it by a few steps; the gap is large
relative to x* when x* is a few steps (μ = 6.84, ρ = 0.5, α = 0.25: 2 against 1.04) and
vanishes relatively as x* grows (x* = 977 → 981). The settings below use the closed form.

ρ and α are inputs, not measured: this project logs no per-sample gradient noise by age
(α would need per-row gradient norms binned by staleness, ρ the correlation of those
noises across rows), so there is nothing to fit them to honestly; the paper gives no
measured values either. Small ρ and α favour a big buffer and much reuse; large μ too.

The loop's settings (one generation per iteration, then S gradient steps of B)
------------------------------------------------------------------------------
A loop that generates R_iter rollouts per iteration and then takes S steps has
R = R_iter / S per step, so x = S·N / R_iter and y = S·B / R_iter. Only whole prompts are
generated (R_iter = G·p, G = `rollout.samples_per_prompt`), and the buffer holds at least one
iteration's fresh rows and one batch (N >= R_iter, N >= B), so the horizon is at least S
steps. Rounding moves (x, y) off (x*, y*), and a nearby setting can be worse than on-policy
even where (x*, y*) is better. So the settings are chosen by the objective itself, at the
values the loop realises: for every whole number of prompts p with y = S·B / (G·p) >= 1,
the capacity N >= max(G·p, B) that minimises V·c(S·N / (G·p), y) (for a fixed y, V·c is
smallest at x = (1 − 2α) / (2α(1/y + ρ)) and grows away from it, so the best N is the whole
number next to it, or the smallest allowed), then the p with the smallest V·c. If that is
not below strict on-policy's V·c(S, 1), the advice is strict on-policy (`--arm on-policy`:
R_iter = N = S·B, y = 1), as it is for μ = 0. Strict on-policy needs S·B to be whole
groups of G; when it is not (the paper's B = 60 with G = 16), the advice names the nearest
batch size that is (64 there), since V·c depends on x and y only.

`y_target` is the theory's y for the horizon the loop can reach: y* when x* >= S, else
sqrt(μ / (ρ + 1/S)) (Theorem 4.5's y for x = S); it is reported beside the realised y,
which the search above chooses.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from replayrl.errors import ReplayRLError


def _check(*, mu: float, rho: float, alpha: float) -> None:
    if not (math.isfinite(mu) and mu >= 0):
        raise ReplayRLError(
            f"μ must be a finite number >= 0 (generation / training cost), got {mu}."
        )
    if not (math.isfinite(rho) and 0 <= rho <= 1):
        raise ReplayRLError(f"ρ must be in [0, 1] (Theorem 4.5's noise correlation), got {rho}.")
    if not math.isfinite(alpha) or alpha < 0:
        raise ReplayRLError(f"α must be a finite number > 0 (σ(age) ∝ age^α), got {alpha}.")
    if alpha == 0:
        raise ReplayRLError(
            "α = 0 (noise does not grow with staleness) gives no finite x*: Theorem 4.5's "
            "objective then falls with every larger buffer. Pass --alpha > 0."
        )


def objective(x: float, *, mu: float, rho: float, alpha: float, discrete: bool = False) -> float:
    """Theorem 4.5's objective σ̄²(x)·(sqrt(1/μ) + sqrt(ρ + 1/x))² for σ(age) = age^α
    (τ = 1: it scales the objective, not its argmin). σ̄ is the continuous mean x^α/(1+α),
    or with `discrete` the mean of σ(1..x) over whole steps (x must then be an integer)."""
    if discrete:
        h = int(x)
        sigma_bar = sum(k**alpha for k in range(1, h + 1)) / h
    else:
        sigma_bar = x**alpha / (1.0 + alpha)
    return sigma_bar**2 * (math.sqrt(1.0 / mu) + math.sqrt(rho + 1.0 / x)) ** 2


def replay_ratio_for(x: float, *, mu: float, rho: float) -> float:
    """Theorem 4.5's best y for a given horizon x: sqrt(μ / (ρ + 1/x))."""
    return math.sqrt(mu / (rho + 1.0 / x))


def variance_cost(x: float, y: float, *, mu: float, rho: float, alpha: float) -> float:
    """Theorem 4.4's variance term times the cost of a step, V·c = σ̄²(x)·(1/y + 1/x + ρ)·(y + μ)
    (R cancels), with the continuous σ̄ and τ = 1: only its ratios mean something."""
    return (x**alpha / (1.0 + alpha)) ** 2 * (1.0 / y + 1.0 / x + rho) * (y + mu)


def closed_form(*, mu: float, rho: float, alpha: float) -> tuple[float, float]:
    """(x*, y*) of App. 9.3.2 for σ(age) ∝ age^α, 0 < α < 1/2; ρ = 0 is the limit."""
    _check(mu=mu, rho=rho, alpha=alpha)
    if alpha >= 0.5:
        raise ReplayRLError(f"The closed form needs α < 1/2, got α = {alpha}.")
    if mu == 0:
        return 0.0, 0.0
    y = mu * (1 - 2 * alpha) / (alpha + math.sqrt(alpha**2 + mu * rho * (1 - 2 * alpha)))
    return y * y / (2 * alpha * (mu + y)), y


def numerical_argmin(*, mu: float, rho: float, alpha: float) -> float:
    """argmin over x > 0 of the continuous objective, by golden-section search on log x
    over [1e-9, 1e12] (the objective has one stationary point for 0 < α < 1/2; for
    α >= 1/2 it increases, and the search ends at the lower edge, returned as 0)."""
    _check(mu=mu, rho=rho, alpha=alpha)
    if mu == 0:
        return 0.0
    lo, hi = math.log(1e-9), math.log(1e12)

    def f(t: float) -> float:
        return math.log(objective(math.exp(t), mu=mu, rho=rho, alpha=alpha))

    g = (math.sqrt(5) - 1) / 2
    a, b = hi - g * (hi - lo), lo + g * (hi - lo)
    fa, fb = f(a), f(b)
    while hi - lo > 1e-10:
        if fa <= fb:
            hi, b, fb = b, a, fa
            a = hi - g * (hi - lo)
            fa = f(a)
        else:
            lo, a, fa = a, b, fb
            b = lo + g * (hi - lo)
            fb = f(b)
    t = (lo + hi) / 2
    return 0.0 if t < math.log(1e-8) else math.exp(t)


def discrete_argmin(*, mu: float, rho: float, alpha: float, x_hint: float) -> int:
    """argmin over whole steps H >= 1 of the objective with σ̄(H) = mean of σ(1..H), the
    paper's definition, searched up to 4·x_hint + 64 (it lies a few steps above the
    continuous x*, `x_hint`)."""
    _check(mu=mu, rho=rho, alpha=alpha)
    if mu == 0:
        return 1
    best, best_f, total = 1, math.inf, 0.0
    for h in range(1, int(4 * x_hint) + 65):
        total += h**alpha
        f = (total / h) ** 2 * (math.sqrt(1.0 / mu) + math.sqrt(rho + 1.0 / h)) ** 2
        if f < best_f:
            best, best_f = h, f
    return best


@dataclass(frozen=True)
class Advice:
    """Theorem 4.5's optimum and the loop settings that realise it. x in gradient steps."""

    mu: float
    rho: float
    alpha: float
    x_star: float  # closed form (App. 9.3.2); 0 when α >= 1/2 (infimum)
    y_star: float
    closed_form: bool  # False when α >= 1/2: no interior optimum
    x_star_numerical: float  # continuous σ̄, golden section
    x_star_discrete: int  # σ̄ = mean of σ(1..H), whole steps
    batch_size: int  # B
    steps_per_iteration: int  # S
    samples_per_prompt: int  # G
    on_policy: bool  # the target y is <= 1
    prompts_per_iteration: int  # rollout.prompts_per_iteration
    rollouts_per_iteration: int  # R_iter = G·p
    buffer_capacity: int  # buffer.capacity N
    x: float  # realised S·N / R_iter
    y: float  # realised S·B / R_iter
    y_target: float  # y* or, when x* < S, sqrt(μ / (ρ + 1/S))
    sample_with_replacement: bool  # needed when B > R_iter
    variance_cost_vs_on_policy: float  # V·c at (x, y) over V·c at on-policy (S, 1)
    on_policy_batch_size: int  # B, or the nearest B with S·B whole groups of G

    @property
    def batch_size_changed(self) -> bool:
        """On-policy advice that needs another train.batch_size (S·B not whole groups)."""
        return self.on_policy and self.on_policy_batch_size != self.batch_size

    @property
    def settings(self) -> dict[str, int | bool]:
        """The config keys to set (`--set KEY=VALUE`), e.g. {"buffer.capacity": 88}."""
        keys: dict[str, int | bool] = {}
        if self.batch_size_changed:
            keys["train.batch_size"] = self.on_policy_batch_size
        keys |= {
            "rollout.prompts_per_iteration": self.prompts_per_iteration,
            "buffer.capacity": self.buffer_capacity,
        }
        if self.sample_with_replacement:
            keys["buffer.sample_with_replacement"] = True
        return keys

    def to_json(self) -> dict:
        return {**asdict(self), "settings": self.settings}


def _best_replay(
    *, b: int, s: int, g: int, mu: float, rho: float, alpha: float
) -> tuple[int, int, float] | None:
    """(prompts p, capacity N, V·c) of the replay setting with the smallest realised V·c:
    every whole p with y = S·B / (G·p) >= 1 (p = 1 when S·B < G), each with its best N >=
    max(G·p, B) (see the module docstring). None when there is no such p."""
    rows = s * b
    best: tuple[int, int, float] | None = None
    for p in range(1, max(1, rows // g) + 1):
        fresh = g * p
        y = rows / fresh
        lo = max(fresh, b)
        capacities = {lo}
        if alpha < 0.5:  # V·c in x is smallest at x_opt for this y; above, it only grows
            x_opt = (1 - 2 * alpha) / (2 * alpha * (1 / y + rho))
            n_opt = x_opt * fresh / s
            if n_opt < 1e12:
                capacities |= {max(lo, math.floor(n_opt)), max(lo, math.ceil(n_opt))}
        for n in sorted(capacities):
            vc = variance_cost(s * n / fresh, y, mu=mu, rho=rho, alpha=alpha)
            if best is None or vc < best[2]:
                best = (p, n, vc)
    return best


def _whole_groups_batch(*, b: int, s: int, g: int) -> int:
    """B itself when S·B is whole groups of G (strict on-policy generates S·B rows as whole
    prompts), else the nearest B' whose S·B' is (the larger on a tie). B = 60, S = 1,
    G = 16 -> 64."""
    if (s * b) % g == 0:
        return b
    unit = g // math.gcd(s, g)  # S·B' is whole groups iff unit divides B'
    return max(unit, unit * math.floor(b / unit + 0.5))


def advise(
    *,
    mu: float,
    rho: float,
    alpha: float,
    batch_size: int,
    steps_per_iteration: int,
    samples_per_prompt: int,
) -> Advice:
    """Theorem 4.5's (x*, y*) and the loop settings for S steps of B, G samples per prompt.

    >>> a = advise(mu=6.84, rho=0.5, alpha=0.25, batch_size=64, steps_per_iteration=4,
    ...            samples_per_prompt=8)
    >>> round(a.x_star, 3), round(a.y_star, 3), a.prompts_per_iteration, a.buffer_capacity
    (1.039, 2.163, 11, 88)
    """
    _check(mu=mu, rho=rho, alpha=alpha)
    b, s, g = batch_size, steps_per_iteration, samples_per_prompt
    for name, v in (
        ("train.batch_size", b),
        ("train.steps_per_iteration", s),
        ("rollout.samples_per_prompt", g),
    ):
        if v < 1:
            raise ReplayRLError(f"{name} must be >= 1, got {v}.")
    interior = alpha < 0.5
    x_star, y_star = closed_form(mu=mu, rho=rho, alpha=alpha) if interior else (0.0, 0.0)
    x_num = numerical_argmin(mu=mu, rho=rho, alpha=alpha)
    x_disc = discrete_argmin(mu=mu, rho=rho, alpha=alpha, x_hint=x_star)

    rows = s * b
    # The loop's horizon is at least S steps (N >= R_iter): y* re-optimised there.
    y_target = y_star if x_star >= s else (replay_ratio_for(s, mu=mu, rho=rho) if mu else 0.0)
    vc_on = variance_cost(float(s), 1.0, mu=mu, rho=rho, alpha=alpha) if mu else 1.0
    best = _best_replay(b=b, s=s, g=g, mu=mu, rho=rho, alpha=alpha) if mu else None
    on_policy = best is None or best[2] >= vc_on
    b_on = _whole_groups_batch(b=b, s=s, g=g)
    if on_policy:
        fresh = capacity = s * b_on
        p = fresh // g
        vc = vc_on
    else:
        assert best is not None
        p, capacity, vc = best
        fresh = g * p
    y = rows / fresh if not on_policy else 1.0
    x = s * capacity / fresh
    return Advice(
        mu=mu,
        rho=rho,
        alpha=alpha,
        x_star=x_star,
        y_star=y_star,
        closed_form=interior,
        x_star_numerical=x_num,
        x_star_discrete=x_disc,
        batch_size=b,
        steps_per_iteration=s,
        samples_per_prompt=g,
        on_policy=on_policy,
        prompts_per_iteration=p,
        rollouts_per_iteration=fresh,
        buffer_capacity=capacity,
        x=x,
        y=y,
        y_target=y_target,
        sample_with_replacement=b > fresh,
        variance_cost_vs_on_policy=vc / vc_on,
        on_policy_batch_size=b_on,
    )


def render(a: Advice, *, source: str) -> str:
    """The advice as a few lines a user can act on."""
    head = f"μ = {a.mu:.2f} ({source}), ρ = {a.rho:g}, α = {a.alpha:g} (σ(age) ∝ age^α)"
    if a.closed_form:
        theory = (
            f"Theorem 4.5 (closed form, App. 9.3.2): x* = {a.x_star:.3f} gradient steps, "
            f"y* = {a.y_star:.3f} (numerical argmin x* = {a.x_star_numerical:.3f}; with σ̄ over "
            f"whole ages 1..H: x* = {a.x_star_discrete})"
        )
    else:
        theory = (
            "Theorem 4.5: α >= 1/2, the objective grows with x: no interior optimum, "
            "x* → 0 and y* → 0 (the shortest horizon there is)"
        )
    shape = f"S = {a.steps_per_iteration} steps of B = {a.batch_size}, G = {a.samples_per_prompt}"
    notes = []
    if a.x_star < a.steps_per_iteration and a.mu > 0:
        notes.append(
            f"x* < S: one generation per iteration makes the horizon at least S = "
            f"{a.steps_per_iteration} steps; at x = S the best y is sqrt(μ/(ρ + 1/S)) = "
            f"{a.y_target:.3f} (fewer steps per iteration bring x closer to x*)."
        )
    if a.on_policy:
        body = (
            f"recommend strict on-policy (--arm on-policy) for {shape}: no replay setting "
            f"this loop can realise (whole prompts, N >= R_iter and N >= B) beats it by "
            f"Theorem 4.4's variance × step cost (target y = {a.y_target:.3f}); "
            f"rollout.prompts_per_iteration = {a.prompts_per_iteration}, buffer.capacity = "
            f"{a.buffer_capacity} (R_iter = N = S·B, y = 1, x = {a.x:.2f} steps)."
        )
        if a.batch_size_changed:
            body += (
                f" S·B = {a.steps_per_iteration * a.batch_size} is not whole groups of "
                f"G = {a.samples_per_prompt}: set train.batch_size = "
                f"{a.on_policy_batch_size}, the nearest batch that is."
            )
    else:
        body = (
            f"recommend replay for {shape}: rollout.prompts_per_iteration = "
            f"{a.prompts_per_iteration} (R_iter = {a.rollouts_per_iteration}), "
            f"buffer.capacity = {a.buffer_capacity}: y = {a.y:.3f}, x = {a.x:.2f} steps."
        )
        if a.sample_with_replacement:
            body += (
                " B > R_iter: also set buffer.sample_with_replacement: true (the first "
                "iteration's buffer holds fewer than B rows)."
            )
    tail = (
        f"Theorem 4.4's variance × step cost at these settings: "
        f"{a.variance_cost_vs_on_policy:.2f}× strict on-policy's."
    )
    return "\n".join([head, theory, *notes, body, tail])
