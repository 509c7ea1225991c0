"""What the kernel test files share: the interpreter switch, the device fixture, seeded inputs, the check.

Import it before flashrt_core.kernels: Triton decides between interpreter and compiler when a kernel module
is first imported. Interpreter by default (TRITON_INTERPRET=1, CPU); with TRITON_INTERPRET=0 on CUDA the
same tests run compiled.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from flashrt_core.kernels._common import interpreting  # noqa: E402


@pytest.fixture(scope="module")
def dev():
    if interpreting():
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    pytest.skip("kernels need TRITON_INTERPRET=1 or CUDA")


def assert_close(out, ref, tol):
    """out == ref within tol[dtype] = (atol, rtol), same dtype and shape."""
    atol, rtol = tol[ref.dtype]
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


def randn(*shape, dtype=torch.float32, dev="cpu", seed=0, std=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * std).to(dtype).to(dev)


def micro_config(kind: str = "pi05"):
    """An interpreter-sized pi0.5 or pi0 with odd shapes: 4 patches per view (28 px), 9-token prompt, 6-action
    chunk, 3 flow steps, 2 camera slots (pi0: a 7-wide state slot)."""
    from flashrt_core.models.pi05.config import GemmaConfig, Pi05Config, VisionConfig

    return Pi05Config(
        vision=VisionConfig(hidden=24, mlp=40, layers=2, heads=3, image_size=28, patch=14),
        vlm=GemmaConfig(width=40, depth=2, mlp=56, heads=4, kv_heads=1, head_dim=10),
        expert=GemmaConfig(width=24, depth=2, mlp=40, heads=4, kv_heads=1, head_dim=10),
        vocab_size=300, chunk_size=6, action_dim=7, num_steps=3, tokenizer_max_length=9, num_image_slots=2,
        **({"state_dim": 7} if kind == "pi0" else {})).as_kind(kind)


def micro_inputs(config, seed: int = 0):
    """Seeded inputs of `micro_config(kind)`: (images, masks, tokens, lang_mask, noise); pi0 also a 5-value
    state before the noise (zero padded to 7 by the model): (images, masks, tokens, lang_mask, state, noise)."""
    g = torch.Generator().manual_seed(seed)
    size, slots, n = config.vision.image_size, config.num_image_slots, config.tokenizer_max_length
    images = torch.rand(1, slots, 3, size, size, generator=g) * 2 - 1
    masks = torch.tensor([[True, False]])
    tokens = torch.randint(0, config.vocab_size, (1, n), generator=g)
    lang_mask = torch.arange(n)[None] < 6
    state = (torch.rand(1, 5, generator=g) * 2 - 1,) if config.kind == "pi0" else ()
    noise = torch.randn(1, config.chunk_size, config.action_dim, generator=g)
    return (images, masks, tokens, lang_mask, *state, noise)
