"""The command line refuses what would fail later, with one line that names the problem: `flashrt doctor` checks
a pi0 checkpoint against the contract `flashrt run` takes for it, `flashrt run --dry-run` checks every tensor name
and shape of the checkpoint as loading does, `flashrt run` serves no random weights by default, and `flashrt
bench` without a GPU says so. A process that warmed a runtime exits quietly."""
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from lerobot_checkpoint import PI0_FIXTURE, checkpoint_copy, hub_cache


def flashrt(*args, env=None):
    import os

    return subprocess.run([sys.executable, "-m", "flashrt_ros.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=300)


def _env(tmp_path):
    return {"HF_HUB_CACHE": str(hub_cache(tmp_path / "hub")), "HF_HOME": str(tmp_path / "hf")}


def test_doctor_checks_a_pi0_checkpoint_against_the_pi0_contract(tmp_path):
    ckpt, env = checkpoint_copy(tmp_path, PI0_FIXTURE), _env(tmp_path)
    out = flashrt("doctor", "--checkpoint", str(ckpt), "--device", "cpu", env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "pi0.yaml" in out.stdout and "model:                pi0" in out.stdout, out.stdout
    # the contract given wins: a pi0.5 contract is refused for it, with the reason
    pi05 = flashrt("doctor", "--checkpoint", str(ckpt), "--device", "cpu", "--config", "config/pi05.yaml", env=env)
    assert pi05.returncode == 1 and "is a pi0 checkpoint" in pi05.stdout, pi05.stdout + pi05.stderr


@pytest.mark.parametrize("change,reason", [
    ("drop", "1 missing keys: model.paligemma_with_expert.gemma_expert.model.layers.0.self_attn.o_proj.weight"),
    ("extra", "1 unexpected keys: model.extra.weight"),
    ("reshape", "1 mis-shaped keys: model.paligemma_with_expert.gemma_expert.model.layers.0.self_attn.o_proj.weight"),
])
def test_dry_run_refuses_a_checkpoint_whose_tensors_loading_refuses(tmp_path, change, reason):
    ckpt = checkpoint_copy(tmp_path)
    state = load_file(str(ckpt / "model.safetensors"))
    key = "model.paligemma_with_expert.gemma_expert.model.layers.0.self_attn.o_proj.weight"
    assert key in state
    if change == "drop":
        del state[key]
    elif change == "extra":
        state["model.extra.weight"] = torch.randn(3, 2)
    else:
        state[key] = state[key][:, :-1].contiguous()
    save_file(state, str(ckpt / "model.safetensors"))
    args = ["--checkpoint", str(ckpt), "--device", "cpu", "--camera-topics", "/a", "/b"]
    run = flashrt("run", "--dry-run", *args, env=_env(tmp_path))
    assert run.returncode == 1 and reason in run.stderr, run.stdout + run.stderr
    assert "Traceback" not in run.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_bench_without_a_gpu_says_so_in_one_line():
    run = flashrt("bench", "--model", "pi05")
    assert run.returncode == 1 and "needs a CUDA GPU" in run.stderr, run.stdout + run.stderr
    assert "Traceback" not in run.stderr


def test_run_without_a_checkpoint_refuses_to_serve_random_weights(tmp_path):
    """A forgotten --checkpoint must not start a node that publishes random actions to a robot; naming the tiny
    contract on purpose runs it."""
    for args in (["--dry-run"], []):
        run = flashrt("run", "--device", "cpu", *args)
        assert run.returncode == 1 and "flashrt run: no checkpoint: give --checkpoint DIR" in run.stderr, \
            run.stdout + run.stderr
    params = tmp_path / "robot.yaml"  # a checkpoint from the params file counts
    params.write_text(f"policy_node:\n  ros__parameters:\n    checkpoint: {tmp_path / 'missing'}\n")
    run = flashrt("run", "--dry-run", "--device", "cpu", "--params-file", str(params))
    assert run.returncode == 1 and "no checkpoint" not in run.stderr and "not found" in run.stderr, run.stderr
    tiny = flashrt("run", "--dry-run", "--device", "cpu", "--config", "config/pi05_tiny.yaml")
    assert tiny.returncode == 0 and "checkpoint:           none (built-in random weights)" in tiny.stdout, \
        tiny.stdout + tiny.stderr
    assert "precision:            preset bf16: nothing quantized, every part in float32" in tiny.stdout
    assert "warning:              no prompt: the node publishes no actions until a task arrives" in tiny.stdout
    told = flashrt("run", "--dry-run", "--device", "cpu", "--config", "config/pi05_tiny.yaml", "--prompt", "fold it")
    assert told.returncode == 0 and "no prompt" not in told.stdout, told.stdout + told.stderr


def test_a_process_that_warmed_a_runtime_exits_without_binding_leak_reports():
    """The warm-up freezes the collector's heap; at exit it is collected again before Triton's bindings are torn
    down, which otherwise report each object frozen with it (~30 lines after every Ctrl-C of a node)."""
    pytest.importorskip("triton")
    code = ("from flashrt_core import Runtime\n"
            "rt = Runtime.from_config('config/pi05_tiny.yaml', device='cpu', seed=0)\n"
            "rt.warmup()\n"
            "import gc; assert gc.get_freeze_count() > 0\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "leaked" not in out.stderr, out.stderr[-2000:]
