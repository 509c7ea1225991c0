"""The scheduler on a simulated clock: exact run counts, order, misses and ages for several rate
combinations, including rates that do not divide each other. Expected values are computed independently
with exact fractions (grid point n of a rate r is ceil(n * 1e9 / r) ns)."""
import math
import pathlib
from fractions import Fraction

import pytest

from flashrt_core.contract.schedule import simulate
from flashrt_core.contract.spec import load_contract, validate
from test_runtime_toy import ToyBinding, toy_contract

CONFIG = pathlib.Path(__file__).resolve().parents[1] / "config" / "pi05_tiny.yaml"
NS = 10 ** 9


def grid(rate, end_ns):
    r = Fraction(str(rate))
    return [math.ceil(n * NS / r) for n in range(int(end_ns * r / NS) + 2) if math.ceil(n * NS / r) < end_ns]


def pi05(observe_hz, act_hz, **limits):
    return load_contract(CONFIG).with_overrides(rates={"observe": observe_hz, "act": act_hz},
                                                limits={"max_observation_age_ms": None, **limits})


def runs(report, stage):
    return [e["t_ns"] for e in report["events"] if e["stage"] == stage and "skipped" not in e]


@pytest.mark.parametrize("observe_hz,act_hz,duration", [(10, 50, 1.0), (7, 30, 1.0), (3, 7.5, 2.0), (9, 13, 1.5)],
                         ids=["10-50", "7-30", "3-7.5", "9-13"])
def test_event_driven_ticks_follow_each_grid_exactly(observe_hz, act_hz, duration):
    end = int(duration * NS)
    rep = simulate(pi05(observe_hz, act_hz), duration)
    obs, act = grid(observe_hz, end), grid(act_hz, end)
    assert runs(rep, "observe") == obs and runs(rep, "act") == act
    assert runs(rep, "prompt") == [0]
    assert rep["ticks"] == len(set(obs) | set(act)) and rep["decisions"] == len(act)
    assert all(s["misses"] == 0 for s in rep["stages"].values())
    # order inside a tick follows the DAG: prompt, observe, act
    order = [(e["t_ns"], e["stage"]) for e in rep["events"]]
    assert order == sorted(order, key=lambda x: (x[0], ["prompt", "observe", "act"].index(x[1])))
    # every act output is as old as the last observe at or before it
    ages = [e["age_ms"] for e in rep["events"] if e["stage"] == "act"]
    expected = [(t - max(o for o in obs if o <= t)) / 1e6 for t in act]
    assert ages == pytest.approx(expected, abs=1e-9)


def test_7_and_30_hz_do_not_drift_over_a_long_run():
    rep = simulate(pi05(7, 30), 100.0)
    assert rep["stages"]["observe"]["runs"] == 700 and rep["stages"]["act"]["runs"] == 3000
    assert rep["ticks"] == 700 + 3000 - 100  # they coincide once per second (t = k s)
    obs, act = grid(7, 100 * NS), grid(30, 100 * NS)
    assert runs(rep, "observe") == obs and runs(rep, "act") == act and obs[-1] == math.ceil(699 * NS / 7)
    ages = [(t - max(o for o in obs[max(0, i * 7 // 30 - 1):i * 7 // 30 + 2] if o <= t)) / 1e6
            for i, t in enumerate(act)]
    assert rep["stages"]["act"]["age_ms"]["max"] == pytest.approx(max(ages))
    assert rep["stages"]["act"]["age_ms"]["max"] < 1000 / 7


@pytest.mark.parametrize("tick_hz,observe_hz,act_hz", [(20, 10, 50), (7, 10, 30), (50, 7, 30)],
                         ids=["tick20-10-50", "tick7-10-30", "tick50-7-30"])
def test_fixed_ticks_count_missed_periods(tick_hz, observe_hz, act_hz):
    duration = 1.0
    end = int(duration * NS)
    rep = simulate(pi05(observe_hz, act_hz), duration, tick_hz=tick_hz)
    ticks = grid(tick_hz, end)
    assert rep["ticks"] == len(ticks)
    for stage, rate in (("observe", observe_hz), ("act", act_hz)):
        points = grid(rate, end)
        # a stage runs at a tick when at least one of its grid points fell in (previous tick, tick]
        expected_runs = [t for i, t in enumerate(ticks)
                         if any((ticks[i - 1] if i else -1) < p <= t for p in points)]
        assert runs(rep, stage) == expected_runs
        passed = sum(1 for p in points if p <= ticks[-1])
        assert rep["stages"][stage]["misses"] == passed - len(expected_runs)


def test_after_stage_runs_right_after_its_parent():
    contract = validate(toy_contract(observe_hz=7, act_hz=30), binding=ToyBinding)
    rep = simulate(contract, 1.0)
    ev = [(e["t_ns"], e["stage"]) for e in rep["events"]]
    assert runs(rep, "energy") == runs(rep, "act") == grid(30, NS)
    for i, (t, s) in enumerate(ev):
        if s == "energy":
            assert ev[i - 1] == (t, "act")


def test_slow_camera_reuse_and_age_limit():
    """Camera at 4 Hz, observe at 10 Hz (reuse): observe runs only on fresh frames; act refuses past 250 ms."""
    rep = simulate(load_contract(CONFIG), 1.0, observation_hz=4)
    assert runs(rep, "observe") == [0, 300 * 10 ** 6, 500 * 10 ** 6, 800 * 10 ** 6]
    assert rep["stages"]["observe"]["lates"] == 6
    refused = [e["t_ns"] // 10 ** 6 for e in rep["events"] if e["stage"] == "act" and "skipped" in e]
    assert refused == [260, 280, 760, 780] and rep["decisions"] == 46
    assert all("exceeds limits.max_observation_age_ms = 250" in e["skipped"]
               for e in rep["events"] if e["stage"] == "act" and "skipped" in e)
    assert rep["stages"]["act"]["age_ms"]["max"] == pytest.approx(240.0)


def test_slow_camera_wait_holds_act():
    contract = load_contract(CONFIG).with_overrides(limits={"late_observe": "wait"})
    rep = simulate(contract, 1.0, observation_hz=4)
    # observe is pending from 100 ms until the 250 ms frame is seen at the 260 ms act tick
    assert runs(rep, "observe")[:2] == [0, 260 * 10 ** 6]
    acts = [t // 10 ** 6 for t in runs(rep, "act")]
    assert acts[:7] == [0, 20, 40, 60, 80, 260, 280]
    held = [e for e in rep["events"] if e["stage"] == "act" and "skipped" in e]
    assert held[0]["t_ns"] == 100 * 10 ** 6 and "waiting for observe" in held[0]["skipped"]


def test_deferred_observe_moves_behind_act_and_ages_grow_by_one_act_period():
    """10/50 Hz with a fresh frame every tick: observe runs at the same ticks but after act, so act's age at an
    observe tick is a whole observe period (100 ms) instead of 0; the first tick still runs observe first."""
    plain = simulate(pi05(10, 50), 1.0)
    rep = simulate(load_contract(CONFIG).with_overrides(
        rates={"observe": 10, "act": 50}, limits={"max_observation_age_ms": None}, deferred={"observe": True}), 1.0)
    assert runs(rep, "observe") == runs(plain, "observe") == grid(10, NS)
    assert runs(rep, "act") == runs(plain, "act") == grid(50, NS)
    order = [(e["t_ns"], e["stage"]) for e in rep["events"] if "skipped" not in e]
    assert order[:3] == [(0, "prompt"), (0, "observe"), (0, "act")]
    for t in grid(10, NS)[1:]:
        assert order.index((t, "act")) < order.index((t, "observe"))
    ages = {e["t_ns"]: e["age_ms"] for e in rep["events"] if e["stage"] == "act" and "skipped" not in e}
    for t, age in ages.items():
        expect = 0.0 if t == 0 else (t - (t - 1) // (100 * 10 ** 6) * 100 * 10 ** 6) / 1e6
        assert age == pytest.approx(expect), t
    assert rep["stages"]["act"]["age_ms"]["max"] == pytest.approx(100.0)
    assert plain["stages"]["act"]["age_ms"]["max"] == pytest.approx(80.0)
