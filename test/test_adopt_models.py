"""Small Gemma-like, SigLIP-like and action-expert-like models (plain torch, written here, no library
classes) used by the adoption tests, and the recognition tests of each known kind on them."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from flashrt_core.adopt.capture import run_with_capture
from flashrt_core.adopt.kinds import NotRecognised
from flashrt_core.adopt.kinds.attention import ATTENTION
from flashrt_core.adopt.kinds.mlp import GATED_MLP, GELU, MLP
from flashrt_core.adopt.kinds.norms import ADA_RMS_NORM, LAYER_NORM, RMS_NORM

# Odd sizes on purpose: nothing is a power of two except the head size.
WIDTH, HEADS, KV_HEADS, HEAD_DIM, HIDDEN, TOKENS, BATCH, COND = 48, 3, 1, 16, 80, 7, 2, 24


class GemmaNorm(nn.Module):
    def __init__(self, dim, eps=1e-6, one_plus=True):
        super().__init__()
        self.eps, self.one_plus = eps, one_plus
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        w = (1.0 + self.weight.float()) if self.one_plus else self.weight.float()
        return (y * w).type_as(x)


def rope(x, positions, theta=10000.0):
    half = x.shape[-1] // 2
    exponents = torch.arange(half, dtype=torch.float32, device=x.device) / half
    freqs = positions[:, None].float() / theta ** exponents
    cos, sin = freqs.cos(), freqs.sin()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class GQARopeAttention(nn.Module):
    """Causal GQA attention with RoPE computed inside: not a plain SDPA block, so only q/k/v merge."""

    def __init__(self):
        super().__init__()
        self.head_dim = HEAD_DIM
        self.q_proj = nn.Linear(WIDTH, HEADS * HEAD_DIM, bias=False)
        self.k_proj = nn.Linear(WIDTH, KV_HEADS * HEAD_DIM, bias=False)
        self.v_proj = nn.Linear(WIDTH, KV_HEADS * HEAD_DIM, bias=False)
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, WIDTH, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, -1, HEAD_DIM).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, HEAD_DIM).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, HEAD_DIM).transpose(1, 2)
        pos = torch.arange(t, device=x.device)
        q, k = rope(q, pos), rope(k, pos)
        k, v = k.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(HEAD_DIM)
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
        out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, -1)
        return self.o_proj(out)


class GeGLU(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj = nn.Linear(WIDTH, HIDDEN, bias=False)
        self.up_proj = nn.Linear(WIDTH, HIDDEN, bias=False)
        self.down_proj = nn.Linear(HIDDEN, WIDTH, bias=False)
        self.act_fn = nn.GELU(approximate="tanh")

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class GemmaLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm = GemmaNorm(WIDTH)
        self.self_attn = GQARopeAttention()
        self.post_attention_layernorm = GemmaNorm(WIDTH)
        self.mlp = GeGLU()

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class GemmaLike(nn.Module):
    def __init__(self, layers=2):
        super().__init__()
        self.layers = nn.ModuleList(GemmaLayer() for _ in range(layers))
        self.norm = GemmaNorm(WIDTH)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class SigAttention(nn.Module):
    """Bidirectional attention with biases, matmul-softmax-matmul; returns (out, weights) like eager HF."""

    def __init__(self, heads=4):
        super().__init__()
        self.num_heads, self.head_dim = heads, WIDTH // heads
        self.scale = self.head_dim ** -0.5
        self.k_proj, self.v_proj = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
        self.q_proj, self.out_proj = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, hidden_states, attention_mask=None):
        b, t, _ = hidden_states.shape
        shape = (b, t, self.num_heads, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        weights = torch.softmax(q @ k.transpose(-1, -2) * self.scale, dim=-1)
        out = (weights @ v).transpose(1, 2).reshape(b, t, WIDTH)
        return self.out_proj(out), weights


class SigMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.activation_fn, self.fc2 = nn.Linear(WIDTH, HIDDEN), nn.GELU("tanh"), nn.Linear(HIDDEN, WIDTH)

    def forward(self, x):
        return self.fc2(self.activation_fn(self.fc1(x)))


class SigLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer_norm1, self.layer_norm2 = nn.LayerNorm(WIDTH, eps=1e-6), nn.LayerNorm(WIDTH, eps=1e-6)
        self.self_attn, self.mlp = SigAttention(), SigMLP()

    def forward(self, x):
        h, _ = self.self_attn(hidden_states=self.layer_norm1(x), attention_mask=None)
        x = x + h
        return x + self.mlp(self.layer_norm2(x))


class SigLIPLike(nn.Module):
    def __init__(self, layers=2):
        super().__init__()
        self.patch_embed = nn.Linear(27, WIDTH)
        self.layers = nn.ModuleList(SigLayer() for _ in range(layers))
        self.post_layernorm = nn.LayerNorm(WIDTH, eps=1e-6)

    def forward(self, patches):
        x = self.patch_embed(patches)
        for layer in self.layers:
            x = layer(x)
        return self.post_layernorm(x)


class AdaNorm(nn.Module):
    """pi0.5-style AdaRMS: returns (rms(x) * (1 + scale) + shift, gate) from dense(cond)."""

    def __init__(self, dim, cond_dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.dense = nn.Linear(cond_dim, 3 * dim)

    def forward(self, x, cond=None):
        normed = x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        mod = self.dense(cond)
        if x.dim() == 3:
            mod = mod.unsqueeze(1)
        scale, shift, gate = mod.chunk(3, dim=-1)
        return (normed * (1 + scale.float()) + shift.float()).to(x.dtype), gate.to(x.dtype)


class ExpertLike(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = AdaNorm(WIDTH, COND), AdaNorm(WIDTH, COND)
        self.mlp = GeGLU()

    def forward(self, x, cond):
        h, gate = self.norm1(x, cond=cond)
        x = x + self.mlp(h) * gate
        h, _ = self.norm2(x, cond=cond)
        return h


def randomized(model: nn.Module, seed: int = 0) -> nn.Module:
    """Every parameter re-drawn (norm weights included, so (1 + w) and w differ), eval mode."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if p.dim() == 1 else 1.0 / math.sqrt(p.shape[-1])))
    return model.eval()


def gemma_like(seed=0):
    return randomized(GemmaLike(), seed)


def siglip_like(seed=1):
    return randomized(SigLIPLike(), seed)


def expert_like(seed=2):
    return randomized(ExpertLike(), seed)


def tokens(t=TOKENS, seed=3, width=WIDTH):
    return torch.randn(BATCH, t, width, generator=torch.Generator().manual_seed(seed))


def cond(seed=4):
    return torch.randn(BATCH, COND, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------ recognition by behaviour
def _calls(model, name, *inputs):
    _, cap = run_with_capture(model, lambda: model(*inputs), lambda m: True)
    return cap.calls[name]


@pytest.mark.parametrize("one_plus,form", [(True, "gemma (1+w)"), (False, "plain w")], ids=["gemma", "plain"])
def test_rms_norm_form_is_probed_not_named(one_plus, form):
    model = gemma_like()
    for m in model.modules():
        if isinstance(m, GemmaNorm):
            m.one_plus = one_plus
    plan = RMS_NORM.recognise(model.norm, _calls(model, "norm", tokens()))
    assert plan.detail.startswith(form)
    y = plan.make()(tokens(seed=9))
    torch.testing.assert_close(y, model.norm(tokens(seed=9)), rtol=1e-5, atol=1e-5)


def test_layer_norm_and_siglip_parts_recognised():
    model = siglip_like()
    x = torch.randn(BATCH, TOKENS, 27)
    assert LAYER_NORM.structure(model.post_layernorm)
    assert LAYER_NORM.recognise(model.post_layernorm, _calls(model, "post_layernorm", x)).detail.startswith("eps=1e-06")
    attn = ATTENTION.recognise(model.layers[0].self_attn, _calls(model, "layers.0.self_attn", x))
    assert "4/4 heads x 12, bidirectional" in attn.detail
    mlp = MLP.recognise(model.layers[0].mlp, _calls(model, "layers.0.mlp", x))
    assert "gelu_tanh" in mlp.detail
    assert GELU.recognise(model.layers[0].mlp.activation_fn,
                          _calls(model, "layers.0.mlp.activation_fn", x)).detail.startswith("tanh")


def test_gemma_parts_recognised_and_rope_attention_is_not_plain_sdpa():
    model = gemma_like()
    plan = GATED_MLP.recognise(model.layers[0].mlp, _calls(model, "layers.0.mlp", tokens()))
    assert plan.detail.startswith("gelu_tanh(gate_proj) * up_proj -> down_proj")
    assert ATTENTION.structure(model.layers[0].self_attn)
    with pytest.raises(NotRecognised, match="matches no known formula"):
        ATTENTION.recognise(model.layers[0].self_attn, _calls(model, "layers.0.self_attn", tokens()))


def test_ada_rms_recognised_and_a_plain_norm_is_not_ada():
    model = expert_like()
    plan = ADA_RMS_NORM.recognise(model.norm1, _calls(model, "norm1", tokens(), cond()))
    assert plan.detail.startswith("AdaRMS")
    assert not ADA_RMS_NORM.structure(gemma_like().norm)


def test_exact_gelu_told_from_tanh():
    model = siglip_like()
    model.layers[1].mlp.activation_fn = nn.GELU()
    x = torch.randn(BATCH, TOKENS, 27)
    plan = GELU.recognise(model.layers[1].mlp.activation_fn, _calls(model, "layers.1.mlp.activation_fn", x))
    assert plan.detail.startswith("exact")
    with pytest.raises(NotRecognised):
        GELU.recognise(nn.SiLU(), _calls(nn.Sequential(nn.SiLU()).eval(), "0", x))


def test_reference_models_are_sane():
    # Guard against a test model that is trivially constant (which would make parity checks meaningless).
    for out in (gemma_like()(tokens()), siglip_like()(torch.randn(BATCH, TOKENS, 27)), expert_like()(tokens(), cond())):
        assert out.std() > 0.1 and torch.isfinite(out).all()
    assert not torch.allclose(F.gelu(torch.tensor(1.5)), F.gelu(torch.tensor(1.5), approximate="tanh"), atol=0, rtol=0)
