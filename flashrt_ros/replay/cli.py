"""`flashrt replay` and `flashrt make-bag` (registered by flashrt_ros.cli through add_subparsers)."""
from __future__ import annotations

import sys


def add_subparsers(sub) -> None:
    p = sub.add_parser("replay", help="replay a rosbag2 through the runtime; latency, staleness and action reports",
                       description="Replay a rosbag2 (mcap or sqlite3) through the execution contract on the bag "
                                   "clock (deterministic), or with --realtime against a running policy_node.")
    p.add_argument("bag", help="rosbag2 folder, .mcap or .db3 file")
    p.add_argument("--config", default=None, help="contract YAML (default: the packaged one a node takes: "
                                                  "pi05_tiny.yaml, or with --checkpoint that model's)")
    p.add_argument("--checkpoint", default=None, metavar="DIR",
                   help="LeRobot checkpoint folder for the contract's model (as the node's checkpoint parameter)")
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="the checkpoint's tokenizer.json / tokenizer.model file or folder (as the node's tokenizer "
                        "parameter; default: the Hugging Face hub cache)")
    p.add_argument("--compare", default=None, metavar="FILE",
                   help="a second contract fed the same inputs and noise; reports their agreement")
    p.add_argument("--report", default=None, metavar="DIR", help="write report.json, report.md and plots here")
    p.add_argument("--realtime", action="store_true",
                   help="play the bag onto ROS topics at bag rate against a running policy_node")
    p.add_argument("--seed", type=int, default=None,
                   help="runtime seed: weights of the tiny model and noise (default: --topics' seed, else 0)")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N (default cpu)")
    p.add_argument("--topics", default=None, metavar="FILE",
                   help="topic mapping YAML (cameras, joint_states, joint_names, prompt, actions) or a "
                        "policy_node parameters file (whose contract, checkpoint, tokenizer, seed and action_dt "
                        "apply too, unless given here)")
    p.add_argument("--cameras", default=None, help="comma-separated camera topics, in the model's slot order")
    p.add_argument("--joints", default=None, metavar="TOPIC", help="sensor_msgs/JointState topic")
    p.add_argument("--joint-names", default=None, help="comma-separated joints in state order (default: as sent)")
    p.add_argument("--prompt-topic", default=None, help="std_msgs/String prompt topic")
    p.add_argument("--action-topic", default=None, help="recorded flashrt_ros/ActionChunk topic")
    p.add_argument("--prompt", default=None, help="use this prompt instead of the bag's prompt topic")
    p.add_argument("--node", default="/policy_node", help="--realtime: the policy node's name (default /policy_node)")
    p.add_argument("--timeout", type=float, default=60.0, help="--realtime: seconds to wait for the node")
    p.add_argument("--action-dt", type=float, default=None, metavar="S",
                   help="seconds between two actions of a chunk on the robot, for the splice metrics (default: "
                        "--topics' action_dt, else 0.02)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=run_replay)

    m = sub.add_parser("make-bag", help="write a sample rosbag2 (synthetic cameras, joints, prompt and actions), "
                                        "or with --from-lerobot one bag per episode of a LeRobot dataset",
                       description="Write a sample rosbag2 with synthetic sensors and the actions a contract computes "
                                   "from them; or, with --from-lerobot DATASET, one MCAP bag per episode of a LeRobot "
                                   "dataset (v3 layout) whose recorded action chunks are the dataset's actions.")
    m.add_argument("out", help="new bag folder (never overwritten); with --from-lerobot, the folder of the bags")
    m.add_argument("--from-lerobot", default=None, metavar="DATASET",
                   help="a LeRobot dataset folder (meta/info.json, data/, videos/): write OUT/episode_XXXXXX bags and "
                        "OUT/topics.yaml for `flashrt replay --topics`; bags converted before are reused")
    m.add_argument("--episodes", default=None, metavar="LIST",
                   help="--from-lerobot: episode indices and ranges, e.g. 0,2,5-7 (default: all)")
    m.add_argument("--chunk", type=int, default=50,
                   help="--from-lerobot: dataset actions per recorded chunk (default 50, the models' chunk size)")
    m.add_argument("--images", choices=("raw", "png", "jpeg"), default="raw",
                   help="--from-lerobot: frames as sensor_msgs/Image rgb8 (raw, default) or CompressedImage")
    m.add_argument("--storage", choices=("mcap", "sqlite3"), default="mcap", help="rosbag2 storage (default mcap)")
    m.add_argument("--duration", type=float, default=10.0, help="seconds of bag time (default 10)")
    m.add_argument("--cameras", type=int, default=2, help="synthetic camera topics (default 2)")
    m.add_argument("--joints", type=int, default=None, help="joints of the synthetic robot (default: the "
                   "contract's state width)")
    m.add_argument("--size", default="240x320", metavar="HxW", help="camera frame size (default 240x320)")
    m.add_argument("--config", default=None, help="contract that computes the recorded actions")
    m.add_argument("--checkpoint", default=None, metavar="DIR",
                   help="LeRobot checkpoint folder whose model computes them (its packaged contract unless --config)")
    m.add_argument("--tokenizer", default=None, metavar="PATH", help="the checkpoint's tokenizer file or folder")
    m.add_argument("--seed", type=int, default=0,
                   help="seed of the recorded decisions' noise (default 0; replay with the same to match them)")
    m.add_argument("--prompt", default="pick up the red cube", help="the task, recorded on the prompt topic")
    m.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N that computes the recorded actions")
    m.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    m.set_defaults(func=run_make_bag)


def run_replay(args) -> int:
    from flashrt_ros.replay.errors import ReplayError
    from flashrt_ros.replay.replay import replay
    from flashrt_ros.replay.topics import load_topic_map, node_run_parameters

    try:
        topics = load_topic_map(args.topics, cameras=args.cameras, joint_states=args.joints,
                                joint_names=args.joint_names, prompt=args.prompt_topic, actions=args.action_topic)
        node = node_run_parameters(args.topics) if args.topics else {}
        if args.realtime:  # (the running node has its own tokenizer)
            node.pop("tokenizer", None)
        given = {"contract": args.config, "checkpoint": args.checkpoint, "tokenizer": args.tokenizer,
                 "seed": args.seed, "action_dt": args.action_dt}
        taken = {k: v for k, v in node.items() if given[k] is None}
        if taken:
            print(f"flashrt replay: from {args.topics}: " + ", ".join(f"{k} {v}" for k, v in taken.items()),
                  file=sys.stderr)
        run = {**given, **taken}
        report = replay(args.bag, config=run["contract"], compare=args.compare, report_dir=args.report,
                        realtime=args.realtime, seed=run["seed"] or 0, progress=not args.no_progress, topics=topics,
                        prompt=args.prompt, device=args.device, node=args.node, timeout_s=args.timeout,
                        action_dt_s=run["action_dt"] or 0.02, checkpoint=run["checkpoint"],
                        tokenizer=run["tokenizer"])
    except ReplayError as e:
        if e.report is not None and e.report.data.get("ticks"):
            print(e.report.summary_table().rsplit("\nerror: ", 1)[0])
        print(f"flashrt replay: error: {e}", file=sys.stderr)
        if e.report_dir is not None:
            print(f"partial report: {e.report_dir}/report.md", file=sys.stderr)
        return 1
    print(report.summary_table())
    if args.report:
        print(f"report: {args.report}/report.md ({', '.join(report.data.get('plots', []))})")
    return 0


def run_make_bag(args) -> int:
    from flashrt_ros.replay.errors import ReplayError
    from flashrt_ros.replay.make_bag import make_bag

    if args.from_lerobot is not None:
        return run_from_lerobot(args)
    if args.episodes is not None:
        print("flashrt make-bag: error: --episodes applies to --from-lerobot", file=sys.stderr)
        return 1
    try:
        h, _, w = args.size.lower().partition("x")
        height, width = int(h), int(w)
    except ValueError:
        print(f"flashrt make-bag: error: --size: expected HxW like 240x320, got {args.size!r}", file=sys.stderr)
        return 1
    try:
        out = make_bag(args.out, storage=args.storage, duration=args.duration, cameras=args.cameras, seed=args.seed,
                       config=args.config, height=height, width=width, joints=args.joints, prompt=args.prompt,
                       device=args.device, progress=not args.no_progress, checkpoint=args.checkpoint,
                       tokenizer=args.tokenizer)
    except ReplayError as e:
        print(f"flashrt make-bag: error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out['path']} ({out['storage']}, {out['duration_s']:g} s, {out['decisions']} recorded decisions "
          f"from {out['config']}, seed {out['seed']})")
    for topic, count in out["topics"].items():
        print(f"  {topic}: {count} messages")
    return 0


def run_from_lerobot(args) -> int:
    """make-bag --from-lerobot: one line per episode as it is converted; exit 1 if any failed."""
    from flashrt_ros.replay import lerobot_dataset
    from flashrt_ros.replay.errors import ReplayError

    given = [f"--{k}" for k in ("config", "checkpoint", "tokenizer") if getattr(args, k) is not None]
    if given:  # (the recorded actions are the dataset's: no model computes them)
        print(f"flashrt make-bag: error: {', '.join(given)} do(es) not apply to --from-lerobot: the recorded "
              "actions are the dataset's", file=sys.stderr)
        return 1
    failed = done = 0
    try:
        episodes = lerobot_dataset.parse_episodes(args.episodes) if args.episodes is not None else None
        ds = lerobot_dataset.open_dataset(args.from_lerobot)
        print(f"{ds.root}: LeRobot dataset, {ds.fps:g} fps, cameras {', '.join(ds.cameras)}; recorded chunks: "
              f"{args.chunk} dataset actions from each frame on")
        for c in lerobot_dataset.convert(ds.root, args.out, episodes=episodes, chunk=args.chunk,
                                         images=args.images, storage=args.storage):
            if c.error is not None:
                failed += 1
                print(f"  episode {c.episode}: error: {c.error}", file=sys.stderr)
                continue
            done += 1
            if c.summary is None:
                print(f"  {c.path}: reused (converted before with the same settings)")
            else:
                s = c.summary
                print(f"  {c.path}: {s['frames']} frames, {s['duration_s']:.2f} s, "
                      f"{s['topics'][lerobot_dataset.ACTIONS_TOPIC]} recorded chunks", flush=True)
    except ReplayError as e:
        print(f"flashrt make-bag: error: {e}", file=sys.stderr)
        return 1
    print(f"{done} bag(s) in {args.out}" + (f", {failed} episode(s) failed" if failed else "")
          + f"; replay one with: flashrt replay {args.out}/episode_XXXXXX --topics {args.out}/topics.yaml "
          f"(a contract acting at {ds.fps:g} Hz decides at every frame)")
    return 1 if failed else 0
