"""Bad input to pi0.5's model API (`models.paligemma.inputs`, the fused engine's staged calls, the policy): a clear
InputError that names the problem, and nothing lost: a refused call leaves the engine's buffers (and batch
size) as they were, and a missing camera's slot never reaches the actions whatever it holds."""
import dataclasses
import re

import numpy as np
import pytest
import torch

from flashrt_core.errors import InputError
from flashrt_core.models import pi05
from flashrt_core.models.pi05 import reference as R
from flashrt_core.models.pi05.config import GemmaConfig, Pi05Config, VisionConfig
from flashrt_core.models.pi05.engine import Pi05Engine
from flashrt_core.models.paligemma.inputs import check_model_inputs, check_noise
from flashrt_core.models.pi05.policy import Pi05Policy
from flashrt_core.lerobot.tokenize import TinyTokenizer

TOL = {"masked_slot": 0.0}  # a masked slot's content must not change a single bit of the actions


def small_config() -> Pi05Config:
    return Pi05Config(
        vision=VisionConfig(hidden=24, mlp=40, layers=2, heads=3, image_size=28, patch=14),
        vlm=GemmaConfig(width=40, depth=2, mlp=56, heads=4, kv_heads=1, head_dim=10),
        expert=GemmaConfig(width=24, depth=2, mlp=40, heads=4, kv_heads=1, head_dim=10),
        vocab_size=300, chunk_size=6, action_dim=7, num_steps=3, tokenizer_max_length=9, num_image_slots=2,
        state_dim=5)


@pytest.fixture(scope="module")
def weights():
    config, state = pi05.build_tiny(7, small_config())
    return pi05.convert(config, state)


def inputs(config, seed=0):
    g = torch.Generator().manual_seed(seed)
    size, n = config.vision.image_size, config.tokenizer_max_length
    images = torch.rand(1, 2, 3, size, size, generator=g) * 2 - 1
    masks = torch.tensor([[True, False]])
    tokens = torch.randint(1, config.vocab_size, (1, n), generator=g)
    lang_mask = torch.arange(n)[None] < 6
    noise = torch.randn(1, config.chunk_size, config.action_dim, generator=g)
    return images, masks, tokens, lang_mask, noise


def buffers_of(engine) -> dict:
    return {f.name: getattr(engine.buffers, f.name).clone() for f in dataclasses.fields(engine.buffers)}


def assert_unchanged(engine, before: dict) -> None:
    after = buffers_of(engine)
    assert after.keys() == before.keys()
    for name, t in before.items():
        assert after[name].shape == t.shape and torch.equal(after[name], t), name


BAD_OBSERVATIONS = {
    # name: (change to (images, masks, tokens, lang_mask), message the error must contain)
    "numpy tokens": (lambda i, m, t, lm: (i, m, t.numpy(), lm), "lang_tokens: expected a torch.Tensor"),
    "float tokens": (lambda i, m, t, lm: (i, m, t.float() + 0.7, lm), "integer ids"),
    "bool tokens": (lambda i, m, t, lm: (i, m, t > 5, lm), "integer ids"),
    "ids past the vocabulary": (lambda i, m, t, lm: (i, m, t + 300, lm), "ids must lie in [0, 300)"),
    "negative ids": (lambda i, m, t, lm: (i, m, t - 400, lm), "ids must lie in [0, 300)"),
    "uint8 images": (lambda i, m, t, lm: (((i + 1) * 127.5).to(torch.uint8), m, t, lm), "expected floats"),
    "images in 0..255": (lambda i, m, t, lm: ((i + 1) * 127.5, m, t, lm), "must lie in [-1, 1]"),
    "NaN in a present camera": (lambda i, m, t, lm: (i.index_put((torch.tensor(0), torch.tensor(0)),
                                                                 torch.tensor(float("nan"))), m, t, lm),
                                "NaN or infinite"),
    "three slots on a two-slot model": (lambda i, m, t, lm: (torch.cat([i, i[:, :1]], 1), torch.ones(1, 3, dtype=bool),
                                                             t, lm), "3 camera slots"),
    "prompt too long": (lambda i, m, t, lm: (i, m, torch.cat([t, t], 1), torch.cat([lm, lm], 1)), "exceed"),
    "mask of another shape": (lambda i, m, t, lm: (i, m[:, :1], t, lm), "image_masks: expected"),
}


@pytest.mark.parametrize("case", list(BAD_OBSERVATIONS))
def test_a_refused_observation_leaves_the_engine_as_it_was(weights, case):
    """Every bad observation is refused by the fused engine (CPU path) before anything is written, and by the
    policy in front of either engine with the same message."""
    change, message = BAD_OBSERVATIONS[case]
    images, masks, tokens, lang_mask, noise = inputs(weights.config)
    engine = Pi05Engine(weights, backend="torch")
    good = engine.sample_actions(images, masks, tokens, lang_mask, noise)
    before = buffers_of(engine)
    bad = change(images, masks, tokens, lang_mask)
    with pytest.raises(InputError, match=re.escape(message)):
        engine.set_observation(*bad)
    assert_unchanged(engine, before)
    engine.observe()
    engine.act()
    assert torch.equal(engine.buffers.actions, good)  # the last good observation still stands
    for name in ("reference", "fused"):
        policy = Pi05Policy(weights.config, weights, pi05.policy.make_engine(name, weights), "cpu", torch.float32)
        with pytest.raises(InputError):
            policy.sample_actions(*bad, noise)


@pytest.mark.parametrize("engine_name", ["reference", "fused"])
@pytest.mark.parametrize("junk", ["nan", "inf", "random"])
def test_a_missing_cameras_slot_never_reaches_the_actions(weights, engine_name, junk):
    """A masked slot is a -1 image whatever it holds (stale pixels, NaN from a dropped frame): the actions are
    bit for bit those of the same observation with the slot already -1 (on the GPU too, where the values are
    not read on the host)."""
    images, masks, tokens, lang_mask, noise = inputs(weights.config, seed=3)
    clean = images.clone()
    clean[:, 1] = -1.0
    dirty = images.clone()
    dirty[:, 1] = {"nan": float("nan"), "inf": float("inf"), "random": 0.37}[junk]
    engine = pi05.policy.make_engine(engine_name, weights)
    if engine_name == "fused":  # the engine's own call (the policy would refuse NaN values it can read)
        want = engine.sample_actions(clean, masks, tokens, lang_mask, noise)
        got = engine.sample_actions(dirty, masks, tokens, lang_mask, noise)
    else:
        want = R.sample_actions(weights, clean, masks, tokens, lang_mask, noise)
        got = R.sample_actions(weights, dirty, masks, tokens, lang_mask, noise)
    assert torch.isfinite(got).all()
    assert (got - want).abs().max() <= TOL["masked_slot"]


def test_the_observe_stage_sanitizes_buffers_filled_any_way(weights):
    """Buffers written without set_observation (as a restored capsule writes them) with junk in a masked
    camera's slot and token ids outside the vocabulary: the observe stage reads the slot as -1s and clamps
    the ids, bit for bit what set_observation's clean copies give."""
    images, masks, tokens, lang_mask, noise = inputs(weights.config, seed=4)
    clean_images = images.clone()
    clean_images[:, 1] = -1.0
    high = tokens.clone()
    high[0, 0] = weights.config.vocab_size + 7
    clamped = tokens.clone()
    clamped[0, 0] = weights.config.vocab_size - 1
    engine = Pi05Engine(weights, backend="torch")
    want = engine.sample_actions(clean_images, masks, clamped, lang_mask, noise)
    engine.set_observation(images, masks, tokens, lang_mask)
    buf = engine.buffers
    buf.images[:, 1] = float("nan")
    buf.lang_tokens[:, :tokens.shape[1]].copy_(high)
    engine.observe()
    prefix = R.PrefixCache(k=buf.prefix_k, v=buf.prefix_v, pad_mask=buf.pad_mask, n_valid=buf.n_valid)
    got = engine.denoise(prefix, noise)
    assert torch.isfinite(got).all() and want.abs().max() > 0
    assert (got - want).abs().max() <= TOL["masked_slot"]


def test_a_refused_denoise_or_prefix_keeps_the_engines_batch_and_buffers(weights):
    images, masks, tokens, lang_mask, noise = inputs(weights.config)
    engine = Pi05Engine(weights, backend="torch")
    prefix = engine.encode_prefix(images, masks, tokens, lang_mask)
    engine.denoise(prefix, noise)
    before = buffers_of(engine)
    two = pi05.PrefixCache(k=prefix.k.repeat(1, 2, 1, 1, 1), v=prefix.v.repeat(1, 2, 1, 1, 1),
                           pad_mask=prefix.pad_mask.repeat(2, 1), n_valid=prefix.n_valid.repeat(2))
    with pytest.raises(InputError, match="noise: expected"):
        engine.denoise(two, noise)  # a batch-2 prefix with batch-1 noise: refused before any resize
    assert engine.batch == 1
    assert_unchanged(engine, before)
    bad_prefixes = {
        "v transposed": (dataclasses.replace(prefix, v=prefix.v.transpose(3, 4).clone()), "prefix.v: expected"),
        "pad mask cut": (dataclasses.replace(prefix, pad_mask=prefix.pad_mask[:, :-1]), "prefix.pad_mask"),
        "n_valid as floats": (dataclasses.replace(prefix, n_valid=prefix.n_valid.float()), "integer counts"),
        "no prefix": (None, "expected a PrefixCache"),
    }
    for name, (bad, message) in bad_prefixes.items():
        with pytest.raises(InputError, match=message):
            engine.denoise(bad, noise)
        with pytest.raises(InputError, match=message):
            engine.set_prefix(bad)
        assert_unchanged(engine, before)
    with pytest.raises(InputError, match="NaN or infinite"):
        engine.denoise(prefix, noise.masked_fill(noise > 1.5, float("nan")))
    assert_unchanged(engine, before)


def test_check_noise_and_inputs_name_the_problem():
    config = small_config()
    images, masks, tokens, lang_mask, noise = inputs(config)
    with pytest.raises(InputError, match=r"noise: expected \(2, 6, 7\)"):
        check_noise(config, noise, 2)
    with pytest.raises(InputError, match="noise: expected floats"):
        check_noise(config, noise.long(), 1)
    with pytest.raises(InputError, match="images: expected a torch.Tensor"):
        check_model_inputs(config, images.numpy(), masks, tokens, lang_mask)
    # values of a masked slot are not checked (the engines replace them), those of a present one are
    check_model_inputs(config, images.index_put((torch.tensor(0), torch.tensor(1)), torch.tensor(float("nan"))),
                       masks, tokens, lang_mask)


def test_the_policys_prompt_refuses_a_long_state_a_foreign_tokenizer_and_a_bad_task(weights):
    policy = Pi05Policy(weights.config, weights, pi05.policy.make_engine("reference", weights), "cpu",
                        torch.float32, tokenizer=TinyTokenizer())
    state = np.linspace(-0.9, 0.9, 5, dtype=np.float32)
    tokens, mask = policy.tokenize("pick up the cube", state)
    assert tokens.shape == (1, 9) and int(tokens.max()) < 300 and bool(mask.all())
    with pytest.raises(InputError, match="6 values but the model takes at most 5"):
        policy.tokenize("pick", np.zeros(6, dtype=np.float32))
    with pytest.raises(InputError, match="task: expected a string"):
        policy.tokenize(None, state)
    with pytest.raises(InputError, match="state: missing"):
        policy.tokenize("pick", None)
    with pytest.raises(InputError, match="state: expected numbers"):
        policy.tokenize("pick", ["a", "b"])

    class Foreign(TinyTokenizer):  # ids of a bigger vocabulary than the model's 300
        def encode(self, text):
            return [299 + ord(c) for c in text]

    policy.tokenizer = Foreign()  # (one that does not say how many pieces it has: caught at its first prompt)
    with pytest.raises(InputError, match="outside the model's vocabulary of 300"):
        policy.tokenize("pick", state)

    class Big(TinyTokenizer):
        vocab_size = 301

    with pytest.raises(InputError, match="301 pieces but the model's vocabulary has 300"):
        Pi05Policy(weights.config, weights, policy.engine, "cpu", torch.float32, tokenizer=Big())


def test_set_observation_writes_what_it_is_given_and_clears_the_rest(weights):
    """Observations of other camera and prompt counts, one after another, then another batch size: each write
    leaves exactly its inputs in the buffers' first slots / tokens and cleared masks and ids past them (the
    write reuses views of the buffers per (slots, tokens), which must follow a reallocation)."""
    c = weights.config
    engine = Pi05Engine(weights, backend="torch")
    g = torch.Generator().manual_seed(11)
    size, slots, n_max = c.vision.image_size, c.num_image_slots, c.tokenizer_max_length
    for batch, s, n in ((1, slots, n_max), (1, 1, 3), (1, slots, n_max), (2, 1, n_max - 2), (2, 1, n_max - 2)):
        images = torch.rand(batch, s, 3, size, size, generator=g) * 2 - 1
        masks = torch.ones(batch, s, dtype=torch.bool)
        tokens = torch.randint(1, c.vocab_size, (batch, n), generator=g, dtype=torch.int32)
        lang_mask = torch.rand(batch, n, generator=g) < 0.8
        engine.set_observation(images, masks, tokens, lang_mask)
        buf = engine.buffers
        assert buf.images.shape[0] == batch
        assert torch.equal(buf.images[:, :s], images.to(buf.images.dtype))
        assert torch.equal(buf.image_masks[:, :s], masks) and not buf.image_masks[:, s:].any()
        assert torch.equal(buf.lang_tokens[:, :n], tokens.long()) and not buf.lang_tokens[:, n:].any()
        assert torch.equal(buf.lang_mask[:, :n], lang_mask) and not buf.lang_mask[:, n:].any()


def test_list_images_with_a_mask_tensor_keep_the_masks_in_place(weights):
    """LeRobot passes images as a list of S [B, ...] tensors; the masks may come as a list of S [B] or as one
    [B, S] tensor. With B == S a stacked tensor would be transposed and still pass the shape check, so the
    wrong cameras would be masked: both forms must give the same actions (exactly: same engine, same noise)."""
    config = weights.config
    g = torch.Generator().manual_seed(3)
    size, n = config.vision.image_size, config.tokenizer_max_length
    images = torch.rand(2, 2, 3, size, size, generator=g) * 2 - 1
    masks = torch.tensor([[True, False], [True, True]])  # not symmetric: a transpose changes it
    tokens = torch.randint(1, config.vocab_size, (2, n), generator=g)
    lang_mask = torch.arange(n)[None].expand(2, n) < 6
    noise = torch.randn(2, config.chunk_size, config.action_dim, generator=g)
    policy = Pi05Policy(config, weights, pi05.policy.make_engine("reference", weights), "cpu", torch.float32,
                        tokenizer=TinyTokenizer())
    as_lists = policy.sample_actions(list(images.unbind(1)), list(masks.unbind(1)), tokens, lang_mask, noise)
    mixed = policy.sample_actions(list(images.unbind(1)), masks, tokens, lang_mask, noise)
    stacked = policy.sample_actions(images, masks, tokens, lang_mask, noise)
    assert torch.equal(mixed, as_lists) and torch.equal(stacked, as_lists)
    swapped = policy.sample_actions(images, masks.T.contiguous(), tokens, lang_mask, noise)
    assert not torch.equal(swapped, as_lists)  # (the masks matter here, so the check above can fail)
    with pytest.raises(InputError, match="img_masks: missing"):
        policy.sample_actions(list(images.unbind(1)), None, tokens, lang_mask, noise)
