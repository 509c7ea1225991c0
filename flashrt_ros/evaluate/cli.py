"""`flashrt evaluate` (registered by flashrt_ros.cli through add_subparsers)."""
from __future__ import annotations

import sys


def add_subparsers(sub) -> None:
    p = sub.add_parser(
        "evaluate", help="replay many bags (or LeRobot datasets) on a Ray cluster; one fleet report",
        description="Replay every bag through the contract on the bag clock (as `flashrt replay`), one Ray actor per "
                    "GPU or CPU worker, each bag's result kept in --report as it arrives: a run started again with "
                    "the same --report replays only the bags without a result.")
    p.add_argument("bags", nargs="+", metavar="BAGS",
                   help="bags (rosbag2 folders, .mcap / .db3 files), folders of bags, globs, LeRobot dataset folders")
    p.add_argument("--report", required=True, metavar="DIR",
                   help="report folder: report.md, report.json, plots, bags/<bag>.json (results kept here)")
    p.add_argument("--contract", "--config", dest="config", default=None, metavar="FILE",
                   help="contract YAML (default: the packaged one a node takes: pi05_tiny.yaml, or the checkpoint's)")
    p.add_argument("--checkpoint", default=None, metavar="DIR", help="LeRobot checkpoint folder for the model")
    p.add_argument("--tokenizer", default=None, metavar="PATH", help="the checkpoint's tokenizer file or folder")
    p.add_argument("--compare", default=None, metavar="FILE",
                   help="a second contract fed the same inputs and noise; the report gives the per-bag difference")
    p.add_argument("--seed", type=int, default=0, help="runtime seed: tiny model weights and noise (default 0)")
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help="replay workers (default: one per GPU, else one per CPU); without --ray-address, a local "
                        "Ray cluster of N CPUs is started")
    p.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="join this Ray cluster (e.g. auto, or HEAD_IP:6379) instead of starting a local one")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="auto (default): cuda when the cluster has GPUs")
    p.add_argument("--actors-per-gpu", type=int, default=1, metavar="M",
                   help="replay workers sharing each GPU (Ray fractional GPUs, 1/M each; default 1)")
    p.add_argument("--retries", type=int, default=2, metavar="K",
                   help="times a bag whose worker died is handed to another worker (default 2)")
    p.add_argument("--retry-failed", action="store_true", help="replay again the bags whose result is an error")
    p.add_argument("--topics", default=None, metavar="FILE",
                   help="topic mapping YAML or policy_node parameters file (default: make-bag's topics, or a "
                        "LeRobot dataset's)")
    p.add_argument("--cameras", default=None, help="comma-separated camera topics, in the model's slot order")
    p.add_argument("--joints", default=None, metavar="TOPIC", help="sensor_msgs/JointState topic")
    p.add_argument("--joint-names", default=None, help="comma-separated joints in state order (default: as sent)")
    p.add_argument("--prompt", default=None, help="use this prompt instead of each bag's prompt topic")
    p.add_argument("--action-dt", type=float, default=0.02, metavar="S",
                   help="seconds between two actions of a chunk on the robot, for the splice metrics (default 0.02)")
    p.add_argument("--no-progress", action="store_true", help="no progress on stderr")
    p.set_defaults(func=run_evaluate)


def run_evaluate(args) -> int:
    from flashrt_ros.evaluate.evaluation import evaluate
    from flashrt_ros.evaluate.units import EvaluateError
    from flashrt_ros.replay.errors import ReplayError
    from flashrt_ros.replay.topics import load_topic_map

    mapped = any(v is not None for v in (args.topics, args.cameras, args.joints, args.joint_names))
    try:
        topics = load_topic_map(args.topics, cameras=args.cameras, joint_states=args.joints,
                                joint_names=args.joint_names) if mapped else None
        data = evaluate(args.bags, args.report, config=args.config, checkpoint=args.checkpoint,
                        tokenizer=args.tokenizer, compare=args.compare, seed=args.seed, topics=topics,
                        prompt=args.prompt, action_dt_s=args.action_dt, device=args.device, workers=args.workers,
                        ray_address=args.ray_address, actors_per_gpu=args.actors_per_gpu, retries=args.retries,
                        retry_failed=args.retry_failed, progress=not args.no_progress)
    except (EvaluateError, ReplayError) as e:
        print(f"flashrt evaluate: error: {e}", file=sys.stderr)
        return 1
    t = data["totals"]
    print(f"evaluated {t['with_result']} of {t['bags']} bags: {t['ok']} ok, {t['errors']} failed, "
          f"{t['decisions']} decisions, {t['refused']} refused, {t['retried']} retried after a worker died")
    for f in data["rows"][:5]:
        e = f.get("action_error") or {}
        what = f["error"] if f["status"] != "ok" else (f"{f['decisions']} decisions, action MSE {e['mse']:.3e}"
                                                       if e else f"{f['decisions']} decisions")
        print(f"  {f['key']}: {what}")
    print(f"report: {args.report}/report.md ({', '.join(data['plots'])})")
    if data["interrupted"]:
        print(f"interrupted: {t['without_result']} bag(s) not replayed; run the same command again to continue",
              file=sys.stderr)
        return 130
    return 0
