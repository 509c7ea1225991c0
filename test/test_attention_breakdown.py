"""benchmarks/attention_breakdown.py builds its ablation variants from the shipped attention kernel's source:
its anchors must still match, and its mode 0 must still be the full attention (the ablations by design are
not)."""
import pathlib
import sys

from kernel_testing import dev, randn  # noqa: F401  (sets TRITON_INTERPRET before the kernels load)

import pytest  # noqa: E402
import torch  # noqa: E402

from flashrt_core.kernels import reference as R  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import attention_breakdown  # noqa: E402


@pytest.mark.interpret
def test_the_breakdown_variants_still_compute_attention(dev, tmp_path):  # noqa: F811
    var = attention_breakdown.variant_module(tmp_path)
    q = randn(1, 7, 4, 32, dev=dev, seed=1, std=2.0)
    k, v = randn(1, 1, 41, 32, dev=dev, seed=2), randn(1, 1, 41, 32, dev=dev, seed=3)
    k2, v2 = randn(1, 1, 7, 32, dev=dev, seed=4), randn(1, 1, 7, 32, dev=dev, seed=5)
    mask = torch.ones(1, 41, dtype=torch.bool, device=dev)
    mask[:, 33:] = False
    ref = R.attention_ref(q, k, v, mask, k2, v2)
    for config in [(16, 16, 2, 1), (16, 16, 4, 1)]:
        full = var.attention(q, k, v, mask, k2, v2, config=config, mode=0)
        torch.testing.assert_close(full, ref, atol=1e-5, rtol=1e-5)
    # mode 2 only stores partials: the output is never written
    out = torch.full_like(q, float("nan"))
    var.attention(q, k, v, mask, k2, v2, config=(16, 16, 2, 1), mode=2, out=out)
    assert torch.isnan(out).all()
    # mode 1 takes the tickets without merging: still no output, and the tickets are left at zero
    from flashrt_core.kernels._common import new_semaphore_workspace, semaphore_workspace
    tickets = new_semaphore_workspace(dev, 64)
    with semaphore_workspace(tickets):
        var.attention(q, k, v, mask, k2, v2, config=(16, 16, 2, 1), mode=1, out=out)
    assert torch.isnan(out).all() and int(tickets.abs().sum()) == 0


def test_a_changed_kernel_source_is_reported(tmp_path, monkeypatch):
    monkeypatch.setattr(attention_breakdown, "PATCHES", [("an anchor that is not there", "")])
    with pytest.raises(RuntimeError, match="update PATCHES"):
        attention_breakdown.variant_module(tmp_path)
