"""`make gpu-check`: the GPU half of the workbench checked on one GPU machine, offline, in at most 8 minutes.

    python3 gpu/check.py [--quick] [--out DIR] [--bundle DIR] [--work DIR] [--parts a,b] [--budget PART=S]

It runs under the GPU machine's own python (its CUDA torch), needs no registry, and writes into --out
(GPU_CHECK_OUT): ``summary.json`` (every part: status, seconds, budget, commands, figures, reason),
``check.log`` (progress), ``logs.tar.gz`` (every command's stdout and stderr) and the two benchmarks'
documents ``bench_gpu_train.json`` and ``bench_kernels.json``. The parts, in order (pytest and the
memory grid share the GPU, as its timings do not matter; the benchmarks run last, alone):

    install          gpu/bundle.toml's wheels in --bundle checked (one per pin, tags, never torch/Triton/NVIDIA),
                     then `pip install --no-index --no-deps --target WORK/site` of the pins this python lacks
    environment      torch, CUDA, GPUs, Triton; each requirement's version here against pyproject (probe.py env)
    doctor           `workbench doctor --json`
    import           `import workbench` and the CLI: seconds, and which view modules load (probe.py import)
    memory           a grid of one-GPU jobs: max_memory_allocated / max_memory_reserved of a 2-step run
                     against `workbench memory predict --device cuda` (predicted in the background, from the
                     start); the runs side by side as far as their predictions fit in the GPU's memory
    snapshot         a short `--memory` run's CUDA snapshot (run beside the grid) through `workbench memory
                     import`: its peak against max_memory_allocated and the recorder's
    views            the imported snapshot drawn by MemoryTimelineView (the bundled plotly/ipywidgets/anywidget)
    pytest           `pytest -m gpu tests/test_gpu.py` (the kernels' check on the GPU included), started after
                     `environment`; the benchmark smoke test deselected (run in full below)
    bench_gpu_train  the trainer against the tuned eager and compiled loops: 886M Llama, 8 x 2048, bf16
    bench_kernels    our Triton kernels at issue 31's targets' sizes vs torch eager, inductor, copy_
    cpu_2rank        `workbench train tiny --nproc 2 --tp 2 --device cpu` (gloo ranks on the GPU machine;
                     started in the background after `environment`)

Each part runs as subprocesses in their own process group, killed when the part's time is up (status
``timed_out``). A part may use its budget plus whatever the parts before it left unused, never time
reserved for the parts after it, so the whole check ends within ``--deadline`` (480 s; 180 s with
``--quick``, which runs a subset). Without a CUDA GPU every GPU part is skipped with the reason and the
others run: that is the CPU smoke of tests/test_gpu_check.py. Exit status: 0 when no part failed or
timed out, 1 otherwise, 2 for bad arguments. Standard library only (and `packaging`, or pip's copy of
it): the bundle is not installed yet.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import shlex
import sys
import tarfile
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from importlib import metadata, util
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

import bundle  # noqa: E402
import figures  # noqa: E402
from jobs import KILL_GRACE_S, Job, _alive, kill_all, run_packed  # noqa: E402,F401

SCHEMA = "workbench.gpu_check/1"
# The untimed GPU work first, side by side: pytest (started in the background after `environment`) beside the
# memory grid, whose runs share the GPU too. The benchmarks last, each alone on the GPU.
GPU_PARTS = ("memory", "snapshot", "views", "pytest", "bench_gpu_train", "bench_kernels")
SERIAL = ("install", "environment", "doctor", "import", *GPU_PARTS)
PARTS = (*SERIAL, "cpu_2rank")
# Seconds per part. The serial parts' budgets add up to under the deadline; the background jobs (the
# memory predictions, cpu_2rank) run beside them with caps of their own, which the deadline also bounds.
BUDGETS = {
# Sized from two runs on an H200 (docs/benchmarks.md, "GPU check"): the memory grid's runs take 35-47 s each,
# most of it the launch (interpreters, NCCL, build); pytest's part is what is left of its wait.
    "full": dict(install=10, environment=12, doctor=15, import_=12, memory=125, snapshot=20, views=20, pytest=10,
                 bench_gpu_train=150, bench_kernels=80, cpu_2rank=120, predictions=150),
    "quick": dict(install=8, environment=8, doctor=8, import_=8, memory=50, snapshot=20, views=15, pytest=5,
                  bench_gpu_train=0, bench_kernels=45, cpu_2rank=60, predictions=60),
}
DEADLINE = {"full": 480.0, "quick": 180.0}
MARGIN_S = 10.0  # kept back from the deadline: a killed part's grace (KILL_GRACE_S), the summary, the logs' archive

LLAMA = "benchmarks/llama-886m.json"  # the ~1B Llama of bench_gpu_train.py: one definition
# name -> (model, seq_len, extra `workbench train` / `memory predict` flags); global batch 8, one GPU
MEMORY_GRID: dict[str, tuple[str, int, list[str]]] = {
    "plain": (LLAMA, 2048, []),
    "ac_full": (LLAMA, 2048, ["--ac", "full"]),
    "ac_selective": (LLAMA, 2048, ["--ac", "selective"]),
    "bf16_mixed": (LLAMA, 2048, ["--mixed-precision", "bf16"]),
    "micro_batch_2": (LLAMA, 2048, ["--micro-batch", "2"]),
    "bf16_dtype": (LLAMA, 2048, ["--dtype", "bfloat16"]),
    "small": ("small", 1024, []),
}
MEMORY_QUICK = ("bf16_mixed", "small")
# --quick leaves out the trainer benchmark: its eager half alone took 65 s on an H200 (two launches, the build)
QUICK_SKIPS = {"bench_gpu_train": "not in --quick: the trainer benchmark alone takes over a minute"}
PYTEST_GPU_BYTES = 12 << 30  # what pytest -m gpu's tiny runs (4 workers) may hold beside the memory grid
MEMORY_STEPS = 2  # the predictor simulates two steps: the first makes the optimizer state


def _key(part: str) -> str:
    return "import_" if part == "import" else part


# --------------------------------------------------------------------------------------------------
# Parts
# --------------------------------------------------------------------------------------------------


@dataclass
class Part:
    name: str
    status: str = "pending"  # ok | failed | skipped | timed_out
    reason: str | None = None
    seconds: float = 0.0
    budget_s: float = 0.0
    allowed_s: float | None = None  # the budget plus what earlier parts left unused
    commands: list[str] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    log_tail: str | None = None

    def end(self, status: str, reason: str | None = None, job: Job | None = None) -> None:
        if status == "timed_out" and reason is None:
            reason = "killed at the end of its time; log_tail shows how far it got"
        self.status, self.reason = status, reason
        if job is not None and status in ("failed", "timed_out"):
            self.log_tail = job.tail()


class Check:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.mode = "quick" if args.quick else "full"
        self.budgets = {**BUDGETS[self.mode], **args.budget}
        self.deadline_s = args.deadline if args.deadline is not None else DEADLINE[self.mode]
        self.out, self.work = Path(args.out).resolve(), Path(args.work).resolve()
        self.logs, self.site, self.runs = self.work / "logs", self.work / "site", self.work / "runs"
        # install and environment always run: they set up the parts' python and tell whether a GPU is here
        self.selected = [p for p in PARTS if p in args.parts or p in ("install", "environment")]
        self.parts = {p: Part(p, budget_s=float(self.budgets[_key(p)])) for p in PARTS}
        self.python = sys.executable
        self.env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.machine: dict[str, Any] = {}
        self.gpu: str | None = None
        self.background: dict[str, Job] = {}
        self._predict_cap = float(self.budgets["predictions"])
        self._snapshot_job: Job | None = None
        self._pytest_workers = 1  # the snapshot part's run, started beside the memory grid
        self.t0 = time.monotonic()
        self.started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
        self._log_file = None

    # -- bookkeeping ------------------------------------------------------------------------------
    def log(self, msg: str) -> None:
        line = f"[gpu-check {time.monotonic() - self.t0:6.1f}s] {msg}"
        print(line, file=sys.stderr, flush=True)
        if self._log_file is not None:
            self._log_file.write(line + "\n")
            self._log_file.flush()

    def left(self) -> float:
        return self.deadline_s - MARGIN_S - (time.monotonic() - self.t0)

    def allowance(self, name: str) -> float:
        """This part's time: its budget, plus what is left before the deadline beyond the budgets of the
        parts after it that will run; never past the deadline. (Budgets that add up to more than the
        deadline shorten the last parts, not the first.)"""
        later = [p for p in SERIAL[SERIAL.index(name) + 1:] if self.parts[p].status == "pending"]
        left = self.left()
        return max(0.0, min(left, max(self.parts[name].budget_s, left - sum(self.parts[p].budget_s for p in later))))

    def job(self, name: str, cmd: list[str], part: Part) -> Job:
        part.commands.append(shlex.join(_rel(c) for c in cmd))
        return Job(name, cmd, self.logs, self.env)

    def cli(self, *args: str) -> list[str]:
        return [self.python, "-m", "workbench.cli", *args]

    # -- running ----------------------------------------------------------------------------------
    def run(self) -> int:
        for d in (self.logs, self.site, self.runs):  # only the folders this check makes
            shutil.rmtree(d, ignore_errors=True)
        self.logs.mkdir(parents=True)
        self.runs.mkdir(parents=True)
        self.out.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.out / "check.log", "w")
        self.log(f"{self.mode} check, deadline {self.deadline_s:.0f} s, python {self.python}, out {self.out}")
        for p in PARTS:
            if p not in self.selected:
                self.parts[p].status, self.parts[p].reason = "skipped", "not in --parts"
            elif self.mode == "quick" and p in QUICK_SKIPS:
                self.parts[p].status, self.parts[p].reason = "skipped", QUICK_SKIPS[p]
        try:
            for name in SERIAL:
                self._run_part(self.parts[name])
                if name == "environment":
                    self._after_environment()
            self._finish_cpu_2rank()
        finally:
            kill_all(list(self.background.values()))
        return self._write()

    def _run_part(self, part: Part) -> None:
        if part.status == "pending":
            allowed = self.allowance(part.name)
            part.allowed_s = round(allowed, 1)
            if allowed < 1.0:
                part.end("skipped", f"the check's {self.deadline_s:.0f} s deadline left no time for it")
            else:
                t = time.monotonic()
                try:
                    getattr(self, f"part_{part.name}")(part, t + allowed)
                except Exception as e:  # noqa: BLE001 - one part's bug must not lose the others' figures
                    part.end("failed", f"the check itself failed in this part: {type(e).__name__}: {e}")
                part.seconds = round(time.monotonic() - t, 1)
        self._report(part)

    def _report(self, part: Part) -> None:
        why = f": {part.reason}" if part.reason else ""
        self.log(f"{part.name}: {part.status} ({part.seconds:.1f} s of {part.allowed_s or part.budget_s:.0f} s){why}")

    def _after_environment(self) -> None:
        env_part = self.parts["environment"]
        if env_part.status not in ("ok", "failed") or not self.machine:
            for p in PARTS[PARTS.index("doctor"):]:
                if self.parts[p].status == "pending":
                    self.parts[p].end("skipped", "the environment probe gave no answer (torch did not import?); "
                                                 "see its log")
            return
        if not self.gpu:
            cuda = self.machine.get("torch_cuda")
            why = (f"no CUDA GPU: torch {self.machine.get('torch')} is a CPU build" if not cuda else
                   f"no CUDA GPU: torch {self.machine.get('torch')} (CUDA {cuda}) sees no device")
            for p in GPU_PARTS:
                if self.parts[p].status == "pending":
                    self.parts[p].end("skipped", why)
                    self.parts[p].commands = self._planned(p)
        else:
            if self.parts["memory"].status == "pending":
                self._start_predictions()
            if self.parts["pytest"].status == "pending":
                self._start_pytest()
        if self.parts["cpu_2rank"].status == "pending":
            part = self.parts["cpu_2rank"]
            out = self.runs / "cpu_2rank"
            j = self.job("cpu_2rank", self.cli("train", "tiny", "--nproc", "2", "--tp", "2", "--steps", "3",
                                              "--device", "cpu", "--out", str(out), "--json", "--timeout",
                                              str(int(part.budget_s))), part)
            self.background["cpu_2rank"] = j.start()
            self.log("cpu_2rank: started in the background")

    def _planned(self, part: str) -> list[str]:
        """What a skipped GPU part would have run (so the summary shows it on any machine)."""
        py = "python"
        if part == "pytest":
            return [shlex.join([py, *self._pytest_args(xdist=False)])]
        if part == "bench_gpu_train":
            return [shlex.join([py, *a]) for a in self._bench_gpu_train_args()]
        if part == "bench_kernels":
            return [shlex.join([py, *self._bench_kernels_args()])]
        if part == "memory":
            return [f"{py} -m workbench.cli memory predict {m} {' '.join(self._memory_args(s, f))} --device cuda --json"
                    f"  |  {py} -m workbench.cli train {m} {' '.join(self._memory_args(s, f))} --device cuda "
                    f"--steps {MEMORY_STEPS} --json" for m, s, f in (MEMORY_GRID[n] for n in self._memory_names())]
        if part == "snapshot":
            return [f"{py} -m workbench.cli train small ... --device cuda --memory --json",
                    f"{py} -m workbench.cli memory import RUN/memory/rank0.cuda_snapshot.pickle --json"]
        return [f"{py} gpu/probe.py views IMPORTED RUN/memory"]

    # -- install ----------------------------------------------------------------------------------
    def part_install(self, part: Part, until: float) -> None:
        """Install the pins this python lacks, or has in another version, from the bundle; nothing else."""
        spec = bundle.Spec(self.args.spec)
        have = {name: _installed(name) for name in spec.pins}
        missing = [n for n, v in have.items() if v is None]
        other = [n for n, v in have.items() if v is not None and v != spec.pins[n]]
        part.figures = {"bundle": _rel(self.args.bundle), "spec": _rel(spec.path), "pins": len(spec.pins),
                        "present": sorted(f"{n}=={v}" for n, v in have.items() if v is not None),
                        "installed": [], "site": _rel(self.site)}
        bundle_dir = Path(self.args.bundle)
        if spec.problems:
            part.end("failed", f"{_rel(spec.path)}: " + "; ".join(spec.problems))
            return
        if not bundle_dir.is_dir():
            if missing:
                part.end("failed", f"no bundle at {_rel(bundle_dir)}, and this python lacks {', '.join(missing)}: "
                                   "run `make gpu-bundle` on a machine with a registry and bring that folder")
            else:  # nothing to bring: a machine that has the packages (another version is noted, not fatal)
                part.end("ok", "nothing to install: this python has every pinned package"
                         + (f" ({len(other)} in another version: {', '.join(other)})" if other else ""))
            return
        wheels, problems = bundle.verify_folder(spec, bundle_dir)
        part.figures.update(wheels=len(wheels), bundle_bytes=sum(w.stat().st_size for w in wheels.values()))
        if problems:
            more = f" (and {len(problems) - 1} more: {'; '.join(problems[1:])})" if len(problems) > 1 else ""
            part.end("failed", problems[0] + more)
            return
        todo = missing + other  # the pinned version, the one tested, goes first on the parts' path
        if not todo:
            part.end("ok", "nothing to install: this python has every pinned package")
            return
        here = f"{sys.version_info.major}.{sys.version_info.minor}"
        if here != spec.python:
            part.end("failed", f"the bundle is for CPython {spec.python} and this python is {here}: run the check "
                               f"with a {spec.python} GPU_PYTHON, or change [target] in {_rel(spec.path)}")
            return
        j = self.job("install", [self.python, "-m", "pip", "install", "--no-index", "--no-deps", "--no-compile",
                                 "--no-cache-dir", "--disable-pip-version-check", "--quiet", "--target",
                                 str(self.site), *[str(wheels[n]) for n in todo]], part).start()
        j.wait(until - time.monotonic())
        if j.timed_out or j.rc != 0:
            part.end("timed_out" if j.timed_out else "failed",
                     None if j.timed_out else f"pip install exited {j.rc}", j)
            return
        part.figures["installed"] = [f"{n}=={spec.pins[n]}" for n in todo]
        part.figures["site_bytes"] = sum(f.stat().st_size for f in self.site.rglob("*") if f.is_file())
        part.end("ok")

    def _path_env(self) -> None:
        """The parts see the installed bundle first, then this checkout's workbench."""
        paths = ([str(self.site)] if self.site.is_dir() else []) + [str(REPO)]
        if os.environ.get("PYTHONPATH"):
            paths.append(os.environ["PYTHONPATH"])
        self.env["PYTHONPATH"] = os.pathsep.join(paths)

    # -- environment, doctor, import ----------------------------------------------------------------
    def _simple(self, part: Part, until: float, name: str, cmd: list[str],
                extract: Callable[[dict[str, Any]], tuple[dict[str, Any], str | None]]) -> dict[str, Any] | None:
        """Run one command that prints one JSON document; ``extract(doc)`` -> (figures, failure or None)."""
        j = self.job(name, cmd, part).start().wait(until - time.monotonic())
        doc = j.document()
        if j.timed_out:
            part.end("timed_out", None, j)
        elif j.rc != 0 or doc is None:
            part.end("failed", f"exit {j.rc}" + ("" if doc is not None else ", no JSON document"), j)
        else:
            part.figures, failure = extract(doc)
            part.end("failed" if failure else "ok", failure, j)
        return doc

    def part_environment(self, part: Part, until: float) -> None:
        self._path_env()

        def extract(doc):
            unmet = [f"{r['requirement']} ({r['for']}): {r['note'] or 'found ' + str(r['found'])}" for r in doc["unmet"]]
            omitted = [r["requirement"] for r in doc["requirements"] if (r["note"] or "").startswith("omitted")]
            figs = {k: v for k, v in doc.items() if k not in ("requirements", "unmet")}
            figs.update(requirements_checked=len(doc["requirements"]), unmet=unmet, omitted=omitted)
            return figs, (f"requirements not met here: {'; '.join(unmet)}" if unmet else None)

        doc = self._simple(part, until, "environment", [self.python, str(HERE / "probe.py"), "env"], extract)
        if doc is None and "No module named 'torch'" in (part.log_tail or ""):
            part.reason = (f"{self.python} has no torch: run the check with the python of the machine's CUDA torch "
                           "(make gpu-check GPU_PYTHON=/path/to/python3)")
        if doc is not None:
            self.machine = {k: v for k, v in doc.items() if k not in ("requirements", "unmet")}
            self.gpu = doc["gpus"][0]["name"] if doc.get("cuda_available") and doc.get("gpus") else None

    def part_doctor(self, part: Part, until: float) -> None:
        def extract(doc):
            keep = ("torch", "torch_cuda", "cuda_available", "devices", "backends", "nccl", "triton", "kernels",
                    "skipped")
            return {k: doc.get(k) for k in keep}, None

        self._simple(part, until, "doctor", self.cli("doctor", "--json"), extract)

    def part_import(self, part: Part, until: float) -> None:
        def extract(doc):
            ours = Path(doc["workbench"]) == REPO / "workbench"
            return doc, None if ours else f"imported workbench from {doc['workbench']}, not this checkout"

        self._simple(part, until, "import", [self.python, str(HERE / "probe.py"), "import"], extract)

    # -- pytest -------------------------------------------------------------------------------------
    def _pytest_args(self, xdist: bool) -> list[str]:
        args = ["-m", "pytest", "-m", "gpu", "tests/test_gpu.py", "-p", "no:cacheprovider", "-v", "-rA",
                f"--junitxml={_rel(self.logs / 'pytest.xml')}"]
        args += ["-k", "one_rank_trains" if self.mode == "quick" else "not gpu_benchmarks_smoke"]
        return args + (["-n", "4"] if xdist else [])

    def _start_pytest(self) -> None:
        xdist = self.mode == "full" and util.find_spec("xdist") is not None  # the tests' launches side by side
        self._pytest_workers = 4 if xdist else 1
        self.background["pytest"] = self.job("pytest", [self.python, *self._pytest_args(xdist)],
                                             self.parts["pytest"]).start()
        self.log(f"pytest: started in the background ({self._pytest_workers} workers)")

    def part_pytest(self, part: Part, until: float) -> None:
        """Waits for the pytest started after `environment` (beside the memory grid), within its budget plus
        what the parts before it left."""
        if "pytest" not in self.background:
            self._start_pytest()
        j = self.background["pytest"].wait(until - time.monotonic())
        # the JUnit file is written at the end: a pytest stopped at its time leaves its -v lines only
        xml = self.logs / "pytest.xml"
        part.figures = figures.junit(xml) if xml.exists() else figures.verbose(j.stdout())
        part.figures["deselected"] = ("all but test_one_rank_trains_on_cuda_with_nccl_and_reports_mfu (--quick)"
                                      if self.mode == "quick" else
                                      "test_gpu_benchmarks_smoke: bench_gpu_train and bench_kernels run in full below")
        part.figures["workers"] = self._pytest_workers
        f = part.figures
        if j.timed_out:
            part.end("timed_out", f"stopped after {f.get('passed', 0)} passed, {f.get('failed', 0)} failed", j)
        elif f.get("failed") or f.get("errors") or j.rc != 0:
            bad = [n for n, t in f.get("tests", {}).items() if t["outcome"] in ("failed", "error")]
            part.end("failed", f"exit {j.rc}; failed: {', '.join(bad) or 'see the log'}", j)
        elif not f.get("passed"):
            part.end("skipped", "; ".join(sorted({t["message"] for t in f.get("tests", {}).values()
                                                  if t["outcome"] == "skipped"})) or "no test ran", j)
        else:
            part.end("ok")

    # -- benchmarks ---------------------------------------------------------------------------------
    def _bench_gpu_train_args(self) -> list[list[str]]:
        script = "benchmarks/bench_gpu_train.py"
        steps = {"eager": ("12", "4"), "compiled": ("10", "3")}  # (steps, warm-up steps dropped)
        return [[script, "--modes", m, "--steps", steps[m][0], "--warmup", steps[m][1]] for m in ("eager", "compiled")
                if m in self.args.train_modes]

    def part_bench_gpu_train(self, part: Part, until: float) -> None:
        runs = self._bench_gpu_train_args()
        docs: dict[str, Any] = {}
        for i, args in enumerate(runs):
            mode = args[args.index("--modes") + 1]
            # eager is the cheaper half (no compilation; 65 s on an H200): 47% of the time when compiled
            # follows, which gets
            # the rest, eager's leftover included
            share = (until - time.monotonic()) * (0.47 if i < len(runs) - 1 else 1.0)
            j = self.job(f"bench_gpu_train_{mode}", [self.python, *args, "--timeout", str(int(share))], part)
            j.start().wait(share)
            doc = j.document()
            if doc is not None:
                docs[mode] = doc
                part.figures[mode] = figures.gpu_train_figures(doc, mode)
            if j.timed_out or j.rc != 0 or doc is None:
                part.end("timed_out" if j.timed_out else "failed",
                         f"{mode}: " + ("stopped at its time" if j.timed_out else f"exit {j.rc}"), j)
                break
        else:
            part.end("ok")
        if docs:
            (self.out / "bench_gpu_train.json").write_text(json.dumps(docs, indent=2))

    def _bench_kernels_args(self) -> list[str]:
        # the kernels' correctness on this GPU is pytest's test_triton_kernels_pass_their_checks_on_the_gpu
        if self.mode == "quick":
            return ["benchmarks/bench_kernels.py", "--targets", "gpu-check", "--no-check", "--quick", "--no-compile",
                    "--repeats", "5"]
        return ["benchmarks/bench_kernels.py", "--targets", "gpu-check", "--no-check", "--repeats", "10"]

    def part_bench_kernels(self, part: Part, until: float) -> None:
        j = self.job("bench_kernels", [self.python, *self._bench_kernels_args()], part).start()
        j.wait(until - time.monotonic())
        doc = j.document()
        if doc is not None:
            (self.out / "bench_kernels.json").write_text(json.dumps(doc, indent=2))
            part.figures = figures.kernel_figures(doc)
        if j.timed_out:
            part.end("timed_out", None, j)
        elif doc is None or j.rc not in (0, 1):
            part.end("failed", f"exit {j.rc}", j)
        elif j.rc == 1 or (doc.get("check") is not None and not doc["check"].get("ok")):
            part.end("failed", "a kernel failed its check on the GPU (bench_kernels.json: check)", j)
        else:
            part.end("ok")

    # -- memory ---------------------------------------------------------------------------------------
    def _memory_names(self) -> tuple[str, ...]:
        if self.args.memory_configs:
            return tuple(self.args.memory_configs)
        return MEMORY_QUICK if self.mode == "quick" else tuple(MEMORY_GRID)

    @staticmethod
    def _memory_args(seq_len: int, flags: list[str]) -> list[str]:
        return ["--nproc", "1", "--global-batch", "8", "--seq-len", str(seq_len), *flags]

    def _start_predictions(self) -> None:
        """CPU work on fake tensors: started right after `environment`, beside the GPU parts (one core each)."""
        part = self.parts["memory"]
        env = dict(self.env, OMP_NUM_THREADS="1")
        for name in self._memory_names():
            model, seq_len, flags = MEMORY_GRID[name]
            j = self.job(f"memory_predict_{name}", self.cli("memory", "predict", model, *self._memory_args(seq_len, flags),
                                                            "--device", "cuda", "--json"), part)
            j.env = env
            self.background[f"predict:{name}"] = j.start()
        self.log(f"memory: {len(self._memory_names())} predictions started in the background")

    def _memory_need(self, name: str, until: float) -> tuple[dict[str, Any] | None, int | None]:
        """The prediction of config ``name`` (waiting for it within its cap) and the GPU memory its run is
        given room for beside the others: predicted x 1.15 + 1.5 GiB (the allocator's reserve over what it
        hands out, the CUDA context). None when there is no prediction: that run goes alone."""
        pj = self.background.get(f"predict:{name}")
        if pj is None:
            return None, None
        pj.wait(min(until - time.monotonic(), self._predict_cap - (time.monotonic() - pj.t0)))
        doc = pj.document()
        if doc is None or pj.rc != 0 or not isinstance(doc.get("max_peak_bytes"), int):
            return None, None
        return doc, int(doc["max_peak_bytes"] * 1.15) + (3 << 29)

    def part_memory(self, part: Part, until: float) -> None:
        """The grid's runs side by side on the one GPU, as many at a time as their predictions fit in 88% of
        its memory (each process's max_memory_allocated is its own); the snapshot part's run joins them."""
        rows: dict[str, Any] = {}
        gpu_bytes = (self.machine.get("gpus") or [{}])[0].get("memory_bytes")
        capacity = int(gpu_bytes * 0.88) if gpu_bytes else None
        pytest_job = self.background.get("pytest")
        if capacity and pytest_job is not None and not pytest_job.done:
            capacity -= PYTEST_GPU_BYTES
        part.figures = {"baseline": "measured max_memory_allocated / max_memory_reserved (step events of a "
                                    f"{MEMORY_STEPS}-step run); error = predicted / measured - 1",
                        "side_by_side": f"within {capacity} bytes (88% of the GPU), by predicted peak",
                        "configs": rows}
        packed, docs = [], {}
        for name in self._memory_names():
            model, seq_len, flags = MEMORY_GRID[name]
            rows[name] = {"model": Path(model).stem, "global_batch": 8, "seq_len": seq_len, "flags": " ".join(flags)}
            docs[name], need = self._memory_need(name, until)
            out = self.runs / "memory" / name
            j = self.job(f"memory_train_{name}", self.cli("train", model, *self._memory_args(seq_len, flags),
                                                          "--device", "cuda", "--steps", str(MEMORY_STEPS),
                                                          "--out", str(out), "--json", "--timeout",
                                                          str(max(1, int(until - time.monotonic() - 5)))), part)
            packed.append((j, need))
        snap = self.parts["snapshot"]
        if snap.status == "pending":  # a small run: it shares the GPU with the grid instead of waiting
            self._snapshot_job = self.job("snapshot_train", self._snapshot_cmd(), snap)
            packed.append((self._snapshot_job, 8 << 30))
        run_packed(packed, capacity, until, leave=(self._snapshot_job,) if self._snapshot_job else ())
        for (j, _), name in zip(packed, self._memory_names()):
            row, out, doc = rows[name], self.runs / "memory" / name, docs[name]
            row.update(figures.measured_peaks(out))
            row.update(figures.run_phases(out))
            row["run_s"] = j.seconds if j.proc is not None else None
            if j.proc is None:
                row["status"] = "not run: the part's time ran out"
            elif j.timed_out or j.rc != 0 or row.get("allocated_bytes") is None:
                row["status"] = "timed out" if j.timed_out else f"train failed (exit {j.rc}): {j.tail(3)}"
            elif doc is None:
                row["status"] = "no prediction: it failed, timed out or was not started"
            else:
                pred = int(doc["max_peak_bytes"])
                # the allocator model's reserved peak against max_memory_reserved (the 5% check)
                pred_res = doc.get("max_reserved_bytes")
                row.update(predict_s=doc.get("prediction_s"), predicted_bytes=pred,
                           predicted_reserved_bytes=pred_res,
                           error_vs_allocated=pred / row["allocated_bytes"] - 1,
                           error_vs_reserved=int(pred_res) / row["reserved_bytes"] - 1
                           if pred_res and row.get("reserved_bytes") else None,
                           status="ok")
        done = [r for r in rows.values() if r.get("status") == "ok"]
        for what in ("allocated", "reserved"):
            errs = sorted(abs(r[f"error_vs_{what}"]) for r in done if r.get(f"error_vs_{what}") is not None)
            if errs:
                part.figures.update({f"median_abs_error_vs_{what}": errs[len(errs) // 2],
                                     f"max_abs_error_vs_{what}": errs[-1]})
        bad = {n: r["status"] for n, r in rows.items() if r.get("status") != "ok"}
        if not bad:
            part.end("ok")
        else:
            timed = all(s.startswith(("not run", "timed out")) for s in bad.values())
            part.end("timed_out" if timed else "failed", "; ".join(f"{n}: {s}" for n, s in bad.items()))

    # -- snapshot and views ---------------------------------------------------------------------------
    def _snapshot_cmd(self) -> list[str]:
        return self.cli("train", "small", "--nproc", "1", "--global-batch", "8", "--seq-len", "1024", "--steps", "2",
                        "--device", "cuda", "--memory", "--out", str(self.runs / "snapshot"), "--json")

    def part_snapshot(self, part: Part, until: float) -> None:
        run, imported = self.runs / "snapshot", self.runs / "snapshot_imported"
        steps = [
            ("snapshot_train", self._snapshot_cmd()),
            ("snapshot_import", self.cli("memory", "import", str(run / "memory" / "rank0.cuda_snapshot.pickle"),
                                         "--out", str(imported), "--json")),
            ("snapshot_show", self.cli("memory", "show", str(run), "--json")),
        ]
        docs = {}
        for name, cmd in steps:
            j = self._snapshot_job if name == "snapshot_train" and self._snapshot_job is not None else None
            if j is None or j.proc is None:  # not run beside the memory grid: run it now
                j = self.job(name, cmd, part).start()
            j.wait(until - time.monotonic())
            docs[name] = j.document()
            if j.timed_out or j.rc != 0 or docs[name] is None:
                part.end("timed_out" if j.timed_out else "failed", f"{name}: exit {j.rc}", j)
                return
            part.figures[f"{name}_s"] = j.seconds
        meta = json.loads((run / "memory" / "rank0.json").read_text())
        allocated = figures.find(meta, "max_memory_allocated")
        snap_peak, recorder_peak = (figures.rank0_peak(docs[k]) for k in ("snapshot_import", "snapshot_show"))
        part.figures.update(
            snapshot_bytes=(run / "memory" / "rank0.cuda_snapshot.pickle").stat().st_size,
            events=docs["snapshot_import"].get("events"), snapshot_peak_bytes=snap_peak,
            max_memory_allocated=allocated, recorder_peak_bytes=recorder_peak,
            snapshot_vs_allocated=snap_peak / allocated - 1 if allocated else None,
            recorder_vs_allocated=recorder_peak / allocated - 1 if allocated else None)
        part.end("ok" if allocated else "failed", None if allocated else "the run's memory meta has no "
                                                                          "max_memory_allocated")

    def part_views(self, part: Part, until: float) -> None:
        imported, measured = self.runs / "snapshot_imported", self.runs / "snapshot" / "memory"
        if self.parts["snapshot"].status != "ok":
            part.end("skipped", "needs the snapshot part's imported timeline")
            part.commands = self._planned("views")
            return
        self._simple(part, until, "views", [self.python, str(HERE / "probe.py"), "views", str(imported),
                                            str(measured)], lambda doc: (doc, None if doc["traces"] else "no traces drawn"))

    # -- cpu_2rank ------------------------------------------------------------------------------------
    def _finish_cpu_2rank(self) -> None:
        part = self.parts["cpu_2rank"]
        j = self.background.get("cpu_2rank")
        if part.status != "pending" or j is None:
            if part.status == "pending":
                part.end("skipped", "not started: the environment probe gave no answer")
            self._report(part)
            return
        j.wait(min(part.budget_s - (time.monotonic() - j.t0), self.left()))  # its budget counts from its start
        part.seconds, part.allowed_s = j.seconds, part.budget_s
        doc = j.document()
        starts = [e for e in figures.events(self.runs / "cpu_2rank") if e.get("type") == "start"]
        part.figures = {"ranks": sorted(e["rank"] for e in starts),
                        "backends": sorted({e.get("backend") for e in starts}),
                        "devices": sorted({e.get("device") for e in starts}),
                        **({k: doc.get(k) for k in ("status", "layout", "first_loss", "final_loss", "tokens_per_s")}
                           if doc else {})}
        f = part.figures
        if j.timed_out:
            part.end("timed_out", None, j)
        elif j.rc != 0 or not doc or doc.get("status") != "succeeded":
            part.end("failed", f"exit {j.rc}", j)
        elif f["ranks"] != [0, 1] or f["backends"] != ["gloo"]:
            part.end("failed", f"expected ranks [0, 1] on gloo, saw {f['ranks']} on {f['backends']}", j)
        else:
            part.end("ok")
        self._report(part)

    # -- the summary ----------------------------------------------------------------------------------
    def _write(self) -> int:
        counts = {s: sum(1 for p in self.parts.values() if p.status == s)
                  for s in ("ok", "failed", "timed_out", "skipped")}
        bad = counts["failed"] + counts["timed_out"]
        skipped_gpu = [p for p in GPU_PARTS if self.parts[p].status == "skipped"]
        summary = {
            "schema": SCHEMA, "status": "failed" if bad else "ok",
            "complete": counts["ok"] == len(PARTS),
            "quick": self.mode == "quick", "gpu": self.gpu,
            "note": None if self.gpu else "no GPU figures: every GPU part was skipped (a plumbing run)",
            "started_at": self.started_at, "wall_s": round(time.monotonic() - self.t0, 1),
            "deadline_s": self.deadline_s, "machine": self.machine, "counts": counts,
            "skipped_gpu_parts": skipped_gpu,
            "parts": {name: {k: v for k, v in asdict(p).items() if k != "name"} for name, p in self.parts.items()},
            "files": {"logs": "logs.tar.gz", "progress": "check.log",
                      **{k: f"{k}.json" for k in ("bench_gpu_train", "bench_kernels") if (self.out / f"{k}.json").exists()}},
        }
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
        with tarfile.open(self.out / "logs.tar.gz", "w:gz") as tar:
            tar.add(self.logs, arcname="logs")
        self.log(f"{summary['status']}: " + ", ".join(f"{n} {s}" for s, n in counts.items() if n)
                 + f" in {summary['wall_s']:.0f} s; {self.out / 'summary.json'}")
        if self._log_file is not None:
            self._log_file.close()
        return 1 if bad else 0


# --------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------


def _rel(p: Any) -> str:
    s = str(p)
    root = str(REPO) + os.sep
    return s[len(root):] if s.startswith(root) else s


def _installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


# --------------------------------------------------------------------------------------------------


def _budget(text: str) -> tuple[str, float]:
    name, _, value = text.partition("=")
    key = _key(name.strip())
    if key not in BUDGETS["full"]:
        raise argparse.ArgumentTypeError(f"{name!r} is not a part; choose from {', '.join((*PARTS, 'predictions'))}")
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give seconds > 0, e.g. pytest=150")
    return key, seconds


def _names(choices: Any, what: str) -> Callable[[str], list[str]]:
    """An argparse type: a comma list of ``choices`` (``what`` names them in the error)."""
    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        unknown = [n for n in names if n not in choices]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"unknown {what} {unknown}; choose from {', '.join(choices)}")
        return names
    return parse


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a subset within 3 minutes")
    ap.add_argument("--out", default=os.environ.get("GPU_CHECK_OUT") or str(REPO / "gpu-check-out"),
                    help="summary.json, check.log, logs.tar.gz and the benchmarks' documents (default: "
                         "$GPU_CHECK_OUT or gpu-check-out/)")
    ap.add_argument("--work", default=str(REPO / ".gpu-check"),
                    help="the installed bundle (site/), the runs and the logs (default: .gpu-check/)")
    ap.add_argument("--bundle", default=str(bundle.DEFAULT_DEST), help="the wheels of `make gpu-bundle` "
                    "(default: .gpu-bundle/)")
    ap.add_argument("--spec", default=str(bundle.SPEC), help=argparse.SUPPRESS)  # tests: another pin list
    ap.add_argument("--parts", type=_names(PARTS, "part(s)"), default=list(PARTS), help=f"a comma list of {', '.join(PARTS)}")
    ap.add_argument("--budget", type=_budget, action="append", default=[], metavar="PART=SECONDS",
                    help="another budget for one part (repeatable; `predictions` caps the memory predictions)")
    ap.add_argument("--train-modes", type=_names(("eager", "compiled"), "mode(s)"),
                    default=["eager", "compiled"], help="bench_gpu_train's modes: eager,compiled (default both; "
                    "--quick: eager)")
    ap.add_argument("--memory-configs", type=_names(MEMORY_GRID, "config(s)"), default=None,
                    help=f"the memory grid's configs to run (default all; --quick: {','.join(MEMORY_QUICK)}): "
                         f"{','.join(MEMORY_GRID)}")
    ap.add_argument("--deadline", type=float, default=None, help="seconds for the whole check (default 480; "
                    "--quick 180)")
    args = ap.parse_args(argv)
    args.budget = dict(args.budget)
    return Check(args).run()


if __name__ == "__main__":
    sys.exit(main())
