"""A Llama-style decoder: RMSNorm, rotary position embeddings, SwiGLU, grouped-query attention.

No parallel code lives here. Tensor parallelism shards the projection weights from the outside
(``workbench.parallel.tensor``); the model never assumes how many heads it holds, so every reshape
infers the local head count from the tensor (``view(b, s, -1, head_dim)``)::

    h   = x + Attention(RMSNorm(x))
    out = h + FeedForward(RMSNorm(h)),     FeedForward(x) = W2 (silu(W1 x) * W3 x)
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from workbench.config import ModelConfig
from workbench.kernels.dropout import dropout_add, residual_rng
from workbench.kernels.embedding import Embedding
from workbench.models.moe import MoEFeedForward


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * w"""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def rope_tables(head_dim: int, max_seq_len: int, theta: float,
                cfg: ModelConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape (max_seq_len, head_dim/2): angle(t, i) = t * inv_freq(i), where inv_freq(i) =
    theta^(-2i/head_dim), rescaled by ``cfg``'s RoPE scaling (:func:`rope_frequencies`) when it is given."""
    if cfg is None:
        inv_freq, scale = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)), 1.0
    else:
        inv_freq, scale = rope_frequencies(cfg)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
    return angles.cos() * scale, angles.sin() * scale


def rope_frequencies(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """``(inv_freq, attention_scale)`` of ``cfg``'s RoPE: the frequencies and cos/sin scale transformers'
    ``ROPE_INIT_FUNCTIONS`` compute for the same config (``workbench.hf_config`` reads it), op for op
    (inv_freq equals transformers' bit for bit: tests/clients/test_hf_export_client.py, every type)::

        default, dynamic   theta^(-2i/d)            (dynamic NTK equals it up to rope_original_max_seq_len,
                                                     which max_seq_len may not pass: workbench.config)
        linear             theta^(-2i/d) / factor
        llama3             low frequencies / factor, high ones kept, a smooth ramp between (Llama 3.1)
        yarn               extrapolated and interpolated frequencies blended by a ramp; cos/sin scaled by
                           attention_factor (default 0.1 ln(factor) + 1)
    """
    d, base, factor, t = cfg.head_dim, cfg.rope_theta, cfg.rope_factor, cfg.rope_type
    if t in ("default", "dynamic"):
        return 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float32) / d)), 1.0
    if t == "linear":
        return 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d)) / factor, 1.0
    orig = cfg.rope_original_max_seq_len or cfg.max_seq_len
    if t == "llama3":
        inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        low, high = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
        low_wavelen, high_wavelen = orig / low, orig / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (orig / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if t == "yarn":
        attention = cfg.rope_attention_factor
        if attention is None:
            attention = 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0

        def correction_dim(rotations: float) -> float:
            return (d * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

        lo = max(math.floor(correction_dim(cfg.rope_beta_fast)), 0)
        hi = min(math.ceil(correction_dim(cfg.rope_beta_slow)), d - 1)
        if lo == hi:
            hi += 0.001  # transformers' guard against a zero-width ramp
        pos_freqs = base ** (torch.arange(0, d, 2).float() / d)
        extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
        keep = 1 - torch.clamp((torch.arange(d // 2, dtype=torch.float32) - lo) / (hi - lo), 0, 1)
        return interpolation * (1 - keep) + extrapolation * keep, float(attention)
    raise ValueError(f"rope_type={t!r} has no frequencies here; choose one of default, linear, dynamic, llama3, yarn")


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) by angle(t, i). x: (batch, seq, heads, head_dim)."""
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return out.type_as(x)


class Attention(nn.Module):
    """Causal grouped-query attention: n_kv_heads key/value heads shared by n_heads query heads."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.n_rep = cfg.n_heads // cfg.n_kv_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        # The tables may be longer than s (they are sliced here, where the whole sequence is seen).
        q, k = apply_rope(q, cos[:s], sin[:s]), apply_rope(k, cos[:s], sin[:s])
        # (b, heads, s, head_dim); each kv head serves n_rep query heads
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        k = k.repeat_interleave(self.n_rep, dim=1)
        v = v.repeat_interleave(self.n_rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """With ``cfg.dropout = p`` in training, each residual add is ``residual + dropout(branch, p)``, fused
    and mask-free (``workbench.kernels.dropout``): its seed and offset come from the layer, the site and
    the training step's :func:`~workbench.kernels.dropout.dropout_scope`."""

    def __init__(self, cfg: ModelConfig, layer_id: int = 0):
        super().__init__()
        self.layer_id = layer_id
        self.dropout = cfg.dropout
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = MoEFeedForward(cfg, layer_id) if cfg.n_experts else FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = self._residual(x, self.attention(self.attention_norm(x), cos, sin), site=0)
        return self._residual(h, self.feed_forward(self.ffn_norm(h)), site=1)

    def _residual(self, residual: torch.Tensor, branch: torch.Tensor, site: int) -> torch.Tensor:
        if not (self.training and self.dropout > 0):
            return residual + branch
        return dropout_add(branch, residual, self.dropout, **residual_rng(self.layer_id, site, branch))


class Transformer(nn.Module):
    """tokens (batch, seq) -> logits (batch, seq, vocab)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        # nn.Embedding whose weight gradient is our deterministic index_put under the Triton backend
        self.tok_embeddings = Embedding(cfg.vocab_size, cfg.dim)
        # A ModuleDict with string keys keeps fully-qualified names stable ("layers.3.attention.wq")
        # and lets later stages drop layers without renumbering.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, i) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def init_weights(self, seed: int) -> None:
        """Deterministic init from ``seed`` alone, so every layout starts from identical weights."""
        with torch.no_grad():
            for name, p in self.named_parameters():
                p.copy_(initial_value(self.cfg, name, tuple(p.shape), seed))
            self.init_buffers()

    def init_buffers(self) -> None:
        """Recompute the rotary tables (not saved in checkpoints; uninitialised after ``to_empty``)."""
        cos, sin = rope_tables(self.cfg.head_dim, self.cfg.max_seq_len, self.cfg.rope_theta, self.cfg)
        with torch.no_grad():
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # A pipeline stage holds only some modules (torchtitan-style): without tok_embeddings the
        # input is already hidden states; without norm/output the hidden states are returned.
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        # Under sequence parallelism h holds a slice of the sequence; attention slices the rope
        # tables to the full length it sees after its input all-gather.
        for layer in self.layers.values():
            h = layer(h, self.rope_cos, self.rope_sin)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h


def _param_seed(seed: int, name: str) -> int:
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def initial_value(cfg: ModelConfig, name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The whole float32 initial value of parameter ``name`` (its name in the unparallelized model).

    A function of ``(seed, name)`` alone: each parameter draws from its own generator, so a rank that
    holds a few parameters, or a shard of one, computes its part without the rest of the model::

        norms          1
        wo, w2         N(0, (0.02 / sqrt(2 n_layers))^2)      scaled residual projections (GPT-2)
        everything     N(0, 0.02^2)
    """
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    std = 0.02
    if name.endswith(("wo.weight", "w2.weight", "experts.w2")):
        std = std / math.sqrt(2 * cfg.n_layers)
    gen = torch.Generator(device="cpu").manual_seed(_param_seed(seed, name))
    return torch.randn(shape, generator=gen, dtype=torch.float32).mul_(std)


def build_model(cfg: ModelConfig, *, seed: int | None = 0, device: str | torch.device = "cpu") -> Transformer:
    """Build on ``device``. On the meta device nothing is allocated and ``seed`` is ignored."""
    with torch.device(device):
        model = Transformer(cfg)
    if seed is not None and str(device) != "meta":
        model.init_weights(seed)
    return model
