"""benchmarks/chain_tuning_probe.py ranks each act-stage shape's candidates by the isolated timings of a
bench_pi05 JSON and turns their names back into the pickers' configurations: checked on the committed W2 run."""
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import chain_tuning_probe as probe  # noqa: E402

from flashrt_core.models.pi05.engine_attention import CANDIDATES  # noqa: E402
from flashrt_core.models.pi05.engine_gemm import CONFIGS  # noqa: E402


def test_ranked_keeps_the_fastest_floats_in_order():
    timings = {"cublas": 9.7e-3, "(32, 128, 1, 4, 4)": 7.6e-3, "(64, 128, 1, 4, 4)": "mismatch",
               "(32, 256, 1, 4, 3)": 8.3e-3, "(16, 256, 0, 4, 1)": "failed: OutOfResources"}
    assert probe.ranked(timings, 2) == ["(32, 128, 1, 4, 4)", "(32, 256, 1, 4, 3)"]
    assert probe.ranked(timings, 9) == ["(32, 128, 1, 4, 4)", "(32, 256, 1, 4, 3)", "cublas"]
    assert probe.ranked(None, 3) == []


def test_every_ranked_name_of_the_w2_run_is_a_known_configuration():
    doc = json.loads((probe.RESULTS / "pi05_w2.json").read_text())
    act_gemms = [r for r in doc["gemm_choices"] if r["m"] == doc["workload"]["chunk"]]
    assert len(act_gemms) >= 5
    for row in act_gemms:
        for name in probe.ranked(row["ms"], 6):
            config = probe.as_config(name)
            assert config is None or config in CONFIGS
    expert = [r for r in doc["attention_choices"] if r["q"][1] == doc["workload"]["chunk"]]
    assert len(expert) == 1
    names = probe.ranked(expert[0]["ms"], 12)
    assert len(names) == 12 and all(probe.as_config(n) is None or probe.as_config(n) in CANDIDATES for n in names)
