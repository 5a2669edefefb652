"""Configuration: what to train (ModelConfig), how to lay it out (ParallelConfig), how to train (TrainConfig).

Every check happens here, before any process starts, and fails with one ``ValueError`` that names the
numbers involved and what to change::

    ValueError: tp=3 does not divide n_heads=8; choose tp in {1, 2, 4, 8}
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workbench.schema import check as _check_settings
from workbench.schema import setting, show

# Our custom ops' implementations (TrainConfig.kernels; workbench.kernels.backend reads them from here, so
# this module, and the command line's help built from it, load without torch).
KERNEL_BACKENDS = ("auto", "triton", "torch")

__all__ = [
    "ModelConfig",
    "ParallelConfig",
    "TrainConfig",
    "PRESETS",
    "resolve_model",
    "validate",
    "model_config_from_hf",
]


# Sanity limits (``Setting.limit``): far above any real job, low enough that a typo or a hostile config.json
# is refused in one line before it costs minutes of planning or gigabytes of memory. Each is named in the
# message, so a user with a real need sees which number to raise.
MAX_RANKS = 1 << 16  # world size (and so any one degree, nproc): 4x the largest published training job (16,384 GPUs)
MAX_LAYERS = 1024  # the deepest published decoders have ~130 layers
MAX_WIDTH = 1 << 17  # hidden size (and head counts): published models stay under 32,768
MAX_FFN = 1 << 20  # feed-forward width: published models stay under 65,536 (Llama 3 405B: 53,248)
MAX_VOCAB = 1 << 22  # 4,194,304 tokens: published vocabularies stay under 300,000
MAX_SEQ_LEN = 1 << 24  # 16,777,216 tokens per sequence
MAX_EXPERTS = 1 << 12  # published MoE models have up to a few hundred experts
MAX_BATCH = 1 << 24  # sequences per step
MAX_STEPS = 10 ** 9  # optimizer steps, and step counts like warm-up and checkpoint intervals
MAX_SEED = 2 ** 32 - 1  # seeds are mixed into generator seeds (seed * 1_000_003 + index) that must fit 64 bits
MAX_RANKS_WHY = f"workbench plans and runs up to {MAX_RANKS:,} ranks"
# RoPE base: the rotation frequencies are theta ** (-2i / head_dim) in float32; a base far past any model's (a
# few billion at most, for million-token contexts) turns every frequency but the first to 0, and a 400-digit
# one overflows inside torch.
MAX_ROPE_THETA = 1e12
MAX_ROPE_FACTOR = 1e6  # RoPE scaling factors (linear, llama3, yarn): published models stretch contexts up to ~64x
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")  # workbench.models.llama.rope_frequencies
MAX_AUX_COEF = 100.0  # the MoE load-balancing loss weight: past this it outweighs the language-model loss


def _divisor_list(n: int) -> list[int]:
    """The divisors of ``n`` in order, in O(sqrt(n)): n may be a batch of 2^24 sequences."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _divisors(n: int) -> str:
    return "{" + ", ".join(map(str, _divisor_list(n))) + "}"


class _JsonMixin:
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[arg-type]

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, data: dict[str, Any]):
        if not isinstance(data, dict):
            raise ValueError(f"{cls.__name__} needs an object of fields, not {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(map(str, set(data) - names))
        if unknown:
            more = f" and {len(unknown) - 10} more" if len(unknown) > 10 else ""
            raise ValueError(
                f"unknown {cls.__name__} field(s) {[k[:60] for k in unknown[:10]]}{more}; "
                f"known fields are {sorted(names)}"
            )
        return cls(**data)


# --------------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelConfig(_JsonMixin):
    """A Llama-architecture decoder: RMSNorm, RoPE, SwiGLU feed-forward, grouped-query attention."""

    name: str = setting("custom", "the model's name (presets: their own)", cli=False)
    dim: int = setting(128, "hidden size", min=1, limit=MAX_WIDTH, limit_why="published models stay under "
                       "32,768", cli=False)
    n_layers: int = setting(4, "transformer blocks", min=1, limit=MAX_LAYERS,
                            limit_why="the deepest published decoders have ~130", cli=False)
    n_heads: int = setting(8, "attention heads", min=1, limit=MAX_WIDTH, cli=False)
    n_kv_heads: int = setting(4, "key/value heads (grouped-query attention)", min=1, limit=MAX_WIDTH, cli=False)
    ffn_hidden: int = setting(384, "feed-forward width (SwiGLU)", min=1, limit=MAX_FFN,
                              limit_why="published models stay under 65,536", cli=False)
    vocab_size: int = setting(256, "vocabulary size", min=1, limit=MAX_VOCAB,
                              limit_why="published vocabularies stay under 300,000", cli=False)
    max_seq_len: int = setting(512, "longest sequence (RoPE table)", min=1, limit=MAX_SEQ_LEN, cli=False)
    norm_eps: float = setting(1e-5, "RMSNorm epsilon", min=0, max=1, exclusive_min=True,
                              expect="a number in (0, 1], e.g. 1e-5", cli=False)
    rope_theta: float = setting(10000.0, "RoPE base", min=0, exclusive_min=True, limit=MAX_ROPE_THETA,
                                limit_why="published models use 10,000 to a few billion", cli=False)
    tie_embeddings: bool = setting(False, "share tok_embeddings' weight with the output layer", cli=False)
    # Mixture of experts: 0 = dense SwiGLU. Otherwise every layer's feed-forward is n_experts SwiGLU
    # experts of ffn_hidden each, and a router sends each token to its top_k experts.
    n_experts: int = setting(0, "experts per layer", min=0, limit=MAX_EXPERTS, expect="0 (dense) or a positive "
                             "integer", limit_why="published MoE models have a few hundred", cli=False)
    top_k: int = setting(2, "experts per token", min=1, limit=MAX_EXPERTS, cli=False)
    router_aux_coef: float = setting(0.01, "load-balancing loss weight", min=0, limit=MAX_AUX_COEF,
                                     limit_why="published MoE models weight it 0.001 to 0.1", cli=False)
    # Residual dropout: each block's two residual adds are residual + dropout(branch, p) in training,
    # fused and mask-free (workbench.kernels.dropout); 0 keeps the plain adds.
    dropout: float = setting(0.0, "residual dropout probability (the fused dropout+add kernel)", min=0, max=1,
                             exclusive_max=True, expect="a probability in [0, 1), e.g. 0.1",
                             off="0 turns it off", metavar="P")
    # RoPE scaling, as Hugging Face configs give it (``rope_parameters`` / ``rope_scaling``; read by
    # workbench.hf_config): the rotary frequencies of workbench.models.llama.rope_frequencies.
    # "dynamic" (NTK) equals "default" for every sequence up to rope_original_max_seq_len, so max_seq_len
    # may not pass it (the tables here are fixed; transformers recomputes them for longer inputs).
    rope_type: str = setting("default", "RoPE frequency scaling", choices=ROPE_TYPES, cli=False)
    rope_factor: float = setting(1.0, "RoPE scaling factor (linear, dynamic, llama3, yarn)", min=1,
                                 limit=MAX_ROPE_FACTOR, limit_why="published models scale contexts up to ~64x",
                                 cli=False)
    rope_low_freq_factor: float = setting(1.0, "llama3 RoPE: low_freq_factor", min=0, exclusive_min=True,
                                          limit=MAX_ROPE_FACTOR, cli=False)
    rope_high_freq_factor: float = setting(4.0, "llama3 RoPE: high_freq_factor", min=0, exclusive_min=True,
                                           limit=MAX_ROPE_FACTOR, cli=False)
    rope_original_max_seq_len: int | None = setting(None, "the pre-scaling context length (llama3, yarn, dynamic)",
                                                    min=1, limit=MAX_SEQ_LEN, none="max_seq_len", cli=False)
    rope_beta_fast: float = setting(32.0, "yarn RoPE: beta_fast", min=0, exclusive_min=True,
                                    limit=MAX_ROPE_FACTOR, cli=False)
    rope_beta_slow: float = setting(1.0, "yarn RoPE: beta_slow", min=0, exclusive_min=True, limit=MAX_ROPE_FACTOR,
                                    cli=False)
    rope_attention_factor: float | None = setting(None, "yarn RoPE: the cos/sin scale", min=0, exclusive_min=True,
                                                  limit=MAX_ROPE_FACTOR, none="0.1 ln(rope_factor) + 1", cli=False)

    settings_group = "model"  # the argparse group of the settings above (not a field)

    def __post_init__(self) -> None:
        _check_settings(self)
        if self.n_experts and not self.top_k <= self.n_experts:
            raise ValueError(f"top_k={self.top_k!r} must be between 1 and n_experts={self.n_experts}")
        if self.dim % self.n_heads:
            raise ValueError(
                f"n_heads={self.n_heads} does not divide dim={self.dim}; "
                f"choose n_heads in {_divisors(self.dim)}"
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_kv_heads={self.n_kv_heads} does not divide n_heads={self.n_heads}; "
                f"choose n_kv_heads in {_divisors(self.n_heads)}"
            )
        if (self.dim // self.n_heads) % 2:
            raise ValueError(
                f"head_dim={self.dim // self.n_heads} (dim/n_heads) must be even for rotary embeddings"
            )
        _check_rope(self)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def n_params(self) -> int:
        """Exact parameter count of the model this config builds."""
        kv = self.n_kv_heads * self.head_dim
        attn = self.dim * self.dim * 2 + self.dim * kv * 2
        ffn = 3 * self.dim * self.ffn_hidden
        if self.n_experts:
            ffn = self.n_experts * ffn + self.dim * self.n_experts  # experts + router
        per_layer = attn + ffn + 2 * self.dim
        emb = self.vocab_size * self.dim
        head = 0 if self.tie_embeddings else self.vocab_size * self.dim
        return self.n_layers * per_layer + emb + head + self.dim

    @classmethod
    def from_hf_config(cls, path_or_dict: str | Path | dict[str, Any], name: str | None = None) -> "ModelConfig":
        """Read a Hugging Face ``config.json`` of a Llama-architecture model (transformers 4.x or 5.x), no
        weights: :func:`workbench.hf_config.model_config_from_hf`, which refuses in one ValueError any key
        whose math this model does not compute."""
        return model_config_from_hf(path_or_dict, name=name)


def model_config_from_hf(path_or_dict: str | Path | dict[str, Any], name: str | None = None) -> ModelConfig:
    """The ModelConfig of a Hugging Face ``config.json`` (path, directory or parsed dict) as transformers 4.x
    or 5.x writes it (:mod:`workbench.hf_config`): RoPE scaling from ``rope_parameters`` or ``rope_scaling``,
    missing keys at LlamaConfig's defaults. One ValueError naming the file and the key for a value out of
    range, a value this model does not compute (``attention_bias: true``, another ``head_dim``, ...) or an
    unknown key; nothing is dropped in silence."""
    from workbench.hf_config import HF_KEYS, hf_model_fields

    source, fields = hf_model_fields(path_or_dict, name=name)
    try:
        return ModelConfig.from_dict(fields)
    except (TypeError, ValueError) as e:  # the setting's own message, in the file's words: hidden_size=..., not dim=...
        msg = str(e)
        field_name = msg.split("=", 1)[0]
        if field_name in HF_KEYS and (" must be " in msg or " is over the limit " in msg):  # one field's own
            msg = re.sub(rf"\b{field_name}\b", HF_KEYS[field_name], msg)
        raise ValueError(f"{source}: {msg}") from None


def _check_rope(cfg: "ModelConfig") -> None:
    """The RoPE scaling fields agree with each other (their ranges are the schema's)."""
    t, orig = cfg.rope_type, cfg.rope_original_max_seq_len
    if t == "default" and cfg.rope_factor != 1:
        raise ValueError(f"rope_factor={cfg.rope_factor} needs a rope_type that scales; set rope_type to one of "
                         f"{list(ROPE_TYPES[1:])} or rope_factor=1")
    if t == "llama3" and not cfg.rope_high_freq_factor > cfg.rope_low_freq_factor:
        raise ValueError(f"rope_high_freq_factor={cfg.rope_high_freq_factor} must be greater than "
                         f"rope_low_freq_factor={cfg.rope_low_freq_factor} (llama3 RoPE)")
    if t == "yarn" and not cfg.rope_beta_fast >= cfg.rope_beta_slow:
        raise ValueError(f"rope_beta_fast={cfg.rope_beta_fast} must be at least rope_beta_slow={cfg.rope_beta_slow} "
                         "(yarn RoPE)")
    if t == "dynamic" and orig is not None and cfg.max_seq_len > orig:
        raise ValueError(f"max_seq_len={cfg.max_seq_len} passes rope_original_max_seq_len={orig}: dynamic RoPE "
                         "recomputes its frequencies for each longer sequence, which workbench's fixed tables do "
                         f"not; choose max_seq_len <= {orig}")


def _read_json_object(p: Path, what: str) -> Any:
    """A run's config.json through the safe-reader layer (:mod:`workbench.safeio`): a regular file of at
    most ``CONFIG_MAX`` bytes (a FIFO would block the open, /dev/zero never ends), UTF-8, not nested past
    the parser's depth; one ValueError naming the file otherwise. (A Hugging Face config.json goes through
    :mod:`workbench.hf_config`.)"""
    from workbench.safeio import CONFIG_MAX, read_json

    return read_json(p, CONFIG_MAX, "config.json", fix="fix or re-download the file", fix_missing=f"pass {what}")


PRESETS: dict[str, ModelConfig] = {
    # ~1M parameters: trains on a laptop CPU in seconds. Byte-level vocabulary.
    "tiny": ModelConfig("tiny", dim=128, n_layers=5, n_heads=8, n_kv_heads=4, ffn_hidden=384, vocab_size=256, max_seq_len=512),
    # ~25M parameters: still CPU-trainable, big enough for memory and throughput to be interesting.
    "small": ModelConfig("small", dim=512, n_layers=8, n_heads=8, n_kv_heads=4, ffn_hidden=1536, vocab_size=256, max_seq_len=1024),
    # Llama-2 shapes, for planning (they are far too large to train on a CPU).
    "llama-7b": ModelConfig("llama-7b", dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_hidden=11008, vocab_size=32000, max_seq_len=4096),
    "llama-70b": ModelConfig("llama-70b", dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_hidden=28672, vocab_size=32000, max_seq_len=4096),
    # Mixture of experts: a CPU-trainable one, and Mixtral-8x7B shapes for planning.
    "tiny-moe": ModelConfig("tiny-moe", dim=128, n_layers=4, n_heads=8, n_kv_heads=4, ffn_hidden=256, vocab_size=256, max_seq_len=512, n_experts=4, top_k=2),
    "moe-8x7b": ModelConfig("moe-8x7b", dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden=14336, vocab_size=32000, max_seq_len=4096, n_experts=8, top_k=2, rope_theta=1e6),
}


def resolve_model(model: "str | Path | ModelConfig | dict") -> ModelConfig:
    """A preset name, a path to a Hugging Face config.json, a dict of ModelConfig fields, or a ModelConfig."""
    if isinstance(model, ModelConfig):
        return model
    if isinstance(model, dict):
        return ModelConfig.from_dict(model)
    text = str(model)
    if text in PRESETS:
        return PRESETS[text]
    if text.endswith(".json") or Path(text).is_dir():
        return ModelConfig.from_hf_config(text)
    raise ValueError(f"unknown model {text!r}; choose a preset in {sorted(PRESETS)} or pass a config.json path")


# --------------------------------------------------------------------------------------------------
# Parallel layout
# --------------------------------------------------------------------------------------------------

# GPipeLean: GPipe that frees each microbatch's stage outputs once sent and its buffers once backward ran.
PP_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "GPipeLean")
PP_INTERLEAVED_STAGES_PER_RANK = 2  # virtual stages per pp rank under Interleaved1F1B
ZERO_STAGES = (0, 1, 2, 3)
# The device mesh's dimensions, outermost first: the order ranks are laid out in (ParallelConfig.rank_coords).
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


@dataclass(frozen=True)
class ParallelConfig(_JsonMixin):
    """Degrees of each parallelism. ``world_size`` is their product (ep borrows from dp_shard).

    ``dp_shard=-1`` means "whatever is left": it is resolved against ``nproc`` by :meth:`resolved`.
    """

    settings_group = "parallel layout"  # the argparse group of these settings (not a field)

    dp_replicate: int = setting(1, "replicated data-parallel degree (DDP / HSDP)", min=1, limit=MAX_RANKS,
                                limit_why=MAX_RANKS_WHY)
    dp_shard: int = setting(-1, "sharded data-parallel degree (FSDP2)", min=1,
                            special={-1: "the rest of nproc"}, limit=MAX_RANKS, limit_why=MAX_RANKS_WHY)
    tp: int = setting(1, "tensor-parallel degree", min=1, limit=MAX_RANKS, limit_why=MAX_RANKS_WHY)
    pp: int = setting(1, "pipeline-parallel degree (stages over ranks, outermost)", min=1, limit=MAX_RANKS,
                      limit_why=MAX_RANKS_WHY)
    ep: int = setting(1, "expert-parallel degree (MoE models; taken from dp_shard)", min=1, limit=MAX_RANKS,
                      limit_why=MAX_RANKS_WHY)
    sequence_parallel: bool = setting(False, "sequence parallel (needs tp > 1)", flag="--sp",
                                      aliases=("--sequence-parallel",))
    pp_schedule: str = setting("1F1B", "pipeline schedule (GPipeLean: GPipe that frees outputs and buffers "
                               "early)", choices=PP_SCHEDULES)
    microbatches: int | None = setting(None, "pipeline microbatches per step", min=1, none="pp", limit=MAX_BATCH)
    zero: int = setting(3, "ZeRO stage of dp_shard: 0 DDP, 1 +sharded optimizer state, 2 FSDP2 keeping params "
                        "gathered from forward to backward, 3 FSDP2 resharding after forward",
                        choices=ZERO_STAGES, choose="a ZeRO stage in")

    def __post_init__(self) -> None:
        _check_settings(self)
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence_parallel needs tp > 1; set tp=2 or more, or turn sequence_parallel off")
        fixed = self.dp_replicate * self.tp * self.pp
        world = fixed * (1 if self.dp_shard == -1 else self.dp_shard)
        if world > MAX_RANKS:  # each degree is within the limit, their product need not be
            what = "dp_replicate*tp*pp" if self.dp_shard == -1 else "dp_replicate*dp_shard*tp*pp"
            raise ValueError(f"{what}={world:,} ranks is over the limit of {MAX_RANKS:,} ({MAX_RANKS_WHY}); "
                             "choose smaller degrees")

    def resolved(self, nproc: int | None = None) -> "ParallelConfig":
        """Fill in ``dp_shard=-1`` from ``nproc`` (default: 1). Raises if the degrees cannot fill nproc."""
        if nproc is not None and (isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1):
            raise ValueError(f"nproc={show(nproc)} must be a positive integer (the processes of the job)")
        if nproc is not None and nproc > MAX_RANKS:
            raise ValueError(f"nproc={nproc} is over the limit of {MAX_RANKS:,} ({MAX_RANKS_WHY}); "
                             f"choose nproc <= {MAX_RANKS}")
        fixed = self.dp_replicate * self.tp * self.pp
        if self.dp_shard == -1:
            n = fixed if nproc is None else nproc
            if n % fixed:
                raise ValueError(
                    f"nproc={n} is not divisible by dp_replicate*tp*pp={fixed}; "
                    f"choose nproc as a multiple of {fixed}"
                )
            return dataclasses.replace(self, dp_shard=n // fixed)
        if nproc is not None and nproc != self.world_size:
            raise ValueError(
                f"nproc={nproc} but dp_replicate*dp_shard*tp*pp={self.world_size}; "
                f"set nproc={self.world_size} or change the degrees"
            )
        return self

    @property
    def world_size(self) -> int:
        if self.dp_shard == -1:
            raise ValueError("dp_shard=-1 is unresolved; call ParallelConfig.resolved(nproc) first")
        return self.dp_replicate * self.dp_shard * self.tp * self.pp

    @property
    def dp(self) -> int:
        """Number of data-parallel ranks: each sees a different slice of the global batch."""
        return self.dp_replicate * self.dp_shard

    @property
    def pp_stages_per_rank(self) -> int:
        """Pipeline stages each pp rank holds: 2 (virtual stages) under Interleaved1F1B, else 1."""
        return PP_INTERLEAVED_STAGES_PER_RANK if self.pp_schedule == "Interleaved1F1B" else 1

    @property
    def pp_microbatches(self) -> int:
        """Pipeline microbatches per step. Default (microbatches=None): pp, the fewest that fill 1F1B."""
        return self.microbatches or self.pp

    @property
    def mesh_shape(self) -> dict[str, int]:
        """Named mesh dimensions with degree > 1, outermost first (the order ranks are laid out in)."""
        dims = {"pp": self.pp, "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "tp": self.tp}
        return {k: v for k, v in dims.items() if v > 1}

    def rank_coords(self, rank: int) -> tuple[int, int, int, int]:
        """Mesh coordinates ``(pp, dp_replicate, dp_shard, tp)`` of ``rank``: the one rank layout rule.

        The mesh is row-major with pp outermost: ``rank = ((p * dp_replicate + r) * dp_shard + s) * tp + t``.
        """
        world = self.world_size
        if not 0 <= rank < world:
            raise ValueError(f"rank={rank} is outside the {world} ranks of {self.describe()}; "
                             f"choose 0..{world - 1}")
        rank, t = divmod(rank, self.tp)
        rank, s = divmod(rank, self.dp_shard)
        p, r = divmod(rank, self.dp_replicate)
        return p, r, s, t

    def all_rank_coords(self) -> Any:
        """Every rank's :meth:`rank_coords` at once: an int64 array of shape ``(world_size, 4)``."""
        import numpy as np

        shape = tuple(getattr(self, d) for d in MESH_DIMS)
        return np.stack(np.unravel_index(np.arange(self.world_size), shape), axis=1).astype(np.int64)

    def describe(self) -> str:
        parts = [f"{k}={v}" for k, v in self.mesh_shape.items()]
        if self.ep > 1:  # not a mesh dimension of its own: it splits dp_shard
            parts.append(f"ep={self.ep}")
        if self.sequence_parallel:
            parts.append("sp")
        return " x ".join(parts) if parts else "single process"


# --------------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------------

DTYPES = ("float32", "bfloat16")
MIXED_PRECISION = ("none", "bf16")
AC_MODES = ("none", "full", "selective", "op")  # workbench.parallel.checkpointing.AC_POLICIES
DATASETS = ("synthetic", "text")
DEVICES = ("auto", "cuda", "cpu")
OPTIM_IMPLS = ("auto", "fused", "foreach", "loop")


@dataclass(frozen=True)
class TrainConfig(_JsonMixin):
    """How to train. ``global_batch`` is in sequences and does not depend on the layout."""

    settings_group = "training"  # the argparse group of these settings (not a field)

    steps: int = setting(20, "optimizer steps", min=1, limit=MAX_STEPS)
    global_batch: int = setting(8, "sequences per step, whatever the layout", min=1, limit=MAX_BATCH)
    micro_batch: int | None = setting(None, "sequences per data-parallel rank per forward (gradient accumulation)",
                                      min=1, none="global_batch / dp, no accumulation", limit=MAX_BATCH)
    seq_len: int = setting(64, "tokens per sequence", min=1, limit=MAX_SEQ_LEN)
    lr: float = setting(3e-3, "peak learning rate (AdamW)", min=0, exclusive_min=True)
    weight_decay: float = setting(0.1, "AdamW weight decay", min=0)
    warmup_steps: int = setting(0, "linear learning-rate warm-up steps", min=0, limit=MAX_STEPS)
    grad_clip: float = setting(1.0, "clip the global gradient norm to this", min=0, off="0 turns clipping off",
                               expect=">= 0")
    seed: int = setting(0, "seed of the model initialisation and the data order", min=0, max=MAX_SEED)
    dtype: str = setting("float32", "parameter (master weight) dtype", choices=DTYPES)
    data: str = setting("synthetic", "training data", choices=DATASETS)
    mixed_precision: str = setting("none", "bf16: compute in bfloat16, keep fp32 master weights, gradients reduced "
                                   "and Adam state in fp32", choices=MIXED_PRECISION)
    activation_checkpointing: str = setting("none", "recompute activations in backward: every block whole (full), "
                                            "every ac_every-th block whole (selective: layer-level), or op-level "
                                            "in every block (op: torchtitan's save list: matmul outputs but every "
                                            "second, attention and reduce-scatter outputs)", choices=AC_MODES,
                                            flag="--ac",
                                            aliases=("--activation-checkpointing",))
    ac_every: int = setting(2, "selective (layer-level) checkpointing: every K-th block", min=1, metavar="K",
                            limit=MAX_LAYERS)
    kernels: str = setting("auto", "our custom ops' implementation: triton kernels, the torch reference, or "
                           "auto (Triton on CUDA, torch elsewhere); the choice made is recorded in config.json",
                           choices=KERNEL_BACKENDS)
    device: str = setting("auto", "where the ranks train: cuda (NCCL, one GPU per rank), cpu (gloo), or auto "
                          "(cuda when this machine has a GPU for every local rank, cpu when it has none; it "
                          "refuses between); the choice made is recorded in config.json", choices=DEVICES,
                          group="device")
    compile: bool = setting(False, "torch.compile each transformer block (as torchtitan does); composes with "
                            "FSDP, TP and activation checkpointing. The first step compiles", group="device")
    optim_impl: str = setting("auto", "AdamW's implementation: fused kernels, foreach, or the per-parameter loop; "
                              "auto: fused on CUDA where every parameter shares one layout, the loop elsewhere",
                              choices=OPTIM_IMPLS, flag="--optim-impl", group="device")
    tf32: bool = setting(True, "let float32 matmuls and convolutions use TF32 tensor cores on CUDA "
                         "(--no-tf32 for full fp32)", group="device")
    peak_tflops: float | None = setting(None, "the device's peak dense TFLOP/s per rank, for MFU", min=0,
                                        exclusive_min=True, none="looked up from the GPU's name; none on CPU",
                                        group="device")
    spmd_rules: bool = setting(True, "install workbench's DTensor sharding rules (workbench.spmd.install) in "
                               "the job; off: torch's own rules")
    memory: bool = setting(False, "record a memory timeline of every rank into RUN_DIR/memory (categories, phases, "
                           "steps; `workbench memory show RUN_DIR`)")
    profile: int | None = setting(None, "trace STEPS steps of every rank with torch.profiler, after one warm-up "
                                  "step, into RUN_DIR/profile (CPU ops and collectives; with a GPU also CUDA kernels "
                                  "and NCCL); `workbench time show RUN_DIR`", min=1, const=3, none="off",
                                  metavar="STEPS", limit=MAX_STEPS,
                                  expect="a positive number of steps to trace (e.g. --profile 3, or --profile "
                                         "alone for 3; leave it out to trace nothing)")
    # Checkpoints (workbench.checkpoint). keep: the newest K checkpoints (None = all), plus every
    # keep_every-th step.
    ckpt_every: int = setting(0, "save a checkpoint every N steps", min=0, off="0 turns it off",
                              metavar="N", group="checkpoints", limit=MAX_STEPS)
    ckpt_async: bool = setting(False, "write checkpoints in the background after a host copy", group="checkpoints")
    zero_stall: bool = setting(False, "snapshot to host memory every step, persist every ckpt_every steps",
                               group="checkpoints")
    keep: int | None = setting(None, "keep the newest K checkpoints", min=1, none="all", metavar="K",
                               group="checkpoints", limit=MAX_STEPS)
    keep_every: int = setting(0, "also keep every N-th step forever", min=0, off="0 turns it off", metavar="N",
                              group="checkpoints", limit=MAX_STEPS)
    ckpt_quant: str = setting("none", "store Adam's moments quantized with block-wise scales (int8: the "
                              "optimizer state in about 0.26 of its fp32 bytes); resuming dequantizes",
                              choices=("none", "int8", "fp8"), group="checkpoints")
    ckpt_dir: str | None = setting(None, "checkpoint directory", none="RUN_DIR/checkpoints", group="checkpoints")
    resume: str | None = setting(None, "resume from a checkpoint: a path, or alone the newest complete one; any "
                                 "layout", const="latest", metavar="PATH|latest", group="checkpoints")
    init_from: str | None = setting(None, "start from the weights of a Hugging Face save_pretrained directory "
                                    "(safetensors, any layout; its config.json must match the model); optimizer "
                                    "and step start fresh", none="the seeded initialisation", metavar="HF_DIR",
                                    group="checkpoints")
    ema: float = setting(0.0, "keep and save an exponential moving average of the weights with this decay",
                         min=0, max=1, exclusive_max=True, expect="a decay in [0, 1), e.g. 0.999",
                         off="0 turns it off", metavar="DECAY", group="checkpoints")

    def __post_init__(self) -> None:
        _check_settings(self)
        if self.mixed_precision == "bf16" and self.dtype != "float32":
            raise ValueError(
                f"mixed_precision='bf16' keeps float32 master weights, but dtype={self.dtype!r}; "
                "set dtype='float32' (or mixed_precision='none' for pure bfloat16 training)"
            )
        if self.compile and self.memory:
            raise ValueError("memory=True records every operator through a dispatch mode, which torch.compile "
                             "cannot trace; drop --compile to record a memory timeline (or --memory to compile)")
        if self.init_from is not None and self.resume is not None:
            raise ValueError("init_from and resume both set: a resumed run takes its weights from the checkpoint; "
                             "drop --init-from to resume, or --resume to start from the HF weights")
        if self.profile is not None and self.profile + 1 > self.steps:
            fix = (f"pass --profile {self.steps - 1} or fewer, or " if self.steps > 1 else "pass ")
            raise ValueError(f"profile={self.profile} traces {self.profile} step(s) after 1 warm-up step, but the run "
                             f"has steps={self.steps}; {fix}--steps {self.profile + 1} or more")
        if (self.ckpt_async or self.zero_stall) and not self.ckpt_every:
            raise ValueError("ckpt_async/zero_stall need periodic checkpoints; set ckpt_every N (e.g. --ckpt-every 100)")

    def grad_accum(self, dp: int) -> int:
        micro = self.micro_batch or self.global_batch // dp
        return self.global_batch // (micro * dp)

    def local_micro_batch(self, dp: int) -> int:
        return self.micro_batch or self.global_batch // dp


# --------------------------------------------------------------------------------------------------
# Cross-checks: everything that depends on two configs at once
# --------------------------------------------------------------------------------------------------


def _validate_zero(parallel: ParallelConfig) -> None:
    """ZeRO 0/1 run DDP over the dp_shard ranks: plain tensors on a 1-D group, nothing else sharded."""
    z = parallel.zero
    if z >= 2 or parallel.dp_shard <= 1:
        return  # FSDP2 handles every combination; with dp_shard=1 there is nothing to shard
    if parallel.tp > 1:
        raise ValueError(
            f"zero={z} (DDP) cannot replicate tensor-parallel DTensor parameters (tp={parallel.tp}); "
            "use zero=2 or zero=3 with tp"
        )
    if parallel.dp_replicate > 1:
        raise ValueError(
            f"zero={z} applies to dp_shard and does not combine with dp_replicate={parallel.dp_replicate}; "
            f"use dp_replicate=1 dp_shard={parallel.dp}, or zero=2/3 for HSDP"
        )
    if parallel.ep > 1:
        raise ValueError(f"zero={z} (DDP) does not support expert parallelism (ep={parallel.ep}); use zero=2 or 3")


def _validate_pp(model: ModelConfig, parallel: ParallelConfig, train: TrainConfig | None) -> None:
    """Pipeline checks: enough layers per stage, enough microbatches, and a batch they divide."""
    pp, sched, mb = parallel.pp, parallel.pp_schedule, parallel.pp_microbatches
    if pp == 1:
        if parallel.microbatches is not None:
            raise ValueError(f"microbatches={parallel.microbatches} applies to pipeline parallelism; set pp > 1 "
                             "or drop microbatches")
        return
    stages = pp * parallel.pp_stages_per_rank
    if pp > model.n_layers:
        raise ValueError(f"pp={pp} exceeds n_layers={model.n_layers}; choose pp <= {model.n_layers}")
    if stages > model.n_layers:
        raise ValueError(
            f"pp_schedule={sched!r} runs {parallel.pp_stages_per_rank} stages per rank, {stages} stages for pp={pp}, "
            f"but n_layers={model.n_layers}; choose pp <= {model.n_layers // parallel.pp_stages_per_rank} "
            "or pp_schedule='1F1B'"
        )
    if model.n_experts:
        raise ValueError(f"pp={pp} with a mixture-of-experts model ({model.name!r}, n_experts={model.n_experts}) "
                         "is not supported yet (the router loss is not pipelined); use pp=1")
    if model.tie_embeddings:
        raise ValueError(f"pp={pp} puts tok_embeddings and output on different stages, so tied embeddings "
                         f"cannot be shared; use a model with tie_embeddings=False or pp=1")
    if sched in ("1F1B", "Interleaved1F1B") and mb < pp:
        raise ValueError(f"microbatches={mb} < pp={pp}: {sched} needs at least pp microbatches; "
                         f"set --microbatches {pp}")
    if sched == "Interleaved1F1B" and mb % max(1, mb // pp):
        raise ValueError(f"microbatches={mb}: Interleaved1F1B runs rounds of pp={pp} microbatches and needs "
                         f"microbatches to be a multiple of {max(1, mb // pp)}; set --microbatches {mb // pp * pp}")
    if train is None or parallel.dp_shard == -1:
        return
    if train.micro_batch is not None:
        raise ValueError(f"micro_batch={train.micro_batch} with pp={pp}: the pipeline splits each batch into "
                         "microbatches itself; drop micro_batch and set microbatches")
    local = train.global_batch // parallel.dp
    if train.global_batch % parallel.dp == 0 and local % mb:
        ok = [d for d in _divisor_list(local) if sched in ("GPipe", "GPipeLean") or d >= pp]
        raise ValueError(f"global_batch={train.global_batch} over dp={parallel.dp} gives {local} sequences per "
                         f"pipeline, not divisible by microbatches={mb}; choose microbatches in "
                         "{" + ", ".join(map(str, ok)) + "}")


def _validate_moe(model: ModelConfig, parallel: ParallelConfig) -> None:
    """Expert parallelism: ep ranks are carved out of dp_shard, each owning n_experts/ep experts."""
    ep = parallel.ep
    if model.n_experts and parallel.sequence_parallel:
        raise ValueError(f"sequence_parallel with a mixture-of-experts model ({model.name}) is not available; "
                         "turn sequence_parallel off (tp without sp works)")
    if model.n_experts and parallel.pp > 1:
        raise ValueError(f"pp={parallel.pp} with a mixture-of-experts model ({model.name}) is not available "
                         "(the router loss is not carried across stages); use pp=1")
    if ep == 1:
        return
    if not model.n_experts:
        raise ValueError(f"ep={ep} needs a mixture-of-experts model (n_experts > 0); choose a preset like tiny-moe")
    if model.n_experts % ep:
        raise ValueError(f"ep={ep} does not divide n_experts={model.n_experts}; "
                         f"choose ep in {_divisors(model.n_experts)}")
    if parallel.dp_shard != -1 and parallel.dp_shard % ep:
        raise ValueError(f"ep={ep} does not divide dp_shard={parallel.dp_shard}: expert-parallel ranks are taken "
                         f"from the sharded data-parallel ranks; choose dp_shard as a multiple of {ep}")


def _validate_torch(parallel: ParallelConfig, train: TrainConfig | None) -> None:
    """Settings whose code needs a private torch API the running torch may lack (workbench.compat)."""
    from workbench import compat

    if parallel.pp > 1 and parallel.pp_schedule == "GPipeLean":
        compat.require("pipeline.lean_schedule", "pp_schedule='GPipeLean'", "choose pp_schedule='GPipe'")
    if train is not None and train.activation_checkpointing != "none":
        compat.require("train.activation_checkpointing",
                       f"activation_checkpointing={train.activation_checkpointing!r}",
                       "set activation_checkpointing='none' (--ac none)")
    if train is not None and train.ema:
        compat.require("checkpoint.ema", f"ema={train.ema}", "set ema=0 (--ema 0)")


def validate(model: ModelConfig, parallel: ParallelConfig, train: TrainConfig | None = None) -> None:
    """Raise one ValueError naming the problem and the fix, or return None if the combination works."""
    tp = parallel.tp
    tp_dims = {"n_heads": model.n_heads, "n_kv_heads": model.n_kv_heads, "ffn_hidden": model.ffn_hidden,
               "vocab_size": model.vocab_size}
    common = math.gcd(*tp_dims.values())
    for name, size in tp_dims.items():
        if size % tp:
            raise ValueError(f"tp={tp} does not divide {name}={size}; choose tp in {_divisors(common)}")
    _validate_pp(model, parallel, train)
    _validate_moe(model, parallel)
    _validate_zero(parallel)
    _validate_torch(parallel, train)
    if train is None:
        return
    if train.seq_len > model.max_seq_len:
        raise ValueError(
            f"seq_len={train.seq_len} exceeds max_seq_len={model.max_seq_len} of model {model.name!r}; "
            f"choose seq_len <= {model.max_seq_len}"
        )
    if parallel.sequence_parallel and train.seq_len % tp:
        raise ValueError(
            f"sequence_parallel shards seq_len={train.seq_len} over tp={tp}, which does not divide it; "
            f"choose seq_len as a multiple of {tp}"
        )
    if parallel.dp_shard == -1:
        return
    dp = parallel.dp
    if train.global_batch % dp:
        raise ValueError(
            f"global_batch={train.global_batch} is not divisible by the {dp} data-parallel ranks "
            f"(dp_replicate*dp_shard); choose global_batch as a multiple of {dp}"
        )
    if train.micro_batch is not None and train.global_batch % (train.micro_batch * dp):
        raise ValueError(
            f"global_batch={train.global_batch} is not divisible by micro_batch*dp={train.micro_batch}*{dp}; "
            f"choose micro_batch in {_divisors(train.global_batch // dp)}"
        )


@dataclass(frozen=True)
class JobConfig(_JsonMixin):
    """Everything a rank needs, written to ``RUN_DIR/config.json``."""

    model: ModelConfig = field(default_factory=lambda: PRESETS["tiny"])
    parallel: ParallelConfig = field(default_factory=lambda: ParallelConfig(dp_shard=1))
    train: TrainConfig = field(default_factory=TrainConfig)
    # A test hook: the named rank raises at the given step, so failure paths can be exercised for real.
    fail_at: dict[str, int] | None = None
    # What train.kernels resolved to on the ranks' device ('triton' or 'torch'), so a run says what ran.
    kernels: str | None = None
    # What train.device resolved to ('cuda' or 'cpu'): the ranks' device and backend (nccl or gloo).
    device: str | None = None
    # Multi-node jobs (workbench.train.launcher.launch(nnodes=...)): {"nnodes", "node_rank",
    # "rdzv_endpoint", "rdzv_id"}; None on one node.
    nodes: dict[str, Any] | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "JobConfig":
        if not isinstance(data, dict) or not all(isinstance(data.get(k), dict) for k in ("model", "parallel", "train")):
            raise ValueError("a job config needs objects 'model', 'parallel' and 'train' (as a run's config.json "
                             "has them)")
        return cls(
            model=ModelConfig.from_dict(data["model"]),
            parallel=ParallelConfig.from_dict(data["parallel"]),
            train=TrainConfig.from_dict(data["train"]),
            fail_at=data.get("fail_at"),
            kernels=data.get("kernels"),
            device=data.get("device"),
            nodes=data.get("nodes"),
        )

    @classmethod
    def load(cls, path: str | Path) -> "JobConfig":
        """A run's ``config.json``; one ValueError naming the file if it is not one. Read as a file of its run
        directory (:func:`workbench.safeio.confine`): a link that leads out of that directory is refused."""
        from workbench.safeio import confine

        path = Path(path)
        try:
            return cls.from_dict(_read_json_object(confine(path.parent, path.name, path.parent, "run config"),
                                                   what="a run's config.json"))
        except ValueError as e:
            msg = str(e)
            raise ValueError(msg if msg.startswith(str(path)) else f"{path}: {msg}") from None
