"""Admission by predicted wait and the fallback in the capacity simulator (issue 43), on small fixed fleets: what a
flood is refused, what a light load is not, and what a fallback answers."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from bench.capacity.profiles import CostProfile
from bench.capacity.report import overload_outcomes
from bench.capacity.scenario import catalog_deployments, fallback_class, fallback_deployment
from bench.capacity.simulator import EXPIRED, LATE, ON_TIME, REFUSED, Admission, Simulation
from bench.capacity.traffic import Arrivals, DayShape, RequestClass, minute_rates, poisson_arrivals

IMG2IMG = "sd15-img2img"
MIX = [RequestClass(IMG2IMG, 25, 512, 512, 0.75)]
# Round costs: a lone 25-step img2img request (20 model calls) takes 0.24 s, a batch of four 0.68 s.
COSTS = CostProfile(
    "round", "test",
    call_fixed_s={1: 0.04, 4: 0.12}, call_step_s={1: 0.01, 4: 0.028}, start_s={1: 0.02, 4: 0.06},
    denoise_s={1: 0.01, 4: 0.028}, decode_s={1: 0.02, 4: 0.06},
)  # fmt: skip
DEADLINE = 5.0


def fleet() -> list:
    """The catalog's img2img deployment (four requests a batch) with a 5 s deadline (one pod held)."""
    return [replace(d, timeout_seconds=DEADLINE) for d in catalog_deployments({IMG2IMG})]


def flood(count: int = 400, seconds: float = 4.0) -> Arrivals:
    """One request alone first (its answer gives the API a run time and a rate), then `count` from 10 s on, evenly
    over `seconds` (a hundred a second: a fallback answers its first within them, and so has an estimate too)."""
    times = np.concatenate([[0.0], 10.0 + np.arange(count) * seconds / count])
    return Arrivals(times, np.zeros(len(times), dtype=np.int32), MIX)


def simulate(arrivals, deployments, admission=None, scheduling="step"):
    replicas = {d.model: 1 for d in deployments}
    return Simulation(arrivals, deployments, COSTS, scheduling, initial_replicas=replicas, autoscale=False,
                      admission=admission).run()  # fmt: skip


@pytest.mark.parametrize("scheduling", ["request", "step"])
def test_a_flood_past_what_one_worker_answers_by_its_deadline_is_refused_at_once(scheduling):
    arrivals = flood()
    without = simulate(arrivals, fleet(), scheduling=scheduling)
    admitted = simulate(arrivals, fleet(), Admission(), scheduling=scheduling)
    # One worker answers about six requests a second: 400 at once cannot all be answered within 5 s.
    assert (without.outcome == EXPIRED).sum() > 300, "without admission the flood waits and expires"
    refused = admitted.outcome == REFUSED
    assert refused.sum() > 300
    assert np.all(admitted.done[refused] == admitted.arrival[refused]), "refused at once, not after waiting"
    assert np.all(admitted.spent[refused] == 0), "no GPU time on a refused request"
    # Admitted first, in arrival order: the refusals start once the backlog ahead is a deadline's worth.
    first_refused = int(np.argmax(refused))
    assert first_refused > 1 and not refused[:first_refused].any()
    assert (admitted.outcome == EXPIRED).sum() < (without.outcome == EXPIRED).sum() / 4
    wasted = overload_outcomes(without, 0, 20)["wasted_gpu_seconds"]
    assert overload_outcomes(admitted, 0, 20)["wasted_gpu_seconds"] <= wasted


def test_a_backlog_counted_only_up_to_a_scan_limit_hides_an_overload_beyond_it():
    # A count capped at 20 waiting requests (as the API's was, at SCAN_LIMIT), which one worker answers in about 3 s,
    # under the 5 s deadline. Counted so, the flood is admitted and expires; counted whole, it is refused.
    arrivals = flood()
    capped = simulate(arrivals, fleet(), Admission(scan_limit=20))
    whole = simulate(arrivals, fleet(), Admission(scan_limit=None))
    assert (capped.outcome == REFUSED).sum() < 10 < 300 < (whole.outcome == REFUSED).sum()
    assert (capped.outcome == EXPIRED).sum() > 300


def test_a_load_one_worker_keeps_up_with_is_admitted_whole():
    arrivals = poisson_arrivals(2.0, 400, MIX, seed=5)  # two requests a second, a third of what the worker answers
    without = simulate(arrivals, fleet())
    admitted = simulate(arrivals, fleet(), Admission())
    assert not np.any(admitted.outcome == REFUSED)
    assert np.all(admitted.outcome == ON_TIME)
    assert np.array_equal(admitted.done, without.done, equal_nan=True), "admission changes nothing it admits"


def test_a_safety_factor_refuses_sooner():
    arrivals = flood()
    plain = simulate(arrivals, fleet(), Admission())
    careful = simulate(arrivals, fleet(), Admission(safety_factor=2.0))
    assert (careful.outcome == REFUSED).sum() > (plain.outcome == REFUSED).sum()


def test_a_refused_request_that_allows_it_is_answered_by_the_fallback_on_its_own_deployment():
    arrivals = flood()
    deployed = fleet()
    fallback = fallback_deployment(deployed[0])
    few_steps = fallback_class(MIX, deployed[0])
    assert (few_steps.model, few_steps.steps) == (f"{IMG2IMG}-lcm", 4)
    policy = Admission(fallback={IMG2IMG: few_steps})
    refused_only = simulate(arrivals, deployed + [fallback], Admission())
    with_fallback = simulate(arrivals, deployed + [fallback], policy)
    fell_back = with_fallback.fell_back
    assert fell_back.sum() > 100
    assert np.all(with_fallback.outcome[fell_back] != REFUSED)
    # The few-step fallback answers them (some a step past the deadline: its estimate, as the API's, counts a lone
    # request's run time, and a full batch's steps are longer).
    assert np.isin(with_fallback.outcome[fell_back], (ON_TIME, LATE)).mean() > 0.9
    assert (with_fallback.outcome[fell_back] == ON_TIME).mean() > 0.5
    assert (with_fallback.outcome == REFUSED).sum() < (refused_only.outcome == REFUSED).sum()
    # The requests that fell back ran their 4 steps on the fallback's worker, not the 25 of the model asked.
    answered = fell_back & (with_fallback.outcome == ON_TIME)
    asked = ~fell_back & (with_fallback.outcome == ON_TIME)
    assert with_fallback.spent[answered].mean() < with_fallback.spent[asked].mean() / 2
    # Without the callers' opt-in nothing falls back: the refusals stand.
    strict = simulate(arrivals, deployed + [fallback], replace(policy, fallback_share=0.0))
    assert not strict.fell_back.any()
    assert np.array_equal(strict.outcome, refused_only.outcome)


@pytest.mark.parametrize("scheduling", ["request", "step"])
def test_the_device_time_charged_to_requests_is_the_device_time_spent(scheduling):
    # Every busy second is some request's (shared by images in a batch or a step segment), expired ones included.
    arrivals = flood()
    result = simulate(arrivals, fleet(), scheduling=scheduling)
    busy = sum(sum(hours.values()) for hours in result.busy_seconds.values())
    assert result.spent.sum() == pytest.approx(busy, rel=1e-9)
    assert result.spent[result.outcome == EXPIRED].sum() > 0, "requests that expired while running took GPU time"


def test_a_surge_is_the_busiest_hour_s_rate_times_its_factor_and_leaves_the_rest_of_the_day_alone():
    shape = DayShape(1_400_000)
    plain, surged = minute_rates(shape, 1), minute_rates(replace(shape, surge_hour=6.0, surge_minutes=20), 1)
    busiest = plain.reshape(24, 60).mean(axis=1).max()
    assert np.allclose(surged[360:380], 2 * busiest)
    assert np.array_equal(np.delete(surged, range(360, 380)), np.delete(plain, range(360, 380)))
