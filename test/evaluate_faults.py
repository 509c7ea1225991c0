"""Ray worker_process_setup_hook for test_evaluate: the worker that replays the bag named by FLASHRT_TEST_KILL_BAG
kills itself (SIGKILL, as the kernel's OOM killer would) in the middle of that bag, after two ticks, the first
time only: FLASHRT_TEST_KILL_MARKER is written (with its pid) just before."""
import os
import signal
from pathlib import Path


def kill_mid_bag() -> None:
    from flashrt_ros.evaluate import worker

    replay = worker.bag_clock_report

    def bag_clock_report(bag, runtimes, **kwargs):
        marker = Path(os.environ["FLASHRT_TEST_KILL_MARKER"])
        if Path(bag).name != os.environ["FLASHRT_TEST_KILL_BAG"] or marker.exists():
            return replay(bag, runtimes, **kwargs)

        def dying_runtimes():
            built = runtimes()
            step, ticks = built[0].step, []

            def step_then_die(now_ns, *args, **kw):
                ticks.append(now_ns)
                if len(ticks) > 2:
                    marker.write_text(str(os.getpid()))
                    os.kill(os.getpid(), signal.SIGKILL)
                return step(now_ns, *args, **kw)

            built[0].step = step_then_die
            return built

        return replay(bag, dying_runtimes, **kwargs)

    worker.bag_clock_report = bag_clock_report
