"""Benchmarks print one JSON document of ratios against a named baseline measured in the same run."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

# The 2-process layouts; the baseline "single" is always added. (The "single_1thread" reference is left
# out to keep this under a minute: the test environment pins OMP_NUM_THREADS=1, where it equals "single".)
LAYOUTS = ["ddp", "fsdp2", "tp", "tp_sp"]


@pytest.mark.multirank
@pytest.mark.timeout(240)
def test_bench_train_quick_prints_one_json_document_of_ratios(repo):
    proc = subprocess.run(
        [sys.executable, str(repo / "benchmarks" / "bench_train.py"), "--quick", "--repeats", "1",
         "--layouts", ",".join(LAYOUTS)],
        capture_output=True, text=True, timeout=200, cwd=repo,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads(proc.stdout)  # stdout is exactly one JSON document; progress went to stderr
    assert "tokens/s" in proc.stderr

    assert doc["benchmark"] == "bench_train"
    assert doc["baseline"] == "single" and doc["preset"] == "tiny"
    assert doc["quick"] is True and doc["repeats"] == 1
    assert 0.0 <= doc["other_cpu_share_max"] <= 1.0
    assert doc["steps"] > doc["warmup_steps_dropped"] >= 0
    machine = doc["machine"]
    for key in ("cpu_count", "torch", "platform", "omp_note"):
        assert machine[key], key

    configs = doc["configs"]
    assert list(configs) == ["single", *LAYOUTS]  # baseline first
    assert configs["single"]["ratio"] == 1.0
    assert configs["single"]["nproc"] == 1
    for name, c in configs.items():
        tps = c["tokens_per_s"]
        assert len(tps["runs"]) == 1, name
        for key in ("median", "min", "max"):
            assert math.isfinite(tps[key]) and tps[key] > 0, (name, key, tps[key])
        assert tps["min"] <= tps["median"] <= tps["max"]
        assert math.isfinite(c["ratio"]) and c["ratio"] > 0, (name, c["ratio"])
        assert math.isclose(c["ratio"], tps["median"] / configs["single"]["tokens_per_s"]["median"])
        assert c["omp_threads_per_rank"] >= 1
        if name != "single":
            assert c["nproc"] == 2, name
    assert configs["tp_sp"]["layout"] == "tp=2 x sp"
    assert configs["fsdp2"]["layout"] == "dp_shard=2"
    assert configs["ddp"]["layout"] == "dp_replicate=2"


@pytest.mark.multirank
@pytest.mark.timeout(89)
def test_bench_parallel_quick_prints_peak_memory_ratios_to_gpipe(repo):
    proc = subprocess.run(
        [sys.executable, str(repo / "benchmarks" / "bench_parallel.py"), "--quick", "--repeats", "1"],
        capture_output=True, text=True, timeout=85, cwd=repo,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads(proc.stdout)  # stdout is exactly one JSON document; progress went to stderr
    assert "peak rank 0" in proc.stderr

    assert doc["benchmark"] == "bench_parallel" and doc["baseline"] == "GPipe"
    assert doc["quick"] is True and doc["repeats"] == 1 and doc["pp"] == 2
    assert doc["global_batch"] % doc["microbatches"] == 0
    for key in ("preset", "seq_len", "microbatches", "global_batch", "seed", "steps"):
        assert doc[key] is not None, key
    for key in ("cpu_count", "torch", "platform"):
        assert doc["machine"][key], key

    configs = doc["configs"]
    assert list(configs) == ["GPipe", "1F1B", "GPipeLean"]  # baseline first
    for name, c in configs.items():
        per_stage = c["per_stage"]
        assert sorted(per_stage) == ["0", "1"], name  # one entry per pp rank (stage)
        for rank, s in per_stage.items():
            assert s["peak_mem_bytes"] > s["param_bytes"] > 0, (name, rank)
            assert len(s["peak_mem_bytes_runs"]) == 1
            assert math.isfinite(s["ratio"]) and s["ratio"] > 0, (name, rank, s["ratio"])
            gpipe = configs["GPipe"]["per_stage"][rank]["peak_mem_bytes"]
            assert math.isclose(s["ratio"], s["peak_mem_bytes"] / gpipe)
            assert c["ratio_by_rank"][rank] == s["ratio"]
            if name == "GPipe":
                assert s["ratio"] == 1.0
        assert math.isfinite(c["step_time_ratio"]) and c["step_time_ratio"] > 0
        assert 0.0 < c["bubble_fraction_measured"]["median"] < 1.0, name
        assert c["bubble_fraction_theory"] == pytest.approx(1 / (doc["microbatches"] + 1))  # (p-1)/(m+p-1), p=2
    # The point of the benchmark: 1F1B holds fewer microbatches' activations than GPipe on every stage.
    assert all(r < 1.0 for r in configs["1F1B"]["ratio_by_rank"].values())


@pytest.mark.multirank
@pytest.mark.timeout(200)
def test_bench_spmd_quick_prints_bytes_ratio_of_our_rules_to_torchs(repo):
    from workbench import compat

    # torch 2.11 runs no elementwise ("masked") rules of ours: benchmark a family it runs instead.
    family = "masked" if compat.available("spmd.elementwise") else "reduction"
    proc = subprocess.run(
        [sys.executable, str(repo / "benchmarks" / "bench_spmd.py"), "--quick", "--family", family],
        capture_output=True, text=True, timeout=190, cwd=repo,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads(proc.stdout)  # stdout is exactly one JSON document; progress went to stderr
    assert "ratio" in proc.stderr

    assert doc["benchmark"] == "bench_spmd" and doc["baseline"] == "torch"
    assert doc["quick"] is True and doc["meshes"] == ["1d"] and doc["family"] == family
    assert set(doc["runs"]) == {"torch", "ours"}
    # The baseline ranks ran under torch's own rules (they never install ours), the other run under ours.
    assert doc["runs"]["torch"]["rules_installed"] == ["torch"] and doc["runs"]["ours"]["rules_installed"] == ["ours"]
    assert doc["runs"]["ours"]["passed"] == doc["runs"]["ours"]["combinations"] > 0
    rows = doc["rows"]
    assert rows and all(r["family"] == family and r["mesh"] == "1d" for r in rows)
    ok = [r for r in rows if r["ours_ok"] and r["torch_ok"]]
    tot = doc["total"]
    assert tot["ours_bytes"] == sum(r["ours_bytes"] for r in ok)
    assert tot["torch_bytes"] == sum(r["torch_bytes"] for r in ok)
    assert math.isclose(tot["ratio"], tot["ours_bytes"] / tot["torch_bytes"])
    assert doc["families"][family]["ratio"] == tot["ratio"]
    # The point of the masked rules: a Partial input to masked_fill / where stays Partial.
    assert tot["ratio"] < 1.0


@pytest.mark.timeout(150)
def test_bench_checkpoint_quick_prints_one_json_document_of_ratios(repo):
    proc = subprocess.run([sys.executable, str(repo / "benchmarks" / "bench_checkpoint.py"), "--quick"],
                          capture_output=True, text=True, timeout=140, cwd=repo)
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads(proc.stdout)  # stdout is exactly one JSON document; progress went to stderr
    assert "async blocked" in proc.stderr
    assert doc["benchmark"] == "bench_checkpoint" and doc["preset"] == "tiny" and doc["quick"] is True
    assert doc["state_bytes"] > 4 * doc["n_params"] * 3  # fp32 weights + two Adam moments, at least
    for key in ("cpu_count", "torch", "platform"):
        assert doc["machine"][key], key
    ratios = doc["ratios"]
    assert set(ratios) == {"save_throughput_vs_raw", "save_throughput_vs_raw_writeback", "save_time_vs_dcp", "checksum_time_vs_dcp", "sha256_time_vs_dcp",
                           "async_blocking_vs_sync", "zero_stall_step_vs_sync", "zero_stall_step_vs_train_step",
                           "load_vs_safetensors", "load_without_verify_vs_safetensors",
                           "load_dcp_reader_vs_safetensors", "load_mmap_vs_safetensors",
                           "first_step_after_mmap_vs_next_step", "int8_optimizer_bytes_vs_fp32", "int8_save_time_vs_sync",
                           "resume_vs_safetensors", "resume_copy_vs_safetensors", "resume_mapped_vs_safetensors",
                           "first_step_after_resume_vs_after_copy", "first_step_after_mapped_vs_after_copy",
                           "resume_and_first_step_vs_copy", "resume_and_first_step_mapped_vs_copy"}
    for name, r in ratios.items():
        assert math.isfinite(r["median"]) and r["median"] > 0, name
        assert r["min"] <= r["median"] <= r["max"], name
    s = doc["seconds"]
    assert math.isclose(ratios["async_blocking_vs_sync"]["median"], s["async_blocking_s"] / s["sync_save_s"])
    # save vs raw from the side-by-side measurements (raw, save, save, raw), not from one of each
    assert math.isclose(ratios["save_throughput_vs_raw"]["median"], s["paired_raw_write_s"] / s["paired_save_s"])
    assert math.isclose(ratios["save_throughput_vs_raw_writeback"]["median"],
                        s["paired_raw_writeback_s"] / s["paired_save_s"])
    assert s["async_blocking_s"] < s["async_total_s"]  # the loop was blocked for part of the save only
    assert math.isclose(ratios["load_mmap_vs_safetensors"]["median"],
                        s["paired_load_mmap_s"] / s["paired_safetensors_load_s"])
    assert ratios["int8_optimizer_bytes_vs_fp32"]["median"] <= 0.27
    # resume into a fresh optimizer: the default path maps its new state and copies into the model's tensors
    default = doc["resume_read"]["default"]
    assert default["mmap"] == "auto" and default["path"] == "mmap" and default["mapped"] > 0 < default["copied"]
    assert doc["resume_read"]["copy"]["mapped"] == 0 and doc["resume_read"]["mapped"]["path"] == "mmap"
    assert math.isclose(ratios["resume_vs_safetensors"]["median"], s["resume_default_s"] / s["resume_st_s"])
    assert 0 < doc["cpu_seconds"]["resume_default_s"] and 0 < doc["cpu_seconds"]["first_step_after_copy_s"]


@pytest.mark.multirank
def test_bench_memory_quick_prints_prediction_errors_and_import_cost(repo):
    proc = subprocess.run(
        [sys.executable, str(repo / "benchmarks" / "bench_memory.py"), "--quick", "--layouts", "fsdp2",
         "--skip", "overhead,70b", "--import-mb", "20"],
        capture_output=True, text=True, timeout=600, cwd=repo)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(proc.stdout)
    assert doc["benchmark"] == "bench_memory"
    layout = doc["prediction"]["layouts"]["fsdp2"]
    assert set(layout["ranks"]) == {"0", "1"}
    for r in layout["ranks"].values():
        assert r["error"] == pytest.approx(r["predicted"] / r["measured"] - 1)
    assert doc["import"]["file_bytes"] > 10 * 2**20 and doc["import"]["seconds"] > 0


@pytest.mark.multirank
@pytest.mark.timeout(600)
def test_bench_time_quick_prints_measured_against_predicted_step_times(repo):
    proc = subprocess.run(
        [sys.executable, str(repo / "benchmarks" / "bench_time.py"), "--quick", "--preset", "tiny",
         "--layouts", "fsdp4,tp4", "--steps", "3", "--warmup", "1", "--no-advisor", "--no-anchors"],
        capture_output=True, text=True, timeout=580, cwd=repo)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(proc.stdout)  # stdout is exactly one JSON document; progress went to stderr
    assert doc["benchmark"] == "bench_time" and doc["baseline"] == "measured" and doc["nproc"] == 4
    assert doc["calibration"]["matmul_flops"]["fp32"] > 0 and doc["calibration"]["links"]["intra"]["bytes_per_s"] > 0
    assert list(doc["layouts"]) == ["fsdp4", "tp4"]
    for r in doc["layouts"].values():
        assert r["measured_s"] > 0 and r["predicted_s"] > 0 and len(r["measured_steps_s"]) == 2
        assert r["ratio"] == pytest.approx(r["predicted_s"] / r["measured_s"])
        assert r["error"] == pytest.approx(r["ratio"] - 1)
    errors = [abs(r["error"]) for r in doc["layouts"].values()]
    assert doc["median_abs_error"] == pytest.approx(sum(errors) / 2) and doc["max_abs_error"] == max(errors)
    assert abs(doc["spearman"]) == pytest.approx(1.0)  # two layouts: their orders agree or not
    assert doc["best_measured"] in doc["layouts"]


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_bench_gpu_train_skips_without_a_gpu_and_checks_its_plumbing_on_cpu(repo):
    import torch

    from workbench.config import PRESETS
    from workbench.train.flops import flops_per_token

    script = str(repo / "benchmarks" / "bench_gpu_train.py")
    if not torch.cuda.is_available():  # the default run: one JSON document saying why it was skipped
        proc = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=40, cwd=repo)
        assert proc.returncode == 0, proc.stderr[-4000:]
        doc = json.loads(proc.stdout)
        assert doc["benchmark"] == "bench_gpu_train" and doc["skipped"] is True and doc["baseline"] == "reference"
        assert "no CUDA GPU" in doc["reason"] and "--device cpu" in doc["reason"]
        assert doc["machine"]["torch"] == torch.__version__ and doc["machine"]["cuda_available"] is False

    proc = subprocess.run([sys.executable, script, "--device", "cpu", "--smoke", "--modes", "eager", "--timeout", "60"],
                          capture_output=True, text=True, timeout=90, cwd=repo)
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads(proc.stdout)  # stdout is exactly one JSON document; progress went to stderr
    assert "tokens/s" in proc.stderr and "trainer step" in proc.stderr
    assert doc["benchmark"] == "bench_gpu_train" and doc["skipped"] is False and doc["baseline"] == "reference"
    assert doc["device"] == "cpu" and doc["plumbing_check_only"] is True and doc["smoke"] is True
    assert doc["model"]["name"] == "tiny" and doc["steps"] > doc["warmup_steps_dropped"] >= 1
    assert doc["model"]["flops_per_token"] == flops_per_token(PRESETS["tiny"], doc["seq_len"])
    assert doc["peak"]["tflops"] is None  # a CPU has no peak in the table: MFU is null, not made up
    for key in ("torch", "triton", "python", "platform"):
        assert key in doc["machine"], key
    assert list(doc["modes"]) == ["eager"]
    m = doc["modes"]["eager"]
    ref, ours = m["reference"], m["trainer"]
    for r in (ref, ours):
        assert math.isfinite(r["tokens_per_s"]) and r["tokens_per_s"] > 0
        assert r["peak_mem_bytes"] > 0 and r["mfu"] is None
        assert r["steps_measured"] == doc["steps"] - doc["warmup_steps_dropped"]
    for key in ("tokens_per_s_ratio", "peak_mem_ratio"):
        assert math.isfinite(m[key]) and m[key] > 0, key
    assert math.isclose(m["tokens_per_s_ratio"], ours["tokens_per_s"] / ref["tokens_per_s"])
    assert math.isclose(m["peak_mem_ratio"], ours["peak_mem_bytes"] / ref["peak_mem_bytes"])
    assert m["targets_met"] is None  # the targets are for a GPU
    # Both loops train the same model from the same weights on the same samples.
    assert m["loss_first_rel_diff"] < 1e-3
    assert ours["device"] == "cpu" and ours["backend"] == "gloo"


@pytest.mark.timeout(120)
def test_bench_startup_quick_prints_ratios_to_import_torch(repo):
    proc = subprocess.run([sys.executable, str(repo / "benchmarks" / "bench_startup.py"), "--quick"],
                          capture_output=True, text=True, timeout=110, cwd=repo)
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads(proc.stdout)  # stdout is exactly one JSON document; progress went to stderr
    assert "import_torch" in proc.stderr
    assert doc["benchmark"] == "bench_startup" and doc["quick"] is True and doc["repeats"] == 1
    assert set(doc["baselines"]) == {"import_torch", "lab_without_extension"}
    results = doc["results"]
    assert list(results) == ["import_torch", "import_workbench", "help", "version", "extension_list"]  # no lab, plan
    base = results["import_torch"]
    assert base["wall_ratio_to_import_torch"] == 1.0 and base["cpu_ratio_to_import_torch"] == 1.0
    for name, r in results.items():
        assert r["runs"] == 1 and r["wall_s"] > 0 and r["cpu_s"] > 0 and r["max_rss_bytes"] > 0, name
        assert r["wall_ratio_to_import_torch"] == pytest.approx(r["wall_s"] / base["wall_s"], abs=1e-4), name
    assert results["extension_list"]["lists_workbench"] is True  # the command listed our extension, enabled
    assert set(doc["targets"]) == {"help_wall_under_0.5s", "version_wall_under_0.3s",
                                   "import_at_most_import_torch_plus_0.3s"}
