"""The `flashrt` console script: run, demo, doctor, bench, replay, make-bag, evaluate, contract, capsule."""
from __future__ import annotations

import argparse
import sys


def _add_demo(sub):
    p = sub.add_parser("demo", help="run the policy node with the tiny model on synthetic sensors")
    p.add_argument("--duration", type=float, default=8.0, help="seconds of listening (default 8)")
    p.add_argument("--config", default=None, help="contract YAML (default: the packaged pi05_tiny.yaml)")
    p.add_argument("--cameras", type=int, default=2, help="synthetic camera topics (default 2)")
    p.add_argument("--act-rate", type=float, default=20.0,
                   help="act stage rate (default 20 Hz: the tiny model on a 2-core CPU; GPUs run 50+ Hz)")
    p.add_argument("--observe-rate", type=float, default=5.0,
                   help="observe stage rate: cameras -> prefix (default 5 Hz)")
    p.add_argument("--json", default=None, help="also write the summary as JSON here")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashrt", description="FlashRT ROS: fast, dependable robot policy inference")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_demo(sub)
    d = sub.add_parser("doctor", help="what hardware, kernels and ROS pieces are available, and what a contract "
                                      "will run here")
    d.add_argument("--config", help="contract YAML (default: the packaged pi05.yaml)")
    d.add_argument("--checkpoint", help="LeRobot checkpoint folder")
    d.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    d.add_argument("--tokenizer", help="tokenizer.json / tokenizer.model file or folder (default: the hub cache)")
    for module in ("flashrt_core.contract.cli", "flashrt_core.capsule.cli", "flashrt_bench.harness",
                   "flashrt_ros.replay.cli", "flashrt_ros.evaluate.cli", "flashrt_ros.run_cli"):
        try:
            mod = __import__(module, fromlist=["add_subparsers"])
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise  # a real import failure inside the module must not hide silently
            continue  # that part is not written yet: it simply has no subcommand
        added = mod.add_subparsers(sub)
        if module == "flashrt_core.capsule.cli":  # the verbs on a running node join `capsule inspect`
            from flashrt_ros.capsule_cli import add_node_verbs

            add_node_verbs(added)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "doctor":
        from flashrt_ros.doctor import doctor

        return doctor(args.config, args.checkpoint, args.device, args.tokenizer)
    if args.command == "demo":
        from flashrt_ros.demo import demo

        return demo(duration=args.duration, config=args.config, cameras=args.cameras,
                    act_rate=args.act_rate, observe_rate=args.observe_rate, json_out=args.json)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
