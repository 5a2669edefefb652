"""The mutation fuzzer, and the preloaded driver process the hostile tests talk to.

Every format workbench reads gets ``per_format`` inputs: its valid base (``hostile_bases``) with one or
two seeded mutations (``hostile_mutate``) applied to one of its files, read by the format's readers
(every input through ``always``, and one of ``rotate`` in turn) in forked children (``hostile_harness``).
Input ``k`` of format ``f`` under seed ``s`` is the same mutation on every run (a path it plants points
into that run's scratch directory): its key is ``fuzz:f:s:k``, and ``--only KEY`` rebuilds and rereads just
that one.

    python tests/hostile/hostile_fuzz.py --per-format 500              # one JSON document on stdout
    python tests/hostile/hostile_fuzz.py --only fuzz:dcp:0:17 --keep   # one input, its directory kept
    python tests/hostile/hostile_fuzz.py --case "deep" --keep          # the corpus cases named so
    python tests/hostile/hostile_fuzz.py --serve                       # the tests' driver (JSON lines)

The driver imports torch and workbench once, writes the bases in a forked child, and calls every
reader once on them (so no child imports anything), then forks its children from that state.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for p in (str(HERE), str(REPO)):
    if p not in sys.path:
        sys.path.insert(0, p)

os.environ.setdefault("OMP_NUM_THREADS", "1")

import hostile_harness as H  # noqa: E402
from hostile_mutate import Mutator  # noqa: E402


@dataclass(frozen=True)
class Format:
    """A file format: its bases (input k starts from ``variants[k % len]``: e.g. a DCP directory with and
    without workbench.json), the files in it a mutation may hit, and the readers."""

    name: str
    variants: tuple[tuple[str, tuple[tuple[str, str, int], ...]], ...]  # (base, ((file, mutator, weight), ...))
    always: tuple[str, ...]
    rotate: tuple[str, ...] = ()


# One reader per input, in turn (inspect and verify twice as often: every other reader starts with them);
# a few cheap sniffers (identify_memory_file) read every input too.
_CKPT = ((), ("ckpt.inspect", "ckpt.verify", "ckpt.tensor_stats", "ckpt.read_tensor", "ckpt.inspect", "ckpt.diff",
              "ckpt.plan_load", "ckpt.verify", "ckpt.export", "server.manifest", "server.tensor"))
_DISTCP = (("__0_0.distcp", "bytes", 1), ("__0_1.distcp", "bytes", 1), ("__0_2.distcp", "bytes", 1))
_MEMORY = ("memory.identify_memory_file",)

FORMATS: dict[str, Format] = {f.name: f for f in [
    Format("snapshot", (("snapshot", (("", "pickle", 1),)),), ("memory.import_snapshots", *_MEMORY)),
    Format("profiler", (("profiler", (("", "json", 1),)), ("profiler_gz", (("", "gz", 1),))),
           ("memory.import_profiler_trace", *_MEMORY)),
    Format("timeline", (("timeline", (("rank0.json", "json", 1), ("rank0.npz", "npz", 2))),),
           ("memory.MemoryTimeline.load", *_MEMORY)),
    Format("dcp", (("dcp", ((".metadata", "pickle", 6), ("workbench.json", "json", 4), *_DISTCP)),
                   ("dcp_plain", ((".metadata", "pickle", 6), *_DISTCP))), *_CKPT),
    Format("hf", (("hf", (("model.safetensors.index.json", "json", 3),
                          ("model-00001-of-00001.safetensors", "safetensors", 3), ("config.json", "json", 1))),),
           *_CKPT),
    Format("safetensors", (("safetensors", (("", "safetensors", 1),)),), *_CKPT),
    Format("torch", (("torch", (("", "pt", 1),)),), *_CKPT),
    Format("run", (("run", (("events.jsonl", "jsonl", 3), ("config.json", "json", 2),
                            ("checkpoints/latest", "text", 1))),),
           (), ("server.run_events", "run.read_events", "server.run_pipeline", "run.JobConfig.load",
                "server.run_events", "ckpt.inspect")),
    Format("plan", (("plan", (("", "json", 1),)),), (), ("server.plan", "plan.ShardingPlan.from_json",
                                                         "plan.ShardingPlan.load")),
    Format("config", (("config", (("", "json", 1),)),), (), ("config.ModelConfig.from_hf_config",
                                                             "config.workbench.plan")),
]}

LONG_FACTOR = 20  # pytest --hostile-long and bench_hostile.py: this many times the suite's 500 inputs per format
_SPLICE: list[bytes] = []  # files of other formats, for splicing (read once in the parent, shared by fork)


def copy_input(src: Path, dst: Path) -> None:
    if src.is_dir():
        shutil.copytree(src, dst, symlinks=True)
    else:
        shutil.copyfile(src, dst)


def fuzz_task(fmt: Format, seed: int, k: int) -> H.Task:
    key = f"fuzz:{fmt.name}:{seed}:{k}"
    readers = list(fmt.always) + ([fmt.rotate[k % len(fmt.rotate)]] if fmt.rotate else [])

    base, targets = fmt.variants[k % len(fmt.variants)]

    def build(ctx: H.Ctx) -> tuple[Path, str]:
        rng = random.Random(key)
        src = ctx.bases[base]
        dst = ctx.root / src.name
        copy_input(src, dst)
        descs = []
        for _ in range(1 if rng.random() < 0.85 else 2):
            rel, kind, _ = rng.choices(targets, weights=[w for _, _, w in targets])[0]
            f = dst / rel if rel else dst
            new, desc = Mutator(rng, ctx, _SPLICE).mutate(kind, f.read_bytes())
            f.write_bytes(new)
            descs.append(f"{rel or dst.name}: {desc}")
        return dst, "; ".join(descs)

    return H.Task(key, fmt.name, build, readers)


def fuzz_tasks(per_format: int, seed: int, formats: list[str] | None = None) -> list[H.Task]:
    names = formats or list(FORMATS)
    return [fuzz_task(FORMATS[f], seed, k) for k in range(per_format) for f in names]


# --------------------------------------------------------------------------------------------------
# the preloaded parent
# --------------------------------------------------------------------------------------------------

class Driver:
    """Loaded once: torch, workbench, the bases, every reader warmed up. Then it forks."""

    def __init__(self, work: Path, opts: H.Options | None = None):
        t0 = time.perf_counter()
        import torch

        torch.set_num_threads(1)
        import tqdm

        tqdm.tqdm.monitor_interval = 0  # no monitor thread: this process forks
        import workbench
        import workbench.cli  # noqa: F401 - the command line, imported before any fork

        H.WORKBENCH_DIR = str(Path(workbench.__file__).resolve().parent) + os.sep
        self.preload_errors = _preload()
        from hostile_readers import READERS

        self.readers = READERS
        self.work = work
        self.opts = opts or H.Options()
        self.bases = self._build_bases(work / "bases")
        _SPLICE[:] = [self.bases[f].read_bytes() for f in ("snapshot", "profiler", "safetensors", "plan")] + \
            [(self.bases["dcp"] / ".metadata").read_bytes(), (self.bases["run"] / "events.jsonl").read_bytes()]
        import zipfile

        from hostile_mutate import prime

        with zipfile.ZipFile(self.bases["torch"]) as z:
            pkl = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
        prime([self.bases["snapshot"].read_bytes(), (self.bases["dcp"] / ".metadata").read_bytes(),
               (self.bases["dcp_plain"] / ".metadata").read_bytes(), pkl])
        self.setup_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        self.warm = self._warm_up()
        self.warm_s = time.perf_counter() - t1
        self.runs = 0

    def _build_bases(self, d: Path) -> dict[str, Path]:
        """In a forked child: the saver's writer threads and the profiler's must not live in the parent."""
        from hostile_bases import BASES, build_bases

        if d.exists():
            shutil.rmtree(d)
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            code = 1
            try:
                build_bases(d)
                code = 0
            except BaseException:  # noqa: BLE001
                import traceback

                traceback.print_exc()
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        if status != 0:
            raise RuntimeError(f"building the hostile harness's base inputs failed (status {status})")
        return {k: d / v for k, v in BASES.items()}

    def _warm_up(self) -> dict[str, Any]:
        """Every reader once on its valid base, here: imports happen once, not in every child. The bases
        must read cleanly (a reader that refuses a valid file would make every count meaningless)."""
        from hostile_corpus import FAMILY_OF

        problems = {}
        scratch = self.work / "warm"
        first = {}
        for fmt, fam in FAMILY_OF.items():
            first.setdefault(fam, fmt)
        names = sorted({(base, r) for f in FORMATS.values() for base, _ in f.variants for r in (*f.always, *f.rotate)}
                       | {(fmt, r) for fam, fmt in first.items() for r in _family_readers(fam)})
        for fmt, name in names:
            ctx = H.Ctx(scratch / fmt, self.bases)
            if not ctx.root.exists():
                ctx.make()
                copy_input(self.bases[fmt], ctx.root / self.bases[fmt].name)
            path = ctx.root / self.bases[fmt].name
            reader = self.readers[name]
            cwd = os.getcwd()
            try:
                value = reader.call(ctx, path)
                if reader.kind == "cli" and value.code != 0:
                    problems[f"{fmt} {name}"] = f"exit {value.code}: {value.stderr.strip()[:300]}"
                elif reader.refused is not None and reader.refused(value):
                    problems[f"{fmt} {name}"] = "refused the valid base"
            except BaseException as e:  # noqa: BLE001
                problems[f"{fmt} {name}"] = f"{type(e).__name__}: {str(e)[:300]}"
            finally:
                os.chdir(cwd)
        shutil.rmtree(scratch, ignore_errors=True)
        deadline = time.monotonic() + 5
        while threading.active_count() > 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        threads = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
        return {"problems": problems, "threads": threads}

    def run(self, tasks: list[H.Task], opts: H.Options | None = None,
            progress: Any = None) -> list[dict[str, Any]]:
        self.runs += 1
        scratch = self.work / f"run{self.runs}"
        shutil.rmtree(scratch, ignore_errors=True)
        try:
            return H.run_tasks(tasks, scratch, self.bases, self.readers, opts or self.opts, progress)
        finally:
            shutil.rmtree(scratch, ignore_errors=True) if not (opts or self.opts).keep_failed else None

    def fuzz(self, per_format: int, seed: int = 0, formats: list[str] | None = None,
             opts: H.Options | None = None, progress: bool = False) -> dict[str, Any]:
        tasks = fuzz_tasks(per_format, seed, formats)
        t0 = time.perf_counter()
        cpu0 = os.times()
        step = max(1, len(tasks) // 20)

        def report(done: int, total: int) -> None:
            if done % step == 0 or done == total:
                print(f"  {done}/{total} inputs, {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)

        results = self.run(tasks, opts, report if progress else None)
        seconds = time.perf_counter() - t0
        cpu1 = os.times()
        classes = H.failure_classes(results)
        by_api: dict[str, list[float]] = {}
        cpu: dict[str, list[float]] = {}
        for r in results:
            for c in r["calls"]:
                by_api.setdefault(c["api"], []).append(c["s"])
            if "t" in r:
                cpu.setdefault(r["format"], []).append(sum(r["t"]))
        slowest = sorted(((sum(r["t"]), r["key"], r.get("desc")) for r in results if "t" in r), reverse=True)[:8]
        return {"per_format": H.count(results), "inputs": len(tasks), "seconds": round(seconds, 2),
                "call_seconds": {k: {"calls": len(v), "total": round(sum(v), 2), "max": round(max(v), 3)}
                                 for k, v in sorted(by_api.items())},
                "cpu_ms_per_input": {k: round(1000 * sum(v) / len(v), 1) for k, v in cpu.items()},
                "slowest": [{"cpu_s": round(t, 2), "key": k, "desc": d} for t, k, d in slowest],
                "inputs_per_s": round(len(tasks) / seconds, 1),
                "child_cpu_s": round((cpu1.children_user + cpu1.children_system)
                                     - (cpu0.children_user + cpu0.children_system), 1),
                "seed": seed, "failures": classes, "summary": H.describe_failures(classes)}

    def selftest(self) -> dict[str, Any]:
        """Each misbehaving reader on an empty snapshot file: the outcome the harness gives it."""
        readers = _selftest_readers()
        self.readers.update(readers)

        def build(ctx: H.Ctx) -> tuple[Path, str]:
            (ctx.root / "other.txt").write_text("a file the readers must leave alone")
            p = ctx.root / "snapshot_rank0.pickle"
            p.write_bytes(b"")
            return p, "an empty snapshot"

        tasks = [H.Task(f"selftest:{name}", "selftest", build, [name]) for name in readers]
        try:
            results = self.run(tasks, H.Options(lanes=self.opts.lanes, cpu_cap=1.0, blocked_cap=1.0))
        finally:
            for name in readers:
                self.readers.pop(name)
        outcomes = {}
        for r in results:
            name = r["key"].split(".", 1)[1]
            for what in ("crash", "hang", "lost", "executed", "outside"):
                if r.get(what):
                    outcomes[name] = what
                    break
            else:
                outcomes[name] = r["calls"][0]["outcome"] if r["calls"] else "?"
        return {"outcomes": outcomes, "results": results}

    def corpus(self, families: list[str] | None = None, opts: H.Options | None = None) -> dict[str, Any]:
        from hostile_corpus import corpus_tasks

        tasks = corpus_tasks(families)
        t0 = time.perf_counter()
        results = self.run(tasks, opts)
        classes = H.failure_classes(results)
        return {"per_family": H.count(results), "results": results, "seconds": round(time.perf_counter() - t0, 2),
                "failures": classes, "summary": H.describe_failures(classes)}


def _selftest_readers() -> dict[str, H.Reader]:
    """Readers that misbehave on purpose, one way each: what the harness must count."""
    import ctypes

    libc = ctypes.CDLL(None)  # loaded here: inside the sandbox a dlopen counts as running code

    def documented(ctx: H.Ctx, p: Path) -> Any:
        from workbench.memory.snapshot import import_snapshots

        return import_snapshots(p, progress=False)  # the input is empty: a ValueError naming it

    def vague(ctx: H.Ctx, p: Path) -> Any:
        from workbench.units import parse_bytes

        return parse_bytes("lots")

    # A function whose code says it lives in the workbench package: its ValueError passes the origin
    # check, so only its two-line message can make it undeclared.
    scope: dict[str, Any] = {}
    exec(compile("def raise_two_lines(p):\n    raise ValueError(f'{p}: first line\\nsecond line')\n",
                 H.WORKBENCH_DIR + "selftest.py", "exec"), scope)

    def multiline(ctx: H.Ctx, p: Path) -> Any:
        scope["raise_two_lines"](p)

    def type_error(ctx: H.Ctx, p: Path) -> Any:
        raise TypeError("'NoneType' object is not subscriptable")

    def from_json(ctx: H.Ctx, p: Path) -> Any:
        return json.loads("{" + p.name)

    def allocate(ctx: H.Ctx, p: Path) -> Any:
        return bytearray(8 << 30)

    def canary_c(ctx: H.Ctx, p: Path) -> Any:
        fd = libc.open(os.fsencode(ctx.canary), os.O_RDONLY)
        try:
            return os.read(fd, 16)
        finally:
            os.close(fd)

    def delete(ctx: H.Ctx, p: Path) -> Any:
        (ctx.root / "other.txt").unlink()

    def segfault(ctx: H.Ctx, p: Path) -> Any:
        return ctypes.string_at(0)

    def spin(ctx: H.Ctx, p: Path) -> Any:
        while True:
            pass

    cases = {
        "well-behaved reader": lambda c, p: p.read_bytes(),
        "documented error naming the file": documented,
        "documented error naming nothing": vague,
        "TypeError": type_error,
        "ValueError from inside json": from_json,
        "multi-line message": multiline,
        "allocates 8 GiB": allocate,
        "opens the canary": lambda c, p: c.canary.read_bytes(),
        "opens the canary from C": canary_c,
        "lists the outside directory": lambda c, p: os.listdir(c.outside),
        "opens /etc/passwd": lambda c, p: Path("/etc/passwd").read_bytes(),
        "writes outside": lambda c, p: (c.cwd / "written").write_text("x"),
        "os.system": lambda c, p: os.system("true"),
        "deletes a file of the input": delete,
        "segfaults": segfault,
        "sleeps past the time cap": lambda c, p: time.sleep(3600),
        "spins past the CPU cap": spin,
    }
    return {f"selftest.{k}": H.Reader(f"selftest.{k}", fn) for k, fn in cases.items()}


# Every module a reader may import on an error path, imported here once: a child then never imports from
# disk, so a run reads one version of the code even while the files change under it.
_PRELOAD = ("workbench.checkpoint", "workbench.memory", "workbench.jupyter", "workbench.plan", "workbench.train",
            "workbench.prediction", "workbench.parallel")
_SKIP = ("workbench.jupyter.handlers",)  # needs jupyter_server; the readers never import it


def _preload() -> dict[str, str]:
    import importlib
    import pkgutil

    import workbench

    errors = {}
    top = [f"workbench.{m.name}" for m in pkgutil.iter_modules(workbench.__path__) if not m.ispkg]
    for name in top + list(_PRELOAD):
        try:
            mod = importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - reported in the driver's hello, not fatal
            errors[name] = f"{type(e).__name__}: {e}"
            continue
        for m in pkgutil.iter_modules(getattr(mod, "__path__", []), name + "."):
            if m.name in _SKIP:
                continue
            try:
                importlib.import_module(m.name)
            except Exception as e:  # noqa: BLE001
                errors[m.name] = f"{type(e).__name__}: {e}"
    return errors


def _family_readers(family: str) -> list[str]:
    from hostile_readers import FAMILY_READERS

    return FAMILY_READERS[family]


def in_child(fn: Any) -> Any:
    """``fn()`` in a forked child (what it starts, threads included, dies with it); its JSON answer."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(r)
        code = 0
        try:
            data = json.dumps({"ok": fn()}, default=str).encode()
        except BaseException as e:  # noqa: BLE001
            import traceback

            data, code = json.dumps({"error": f"{type(e).__name__}: {e}", "tb": traceback.format_exc()}).encode(), 1
        with os.fdopen(w, "wb") as f:
            f.write(data)
        os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    doc = json.loads(data) if data else {"error": "the child died"}
    if "error" in doc:
        raise RuntimeError(f"{doc['error']}\n{doc.get('tb', '')}")
    return doc["ok"]


def fixed_hash_seed() -> None:
    """Run again under PYTHONHASHSEED=0 unless already: the order of a set of names (which file a reader
    opens first) is then the same on every run, and so is every count."""
    if os.environ.get("PYTHONHASHSEED") != "0":
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "PYTHONHASHSEED": "0"})


def scratch_dir() -> Path:
    """A new directory on tmpfs where there is one: each input makes and removes a few files, which on a
    disk (ext4 with discard) costs tens of milliseconds, on tmpfs a fraction of one."""
    shm = Path("/dev/shm")
    use = shm if shm.is_dir() and os.access(shm, os.W_OK) else None
    return Path(tempfile.mkdtemp(prefix="workbench-hostile-", dir=use))


def machine() -> dict[str, Any]:
    import torch

    return {"cpu_count": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "load_avg": [round(x, 2) for x in os.getloadavg()]}


def serve(work: Path) -> None:
    """JSON lines: one command in on stdin, one answer out on stdout (the tests' driver)."""
    out = sys.stdout
    sys.stdout = sys.stderr  # anything else printed goes to stderr, never into the answers
    try:
        driver = Driver(work)
        hello = {"ready": True, "setup_s": round(driver.setup_s, 2), "warm_s": round(driver.warm_s, 2),
                 "warm": driver.warm, "preload_errors": driver.preload_errors,
                 "bases": {k: str(v) for k, v in driver.bases.items()}}
    except BaseException as e:  # noqa: BLE001
        import traceback

        hello = {"ready": False, "error": f"{type(e).__name__}: {e}", "tb": traceback.format_exc()[-3000:]}
        out.write(json.dumps(hello) + "\n")
        out.flush()
        return
    out.write(json.dumps(hello) + "\n")
    out.flush()
    for line in sys.stdin:
        cmd = json.loads(line)
        opts = H.Options(**cmd.get("options", {}))
        try:
            if cmd["cmd"] == "fuzz":
                ans = driver.fuzz(cmd["per_format"], cmd.get("seed", 0), cmd.get("formats"), opts)
            elif cmd["cmd"] == "selftest":
                ans = driver.selftest()
            elif cmd["cmd"] == "corpus":
                ans = driver.corpus(cmd.get("families"), opts)
                if cmd.get("brief"):
                    ans.pop("results")
            elif cmd["cmd"] == "server_root":
                from hostile_corpus import build_server_root

                ans = in_child(lambda: build_server_root(Path(cmd["root"]), Path(cmd["outside"]), driver.bases))
            elif cmd["cmd"] == "quit":
                return
            else:
                ans = {"error": f"unknown command {cmd['cmd']!r}"}
        except BaseException as e:  # noqa: BLE001
            import traceback

            ans = {"error": f"{type(e).__name__}: {e}", "tb": traceback.format_exc()[-3000:]}
        out.write(json.dumps(ans, default=str) + "\n")
        out.flush()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--per-format", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--formats", default=None, help="comma-separated, of " + ",".join(FORMATS))
    ap.add_argument("--lanes", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--cpu-cap", type=float, default=8.0, help="CPU seconds one input may take")
    ap.add_argument("--only", default=None, help="one input by its key, fuzz:FORMAT:SEED:INDEX")
    ap.add_argument("--case", default=None, help="the corpus cases whose name contains this text")
    ap.add_argument("--keep", action="store_true", help="keep the directories of failed inputs")
    ap.add_argument("--work", default=None, help="scratch directory (default: a new temporary one)")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    fixed_hash_seed()
    work = Path(args.work) if args.work else scratch_dir()
    if args.serve:
        serve(work)
        return 0
    opts = H.Options(lanes=args.lanes, cpu_cap=args.cpu_cap, keep_failed=50 if args.keep else 0)
    driver = Driver(work, opts)
    print(f"setup {driver.setup_s:.1f} s, warm-up {driver.warm_s:.1f} s; {driver.warm}", file=sys.stderr)
    if args.only or args.case:
        if args.only:
            _, fmt, seed, k = args.only.split(":")
            tasks = [fuzz_task(FORMATS[fmt], int(seed), int(k))]
        else:
            from hostile_corpus import corpus_tasks

            tasks = [t for t in corpus_tasks() if args.case in t.key]
        print(json.dumps(driver.run(tasks, opts), indent=2, default=str))
        return 0
    doc = driver.fuzz(args.per_format, args.seed, args.formats.split(",") if args.formats else None, opts)
    print(doc.pop("summary"), file=sys.stderr)
    print(json.dumps({**doc, "machine": machine()}, indent=2, default=str))
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
