"""AdoptedModule, the swapped-in wrapper: its fast path runs the fused form only for an adopted call (shape,
dtype, device, eval mode, no gradient wanted, weights unchanged since adoption); every other call runs the
original module and is counted. The fused form here is deliberately distinguishable (original + OFFSET) so
each test sees which path ran."""
import pytest
import torch
from torch import nn

from flashrt_core.adopt.signature import call_signature, canonical_call, parameters_of
from flashrt_core.adopt.wrappers import AdoptedModule, UnitStats

# Tolerance table: which path ran is told by exact outputs (fused = original + OFFSET).
TOL = {"exact": 0.0}
OFFSET = 1000.0


class Scale(nn.Module):
    def __init__(self, width=13):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, generator=torch.Generator().manual_seed(7)) + 0.5)

    def forward(self, x, shift=None):
        return x * self.weight if shift is None else x * self.weight + shift


class Marked(nn.Module):
    """The fused stand-in: the original's result plus OFFSET."""

    def __init__(self, original):
        super().__init__()
        object.__setattr__(self, "orig", original)

    def forward(self, x, shift=None):
        return self.orig(x, shift) + OFFSET


def x_of(rows=3, width=13, seed=1, dtype=torch.float32):
    return torch.randn(rows, width, generator=torch.Generator().manual_seed(seed)).to(dtype)


def wrapped(*calls):
    orig = Scale().eval()
    stats = UnitStats()
    sigs = {call_signature(args, kwargs) for args, kwargs in calls}
    return orig, AdoptedModule(orig, Marked(orig).eval(), sigs, stats, "scale"), stats


def ran_fused(wrapper, orig, *args, **kwargs) -> bool:
    with torch.no_grad():
        out, ref = wrapper(*args, **kwargs), orig(*args, **kwargs)
    if torch.equal(out, ref + OFFSET):
        return True
    assert torch.equal(out, ref)
    return False


def test_fast_path_runs_fused_for_the_adopted_call_only():
    x = x_of()
    orig, w, stats = wrapped(((x,), {}))
    assert ran_fused(w, orig, x_of(seed=2))  # same signature, other values
    assert not ran_fused(w, orig, x_of(rows=5))  # other shape
    assert not ran_fused(w, orig, x_of(dtype=torch.float64))  # other dtype
    assert (stats.fused_calls, stats.fallback_calls) == (1, 2)


def test_other_device_falls_back():
    # Adopted on the meta device (needs no accelerator), called on the CPU: same shape and dtype, other device.
    orig, w, stats = wrapped(((torch.empty(3, 13, device="meta"),), {}))
    assert next(iter(w._one_tensor_keys))[2] == torch.device("meta")
    assert not ran_fused(w, orig, x_of())
    assert (stats.fused_calls, stats.fallback_calls) == (0, 1)


def test_general_path_for_keyword_and_multi_tensor_calls():
    x, s = x_of(), x_of(seed=3)
    orig, w, stats = wrapped(((x,), {"shift": s}), ((x, s), {}))
    assert ran_fused(w, orig, x, shift=s)
    assert ran_fused(w, orig, x, s)
    assert not ran_fused(w, orig, x, shift=x_of(rows=1))
    assert not ran_fused(w, orig, x)  # the one-tensor form was never adopted
    assert (stats.fused_calls, stats.fallback_calls) == (2, 2)


def test_training_mode_grad_mode_and_changed_weights_fall_back():
    x = x_of()
    orig, w, stats = wrapped(((x,), {}))
    w.train()
    assert not ran_fused(w, orig, x)
    w.eval()
    with torch.enable_grad():  # the weight wants a gradient: only the original gives one
        out = w(x)
        assert out.requires_grad and torch.equal(out, orig(x))
    orig.weight.requires_grad_(False)
    with torch.enable_grad():
        assert torch.equal(w(x), orig(x) + OFFSET)  # grad mode on, but nothing wants a gradient
    with torch.no_grad():
        orig.weight.mul_(1.5)  # a checkpoint reload writes in place: derived tensors would be stale
    assert not ran_fused(w, orig, x)
    assert stats.fallback_calls == 3 and stats.fused_calls == 1


def test_converted_weights_fall_back():
    x = x_of()
    orig, w, stats = wrapped(((x,), {}))
    assert ran_fused(w, orig, x)
    w.double()  # .to() keeps the parameter objects and their versions: only dtype tells
    assert orig.weight.dtype == torch.float64
    assert not ran_fused(w, orig, x.double())
    assert (stats.fused_calls, stats.fallback_calls) == (1, 1)


@pytest.mark.parametrize("shape", [(4, 13), (2, 3, 13)])
def test_fast_path_key_matches_the_general_signature(shape):
    x = torch.randn(*shape)
    orig, w, _ = wrapped(((x,), {}))
    orig.weight.requires_grad_(False)
    assert w.fused_allowed((x,), {}) and w.fused_allowed((torch.randn(*shape),), {})
    assert not w.fused_allowed((torch.randn(*shape[:-1], 14),), {})


def test_canonical_call_is_the_same_for_positional_keyword_and_default_forms():
    def method(images, masks, tokens=None, *, noise=None, steps=10):
        return images, masks, tokens, noise, steps
    params = parameters_of(method)
    gen = torch.Generator().manual_seed(5)
    a, b, n = (torch.randn(2, 3, generator=gen) + 0.5 for _ in range(3))
    forms = [((a, b), {"noise": n}), ((), {"images": a, "masks": b, "noise": n}),
             ((a,), {"masks": b, "tokens": None, "noise": n, "steps": 10})]
    canon = [canonical_call(params, args, kwargs) for args, kwargs in forms]
    assert all(call_signature(*c) == call_signature(*canon[0]) for c in canon)
    assert canon[0] == ((a, b, None), {"noise": n, "steps": 10})
    # Another value of a plain argument, a missing argument, or no known parameters: not the same call.
    assert call_signature(*canonical_call(params, (a, b), {"steps": 5})) != call_signature(*canon[0])
    assert canonical_call(params, (a,), {}) is None
    assert canonical_call(None, (a,), {"x": b}) == ((a,), {"x": b})


def test_canonical_call_orders_extra_keywords_and_dict_arguments_by_name():
    from torch.utils._pytree import tree_flatten

    def method(images, **extra):
        return images, extra
    params = parameters_of(method)
    gen = torch.Generator().manual_seed(6)
    a, n, st = torch.randn(2, 3, generator=gen) + 0.5, torch.randn(4, generator=gen), torch.randn(5, generator=gen)
    one = canonical_call(params, (a,), {"noise": n, "state": st})
    other = canonical_call(params, (a,), {"state": st, "noise": n})
    assert call_signature(*one) == call_signature(*other)
    leaves_one, spec_one = tree_flatten(one)
    leaves_other, spec_other = tree_flatten(other)
    assert spec_one == spec_other and all(x is y for x, y in zip(leaves_one, leaves_other, strict=True))
    # A dict argument is described by key: the same entries in another order match, other shapes do not.
    assert call_signature(({"n": n, "s": st},), {}) == call_signature(({"s": st, "n": n},), {})
    assert call_signature(({"n": n, "s": st},), {}) != call_signature(({"n": st, "s": n},), {})
