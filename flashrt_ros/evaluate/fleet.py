"""The Ray side of an evaluation: a cluster (a local one by default, or an existing one joined by address), one
replay actor per GPU (fractions of a GPU with actors_per_gpu > 1) or per CPU worker, and the loop that hands
each idle actor the next bag, takes results as they end (`ray.wait`), and gives the bag of a worker that died
to another worker, at most `retries` times. Ray restarts the dead actor (max_restarts); nothing here
re-implements scheduling, restarts or transport."""
from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

from tqdm import tqdm

from flashrt_ros.evaluate.units import EvaluateError, Unit
from flashrt_ros.evaluate.worker import BagReplayer

OBJECT_STORE_MB = 128  # results are small (numbers and first action rows); Ray's floor is 75 MB


def _package_root() -> str:
    import flashrt_ros

    return str(Path(flashrt_ros.__file__).resolve().parents[1])


@contextlib.contextmanager
def cluster(address: str | None, cpus: int, runtime_env: dict | None = None):
    """ray.init for the evaluation, ray.shutdown after it. A local cluster (address None) is a new one of this
    machine alone (never one found running), with no dashboard, a small object store and its files in a
    temporary folder removed afterwards; its workers import the same flashrt as this process. Ray's servers
    listen on every interface and Ray has no loopback-only mode: its token authentication (on by default
    for a local cluster since Ray 2.5x, the token in ~/.ray/auth_token) is what keeps others out. A Ray
    already initialized in this process (a notebook) is used as it is and left running."""
    import ray

    if ray.is_initialized():
        yield
        return
    env = dict(runtime_env or {})
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # (no usage report leaves the machine)
    quiet = dict(logging_level=logging.WARNING, log_to_driver=False, configure_logging=True)
    temp = None
    try:
        if address:
            ray.init(address=address, runtime_env=env or None, **quiet)
        else:
            env_vars = dict(env.get("env_vars") or {})
            paths = [_package_root()] + [p for p in env_vars.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
                                         .split(os.pathsep) if p]
            env_vars["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
            env["env_vars"] = env_vars
            temp = tempfile.mkdtemp(prefix="flashrt_ray_")  # (short: Ray's socket paths must stay < 108 bytes)
            ray.init(address="local", num_cpus=cpus, include_dashboard=False, _temp_dir=temp,
                     object_store_memory=OBJECT_STORE_MB << 20, runtime_env=env, **quiet)
    except Exception as e:
        if temp:
            shutil.rmtree(temp, ignore_errors=True)
        raise EvaluateError(f"cannot start Ray{' at ' + address if address else ''}: {e}") from None
    try:
        yield
    finally:
        ray.shutdown()
        if temp:
            shutil.rmtree(temp, ignore_errors=True)


def plan_actors(device: str, workers: int | None, actors_per_gpu: int) -> tuple[str, int, dict]:
    """(device, actors, Ray resources per actor) for the cluster ray is connected to."""
    import ray

    resources = ray.cluster_resources()
    gpus, cpus = int(resources.get("GPU", 0)), int(resources.get("CPU", 0))
    if device == "auto":
        device = "cuda" if gpus else "cpu"
    if device.startswith("cuda"):
        if not gpus:
            raise EvaluateError(f"--device {device}: the Ray cluster has no GPU (resources: {resources})")
        n = workers or gpus * actors_per_gpu
        return "cuda", n, {"num_gpus": 1.0 / actors_per_gpu, "num_cpus": 1}
    n = workers or max(1, cpus)
    return "cpu", n, {"num_cpus": 1}


def _death(exc: Exception) -> str:
    """A Ray failure in one line (its messages run over many)."""
    text = re.sub(r"\s+", " ", str(exc)).strip()
    return f"{type(exc).__name__}: {text[:300]}" + ("..." if len(text) > 300 else "")


class Pool:
    """The replay actors and the bags handed to them."""

    def __init__(self, spec: dict, actors: int, resources: dict, retries: int):
        import ray

        self.retries = retries
        actor_cls = ray.remote(BagReplayer).options(max_restarts=-1, max_task_retries=0, **resources)
        self.actors = [actor_cls.remote(spec) for _ in range(actors)]
        self.streak = [0] * actors  # deaths in a row per actor: one that dies on every bag is retired
        self.live = set(range(actors))

    def start(self) -> list[dict]:
        """Wait for every actor's runtime; -> what each built. A configuration that does not build is the
        evaluation's error (every bag would fail the same way); an actor that died starting is retired."""
        import ray

        ready = []
        for i, actor in enumerate(self.actors):
            try:
                info = ray.get(actor.ready.remote())
            except Exception as e:
                self._retire(i)
                ready.append({"error": _death(e), "died": True})
                continue
            if info["error"] is not None:
                raise EvaluateError(info["error"])
            ready.append(info)
        if not self.live:
            raise EvaluateError(f"no replay worker started: {ready[0]['error']}")
        return ready

    def _retire(self, i: int) -> None:
        import ray

        self.live.discard(i)
        with contextlib.suppress(Exception):
            ray.kill(self.actors[i], no_restart=True)

    def _pick(self, queue: deque, i: int):
        """The first queued unit that did not die on actor i (any unit when every live actor is one it died on)."""
        for u in queue:
            if i not in u.avoid or self.live <= set(u.avoid):
                queue.remove(u)
                return u
        return None

    def run(self, units: list[Unit], on_result, bar) -> None:
        """Replay every unit; on_result(row, arrays) for each as it ends (a bag whose workers kept dying gets an
        error row after `retries` retries)."""
        import ray
        from ray.exceptions import OutOfMemoryError, RayActorError, WorkerCrashedError

        queue, inflight, idle = deque(units), {}, sorted(self.live)
        while queue or inflight:
            for i in list(idle):
                unit = self._pick(queue, i) if i in self.live else None
                if unit is not None:
                    inflight[self.actors[i].replay.remote(unit.to_dict())] = (i, unit)
                    idle.remove(i)
            if not inflight:  # every actor retired: the rest cannot be replayed here
                for unit in queue:
                    on_result(self._given_up(unit, "no replay worker left (each died on its last bags)"), {})
                return
            done, _ = ray.wait(list(inflight), num_returns=1, timeout=1.0)
            bar.refresh()
            for ref in done:
                i, unit = inflight.pop(ref)
                idle.append(i)
                try:
                    result = ray.get(ref)
                except (RayActorError, WorkerCrashedError, OutOfMemoryError) as e:
                    self._died(i, unit, _death(e), queue, on_result, bar)
                    continue
                except Exception as e:  # the method itself failed (it catches a bag's own errors)
                    result = {"row": {"key": unit.key, "bag": unit.path, "episode": unit.episode,
                                      "status": "error", "error": _death(e)}, "arrays": {}}
                self.streak[i] = 0
                result["row"]["attempts"] = len(unit.deaths) + 1
                result["row"]["worker_deaths"] = unit.deaths
                on_result(result["row"], result["arrays"])

    def _died(self, i, unit, why, queue, on_result, bar) -> None:
        unit.deaths.append(why)
        unit.avoid.append(i)
        self.streak[i] += 1
        bar.died()
        if self.streak[i] > self.retries:  # (Ray would restart it again; it has shown it cannot work)
            self._retire(i)
        if len(unit.deaths) > self.retries:
            on_result(self._given_up(unit, f"the worker died on each of its {len(unit.deaths)} attempts "
                                           f"(last: {why})"), {})
        else:
            queue.appendleft(unit)

    @staticmethod
    def _given_up(unit: Unit, why: str) -> dict:
        return {"key": unit.key, "bag": unit.path, "episode": unit.episode, "status": "error", "error": why,
                "attempts": len(unit.deaths), "worker_deaths": unit.deaths}


class FleetProgress:
    """bags done / total, rate, failures and worker deaths: a tqdm bar on a terminal, else one line per bag."""

    def __init__(self, total: int, done: int, enabled: bool = True, stream=None):
        self.stream = stream or sys.stderr
        self.total, self.failed, self.deaths, self.done = total, 0, 0, done
        self.lines = enabled and not (hasattr(self.stream, "isatty") and self.stream.isatty())
        self.t0, self.first = time.perf_counter(), done
        self.bar = tqdm(total=total, initial=done, desc="  evaluate", unit="bag", file=self.stream,
                        disable=None if enabled else True, dynamic_ncols=False, mininterval=0.5,
                        bar_format="{desc} {n_fmt}/{total_fmt} bags [{bar:25}] {elapsed}<{remaining}{postfix}")

    def _postfix(self) -> str:
        minutes = (time.perf_counter() - self.t0) / 60
        rate = (self.done - self.first) / minutes if minutes > 0 else 0.0
        extra = f", {self.deaths} worker deaths" if self.deaths else ""
        return f"{rate:.1f} bags/min, {self.failed} failed{extra}"

    def result(self, row: dict) -> None:
        self.done += 1
        self.failed += row["status"] != "ok"
        if self.lines:
            what = row["error"] if row["status"] != "ok" else f"{row['replay']['decisions']} decisions"
            print(f"[{self.done}/{self.total}] {row['key']}: {row['status']}: {what}", file=self.stream,
                  flush=True)
        self.bar.set_postfix_str(self._postfix(), refresh=False)
        self.bar.update(1)

    def died(self) -> None:
        self.deaths += 1
        self.bar.set_postfix_str(self._postfix(), refresh=False)

    def refresh(self) -> None:
        if not self.bar.disable:
            self.bar.refresh()

    def close(self) -> None:
        self.bar.close()
