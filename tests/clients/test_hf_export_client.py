"""transformers as a real client of our Hugging Face export and config reading (issue 29, rows 1, 3 and 4).

* ``workbench ckpt convert RUN OUT --to hf`` (the README's command, no ``--names``) writes what
  ``transformers.AutoModelForCausalLM.from_pretrained(OUT)`` loads whole (no missing or unexpected weight) and
  computes our logits with (fp32, max |diff| <= 1e-5): tiny, GQA, tied embeddings, Llama 3.1 rope scaling, a
  sharded export with an index; linear, dynamic and yarn RoPE too. Before, the default wrote workbench names
  under a config saying LlamaForCausalLM, and transformers loaded 1 of the weights and random numbers for the rest.
* ``--names workbench`` writes a config.json transformers refuses (ValueError), not one it half-loads.
* config.json as transformers 5 writes it (``rope_parameters``) and as 4.x wrote it (``rope_scaling`` +
  ``rope_theta``; tests/clients/data/llama31_tf4_config.json is Llama 3.1 8B's, shrunk) reads into a
  ModelConfig whose model computes transformers' logits; keys whose math this model lacks are refused in one line.
* ``ckpt stats`` / ``read_tensor`` of HF-named weights with no config.json serve every tensor but q/k, and for
  those say which config is needed.

The logit differences measured are printed (``-s`` shows them).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from workbench.checkpoint import export, read_tensor  # noqa: E402
from workbench.checkpoint.formats import from_hf_llama_name, _rope_permute  # noqa: E402
from workbench.config import JobConfig, ModelConfig, ParallelConfig, TrainConfig, model_config_from_hf  # noqa: E402
from workbench.models import build_model  # noqa: E402
from workbench.models.llama import rope_frequencies  # noqa: E402

DATA = Path(__file__).parent / "data"
TOL = 1e-5
SMALL = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=4, ffn_hidden=96, vocab_size=120, max_seq_len=64)
CASES = {
    "tiny": ModelConfig("tiny-hf", **SMALL),
    "gqa": ModelConfig("gqa", **{**SMALL, "n_heads": 8, "n_kv_heads": 2}),
    "tied": ModelConfig("tied", **{**SMALL, "n_kv_heads": 2}, tie_embeddings=True),
    "llama3": ModelConfig("llama31", **{**SMALL, "n_kv_heads": 2, "max_seq_len": 256}, rope_theta=500000.0,
                          rope_type="llama3", rope_factor=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                          rope_original_max_seq_len=32),
    "linear": ModelConfig("linear", **SMALL, rope_type="linear", rope_factor=2.0),
    "dynamic": ModelConfig("dynamic", **SMALL, rope_type="dynamic", rope_factor=2.0),
    "yarn": ModelConfig("yarn", **{**SMALL, "max_seq_len": 256}, rope_type="yarn", rope_factor=4.0,
                        rope_original_max_seq_len=64),
}


@pytest.fixture(autouse=True)
def _quiet():
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    yield


def write_run(run: Path, cfg: ModelConfig) -> torch.nn.Module:
    """A run directory with one step (model only, one process): what `workbench train` leaves for convert.
    Every weight, norms included, is moved off its init, so a weight loaded under the wrong name shows."""
    import torch.distributed.checkpoint as dcp

    model = build_model(cfg, seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    step_dir = run / "checkpoints" / "step-000001"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": dict(model.state_dict())}, checkpoint_id=str(step_dir), no_dist=True)
    job = JobConfig(model=cfg, parallel=ParallelConfig(dp_shard=1), train=TrainConfig())
    (step_dir / "workbench.json").write_text(json.dumps({
        "format": "workbench-checkpoint", "version": 1, "step": 1, "world_size": 1,
        "layout": job.parallel.to_dict(), "job": job.to_dict(), "kinds": ["model"]}))
    (run / "checkpoints" / "latest").write_text(step_dir.name)
    return model.eval()


def tokens_for(cfg: ModelConfig, seq: int | None = None) -> torch.Tensor:
    seq = seq or min(cfg.max_seq_len, 160)
    return torch.randint(0, cfg.vocab_size, (2, seq), generator=torch.Generator().manual_seed(3))


def load_hf(path: Path):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                                     output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.eval()


def max_diff(ours: torch.nn.Module, hf, tokens: torch.Tensor) -> float:
    with torch.no_grad():
        return float((ours(tokens) - hf(tokens).logits).abs().max())


@pytest.mark.parametrize("case", ["tiny", "gqa", "tied", "llama3", "linear", "dynamic", "yarn"])
def test_default_hf_export_loads_in_transformers_with_equal_logits(case, tmp_path, capsys):
    """The README's command, `workbench ckpt convert RUN OUT --to hf`, with no --names."""
    from workbench.cli import main

    cfg = CASES[case]
    ours = write_run(tmp_path / "run", cfg)
    assert main(["ckpt", "convert", str(tmp_path / "run"), str(tmp_path / "hf"), "--to", "hf"]) == 0
    hf = load_hf(tmp_path / "hf")
    # the rotary frequencies are transformers' own, to the bit (default, linear, dynamic, llama3, yarn)
    inv_freq, scale = rope_frequencies(cfg)
    assert torch.equal(inv_freq, hf.model.rotary_emb.inv_freq) and scale == hf.model.rotary_emb.attention_scaling
    d = max_diff(ours, hf, tokens_for(cfg))
    with capsys.disabled():
        print(f"\n[hf export] {case}: max |logits diff| vs transformers {transformers.__version__} = {d:.3g}")
    assert d <= TOL
    if cfg.tie_embeddings:  # written once, as HF does; transformers ties lm_head to it
        index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
        assert "lm_head.weight" not in index["weight_map"] and hf.lm_head.weight is hf.model.embed_tokens.weight


def test_sharded_export_with_an_index_loads_in_transformers(tmp_path, capsys):
    cfg = CASES["gqa"]
    ours = write_run(tmp_path / "run", cfg)
    export(tmp_path / "run", tmp_path / "hf", to="hf", max_shard_size="20KB", progress=False)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 5 and all(name.startswith("model.") or name == "lm_head.weight" for name in index["weight_map"])
    d = max_diff(ours, load_hf(tmp_path / "hf"), tokens_for(cfg))
    with capsys.disabled():
        print(f"\n[hf export] sharded ({len(shards)} shards): max |logits diff| = {d:.3g}")
    assert d <= TOL


def test_workbench_names_export_is_refused_by_transformers(tmp_path):
    """An explicit --names workbench: the config says what it is, and transformers refuses it instead of
    loading its 1 recognised weight beside random ones."""
    from workbench.checkpoint.formats import open_source
    from workbench.cli import main

    cfg = CASES["gqa"]
    write_run(tmp_path / "run", cfg)
    assert main(["ckpt", "convert", str(tmp_path / "run"), str(tmp_path / "wb"), "--to", "hf",
                 "--names", "workbench"]) == 0
    doc = json.loads((tmp_path / "wb" / "config.json").read_text())
    assert doc["architectures"] != ["LlamaForCausalLM"] and "transformers cannot load" in doc["workbench_note"]
    with pytest.raises(ValueError, match="does not recognize this architecture"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "wb")
    source = open_source(tmp_path / "wb")  # workbench still reads it, config included
    assert source.names == "workbench" and source.model_cfg == cfg


def test_moe_export_needs_explicit_workbench_names(tmp_path, capsys):
    from workbench.cli import main

    cfg = ModelConfig("moe", **SMALL, n_experts=2, top_k=1)
    write_run(tmp_path / "run", cfg)
    capsys.readouterr()
    assert main(["ckpt", "convert", str(tmp_path / "run"), str(tmp_path / "hf"), "--to", "hf"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "mixture-of-experts" in err and "--names workbench" in err
    assert not (tmp_path / "hf").exists()


# --------------------------------------------------------------------------------------------------
# config.json as transformers writes it -> ModelConfig -> the same logits as transformers
# --------------------------------------------------------------------------------------------------

def _ours_from_hf_model(cfg: ModelConfig, hf) -> torch.nn.Module:
    """Our model holding transformers' (random) weights: HF names back to ours, q/k un-permuted."""
    ours = build_model(cfg, seed=0)
    sd = ours.state_dict()
    with torch.no_grad():
        for name, t in hf.state_dict().items():
            if name == "lm_head.weight" and cfg.tie_embeddings:
                continue
            fqn = from_hf_llama_name(name)
            heads = {"attention.wq.weight": cfg.n_heads, "attention.wk.weight": cfg.n_kv_heads}
            h = next((n for suffix, n in heads.items() if fqn.endswith(suffix)), None)
            sd[fqn].copy_(_rope_permute(t, h, to_hf=False) if h else t)
    return ours.eval()


def _hf_model(config_dir: Path):
    config = transformers.AutoConfig.from_pretrained(config_dir)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # norms off 1, so a norm read wrongly shows
                p.add_(torch.randn(p.shape) * 0.1)
    return model


def test_llama31_config_as_transformers_4_wrote_it(tmp_path, capsys):
    """rope_theta and rope_scaling (llama3) at the top level: before, the scaling was dropped in silence."""
    cfg = model_config_from_hf(DATA / "llama31_tf4_config.json")
    assert (cfg.rope_type, cfg.rope_factor, cfg.rope_original_max_seq_len, cfg.rope_theta) == ("llama3", 8.0, 32, 5e5)
    assert (cfg.n_kv_heads, cfg.norm_eps) == (2, 1e-5)
    (tmp_path / "config.json").write_bytes((DATA / "llama31_tf4_config.json").read_bytes())
    hf = _hf_model(tmp_path)
    d = max_diff(_ours_from_hf_model(cfg, hf), hf, tokens_for(cfg, 200))
    with capsys.disabled():
        print(f"\n[hf config] Llama 3.1 config in transformers 4.x form: max |logits diff| = {d:.3g}")
    assert d <= TOL


@pytest.mark.parametrize("rope", [
    {"rope_type": "default", "rope_theta": 1e6},
    {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 32},
    {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 16.0},
    {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0},
    {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0},
], ids=["default", "llama3", "yarn", "linear", "dynamic"])
def test_config_as_transformers_5_writes_it(rope, tmp_path, capsys):
    """save_pretrained of transformers 5 itself: rope_theta inside rope_parameters (before, read as 10000),
    head_dim, tie_word_embeddings, attention_bias and mlp_bias written out."""
    transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             intermediate_size=96, vocab_size=120, max_position_embeddings=256,
                             rms_norm_eps=1e-5, rope_parameters=dict(rope), tie_word_embeddings=True
                             ).save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert "rope_parameters" in written and "rope_theta" not in written and written["head_dim"] == 16
    cfg = model_config_from_hf(tmp_path)
    assert (cfg.rope_type, cfg.rope_theta, cfg.tie_embeddings) == (rope["rope_type"], rope["rope_theta"], True)
    hf = _hf_model(tmp_path)
    assert torch.equal(rope_frequencies(cfg)[0], hf.model.rotary_emb.inv_freq)
    d = max_diff(_ours_from_hf_model(cfg, hf), hf, tokens_for(cfg, 200))
    with capsys.disabled():
        print(f"\n[hf config] transformers {transformers.__version__} config, {rope['rope_type']}: "
              f"max |logits diff| = {d:.3g}")
    assert d <= TOL


_BASE = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "intermediate_size": 96, "vocab_size": 120}


@pytest.mark.parametrize("extra, words", [
    ({"attention_bias": True}, "attention_bias=True: this model's projections have no bias"),
    ({"mlp_bias": True}, "mlp_bias=True: this model's projections have no bias"),
    ({"head_dim": 32}, "head_dim=32: this model's heads are hidden_size/num_attention_heads = 64/4 wide"),
    ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}},
     "rope_type='longrope' is not supported"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 32, "smoothing": 2}}, "['smoothing'] that rope_type"),
    ({"quantization_config": {"quant_method": "fp8"}}, "unknown key(s) ['quantization_config']"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"sliding_window": 16}, "sliding_window=16: this model attends to the whole sequence"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
])
def test_config_math_this_model_lacks_is_refused_in_one_line(extra, words):
    with pytest.raises(ValueError) as e:
        model_config_from_hf({**_BASE, **extra})
    assert words in str(e.value) and "\n" not in str(e.value)


def test_missing_keys_take_transformers_defaults():
    """A config.json without rms_norm_eps / max_position_embeddings: LlamaConfig's defaults, as from_pretrained."""
    cfg = model_config_from_hf(_BASE)
    hf = transformers.LlamaConfig(**{k: v for k, v in _BASE.items() if k != "model_type"})
    assert (cfg.norm_eps, cfg.max_seq_len, cfg.rope_theta) == (hf.rms_norm_eps, hf.max_position_embeddings,
                                                                hf.rope_parameters["rope_theta"])


# --------------------------------------------------------------------------------------------------
# tools on HF-named files without a config.json
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
def test_stats_and_read_tensor_of_hf_names_without_a_config(fmt, tmp_path, capsys):
    from safetensors.torch import save_file

    from workbench.cli import main

    cfg = CASES["gqa"]
    write_run(tmp_path / "run", cfg)
    export(tmp_path / "run", tmp_path / "hf", to="hf", progress=False)
    sd = {}
    for f in sorted((tmp_path / "hf").glob("*.safetensors")):
        from safetensors.torch import load_file

        sd.update(load_file(str(f)))
    lone = tmp_path / "lone"
    lone.mkdir()
    path = lone / f"model.{fmt}"
    torch.save(sd, path) if fmt == "pt" else save_file(sd, str(path))
    # every tensor needing no permutation reads, under either name
    for key in ("model.layers.0.input_layernorm.weight", "model.layers.1.self_attn.v_proj.weight", "lm_head.weight"):
        canon = "model." + from_hf_llama_name(key)
        assert torch.equal(read_tensor(path, canon), read_tensor(tmp_path / "run", canon))
        capsys.readouterr()
        assert main(["ckpt", "stats", str(path), key, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["numel"] == sd[key].numel()
    # q/k: one line naming the config needed
    capsys.readouterr()
    assert main(["ckpt", "stats", str(path), "model.layers.0.self_attn.k_proj.weight"]) != 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "num_attention_heads and num_key_value_heads" in err and "config.json" in err
    # with the config beside it, q/k read back as our weights
    (lone / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    key = "model.layers.0.attention.wk.weight"
    assert torch.equal(read_tensor(path, key), read_tensor(tmp_path / "run", key))
