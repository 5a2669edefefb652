"""One GPU: the workbench trainer against a tuned torch training loop on the same model and batch.

    python benchmarks/bench_gpu_train.py                          # 886M Llama, 8 x 2048, eager and compiled
    python benchmarks/bench_gpu_train.py --modes eager --steps 20
    python benchmarks/bench_gpu_train.py --smoke                  # tiny model, a few steps: a quick check
    python benchmarks/bench_gpu_train.py --device cpu --smoke --modes eager   # the plumbing, without a GPU

Two loops train the same model on the same global batch (default: the issue's 886M-parameter Llama,
hidden 2048, 16 layers, GQA 16/8, ffn 5632, vocab 32000, on 8 x 2048 tokens), in bf16 mixed precision:

``trainer``
    ``workbench.launch(model, nproc=1, device=..., mixed_precision="bf16", compile=<mode>)``: torchrun
    and one rank, exactly as the CLI and the dashboard run it. Its figures come from its step events.
``reference`` (the baseline)
    a tuned loop in this process: our ``Transformer`` built directly on the device with the same initial
    weights and the same samples, ``torch.autocast`` bf16 over fp32 master weights, cross entropy in fp32,
    gradient clipping (foreach), and fused AdamW with the trainer's settings (lr, weight decay 0.1, betas
    (0.9, 0.95)). Its batches are drawn before the clock starts and wait on the device.

``eager`` runs both loops eagerly; ``compiled`` compiles each transformer block in both (the trainer's
``--compile``; ``block.compile()`` in the reference). Each loop's figure is the median over its steps
after the first ``--warmup`` (which include compilation); a step is timed from its start until its loss
is a Python number, in both loops. Peak memory is ``torch.cuda.max_memory_allocated`` over the whole
loop, model build included (on CPU: the process's resident set, which is not comparable between a
torchrun rank and this process). MFU is reported by both FLOP counts of ``workbench.train.flops``.

Targets (issue 12): trainer/reference tokens/s >= 0.95 in each mode, peak memory ratio <= 1.0.
Without a CUDA GPU, and without ``--device cpu``, it prints one JSON document saying it was skipped.
stdout carries exactly one JSON document; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

# Run from a source checkout without installing.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BASELINE = "reference"
MODES = ("eager", "compiled")
TARGETS = {"tokens_per_s_ratio_min": 0.95, "peak_mem_ratio_max": 1.0}
SMOKE = dict(preset="tiny", steps=6, warmup=2, batch=4, seq_len=64)
DEFAULTS = dict(steps=25, warmup=5, batch=8, seq_len=2048)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# The 886M-parameter Llama (hidden 2048, 16 layers, GQA 16/8, ffn 5632, vocab 32000, untied), as a
# Hugging Face config.json: one definition, which the GPU check (gpu/check.py) also passes to the CLI.
DEFAULT_MODEL = Path(__file__).resolve().with_name("llama-886m.json")


def default_model():
    from workbench.config import ModelConfig

    return ModelConfig.from_hf_config(DEFAULT_MODEL)


def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def machine_info() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "cuda_runtime": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=torch.cuda.get_device_name(0), gpu_count=torch.cuda.device_count(),
                    gpu_memory_bytes=int(props.total_memory), gpu_capability=f"{props.major}.{props.minor}")
    return info


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def steady(values: list[float], warmup: int) -> list[float]:
    kept = values[warmup:]
    if not kept:
        raise RuntimeError(f"no steady-state steps: {len(values)} steps, warmup={warmup}")
    return kept


# --------------------------------------------------------------------------------------------------
# The reference loop (this process)
# --------------------------------------------------------------------------------------------------


def draw_batches(mcfg, tcfg, device) -> tuple[list, float]:
    """The trainer's samples for every step (same dataset, seed and order), on ``device``; and the
    seconds one step's draw takes, which the trainer spends inside its step."""
    from workbench.train.data import make_dataset, micro_batches

    ds = make_dataset(tcfg.data, mcfg.vocab_size, tcfg.seq_len, tcfg.seed)
    t0 = time.perf_counter()
    batches = []
    for step in range(tcfg.steps):
        (x, y), = micro_batches(ds, step, tcfg.global_batch, 0, 1, tcfg.global_batch)
        batches.append((x, y))
    draw_s = (time.perf_counter() - t0) / tcfg.steps
    return [(x.to(device), y.to(device)) for x, y in batches], draw_s


def reference_loop(mcfg, tcfg, device, compiled: bool, warmup: int, tag: str) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from workbench.models.llama import build_model

    cuda = device.type == "cuda"
    if cuda:
        torch.set_float32_matmul_precision("high" if tcfg.tf32 else "highest")
    batches, draw_s = draw_batches(mcfg, tcfg, device)
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    rss_peak = 0
    torch.manual_seed(tcfg.seed)
    model = build_model(mcfg, seed=tcfg.seed, device=device)  # the trainer's initial weights (by seed)
    model.train()
    if compiled:
        for block in model.layers.values():
            block.compile()
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=tcfg.lr, weight_decay=tcfg.weight_decay, betas=(0.9, 0.95), fused=True)
    bf16 = tcfg.mixed_precision == "bf16"
    times, losses = [], []
    for step, (x, y) in enumerate(batches):
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else nullcontext():
            logits = model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        del logits
        loss.backward()
        if tcfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, tcfg.grad_clip)  # foreach where the device has it
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())  # waits for the step, as the trainer's float(loss) does
        dt = time.perf_counter() - t0
        times.append(dt)
        if not cuda:
            rss_peak = max(rss_peak, _rss_bytes())
        _log(f"  [{tag}] reference step {step + 1}/{len(batches)}: {dt * 1e3:8.1f} ms, loss {losses[-1]:.4f}"
             + ("  (warm-up)" if step < warmup else ""))
    peak = int(torch.cuda.max_memory_allocated(device)) if cuda else rss_peak
    del model, opt, params, batches, loss
    gc.collect()
    if compiled:
        torch.compiler.reset()
    if cuda:
        torch.cuda.empty_cache()
    tokens = tcfg.global_batch * tcfg.seq_len
    kept = steady(times, warmup)
    return {
        "tokens_per_s": tokens / statistics.median(kept),
        "step_time_s": statistics.median(kept),
        "steps_measured": len(kept),
        "peak_mem_bytes": peak,
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "optimizer": "torch.optim.AdamW(fused=True)",
        "compile": "block.compile() per transformer block" if compiled else None,
        "data_draw_s_per_step": draw_s,
    }


# --------------------------------------------------------------------------------------------------
# The trainer (workbench.launch: torchrun, one rank)
# --------------------------------------------------------------------------------------------------


def trainer_run(mcfg, settings: dict[str, Any], warmup: int, timeout: float, tag: str) -> dict[str, Any]:
    from workbench.train.launcher import launch

    with tempfile.TemporaryDirectory(prefix="bench-gpu-train-") as out:
        run = launch(mcfg, out=out, nproc=1, **settings)
        deadline, seen = time.monotonic() + timeout, 0
        while not run.done:  # follow rank 0's steps, with a hard deadline
            for e in run.events_since(seen):
                seen += 1
                if e.get("type") == "step" and e.get("rank") == 0:
                    _log(f"  [{tag}] trainer step {e['step'] + 1}/{settings['steps']}: "
                         f"{e['step_time_s'] * 1e3:8.1f} ms, loss {e['loss']:.4f}"
                         + ("  (warm-up)" if e["step"] < warmup else ""))
            if time.monotonic() > deadline:
                run.stop()
                raise TimeoutError(f"the trainer's {tag} run did not finish within {timeout:.0f} s; "
                                   "it was stopped (raise --timeout)")
            time.sleep(0.2)
        run.wait(0)  # raises RunFailed naming the rank, with its traceback
        m = run.metrics
        r0 = m[m["rank"] == 0].sort_values("step")
        start = next((e for e in run.events_since(0) if e.get("type") == "start" and e.get("rank") == 0), {})
        kept = r0[r0["step"] >= warmup]
        if kept.empty:
            raise RuntimeError(f"no steady-state steps: {len(r0)} steps logged, warmup={warmup}")
        step_time = float(kept["step_time_s"].median())
        out_doc: dict[str, Any] = {
            "tokens_per_s": float(kept["tokens_per_s"].median()),
            "step_time_s": step_time,
            "steps_measured": int(len(kept)),
            "peak_mem_bytes": int(r0["mem_bytes"].max()),
            "loss_first": float(r0["loss"].iloc[0]),
            "loss_last": float(r0["loss"].iloc[-1]),
            # what the trainer says about itself (start event), where it says it
            **{k: start[k] for k in ("optim_impl", "compiled_blocks", "precision", "device", "backend", "kernels")
               if k in start},
        }
        if "mfu" in kept.columns and kept["mfu"].notna().any():
            out_doc["mfu_reported"] = float(kept["mfu"].median())  # the trainer's own MFU (step events)
        return out_doc


# --------------------------------------------------------------------------------------------------


def with_mfu(result: dict[str, Any], fpt: float, fpt_6n: float, peak: float | None) -> dict[str, Any]:
    from workbench.train.flops import mfu

    # one rank: the global tokens/s is the rank's
    return {**result, "mfu": mfu(result["tokens_per_s"], fpt, peak),
            "mfu_6n": mfu(result["tokens_per_s"], fpt_6n, peak)}


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def _describe(name: str, r: dict[str, Any]) -> str:
    mfu = "" if r["mfu"] is None else f", MFU {r['mfu']:.3f} ({r['mfu_6n']:.3f} by 6N)"
    return (f"{name:<9} {r['tokens_per_s']:12,.0f} tokens/s ({r['step_time_s'] * 1e3:.1f} ms/step){mfu}, "
            f"peak {_gib(r['peak_mem_bytes'])}")


def skipped(reason: str) -> dict[str, Any]:
    return {"benchmark": "bench_gpu_train", "skipped": True, "reason": reason, "baseline": BASELINE,
            "machine": machine_info()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {list(MODES)}")
    p.add_argument("--steps", type=int, default=None, help=f"steps per loop, warm-up included (default: "
                   f"{DEFAULTS['steps']}; --smoke {SMOKE['steps']})")
    p.add_argument("--warmup", type=int, default=None, help=f"leading steps dropped from each loop (default: "
                   f"{DEFAULTS['warmup']}; --smoke {SMOKE['warmup']}); compiled steps compile at first")
    p.add_argument("--batch", type=int, default=None, help=f"global batch in sequences (default: "
                   f"{DEFAULTS['batch']}; --smoke {SMOKE['batch']})")
    p.add_argument("--seq-len", type=int, default=None, help=f"tokens per sequence (default: "
                   f"{DEFAULTS['seq_len']}; --smoke {SMOKE['seq_len']})")
    p.add_argument("--preset", default=None, help="a model preset or a Hugging Face config.json (default: the "
                   "issue's 886M Llama; --smoke: tiny)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda (default; skipped without a GPU) or cpu (a plumbing check, not a performance figure)")
    p.add_argument("--smoke", action="store_true", help="quick check: the tiny preset, "
                   f"{SMOKE['steps']} steps ({SMOKE['warmup']} dropped), {SMOKE['batch']} x {SMOKE['seq_len']} tokens")
    p.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate of both loops (default: 3e-4)")
    p.add_argument("--kernels", choices=("auto", "triton", "torch"), default="auto",
                   help="our custom ops' backend, the same in both loops (default: auto, Triton on CUDA)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="the device's dense peak TFLOP/s for MFU (default: looked up from the GPU's name)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed per trainer run")
    args = p.parse_args(argv)

    base = SMOKE if args.smoke else DEFAULTS
    for key in ("steps", "warmup", "batch", "seq_len"):
        if getattr(args, key) is None:
            setattr(args, key, base[key])
    if args.steps <= args.warmup:
        p.error(f"--steps={args.steps} must exceed --warmup={args.warmup} to leave steady-state steps")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = sorted(set(modes) - set(MODES))
    if unknown or not modes:
        p.error(f"unknown mode(s) {unknown}; choose from {list(MODES)}")
    modes = [m for m in MODES if m in modes]

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(json.dumps(skipped(
            "no CUDA GPU on this machine (torch.cuda.is_available() is False, torch "
            f"{torch.__version__}); run it on a GPU, or pass --device cpu for a plumbing check"), indent=2))
        return 0

    from workbench import kernels
    from workbench.config import TrainConfig, resolve_model
    from workbench.train import flops
    from workbench.train.launcher import build_job

    try:
        mcfg = resolve_model(args.preset or SMOKE["preset"]) if (args.preset or args.smoke) else default_model()
    except ValueError as e:
        p.error(str(e))
    settings = dict(device=args.device, mixed_precision="bf16", steps=args.steps, global_batch=args.batch,
                    seq_len=args.seq_len, lr=args.lr, kernels=args.kernels, peak_tflops=args.peak_tflops)
    try:  # every setting checked before anything runs
        jobs = {mode: build_job(mcfg, nproc=1, compile=mode == "compiled", **settings) for mode in modes}
    except ValueError as e:
        p.error(str(e))
    job = jobs[modes[0]]
    tcfg: TrainConfig = job.train  # lr, weight decay, clipping, seed, data: what the reference loop shares
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    kernels.set_backend(args.kernels)  # the reference's custom ops run where the trainer's do

    precision = flops.precision_of(tcfg, device.type)
    peak = flops.peak_flops_per_s(device, precision, args.peak_tflops)
    fpt, fpt_6n = flops.flops_per_token(mcfg, args.seq_len), flops.flops_per_token_6n(mcfg)
    row = flops.peak_name(device)
    peak_doc = {
        "precision": precision,
        "tflops": None if peak is None else peak / 1e12,
        "source": ("--peak-tflops" if args.peak_tflops is not None else
                   f"table row {row!r} (workbench.train.flops.PEAKS)" if row else None),
        "note": None if peak is not None else "no peak known for this device: MFU is null (pass --peak-tflops)",
    }
    machine = machine_info()
    _log(f"bench_gpu_train: {mcfg.name} ({mcfg.n_params / 1e6:.1f}M params) on {machine.get('gpu', 'cpu')}, "
         f"{args.batch} x {args.seq_len} tokens, {args.steps} steps ({args.warmup} dropped), modes {modes}")

    t_start = time.time()
    results: dict[str, Any] = {}
    for mode in modes:
        compiled = mode == "compiled"
        _log(f"[{mode}] reference loop (this process) ...")
        try:
            ref = reference_loop(mcfg, tcfg, device, compiled, args.warmup, mode)
        except torch.OutOfMemoryError as e:
            p.exit(1, f"error: the reference loop ran out of GPU memory ({str(e).splitlines()[0]}); "
                      "use a smaller --batch or --seq-len, or a smaller --preset\n")
        ref = with_mfu(ref, fpt, fpt_6n, peak)
        _log("    " + _describe("reference", ref))
        _log(f"[{mode}] trainer (workbench.launch, torchrun, 1 rank) ...")
        ours = with_mfu(trainer_run(mcfg, {**settings, "compile": compiled}, args.warmup, args.timeout, mode),
                        fpt, fpt_6n, peak)
        _log("    " + _describe("trainer", ours))
        ratio_tps = ours["tokens_per_s"] / ref["tokens_per_s"]
        ratio_mem = ours["peak_mem_bytes"] / ref["peak_mem_bytes"]
        on_gpu = device.type == "cuda"
        results[mode] = {
            BASELINE: ref,
            "trainer": ours,
            "tokens_per_s_ratio": ratio_tps,
            "peak_mem_ratio": ratio_mem,
            # same weights, same samples: the first losses agree up to bf16 rounding
            "loss_first_rel_diff": abs(ours["loss_first"] - ref["loss_first"]) / abs(ref["loss_first"]),
            "targets_met": {
                "tokens_per_s": ratio_tps >= TARGETS["tokens_per_s_ratio_min"],
                "peak_mem": ratio_mem <= TARGETS["peak_mem_ratio_max"],
            } if on_gpu else None,
        }
        _log(f"[{mode}] trainer / reference: tokens/s {ratio_tps:.3f}, peak memory {ratio_mem:.3f}"
             + ("" if on_gpu else "  (CPU: a plumbing check, not a performance figure)"))

    doc = {
        "benchmark": "bench_gpu_train",
        "skipped": False,
        "baseline": BASELINE,
        "metric": "tokens_per_s: global tokens (global_batch * seq_len) per second of step time, median over "
                  "the steps after the warm-up; peak_mem_bytes: torch.cuda.max_memory_allocated over the "
                  "whole loop, model build included (CPU: resident set size, not comparable); ratios are "
                  "trainer / reference",
        "device": device.type,
        "plumbing_check_only": device.type != "cuda",
        "smoke": args.smoke,
        "model": {**mcfg.to_dict(), "n_params": mcfg.n_params, "flops_per_token": fpt,
                  "flops_per_token_6n": fpt_6n},
        "global_batch": args.batch,
        "seq_len": args.seq_len,
        "steps": args.steps,
        "warmup_steps_dropped": args.warmup,
        "lr": args.lr,
        "mixed_precision": "bf16",
        "kernels": job.kernels,
        "peak": peak_doc,
        "targets": TARGETS,
        "modes": results,
        "wall_s": round(time.time() - t_start, 1),
        "machine": machine,
    }
    for r in results.values():
        assert math.isfinite(r["tokens_per_s_ratio"]) and math.isfinite(r["peak_mem_ratio"])
    print(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
