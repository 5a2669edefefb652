"""Hugging Face ``config.json`` <-> :class:`~workbench.config.ModelConfig`, as transformers 4.x and 5.x write it.

Reading (:func:`hf_model_fields`, which :func:`workbench.config.model_config_from_hf` builds into a ModelConfig)::

    transformers 4.x   "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, ...}
    transformers 5.x   "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, ...}

Both are read the way transformers 5 reads them (``rope_scaling`` wins over ``rope_parameters``; a top-level
``rope_theta`` fills the dict's), and a missing key takes LlamaConfig's default (``rms_norm_eps`` 1e-6,
``max_position_embeddings`` 2048), so the ModelConfig computes what ``from_pretrained`` computes.

Every key is accounted for: one we read, one that cannot change the logits (token ids, generation and
output options, metadata), or a refusal. A key that changes the math in a way this model does not
(``attention_bias: true``, a ``head_dim`` other than ``hidden_size / num_attention_heads``, a sliding window,
``rope_type: longrope``) and a key nobody here knows are refused in one ValueError naming the file and the
key: a config read with a setting silently dropped gives a model whose logits differ with no warning.

Writing (:func:`hf_config_dict`) gives both spellings at once: ``rope_parameters`` (5.x) and ``rope_theta``
+ ``rope_scaling`` (4.x; 5.x reads ``rope_scaling`` too and the two agree), ``dtype`` and ``torch_dtype``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from workbench.schema import show

__all__ = ["hf_model_fields", "hf_config_dict", "workbench_names_config", "WORKBENCH_MODEL_TYPE", "HF_KEYS"]

# config.json of an export under workbench names: transformers refuses this model_type (it knows no such model)
WORKBENCH_MODEL_TYPE = "parallel-workbench"

# Keys that change nothing transformers computes from the weights: metadata, token ids, generation and output
# options (PretrainedConfig's own attributes in 4.x and 5.x). Anything else is read below or refused.
_HARMLESS = frozenset({
    "architectures", "_name_or_path", "name_or_path", "torch_dtype", "dtype", "transformers_version",
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id", "use_cache",
    "initializer_range", "return_dict", "output_hidden_states", "output_attentions", "torchscript",
    "use_bfloat16", "tf_legacy_loss", "chunk_size_feed_forward", "is_decoder", "tie_encoder_decoder",
    "id2label", "label2id", "num_labels", "problem_type", "tokenizer_class", "prefix", "task_specific_params",
    "finetuning_task", "cross_attention_hidden_size", "_attn_implementation", "_attn_implementation_autoset",
    "attn_implementation", "_commit_hash", "max_length", "min_length", "do_sample", "early_stopping",
    "num_beams", "num_beam_groups", "diversity_penalty", "temperature", "top_k", "top_p", "typical_p",
    "repetition_penalty", "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size",
    "bad_words_ids", "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens",
    "begin_suppress_tokens", "pretraining_tp",  # pretraining_tp: 4.x split the same matmuls into slices
    "workbench_note",
})
# Keys read into the ModelConfig, or checked against the one value this model computes.
_READ = frozenset({
    "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "intermediate_size", "vocab_size", "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling",
    "rope_parameters", "tie_word_embeddings", "head_dim", "attention_bias", "mlp_bias", "hidden_act",
    "attention_dropout", "sliding_window", "use_sliding_window", "max_window_layers", "partial_rotary_factor",
    "pruned_heads", "is_encoder_decoder", "add_cross_attention",
})
# The keys each RoPE type takes in its dict (besides rope_type/type, rope_theta, partial_rotary_factor).
_ROPE_KEYS = {
    "default": set(),
    "linear": {"factor"},
    # transformers' dynamic NTK scales from max_position_embeddings; an original_max_position_embeddings in the
    # dict is not used by it (4.x or 5.x), so it is accepted and not used here either
    "dynamic": {"factor", "original_max_position_embeddings"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "yarn": {"factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim", "truncate"},
}
# LlamaConfig's defaults (transformers 4.x and 5.x agree): what from_pretrained uses for a missing key.
_DEFAULTS = {"llama": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "sliding_window": None},
             "mistral": {"max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-6, "sliding_window": 4096}}
# ModelConfig field -> its key in config.json (or in the RoPE dict): messages use the file's words
HF_KEYS = {"dim": "hidden_size", "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
           "n_kv_heads": "num_key_value_heads", "ffn_hidden": "intermediate_size", "vocab_size": "vocab_size",
           "max_seq_len": "max_position_embeddings", "norm_eps": "rms_norm_eps", "rope_theta": "rope_theta",
           "tie_embeddings": "tie_word_embeddings", "rope_factor": "factor", "rope_low_freq_factor": "low_freq_factor",
           "rope_high_freq_factor": "high_freq_factor", "rope_original_max_seq_len": "original_max_position_embeddings",
           "rope_beta_fast": "beta_fast", "rope_beta_slow": "beta_slow", "rope_attention_factor": "attention_factor",
           "rope_type": "rope_type"}


def _load(path_or_dict: "str | Path | dict[str, Any]") -> tuple[str, dict[str, Any]]:
    """The config's JSON through the safe-reader layer (:mod:`workbench.safeio`): a regular file of at most
    ``CONFIG_MAX`` bytes (a FIFO would block the open, /dev/zero never ends), UTF-8, not nested past the parser's
    depth; one ValueError naming the file otherwise."""
    from workbench.safeio import CONFIG_MAX, read_json

    if isinstance(path_or_dict, dict):
        return "config", path_or_dict
    p = Path(path_or_dict)
    if p.is_dir():
        p = p / "config.json"
    hf = read_json(p, CONFIG_MAX, "config.json", fix="fix or re-download the file",
                   fix_missing="pass a preset name or a Hugging Face config.json")
    if not isinstance(hf, dict):
        raise ValueError(f"{p}: holds a JSON {type(hf).__name__}, not an object of settings; pass a Hugging Face "
                         "config.json")
    return str(p), hf


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _rope(source: str, hf: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig's rope_* fields from rope_scaling (4.x) / rope_parameters (5.x) / rope_theta."""
    scaling, params = hf.get("rope_scaling"), hf.get("rope_parameters")
    for key, value in (("rope_scaling", scaling), ("rope_parameters", params)):
        if value is not None and not isinstance(value, dict):
            raise ValueError(f"{source}: {key}={show(value)} is not an object; write e.g. "
                             '{"rope_type": "default", "rope_theta": 10000.0}')
    # transformers 5 (convert_rope_params_to_dict): rope_scaling, when given, replaces rope_parameters;
    # 4.x reads only rope_scaling. Either way the 4.x spelling wins.
    legacy = bool(scaling)
    rope = dict(scaling or params or {})
    key_name = "rope_scaling" if legacy else "rope_parameters"
    nested = [k for k, v in rope.items() if isinstance(v, dict)]
    if nested:
        raise ValueError(f"{source}: {key_name} has one RoPE per layer type ({nested[:3]}); this model has one "
                         "RoPE for every layer")
    rope.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    if "partial_rotary_factor" in hf:
        rope.setdefault("partial_rotary_factor", hf["partial_rotary_factor"])
    rope_type = rope.pop("rope_type", None) or rope.pop("type", None) or "default"
    rope.pop("type", None)
    if not isinstance(rope_type, str) or rope_type not in _ROPE_KEYS:
        raise ValueError(f"{source}: {key_name} rope_type={show(rope_type)} is not supported (this model computes "
                         f"{sorted(_ROPE_KEYS)}); use a checkpoint with one of those")
    prf = rope.pop("partial_rotary_factor", 1.0)
    if prf != 1.0:
        raise ValueError(f"{source}: partial_rotary_factor={show(prf)}: this model rotates every dimension of a "
                         "head; only 1.0 is supported")
    unknown = sorted(map(str, set(rope) - _ROPE_KEYS[rope_type] - {"rope_theta"}))
    if unknown:
        raise ValueError(f"{source}: {key_name} has key(s) {[k[:40] for k in unknown[:5]]} that rope_type="
                         f"{rope_type!r} does not take; it takes {sorted(_ROPE_KEYS[rope_type] | {'rope_theta'})}")
    out: dict[str, Any] = {"rope_type": rope_type, "rope_theta": rope["rope_theta"]}
    if rope_type == "default":
        return out
    max_pos = hf.get("max_position_embeddings", _DEFAULTS.get(hf.get("model_type", "llama"), {}).get(
        "max_position_embeddings", 2048))
    factor = rope.get("factor")
    orig = rope.get("original_max_position_embeddings")
    if rope_type == "yarn":
        if factor is None and _is_number(max_pos) and _is_number(orig) and orig:
            factor = max_pos / orig  # 5.x: the ratio of the context lengths stands in for a missing factor
        elif legacy and _is_number(orig) and _is_number(max_pos) and _is_number(factor) and orig and \
                factor != max_pos / orig:
            # 4.x replaced factor by max_position_embeddings / original_max_position_embeddings; 5.x keeps factor
            raise ValueError(f"{source}: rope_scaling yarn has factor={factor} but max_position_embeddings/"
                             f"original_max_position_embeddings={max_pos}/{orig}: transformers 4.x uses the ratio, 5.x "
                             "the factor; make them agree (or write rope_parameters, which 5.x reads as given)")
        if rope.get("truncate", True) is not True:
            raise ValueError(f"{source}: {key_name} truncate={show(rope.get('truncate'))}: only truncated yarn "
                             "correction ranges (the default, true) are supported")
        attention = rope.get("attention_factor")
        mscale, mscale_all = rope.get("mscale"), rope.get("mscale_all_dim")
        if attention is None and mscale and mscale_all and _is_number(factor):
            def get_mscale(scale: float, m: float) -> float:  # transformers' _compute_yarn_parameters
                return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

            attention = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all))
        out.update(rope_attention_factor=attention, rope_original_max_seq_len=orig if orig is not None else max_pos)
        if rope.get("beta_fast") is not None:  # transformers: `or 32`, `or 1`
            out["rope_beta_fast"] = rope["beta_fast"] or 32.0
        if rope.get("beta_slow") is not None:
            out["rope_beta_slow"] = rope["beta_slow"] or 1.0
    elif rope_type == "llama3":
        for k in ("factor", "low_freq_factor", "high_freq_factor"):
            if rope.get(k) is None:
                raise ValueError(f"{source}: {key_name} rope_type='llama3' needs {k}; a Llama 3.1 config has "
                                 "factor, low_freq_factor, high_freq_factor and original_max_position_embeddings")
        out.update(rope_low_freq_factor=rope["low_freq_factor"], rope_high_freq_factor=rope["high_freq_factor"],
                   rope_original_max_seq_len=orig if orig is not None else max_pos)
    elif rope_type == "dynamic":
        out["rope_original_max_seq_len"] = max_pos  # transformers' dynamic NTK scales from max_position_embeddings
    if factor is None:
        raise ValueError(f"{source}: {key_name} rope_type={rope_type!r} needs a factor")
    out["rope_factor"] = factor
    return out


def _check_math_keys(source: str, hf: dict[str, Any], model_type: str) -> None:
    """Keys whose one supported value is what this model computes; any other value is refused."""
    def refuse(key: str, why: str) -> None:
        raise ValueError(f"{source}: {key}={show(hf.get(key))}: {why}")

    if hf.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", "this model's feed-forward is SwiGLU (silu); only 'silu' is supported")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key, False) not in (False, None):
            refuse(key, "this model's projections have no bias; only false is supported")
    if hf.get("attention_dropout", 0.0) not in (0, 0.0, None):
        refuse("attention_dropout", "this model's attention has no dropout; only 0.0 is supported (workbench's "
                                    "residual dropout is the model's `dropout` setting)")
    for key in ("is_encoder_decoder", "add_cross_attention"):
        if hf.get(key, False) not in (False, None):
            refuse(key, "this model is a decoder without cross-attention; only false is supported")
    if hf.get("pruned_heads") not in (None, {}, []):
        refuse("pruned_heads", "this model has every head of every layer; pruned heads are not supported")
    head_dim, dim, heads = hf.get("head_dim"), hf.get("hidden_size"), hf.get("num_attention_heads")
    if head_dim is not None and _is_number(dim) and _is_number(heads) and heads and head_dim != dim / heads:
        refuse("head_dim", f"this model's heads are hidden_size/num_attention_heads = {dim}/{heads} wide; only "
                           f"head_dim={dim // heads if dim % heads == 0 else dim / heads} (or none) is supported")
    window = hf.get("sliding_window", _DEFAULTS[model_type]["sliding_window"])
    if hf.get("use_sliding_window") is False:  # Qwen-style switch: the window is off whatever its size
        window = None
    max_pos = hf.get("max_position_embeddings", _DEFAULTS[model_type]["max_position_embeddings"])
    if window is not None and not (_is_number(window) and _is_number(max_pos) and window >= max_pos):
        refuse("sliding_window", "this model attends to the whole sequence; only null (or a window of at least "
                                 f"max_position_embeddings={show(max_pos)}) is supported"
                                 + (" (a mistral config without the key has transformers' default 4096)"
                                    if "sliding_window" not in hf else ""))


def hf_model_fields(path_or_dict: "str | Path | dict[str, Any]",
                    name: str | None = None) -> tuple[str, dict[str, Any]]:
    """``(source, fields)``: the ModelConfig fields a Hugging Face Llama (or Mistral) ``config.json`` describes,
    and the name to use for it in messages. :func:`workbench.config.model_config_from_hf` builds the config
    (and checks each value's range); this module knows config.json, not ModelConfig.

    ``path_or_dict``: the file, its directory, or its parsed dict. Only a regular file of at most
    ``workbench.safeio.CONFIG_MAX`` bytes is read. A value this model does not compute, or an unknown key, is
    one ValueError naming the file and the key. The config.json of an export under workbench names
    (``names="workbench"``) gives back its own recorded fields.
    """
    source, hf = _load(path_or_dict)
    model_type = hf.get("model_type", "llama")
    if model_type == WORKBENCH_MODEL_TYPE and isinstance(hf.get("workbench_model"), dict):
        return source, dict(hf["workbench_model"])
    if model_type not in ("llama", "mistral"):
        raise ValueError(f"{source}: model_type={show(model_type)} is not a Llama-architecture model; "
                         "supported model_type values are 'llama' and 'mistral'")
    required = ["hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"]
    missing = [k for k in required if k not in hf]
    if missing:
        raise ValueError(f"{source}: missing key(s) {missing}; a Llama config.json needs {required}")
    unknown = sorted(map(str, set(hf) - _READ - _HARMLESS))
    if unknown:
        more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        raise ValueError(f"{source}: unknown key(s) {[k[:40] for k in unknown[:5]]}{more}: workbench cannot tell "
                         "whether they change the model's math; remove them if they do not")
    _check_math_keys(source, hf, model_type)
    path_name = hf.get("_name_or_path")
    defaults = _DEFAULTS[model_type]
    return source, {
        "name": name or (path_name if isinstance(path_name, str) and path_name else None)
        or Path(source).parent.name or "hf",
        "dim": hf["hidden_size"],
        "n_layers": hf["num_hidden_layers"],
        "n_heads": hf["num_attention_heads"],
        "n_kv_heads": hf.get("num_key_value_heads") or hf["num_attention_heads"],
        "ffn_hidden": hf["intermediate_size"],
        "vocab_size": hf["vocab_size"],
        "max_seq_len": hf.get("max_position_embeddings", defaults["max_position_embeddings"]),
        "norm_eps": hf.get("rms_norm_eps", defaults["rms_norm_eps"]),
        "tie_embeddings": hf.get("tie_word_embeddings", False),
        **_rope(source, hf),
    }


def _rope_dicts(cfg) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """``(rope_parameters, rope_scaling)``: the 5.x dict (with rope_theta) and the 4.x one (None for default)."""
    t = cfg.rope_type
    extra: dict[str, Any] = {}
    if t != "default":
        extra["factor"] = float(cfg.rope_factor)
    if t == "llama3":
        extra.update(low_freq_factor=float(cfg.rope_low_freq_factor), high_freq_factor=float(cfg.rope_high_freq_factor),
                     original_max_position_embeddings=cfg.rope_original_max_seq_len or cfg.max_seq_len)
    elif t == "yarn":
        extra.update(original_max_position_embeddings=cfg.rope_original_max_seq_len or cfg.max_seq_len,
                     beta_fast=float(cfg.rope_beta_fast), beta_slow=float(cfg.rope_beta_slow))
        if cfg.rope_attention_factor is not None:
            extra["attention_factor"] = float(cfg.rope_attention_factor)
    params = {"rope_type": t, "rope_theta": float(cfg.rope_theta), **extra}
    return params, ({"rope_type": t, **extra} if t != "default" else None)


def hf_config_dict(cfg, dtype: str = "float32") -> dict[str, Any]:
    """The ``config.json`` transformers (4.x and 5.x) loads as a ``LlamaForCausalLM`` computing what ``cfg``
    computes. ``cfg`` must be a dense model (a mixture of experts has no Llama config): ValueError."""
    if cfg.n_experts:
        raise ValueError(f"model {cfg.name!r} is a mixture of experts (n_experts={cfg.n_experts}), which has no "
                         "Hugging Face Llama config; export with names='workbench' (--names workbench)")
    params, scaling = _rope_dicts(cfg)
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": cfg.dim,
            "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "intermediate_size": cfg.ffn_hidden,
            "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
            "rope_parameters": params, "rope_theta": float(cfg.rope_theta), "rope_scaling": scaling,
            "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu", "attention_bias": False,
            "attention_dropout": 0.0, "mlp_bias": False, "dtype": dtype, "torch_dtype": dtype}


def workbench_names_config(cfg, dtype: str = "float32") -> dict[str, Any]:
    """The ``config.json`` of an export under workbench names: a model_type transformers refuses to load
    (rather than half-load it with random weights), and our own config, which workbench reads back."""
    return {"architectures": ["WorkbenchTransformer"], "model_type": WORKBENCH_MODEL_TYPE,
            "workbench_note": "weights under parallel-workbench names (layers.N.attention.wq.weight, ...), not "
                              "Hugging Face ones: transformers cannot load this directory. For a checkpoint "
                              "transformers loads, export with `workbench ckpt convert SRC DST --to hf` (Hugging "
                              "Face names are the default)",
            "workbench_model": cfg.to_dict(), "dtype": dtype}
