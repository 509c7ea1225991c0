"""Which stages run at a tick: a deterministic, pure-Python scheduler shared by the Runtime and `simulate`.

Rules, applied to stages in DAG order at each tick `now_ns`:
- `rate_hz`: due when `now` reached the stage's next grid point. Grid point n is
  `t0 + ceil(n * 1e9 / rate)` ns with exact fractions, so rates that do not divide each other never drift;
  a tick that comes after several grid points runs the stage once and counts the skipped points as misses.
- `on_change: b`: due when buffer `b`'s version differs from the one the stage saw on its last run (planned
  versions, so a stage earlier in the same tick counts). Combined with `rate_hz`, it also fires early.
- `after: s`: due when stage `s` runs in this tick.
A `deferred` stage (and any stage `after` it) runs after the tick's other stages, off the output's critical
path: its writes count from the next tick on, so a stage that reads them in the same tick uses the previous
outputs (and their older stamps); its `after` children are planned against its new outputs. It runs in
order instead when its outputs were never produced (so the first tick decides), when it had been waiting
for fresh inputs (`late_observe: wait`: what the output was held for is used at once), and when deferring
it would have the output stage refuse for age.
A due stage is then held back (with a reason) when a buffer it reads was never produced; when it reads
inputs but none of its reads changed since its last run and it is not the output stage (a late observation:
`late_observe: reuse` skips this period and later stages use the last outputs; `wait` keeps it pending and
holds every stage that reads its outputs); or, for the stage writing the contract's output, when the
observation its reads came from is older than `limits.max_observation_age_ms`, or stamped more than that far
in the future. (The output stage runs every period on the inputs it last got: a new chunk from new noise, and
pi0's act over a state that a driver slower than the act rate has not changed.)
Planning only reads the ledger (versions and stamps on the host), so it never waits for the device.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from fractions import Fraction

from flashrt_core.contract.spec import MAX_RATE_HZ, Contract

NS = 1_000_000_000


@dataclass
class BufferMeta:
    version: int = 0  # 0: never produced
    step: int = -1  # the step that produced it
    stamp_ns: int | None = None  # stamp of the oldest observation it was computed from


@dataclass
class Ledger:
    """Host-side bookkeeping of every buffer and stage; plain data so capsules can carry it."""

    buffers: dict[str, BufferMeta]
    seen: dict[str, dict[str, int]]  # stage -> versions of its reads at its last run
    runs: dict[str, int]
    misses: dict[str, int]
    lates: dict[str, int]
    step: int = 0
    decisions: int = 0  # runs of the output stage

    @classmethod
    def fresh(cls, contract: Contract) -> "Ledger":
        names = list(contract.stages)
        return cls(buffers={b: BufferMeta() for b in contract.buffers},
                   seen={s: {b: 0 for b in contract.stages[s].reads} for s in names},
                   runs=dict.fromkeys(names, 0), misses=dict.fromkeys(names, 0), lates=dict.fromkeys(names, 0))

    def to_dict(self) -> dict:
        return {"buffers": {k: [m.version, m.step, m.stamp_ns] for k, m in self.buffers.items()},
                "seen": {k: dict(v) for k, v in self.seen.items()}, "runs": dict(self.runs),
                "misses": dict(self.misses), "lates": dict(self.lates), "step": self.step,
                "decisions": self.decisions}

    @classmethod
    def from_dict(cls, d: dict) -> "Ledger":
        return cls(buffers={k: BufferMeta(*v) for k, v in d["buffers"].items()},
                   seen={k: dict(v) for k, v in d["seen"].items()}, runs=dict(d["runs"]),
                   misses=dict(d["misses"]), lates=dict(d["lates"]), step=int(d["step"]),
                   decisions=int(d["decisions"]))

    def write_input(self, name: str, stamp_ns: int | None) -> None:
        m = self.buffers[name]
        m.version += 1
        m.step = self.step
        m.stamp_ns = stamp_ns


class RateClock:
    """Grid points t0 + ceil(n * 1e9 / rate) ns, anchored at the first tick."""

    def __init__(self, rate_hz: float):
        self.rate = Fraction(str(rate_hz))  # exact decimal, e.g. 7.5 -> 15/2
        self.t0: int | None = None
        self.n = 0  # index of the next grid point not yet consumed

    def point(self, n: int) -> int:
        return self.t0 + math.ceil(n * NS / self.rate)

    def latest(self, now_ns: int) -> int:
        """Index of the last grid point <= now."""
        # point(m) <= now  <=>  m * 1e9 / rate <= now - t0 (an integer), so the floor is exact
        return math.floor((now_ns - self.t0) * self.rate / NS)

    def next_due(self) -> int:
        return self.point(self.n)


@dataclass
class Plan:
    now_ns: int
    runs: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # stage -> reason
    stamps: dict[str, int | None] = field(default_factory=dict)  # stage -> observation stamp of its reads
    consume: set[str] = field(default_factory=set)  # rate stages whose due grid point is used up
    late: set[str] = field(default_factory=set)
    versions: dict[str, int] = field(default_factory=dict)  # planned versions after this tick
    deferred: list[str] = field(default_factory=list)  # the runs that go after the others (a suffix of runs)
    output_versions: dict[str, int] | None = None  # buffer versions the output stage was planned against
    refused_for_age: bool = False  # the output stage was due but its data was too old

    def age_ms(self, stage: str) -> float | None:
        s = self.stamps.get(stage)
        return None if s is None else (self.now_ns - s) / 1e6


class Scheduler:
    def __init__(self, contract: Contract):
        self.contract = contract
        self.clocks = {n: RateClock(s.trigger.rate_hz) for n, s in contract.stages.items()
                       if s.trigger.rate_hz is not None}
        self.pending: set[str] = set()  # late stages waiting for fresh inputs (late_observe: wait)
        self.output_stage = contract.output_stage()
        # A wake this close before a grid point counts as on time. Real timers (ROS, OS) fire with jitter
        # around a phase that differs from the grid's anchor by the first tick's wake latency; without a
        # slack a timer that fires a hair early finds nothing due and the stage runs a whole period late.
        self.slack_ns = 0

    def next_due_ns(self, after_ns: int) -> int | None:
        """The first grid point of any rate stage strictly after `after_ns` (pending stages included)."""
        due = [c.point(max(c.n, c.latest(after_ns) + 1)) for c in self.clocks.values() if c.t0 is not None]
        return min(due) if due else None

    def plan(self, now_ns: int, ledger: Ledger) -> Plan:
        plan = self._plan(now_ns, ledger, inline=frozenset())
        if plan.refused_for_age and set(plan.deferred) & self.contract.upstream(self.output_stage):
            # Deferring the refresh would cost a decision: run it in order this tick instead.
            plan = self._plan(now_ns, ledger, inline=frozenset(plan.deferred))
        return plan

    def _plan(self, now_ns: int, ledger: Ledger, inline: frozenset) -> Plan:
        """Plan a tick; stages in `inline` are not deferred. Pure but for anchoring unset clocks."""
        c = self.contract
        for clock in self.clocks.values():
            if clock.t0 is None:
                clock.t0 = now_ns  # phase: every rate stage is due at the first tick
        plan = Plan(now_ns)
        ver = {b: m.version for b, m in ledger.buffers.items()}
        stamp = {b: m.stamp_ns for b, m in ledger.buffers.items()}
        waiting: set[str] = set()
        deferred: list[tuple[str, int | None]] = []  # (stage, stamp): writes applied after the first pass
        later: set[str] = set()  # deferred stages and their `after` children
        children: list[str] = []  # `after` children of deferred stages: planned in the second pass
        for name, s in c.stages.items():
            if s.trigger.after is not None and s.trigger.after in later:
                children.append(name)
                later.add(name)
                continue
            src = self._consider(name, s, plan, ledger, ver, stamp, waiting)
            if src is False:
                continue
            if (s.deferred and name not in inline and name not in self.pending  # a stage that waited runs now
                    and all(ver[b] > 0 for b in s.writes)):  # and so does a first refresh: the output needs it
                deferred.append((name, src))
                later.add(name)
                continue
            if name == self.output_stage:
                plan.output_versions = dict(ver)
            self._run(name, src, plan, ver, stamp)
        for name, src in deferred:
            self._run(name, src, plan, ver, stamp, deferred=True)
        for name in children:  # see their parents' new outputs, as stages after their parent in a tick do
            src = self._consider(name, c.stages[name], plan, ledger, ver, stamp, waiting)
            if src is not False:
                self._run(name, src, plan, ver, stamp, deferred=True)
        plan.versions = ver
        return plan

    def _never_given(self, buffer: str, ver: dict) -> str:
        """Why `buffer` was never written, traced back to the inputs never set (e.g. a prefix that waits for a
        prompt): ': the input prompt was never set', or '' where the cause is not a missing input."""
        c, missing, todo, seen = self.contract, [], [buffer], set()
        while todo:
            b = todo.pop()
            if b in seen:
                continue
            seen.add(b)
            if c.buffers[b].is_input:
                missing.append(b)
            elif (producer := c.producer(b)) is not None:
                todo += [r for r in c.stages[producer].reads if ver[r] == 0]
        missing = sorted(m for m in missing if m != buffer)
        if not missing:
            return ""
        many = len(missing) > 1
        return f": the input{'s' * many} {', '.join(missing)} {'were' if many else 'was'} never set"

    def _consider(self, name, s, plan: Plan, ledger: Ledger, ver: dict, stamp: dict, waiting: set):
        """Whether stage `name` runs at this tick: the stamp of its data, or False (with the reason in
        plan.skipped when it was due but held back)."""
        c, now_ns, t = self.contract, plan.now_ns, s.trigger
        changed = t.on_change is not None and ver[t.on_change] != ledger.seen[name][t.on_change]
        clock_due = name in self.clocks and (name in self.pending or
                                             now_ns + self.slack_ns >= self.clocks[name].next_due())
        due = changed or clock_due or (t.after is not None and t.after in plan.runs)
        if not due:
            return False
        if clock_due:
            plan.consume.add(name)
        stamps = [stamp[b] for b in s.reads if stamp[b] is not None]
        src = min(stamps) if stamps else None
        plan.stamps[name] = src  # also for a held stage: how old its data would be
        never = [b for b in s.reads if ver[b] == 0]
        if never:
            plan.skipped[name] = f"{never[0]} has not been produced yet" + self._never_given(never[0], ver)
            return False
        held = sorted(c.upstream(name) & waiting)
        if held:
            plan.skipped[name] = f"waiting for {held[0]} (late_observe: wait)"
            waiting.add(name)
            return False
        # (not the output stage: it runs every period on what it last got, as long as that is young enough;
        # pi0's act reads the robot state, which a driver slower than the act rate leaves unchanged)
        reads_inputs = any(c.buffers[b].is_input for b in s.reads) and name != self.output_stage
        if reads_inputs and not changed and all(ver[b] == ledger.seen[name][b] for b in s.reads):
            plan.late.add(name)
            if c.limits.late_observe == "wait":
                plan.consume.discard(name)
                waiting.add(name)
                plan.skipped[name] = "late: no new inputs since its last run; waiting (late_observe: wait)"
            else:
                plan.skipped[name] = "late: no new inputs since its last run; reusing its last outputs"
            return False
        limit = c.limits.max_observation_age_ms
        if name == self.output_stage and limit is not None and src is not None:
            age = (now_ns - src) / 1e6
            if age > limit:
                oldest = min((b for b in s.reads if stamp[b] is not None), key=lambda b: stamp[b])
                plan.skipped[name] = (f"observation age {age:.1f} ms exceeds limits.max_observation_age_ms = "
                                      f"{limit:g} (the oldest it reads: {oldest})")
            elif -age > limit:  # a negative age would pass any limit: the sensor's clock and ours disagree
                plan.skipped[name] = (f"observation stamped {-age:.1f} ms in the future (more than "
                                      f"limits.max_observation_age_ms = {limit:g}): sensor and runtime clocks disagree")
            if name in plan.skipped:
                plan.refused_for_age = True
                return False
        return src

    def _run(self, name, src, plan: Plan, ver: dict, stamp: dict, deferred: bool = False) -> None:
        plan.runs.append(name)
        if deferred:
            plan.deferred.append(name)
        for b in self.contract.stages[name].writes:
            ver[b] += 1
            stamp[b] = src

    def drop(self, plan: Plan, stage: str, why: str) -> None:
        """Take a planned deferred stage (and the deferred stages `after` it) back out of a plan that has
        not been committed, e.g. because its host part failed: it did not run, and its clock stays due."""
        gone = {stage}
        for name in list(plan.deferred):
            after = self.contract.stages[name].trigger.after
            if name in gone or after in gone:
                gone.add(name)
                plan.deferred.remove(name)
                plan.runs.remove(name)
                plan.consume.discard(name)
                plan.skipped[name] = why if name == stage else f"{stage} did not run: {why}"

    def commit(self, plan: Plan, ledger: Ledger) -> None:
        """Record a plan as executed: versions, stamps, seen versions, counters, clocks."""
        c = self.contract
        for name in plan.runs:
            s = c.stages[name]
            for b in s.reads:
                ledger.seen[name][b] = ledger.buffers[b].version  # includes writes earlier in this tick
            for b in s.writes:
                m = ledger.buffers[b]
                m.version += 1
                m.step = ledger.step
                m.stamp_ns = plan.stamps[name]
            ledger.runs[name] += 1
            if name == self.output_stage:
                ledger.decisions += 1
        for name in plan.late:
            ledger.lates[name] += 1
        for name, clock in self.clocks.items():
            if name in plan.consume:
                m = clock.latest(plan.now_ns + self.slack_ns)
                ledger.misses[name] += max(0, m - clock.n)
                clock.n = m + 1
                self.pending.discard(name)
            elif name in plan.skipped and name in plan.late:
                self.pending.add(name)  # waiting: stays due until fresh inputs arrive
        ledger.step += 1


# ---- simulated clock -------------------------------------------------------------------------------------
def simulate(contract: Contract, duration_s: float, tick_hz: float | None = None,
             observation_hz: float | None = None) -> dict:
    """Run the scheduler on a simulated clock over [0, duration_s) and report what ran when.

    Ticks happen at the stages' grid points (tick_hz=None) or on a fixed tick grid. A fresh observation
    (every input except the prompt-like ones nobody stamps) arrives at every tick, or at observation_hz. The
    prompt is set once at t=0. Compute takes no simulated time, so ages are pure scheduling staleness.
    """
    if not (duration_s > 0 and math.isfinite(duration_s)):
        raise ValueError(f"duration_s must be positive and finite (seconds), got {duration_s}")
    for name, hz in (("tick_hz", tick_hz), ("observation_hz", observation_hz)):
        if hz is not None and not 0 < hz <= MAX_RATE_HZ:  # (None: not set; 0 is not "unset"; NaN fails too)
            raise ValueError(f"{name} must be a rate in (0, {MAX_RATE_HZ:g}] Hz, got {hz}")
    sched = Scheduler(contract)
    ledger = Ledger.fresh(contract)
    end = int(Fraction(str(duration_s)) * NS)
    inputs = [b.name for b in contract.buffers.values() if b.is_input]
    stamped = [b for b in inputs if not _is_prompt(contract, b)]
    unstamped = [b for b in inputs if b not in stamped]
    tick_clock = RateClock(tick_hz) if tick_hz is not None else None
    cam_clock = RateClock(observation_hz) if observation_hz is not None else None
    for clock in (tick_clock, cam_clock):
        if clock:
            clock.t0 = 0
    events, ticks, now = [], 0, 0
    ages: dict[str, list[float]] = {n: [] for n in contract.stages}
    for b in unstamped:
        ledger.write_input(b, None)
    while now < end:
        stamp = now if cam_clock is None else cam_clock.point(cam_clock.latest(now))
        for b in stamped:
            if ledger.buffers[b].stamp_ns != stamp:
                ledger.write_input(b, stamp)
        plan = sched.plan(now, ledger)
        sched.commit(plan, ledger)
        ticks += 1
        for name in plan.runs:
            age = plan.age_ms(name)
            events.append({"t_ns": now, "stage": name, "age_ms": age, **({"deferred": True}
                                                                          if name in plan.deferred else {})})
            if age is not None:
                ages[name].append(age)
        for name, why in plan.skipped.items():
            events.append({"t_ns": now, "stage": name, "skipped": why})
        if tick_clock:
            tick_clock.n = tick_clock.latest(now) + 1
            now = tick_clock.next_due()
        else:
            nxt = sched.next_due_ns(now)
            now = nxt if nxt is not None else end
    stages = {}
    for name in contract.stages:
        a = ages[name]
        held = sum(1 for e in events if e["stage"] == name and "skipped" in e)
        stages[name] = {"trigger": contract.stages[name].describe_trigger(), "runs": ledger.runs[name],
                        "misses": ledger.misses[name], "lates": ledger.lates[name], "skipped": held,
                        "age_ms": {"min": min(a), "mean": sum(a) / len(a), "max": max(a)} if a else None}
    return {"contract": contract.source, "duration_s": duration_s, "tick_hz": tick_hz,
            "observation_hz": observation_hz, "ticks": ticks, "decisions": ledger.decisions,
            "stages": stages, "events": events}


def _is_prompt(contract: Contract, name: str) -> bool:
    """Inputs read only by on_change stages are commands (the prompt), not stamped observations."""
    readers = [s for s in contract.stages.values() if name in s.reads]
    return bool(readers) and all(s.trigger.on_change == name and s.trigger.rate_hz is None for s in readers)


def format_report(report: dict, max_events: int = 40) -> str:
    lines = [f"simulated {report['duration_s']} s: {report['ticks']} ticks, {report['decisions']} decisions"]
    w = max([28] + [len(s["trigger"]) + 2 for s in report["stages"].values()])
    lines.append(f"{'stage':<12}{'trigger':<{w}}{'runs':>6}{'misses':>8}{'lates':>7}{'skipped':>9}"
                 "   age ms min/mean/max")
    for name, s in report["stages"].items():
        a = s["age_ms"]
        age = f"{a['min']:.1f}/{a['mean']:.1f}/{a['max']:.1f}" if a else "-"
        lines.append(f"{name:<12}{s['trigger']:<{w}}{s['runs']:>6}{s['misses']:>8}{s['lates']:>7}"
                     f"{s['skipped']:>9}   {age}")
    ev = report["events"]
    lines.append(f"first {min(max_events, len(ev))} of {len(ev)} events:")
    for e in ev[:max_events]:
        what = f"skipped: {e['skipped']}" if "skipped" in e else (
            f"age {e['age_ms']:.1f} ms" if e["age_ms"] is not None else "") + (
            " (deferred: its outputs count from the next tick)" if e.get("deferred") else "")
        lines.append(f"  {e['t_ns'] / 1e6:10.3f} ms  {e['stage']:<10} {what}")
    return "\n".join(lines)


def report_json(report: dict) -> str:
    return json.dumps(report, indent=1)
