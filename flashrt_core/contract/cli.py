"""`flashrt contract check FILE [--checkpoint DIR]` and `flashrt contract simulate FILE --duration S [--json]`.

The lead's console script calls `add_subparsers(subparsers)`; each subcommand sets `func(args) -> int`.
"""
from __future__ import annotations

import sys

from flashrt_core.errors import FlashRTError


def contract_check(path, checkpoint: str | None = None) -> int:
    """Print an OK summary (exit 0) or the precise error naming the field (exit 1); checkpoint: the contract's
    `model.checkpoint` set to that folder first (as `flashrt run --checkpoint` sets it)."""
    from flashrt_core.contract.spec import configured_contract, load_contract

    try:
        contract = load_contract(path) if checkpoint is None else configured_contract(path, checkpoint=checkpoint)
    except FlashRTError as e:
        print(f"{path}: INVALID: {e}", file=sys.stderr)
        return 1
    print(f"{path}: OK")
    print(contract.summary())
    return 0


def contract_simulate(path, duration: float, as_json: bool = False, tick_hz: float | None = None,
                      observation_hz: float | None = None) -> int:
    from flashrt_core.contract.schedule import format_report, report_json, simulate
    from flashrt_core.contract.spec import load_contract

    try:
        contract = load_contract(path)
        report = simulate(contract, duration, tick_hz=tick_hz, observation_hz=observation_hz)
    except (FlashRTError, ValueError) as e:
        print(f"{path}: {e}", file=sys.stderr)
        return 1
    print(report_json(report) if as_json else format_report(report))
    return 0


def add_subparsers(subparsers) -> None:
    p = subparsers.add_parser("contract", help="check or simulate an execution contract")
    sub = p.add_subparsers(dest="contract_command", required=True)
    c = sub.add_parser("check", help="validate a contract; exit 1 with the offending field if invalid")
    c.add_argument("file", help="contract YAML (e.g. config/pi05.yaml)")
    c.add_argument("--checkpoint", default=None,
                   help="check it with this checkpoint folder as model.checkpoint (a contract that needs one)")
    c.set_defaults(func=lambda a: contract_check(a.file, a.checkpoint))
    s = sub.add_parser("simulate", help="which stages run when, on a simulated clock")
    s.add_argument("file", help="contract YAML (e.g. config/pi05.yaml)")
    s.add_argument("--duration", type=float, required=True, help="simulated seconds")
    s.add_argument("--json", action="store_true", help="print the full report as JSON")
    s.add_argument("--tick-hz", type=float, default=None,
                   help="tick on a fixed grid (default: at every stage's due time)")
    s.add_argument("--observation-hz", type=float, default=None,
                   help="camera rate (default: a fresh observation at every tick)")
    s.set_defaults(func=lambda a: contract_simulate(a.file, a.duration, a.json, a.tick_hz, a.observation_hz))


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="flashrt")
    add_subparsers(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
