"""scripts/before_after.sh and its summary (scripts/before_after.py) without a GPU: the summary's numbers,
change and pass from two made-up bench files, and the shell script's old run (tree, arguments, environment)
through a stand-in old tree whose bench_pi05.py records what it was given."""
import json
import os
import pathlib
import stat
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import before_after  # noqa: E402


def bench_doc(commit, whole, act_only, eager, choices):
    return {"gpu": "NVIDIA H200", "commit": commit, "workload": {"model": "pi05"},
            "results": {"flashrt": {"p50_ms": whole}, "flashrt-act-only": {"p50_ms": act_only},
                        "lerobot-eager": {"p50_ms": eager}},
            "stages": {"observe": {"ms": 5.8}, "act": {"ms": act_only}}, "flashrt_build_s": 200.0,
            "parity": {"targets": {}, "flashrt_vs_reference_fp32": {"cosine": 0.99999, "rel_l2": 3e-3,
                                                                    "max_abs": 1e-3, "pass": True}},
            "gemm_choices": [{"m": 50, "weight": [2560, 1024], "bias": False, "geglu": False,
                              "dtype": "torch.bfloat16", "fused": f, "choice": c} for c, f in choices]}


def write_runs(tmp_path, old, new):
    out, work = tmp_path / "out", tmp_path / "work"
    out.mkdir()
    work.mkdir()
    for name, doc in (("old", old), ("new", new)):
        if doc is not None:
            (out / f"pi05_w2_{name}.json").write_text(json.dumps(doc))
        (work / f"{name}.status").write_text("0 240" if doc is not None else "124 300")
    return out, work


def test_summary_changes_and_the_two_percent_pass(tmp_path):
    old = bench_doc("9184cfe", 11.18, 5.87, 258.0, [("(64, 512, 0, 8, 1)", ["defer", None])])
    new = bench_doc("abc1234", 11.30, 6.10, 260.0, [("(32, 128, 2, 4, 4)", ["defer"])])
    out, work = write_runs(tmp_path, old, new)
    doc = before_after.summarize(out, work, 0.02, "9184cfe", "abc1234")
    change = doc["results"]["change"]
    assert change["flashrt_p50_ms"] == pytest.approx(0.12 / 11.18)
    assert change["act_only_p50_ms"] == pytest.approx(0.23 / 5.87)
    assert change["lerobot_eager_p50_ms"] == pytest.approx(2 / 258)
    assert doc["pass"] == {"whole_decision": True, "act_only": False, "all": False}
    assert doc["results"]["old"]["wall_s"] == 240 and doc["results"]["new"]["parity"]["flashrt_vs_reference_fp32"]
    # the fusion fields differ between versions: the same shape, another pick
    assert doc["gemm_choices_compared"]["shapes_in_both"] == 1
    assert len(doc["gemm_choices_compared"]["different_choice"]) == 1
    assert json.loads((out / before_after.RESULT).read_text())["workload"]["old_commit"] == "9184cfe"
    lines = []
    before_after.print_table(doc, out=lines.append)
    assert any(x.startswith("act_only_p50_ms") and "+3.92%" in x for x in lines)
    assert before_after.main([str(out), str(work)]) == 1


def test_summary_of_a_run_that_wrote_nothing_fails(tmp_path):
    out, work = write_runs(tmp_path, bench_doc("old", 11.0, 5.9, 250.0, []), None)
    doc = before_after.summarize(out, work, 0.02, "old", "new")
    assert doc["results"]["new"] == {"exit": "124", "wall_s": 300.0} and doc["results"]["change"] == {}
    assert not doc["pass"]["all"] and "gemm_choices_compared" not in doc


FAKE_BENCH = '''import json, os, pathlib, sys
args = sys.argv[1:]
out = pathlib.Path(args[args.index("--out-dir") + 1])
out.mkdir(parents=True, exist_ok=True)
env = {k: os.environ.get(k) for k in ("PYTHONPATH", "FLASHRT_COMMIT", "FLASHRT_TUNING_CACHE", "TRITON_INTERPRET",
                                      "TRITON_CACHE_DIR")}
doc = {"commit": os.environ["FLASHRT_COMMIT"], "results": {"flashrt": {"p50_ms": 11.0},
       "flashrt-act-only": {"p50_ms": 5.9}}, "args": args, "env": env, "cwd": os.getcwd()}
(out / "pi05_w2.json").write_text(json.dumps(doc))
'''


def test_the_script_runs_the_old_tree_with_its_own_path_cache_and_commit(tmp_path):
    old = tmp_path / "old"
    (old / "benchmarks").mkdir(parents=True)
    (old / "flashrt_core").mkdir()
    (old / "benchmarks" / "bench_pi05.py").write_text(FAKE_BENCH)
    (old / "COMMIT").write_text("9184cfe\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    wrapper = bin_dir / "python3"
    wrapper.write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(out), "FLASHRT_COMMIT": "new1234",
           "FLASHRT_WHEELS": str(tmp_path / "no-wheels"), "FLASHRT_DEADLINE_S": "240", "TRITON_INTERPRET": "1"}
    proc = subprocess.run(["bash", str(REPO / "scripts" / "before_after.sh"), str(old)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    seen = json.loads((out / "pi05_w2_old.json").read_text())
    assert seen["args"] == ["--out-dir", seen["args"][1], "--workloads", "w2", "--skip-compile"]
    assert seen["cwd"] == str(old) and seen["env"]["PYTHONPATH"].split(":")[0] == str(old)
    assert seen["env"]["FLASHRT_COMMIT"] == "9184cfe" and seen["env"]["TRITON_INTERPRET"] == "0"
    assert seen["env"]["FLASHRT_TUNING_CACHE"] == str(REPO / ".cache" / "tuning-old")
    assert seen["env"]["TRITON_CACHE_DIR"] == str(REPO / ".cache" / "triton")
    summary = json.loads((out / before_after.RESULT).read_text())
    assert summary["workload"]["old_commit"] == "9184cfe" and summary["workload"]["new_commit"] == "new1234"
    assert summary["results"]["old"]["flashrt_p50_ms"] == 11.0
    # this tree's own run needs CUDA: without it the new side has no numbers and the script fails
    if not (out / "pi05_w2_new.json").exists():
        assert proc.returncode == 1 and not summary["pass"]["all"]
    assert (out / "before_after.log").exists() and "== old: exit 0" in (out / "before_after.log").read_text()
