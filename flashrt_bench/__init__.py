"""The benchmark harness behind `flashrt bench` and `benchmarks/`: workloads, timing, LeRobot baselines, parity.
It imports the engine (`flashrt_core`); the engine never imports it."""
