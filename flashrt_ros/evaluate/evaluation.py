"""`evaluate(bags, report_dir)`: every bag through the contract on a Ray cluster, nothing lost.

The bags that already have a result in `report_dir` (from an interrupted or earlier run of the same
evaluation) are skipped; the others are handed to replay workers, and each result is written to the folder as
it arrives. The fleet report is rebuilt from the folder at the end (also after an interruption), so a run
continued after an interruption reports exactly what one uninterrupted run does.
"""
from __future__ import annotations

import datetime
import hashlib
import os
from pathlib import Path

from flashrt_ros.evaluate import summary
from flashrt_ros.evaluate.fleet import FleetProgress, Pool, cluster, plan_actors
from flashrt_ros.evaluate.results import ReportFolder, checkpoint_identity
from flashrt_ros.evaluate.units import EvaluateError, dataset_topic_map, expand
from flashrt_ros.replay.topics import TopicMap


def _sha256(path) -> str | None:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest() if path else None


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def evaluate(bags, report_dir, *, config=None, checkpoint: str | None = None, tokenizer: str | None = None,
             compare=None, seed: int = 0, topics: TopicMap | None = None, prompt: str | None = None,
             action_dt_s: float = 0.02, device: str = "auto", workers: int | None = None,
             ray_address: str | None = None, actors_per_gpu: int = 1, retries: int = 2, retry_failed: bool = False,
             progress: bool = True, runtime_env: dict | None = None, on_result=None) -> dict:
    """Evaluate `bags` (bags, folders of bags, globs, LeRobot dataset folders) into `report_dir`; -> the content
    of report.json (`interrupted`: True when stopped by Ctrl-C / KeyboardInterrupt; run again to continue).

    config / checkpoint / tokenizer / compare / seed / topics / prompt / action_dt_s: as `flashrt replay`.
    workers: replay workers (default: one per GPU, times actors_per_gpu; without a GPU, one per CPU); without
    ray_address a local Ray cluster with that many CPUs is started. device: auto (cuda when the cluster has
    GPUs), cpu or cuda. retries: how many times a bag whose worker died (killed, out of memory) is handed to
    another worker before it gets an error row. retry_failed: replay again the bags whose result is an error.
    runtime_env: Ray's runtime environment for the workers (env_vars, py_modules, a worker_process_setup_hook).
    on_result(row): called after each bag's result is written."""
    from flashrt_ros.replay.runtimes import default_config

    if retries < 0 or actors_per_gpu < 1 or (workers is not None and workers < 1):
        raise EvaluateError("--retries must be >= 0, --actors-per-gpu and --workers >= 1")
    units = expand(bags)
    topic_map = topics or dataset_topic_map(units) or TopicMap()
    config = Path(config) if config is not None else default_config(checkpoint)
    for name, path in (("contract", config), ("compare", compare)):
        if path is not None and not Path(path).is_file():
            raise EvaluateError(f"--{name} {path}: no such file")
    fingerprint = {"contract_sha256": _sha256(config), "compare_sha256": _sha256(compare),
                   "checkpoint": checkpoint_identity(checkpoint), "seed": seed, "topics": topic_map.describe(),
                   "prompt": prompt, "action_dt_s": action_dt_s}
    folder = ReportFolder(report_dir)
    manifest = folder.open(fingerprint)
    todo = [u for u in units if not folder.has_result(u.key, retry_failed)]
    run = {"started": _now(), "bags": len(units), "reused": len(units) - len(todo), "replayed": [],
           "interrupted": False}
    manifest["runs"].append(run)
    evaluation = {"config": str(config), "compare": str(compare) if compare else None, "checkpoint": checkpoint,
                  "seed": seed, "device": device, "ray_address": ray_address, "topics": topic_map.describe()}
    bar = FleetProgress(len(units), len(units) - len(todo), enabled=progress)

    def take(row, arrays):
        folder.write_result(row, arrays)
        run["replayed"].append(row["key"])
        bar.result(row)
        if on_result is not None:
            on_result(row)

    try:
        for u in [u for u in todo if u.error is not None]:  # (a dataset that cannot be listed: no worker needed)
            take({"key": u.key, "bag": u.path, "episode": None, "status": "error", "error": u.error,
                  "attempts": 0, "worker_deaths": []}, {})
        todo = [u for u in todo if u.error is None]
        if todo:
            cpus = workers or os.cpu_count() or 1
            with cluster(ray_address, cpus, runtime_env):
                kind, actors, resources = plan_actors(device, workers, actors_per_gpu)
                actors = min(actors, len(todo))  # (no more runtimes than bags)
                threads = max(1, cpus // actors) if kind == "cpu" and not ray_address else None
                spec = {"config": str(config), "compare": str(compare) if compare else None,
                        "checkpoint": checkpoint, "tokenizer": tokenizer, "seed": seed, "device": kind,
                        "topics": topic_map.describe(), "prompt": prompt, "action_dt_s": action_dt_s,
                        "threads": threads}
                pool = Pool(spec, actors, resources, retries)
                ready = pool.start()
                built = {"device": kind, "weights_digest": next(r["weights_digest"] for r in ready if "pid" in r)}
                for r in ready:
                    if "pid" in r and r["weights_digest"] != built["weights_digest"]:
                        raise EvaluateError(f"the workers loaded different weights ({r['host']} pid {r['pid']}: "
                                            f"{r['weights_digest']} vs {built['weights_digest']}): is the checkpoint "
                                            "the same on every node?")
                if "built" in manifest:
                    folder.check(manifest["built"], built)
                manifest["built"] = built
                evaluation.update(device=kind, actors=actors, workers=ready)
                pool.run(todo, take, bar)
    except KeyboardInterrupt:
        run["interrupted"] = True
    finally:
        bar.close()
        run["finished"] = _now()
        folder.save_manifest(manifest)
    if "actors" not in evaluation:  # (nothing replayed in this run)
        evaluation.update(device=manifest.get("built", {}).get("device", device), actors=0)
    data = summary.build(folder, units, manifest, evaluation)
    data["interrupted"] = run["interrupted"]
    return data
