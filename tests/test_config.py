"""Config validation: every bad combination is one ValueError naming the numbers and the fix."""

from __future__ import annotations

import json

import pytest

from workbench.config import PRESETS, JobConfig, ModelConfig, ParallelConfig, TrainConfig, resolve_model, validate
from workbench.train.launcher import build_job


def test_tp_not_dividing_heads_names_the_fix():
    with pytest.raises(ValueError, match=r"^tp=3 does not divide n_heads=8; choose tp in \{1, 2, 4\}$"):
        build_job("tiny", nproc=2, tp=3)


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (dict(nproc=3, tp=2), r"nproc=3 is not divisible by dp_replicate\*tp\*pp=2"),
        (dict(nproc=4, dp_shard=3), r"nproc=4 but dp_replicate\*dp_shard\*tp\*pp=3"),
        (dict(nproc=2, dp_shard=2, global_batch=3), r"global_batch=3 is not divisible by the 2 data-parallel ranks"),
        (dict(nproc=2, dp_shard=2, global_batch=8, micro_batch=3), r"micro_batch\*dp=3\*2; choose micro_batch in \{1, 2, 4\}"),
        (dict(nproc=2, tp=2, sequence_parallel=True, seq_len=63), r"seq_len=63 .* multiple of 2"),
        (dict(nproc=1, sequence_parallel=True), r"sequence_parallel needs tp > 1"),
        (dict(nproc=1, seq_len=100000), r"seq_len=100000 exceeds max_seq_len=512"),
        (dict(nproc=1, steps=0), r"steps=0 must be a positive integer"),
        (dict(nproc=1, lr=-1.0), r"lr=-1.0 must be a positive finite number"),
        (dict(nproc=1, dtype="float8"), r"dtype='float8' is unknown; choose one of"),
        (dict(nproc=1, data="imagenet"), r"data='imagenet' is unknown"),
        (dict(nproc=2, tp=8), r"tp=8 does not divide n_kv_heads=4; choose tp in \{1, 2, 4\}"),
        (dict(nproc=1, tp=0), r"tp=0 must be a positive integer"),
        (dict(nproc=1, stepz=3), r"unknown training setting\(s\) \['stepz'\]"),
    ],
)
def test_bad_layouts_are_one_clear_error(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern) as info:
        build_job("tiny", **kwargs)
    assert "\n" not in str(info.value)


def test_reserved_pp_and_ep_are_validated():
    with pytest.raises(ValueError, match=r"pp=9 exceeds n_layers=5"):
        validate(PRESETS["tiny"], ParallelConfig(pp=9, dp_shard=1))
    validate(PRESETS["tiny"], ParallelConfig(pp=2, dp_shard=1))  # pipeline parallelism is available
    with pytest.raises(ValueError, match=r"ep=2 needs a mixture-of-experts model \(n_experts > 0\)"):
        validate(PRESETS["tiny"], ParallelConfig(ep=2, dp_shard=1))
    with pytest.raises(ValueError, match=r"pp_schedule='ZB' is unknown"):
        ParallelConfig(pp_schedule="ZB")


def test_dp_shard_fills_the_rest_of_nproc():
    p = ParallelConfig(tp=2).resolved(8)
    assert (p.dp_replicate, p.dp_shard, p.tp, p.world_size, p.dp) == (1, 4, 2, 8, 4)
    assert p.describe() == "dp_shard=4 x tp=2"
    assert ParallelConfig().resolved(1).describe() == "single process"


@pytest.mark.parametrize("name, lo, hi", [("tiny", 0.8e6, 1.3e6), ("small", 20e6, 30e6),
                                          ("llama-7b", 6.7e9, 6.8e9), ("llama-70b", 68.9e9, 69.1e9)])
def test_preset_sizes(name, lo, hi):
    assert lo <= PRESETS[name].n_params <= hi


def test_model_config_rejects_inconsistent_dims():
    with pytest.raises(ValueError, match=r"n_kv_heads=3 does not divide n_heads=8"):
        ModelConfig(n_heads=8, n_kv_heads=3)
    with pytest.raises(ValueError, match=r"n_heads=7 does not divide dim=128"):
        ModelConfig(dim=128, n_heads=7, n_kv_heads=7)


def _llama_config_json(**over):
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
        "intermediate_size": 5632, "num_attention_heads": 32, "num_hidden_layers": 22,
        "num_key_value_heads": 4, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "vocab_size": 32000,
        "max_position_embeddings": 2048, "tie_word_embeddings": False,
    }
    cfg.update(over)
    return cfg


def test_hugging_face_config_json(tmp_path):
    path = tmp_path / "tinyllama" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(_llama_config_json()))
    cfg = resolve_model(str(path))
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_hidden) == (2048, 22, 32, 4, 5632)
    assert 1.0e9 < cfg.n_params < 1.2e9  # TinyLlama-1.1B
    assert resolve_model(str(path.parent)) == cfg  # a directory holding config.json works too


def test_hugging_face_config_errors(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps(_llama_config_json(model_type="gpt2")))
    with pytest.raises(ValueError, match=r"model_type='gpt2' is not a Llama-architecture model"):
        resolve_model(str(bad))
    bad.write_text("{not json")
    with pytest.raises(ValueError, match=r"not valid JSON"):
        resolve_model(str(bad))
    cfg = _llama_config_json()
    del cfg["vocab_size"]
    bad.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"missing key\(s\) \['vocab_size'\]"):
        resolve_model(str(bad))
    with pytest.raises(ValueError, match=r"unknown model 'gpt-5'; choose a preset in"):
        resolve_model("gpt-5")


def test_job_config_round_trips_through_json():
    job = build_job("tiny", nproc=4, dp_shard=2, tp=2, steps=3, seed=5)
    again = JobConfig.from_dict(json.loads(job.to_json()))
    assert again == job
    with pytest.raises(ValueError, match=r"unknown TrainConfig field\(s\) \['bogus'\]"):
        TrainConfig.from_dict({"bogus": 1})
