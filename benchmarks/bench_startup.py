"""Start-up cost: importing the package, the command line's help and version, the Jupyter server extension.

    python benchmarks/bench_startup.py                  # 5 repeats of each, the JupyterLab starts, the 70b plan
    python benchmarks/bench_startup.py --quick          # 1 repeat; no JupyterLab starts, no plan
    python benchmarks/bench_startup.py --src /tmp/old   # measure another workbench tree (e.g. `git archive`)

Every figure is a fresh process, measured from outside: wall seconds from start to exit (or, for a server,
to its first answer), its CPU seconds (user + system) and its peak RSS (Linux counts the forked copy of
this script too, so about 20 MB is the floor). Commands are interleaved (one
repeat of each, then the next) so that other load on the machine falls on all of them alike, and the
median of the repeats is kept. Two named baselines, each measured in the same run:

- ``import_torch`` (``python -c "import torch"``): ``import workbench``, ``workbench --help``,
  ``workbench --version``, ``jupyter server extension list`` and the plan are given as ratios to it.
- ``lab_without_extension`` (JupyterLab with ``workbench.jupyter`` disabled): ``lab_with_extension`` (the
  same start with it enabled) is given as a ratio to it, and as the seconds it adds. A start is timed to
  the server answering ``GET /api/status``, which it does once every extension has loaded.

``plan_70b``: ``workbench plan llama-70b --dp-shard 128 --tp 8 --json`` (1024 simulated ranks), once.

The targets of issue 30 are checked in ``targets`` (help under 0.5 s wall, version under 0.3 s, import
at most import torch + 0.3 s, JupyterLab with the extension within 0.5 s of without); on a loaded machine
every figure is slower, so read them beside ``loadavg``.

stdout carries exactly one JSON document; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _script(name: str, module: list[str]) -> list[str]:
    """The console script ``name`` next to this Python (what a user types), else ``python -m``."""
    exe = BIN / name
    return [str(exe)] if exe.exists() else [sys.executable, "-m", *module]


def commands() -> dict[str, list[str]]:
    return {
        "import_torch": [sys.executable, "-c", "import torch"],
        "import_workbench": [sys.executable, "-c", "import workbench"],
        "help": [*_script("workbench", ["workbench.cli"]), "--help"],
        "version": [*_script("workbench", ["workbench.cli"]), "--version"],
        "extension_list": [*_script("jupyter", ["jupyter"]), "server", "extension", "list"],
    }


def run_once(cmd: list[str], env: dict[str, str], cwd: Path, timeout: float) -> dict[str, Any]:
    """Wall, CPU (user + sys) and peak RSS of one process, from its own rusage (os.wait4)."""
    with tempfile.TemporaryFile(dir=cwd) as out:  # a file, not a pipe: a long output cannot block the child
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=cwd)
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() - t0 > timeout:
                proc.kill()
                os.wait4(proc.pid, 0)
                raise TimeoutError(f"{' '.join(cmd)} took over {timeout:g} s; raise --timeout")
            time.sleep(0.005)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        text = out.read().decode(errors="replace")
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {text[-2000:]}")
    return {"wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime, "max_rss_bytes": usage.ru_maxrss * 1024,
            "output": text}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _proc_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a running process (Linux /proc), else None."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def lab_start(env: dict[str, str], base: Path, extension: bool, timeout: float) -> dict[str, Any]:
    """Start JupyterLab, time it to answering /api/status, then stop it."""
    config = base / ("config-with" if extension else "config-without")
    config.mkdir(parents=True, exist_ok=True)
    # A user config over the installed one (which enables the extension): the same servers but for it.
    (config / "jupyter_server_config.json").write_text(json.dumps(
        {"ServerApp": {"jpserver_extensions": {"workbench.jupyter": extension}}}))
    root = base / "root"
    root.mkdir(exist_ok=True)
    port, token = _free_port(), "bench-startup"
    env = dict(env, JUPYTER_CONFIG_DIR=str(config), JUPYTER_DATA_DIR=str(base / "data"),
               JUPYTER_RUNTIME_DIR=str(base / "runtime"), JUPYTER_PLATFORM_DIRS="1")
    cmd = [*_script("jupyter-lab", ["jupyterlab"]), "--no-browser", "--ServerApp.ip=127.0.0.1",
           f"--ServerApp.port={port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
           f"--ServerApp.root_dir={root}", "--ServerApp.allow_root=True"]
    log = base / "lab.log"
    with open(log, "wb") as fh:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=base,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}/api/status?token={token}"
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"JupyterLab exited {proc.returncode}: {log.read_text(errors='replace')[-2000:]}")
            if time.perf_counter() - t0 > timeout:
                raise TimeoutError(f"JupyterLab did not answer within {timeout:g} s; raise --timeout")
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.02)
        wall = time.perf_counter() - t0
        cpu = _proc_cpu_s(proc.pid)
        loaded = "workbench.jupyter | extension was successfully loaded" in log.read_text(errors="replace")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if loaded != extension:
        raise RuntimeError(f"JupyterLab {'did not load' if extension else 'loaded'} workbench.jupyter; see {log}")
    return {"wall_s": wall, "cpu_s": cpu}


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"runs": len(runs)}
    for key in ("wall_s", "cpu_s", "max_rss_bytes"):
        values = [r[key] for r in runs if r.get(key) is not None]
        if values:
            out[key] = round(statistics.median(values), 4) if key != "max_rss_bytes" else int(statistics.median(values))
            if key == "wall_s":
                out["wall_s_min"], out["wall_s_max"] = round(min(values), 4), round(max(values), 4)
    return out


def _ratio(a: dict[str, Any], b: dict[str, Any], key: str) -> float | None:
    return round(a[key] / b[key], 4) if a.get(key) and b.get(key) else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 repeat; no JupyterLab starts and no plan")
    ap.add_argument("--repeats", type=int, default=None, help="fresh processes per command (default 5; --quick 1)")
    ap.add_argument("--src", type=Path, default=REPO, help="the tree whose workbench/ is measured (default: this repo)")
    ap.add_argument("--no-lab", action="store_true", help="leave out the JupyterLab starts")
    ap.add_argument("--no-plan", action="store_true", help="leave out the llama-70b plan")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds any one process may take")
    args = ap.parse_args()
    repeats = args.repeats or (1 if args.quick else 5)
    if repeats < 1:
        ap.error("--repeats must be at least 1")
    src = args.src.resolve()
    if not (src / "workbench" / "__init__.py").is_file():
        ap.error(f"--src {src} holds no workbench/__init__.py; pass the directory above the package")
    lab = not (args.quick or args.no_lab)
    plan = not (args.quick or args.no_plan)

    # The measured tree first on the path, from a directory outside the repo, with no TRITON_INTERPRET
    # inherited (that is what `import workbench` used to set; a user's shell has none).
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(src), *filter(None, [os.environ.get("PYTHONPATH")])])
    doc: dict[str, Any] = {
        "benchmark": "bench_startup", "quick": args.quick, "repeats": repeats, "src": str(src),
        "baselines": {"import_torch": "python -c 'import torch' (for imports, the CLI, extension list, plan)",
                      "lab_without_extension": "JupyterLab with workbench.jupyter disabled (for lab_with_extension)"},
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
    }
    if hasattr(os, "getloadavg"):
        doc["machine"]["loadavg_1m_at_start"] = round(os.getloadavg()[0], 2)

    work = Path(tempfile.mkdtemp(prefix="bench-startup-"))
    try:
        cmds = commands()
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in cmds}
        for i in range(repeats):  # interleaved: each repeat runs every command once
            for name, cmd in cmds.items():
                r = run_once(cmd, env, work, args.timeout)
                runs[name].append(r)
                _log(f"[{i + 1}/{repeats}] {name}: {r['wall_s']:.2f} s wall, {r['cpu_s']:.2f} s CPU")
        results = {name: _summary(rs) for name, rs in runs.items()}
        listed = runs["extension_list"][-1]["output"]
        results["extension_list"]["lists_workbench"] = "workbench.jupyter" in listed and "enabled" in listed
        base = results["import_torch"]
        for name, r in results.items():
            r["wall_ratio_to_import_torch"] = _ratio(r, base, "wall_s")
            r["cpu_ratio_to_import_torch"] = _ratio(r, base, "cpu_s")

        if lab:
            starts: dict[str, list[dict[str, Any]]] = {"lab_without_extension": [], "lab_with_extension": []}
            for i in range(repeats):
                for name in starts:
                    r = lab_start(env, work / "lab", name == "lab_with_extension", args.timeout)
                    starts[name].append(r)
                    _log(f"[{i + 1}/{repeats}] {name}: {r['wall_s']:.2f} s to /api/status, {r['cpu_s'] or 0:.2f} s CPU")
            without, with_ = _summary(starts["lab_without_extension"]), _summary(starts["lab_with_extension"])
            with_["wall_ratio_to_lab_without_extension"] = _ratio(with_, without, "wall_s")
            with_["cpu_ratio_to_lab_without_extension"] = _ratio(with_, without, "cpu_s")
            with_["added_wall_s"] = round(with_["wall_s"] - without["wall_s"], 4)
            results["lab_without_extension"], results["lab_with_extension"] = without, with_

        if plan:
            cmd = [*_script("workbench", ["workbench.cli"]), "plan", "llama-70b", "--dp-shard", "128", "--tp", "8",
                   "--json"]
            r = run_once(cmd, env, work, args.timeout)
            json.loads(r["output"])  # the command's own one JSON document
            _log(f"plan_70b: {r['wall_s']:.2f} s wall, {r['cpu_s']:.2f} s CPU, {r['max_rss_bytes'] / 2**20:.0f} MiB")
            p = _summary([r])
            p["wall_ratio_to_import_torch"] = _ratio(p, base, "wall_s")
            p["cpu_ratio_to_import_torch"] = _ratio(p, base, "cpu_s")
            results["plan_70b"] = p
    finally:
        shutil.rmtree(work, ignore_errors=True)

    doc["results"] = results
    targets = {
        "help_wall_under_0.5s": results["help"]["wall_s"] < 0.5,
        "version_wall_under_0.3s": results["version"]["wall_s"] < 0.3,
        "import_at_most_import_torch_plus_0.3s": results["import_workbench"]["wall_s"] <= base["wall_s"] + 0.3,
    }
    if lab:
        targets["lab_with_extension_within_0.5s"] = results["lab_with_extension"]["added_wall_s"] <= 0.5
    doc["targets"] = targets
    if hasattr(os, "getloadavg"):
        doc["machine"]["loadavg_1m_at_end"] = round(os.getloadavg()[0], 2)
    print(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
