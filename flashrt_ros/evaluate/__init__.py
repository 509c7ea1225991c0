"""Fleet-scale replay evaluation on Ray: `evaluate(bags, report_dir)` replays every recorded episode through
the contract on the bag clock (the same replay as `flashrt replay`), one actor per GPU or CPU worker, each
bag's result kept in the report folder as it arrives, and a fleet report (report.md, report.json, plots)."""

__all__ = ["EvaluateError", "evaluate"]


def __getattr__(name):
    # The CLI imports this package to register its subcommand; ray, torch and numpy load on first use.
    if name == "evaluate":
        from flashrt_ros.evaluate.evaluation import evaluate

        return evaluate
    if name == "EvaluateError":
        from flashrt_ros.evaluate.units import EvaluateError

        return EvaluateError
    raise AttributeError(name)
