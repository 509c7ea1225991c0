"""benchmarks/bench_pi05.py's file names: a run without W2 (the views round) keeps its parity summary apart
from the W2 run's `pi05_parity.json`, which a results directory holds side by side."""
import pytest

from benchmark_loading import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("bench_pi05")


@pytest.mark.parametrize("workloads,name", [
    (["w2"], "pi05_parity.json"), (["w2", "views1", "views3"], "pi05_parity.json"),
    (["views1", "views3"], "pi05_parity_views.json"), (["views3"], "pi05_parity_views.json"),
    (["siglip32"], "pi05_parity_siglip32.json"), (["views1", "siglip32"], "pi05_parity_views1_siglip32.json")])
def test_the_parity_summary_of_a_run_without_w2_never_takes_the_w2_name(bench, workloads, name):
    assert bench.parity_file(workloads) == name
