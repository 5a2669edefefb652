"""What the GPU check's parts ask the python they run under: one JSON document on stdout.

    python gpu/probe.py env                     # torch, CUDA, GPUs, Triton; every requirement's version here
    python gpu/probe.py import                  # `import workbench` and the CLI parser: seconds, view modules loaded
    python gpu/probe.py views IMPORTED MEASURED # the memory view of an imported CUDA snapshot, over the recorder's

gpu/check.py runs these with the bundle's folder on PYTHONPATH, so they see what the parts see.
"""

from __future__ import annotations

import json
import platform
import sys
import time
import tomllib
from importlib import metadata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bundle  # noqa: E402  (gpu/bundle.py: the pins and the requirement checks)

# What the GPU tests need beyond the runtime dependencies (tests/conftest.py, tests/test_gpu.py, the
# `timeout` setting of pyproject's pytest options).
GPU_TEST_NEEDS = ("pytest", "pytest-timeout")
VIEW_MODULES = ("plotly", "ipywidgets", "anywidget", "IPython", "jupyterlab", "jupyter_server")


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _where(name: str) -> str | None:
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return None
    return str(Path(dist.locate_file("")).resolve())


def requirements() -> list[dict]:
    """pyproject's runtime dependencies, the kernels extra and the GPU tests' needs, then every pin's own
    requirements: each with the version found here and whether it is in range."""
    Requirement, _, Version, _ = bundle.packaging_modules()
    spec = bundle.Spec()
    project = tomllib.loads((bundle.REPO / "pyproject.toml").read_text())["project"]
    extras = project.get("optional-dependencies", {})
    wanted = [(line, "pyproject") for line in project["dependencies"]]
    wanted += [(line, "pyproject [kernels]") for line in extras.get("kernels", [])]
    wanted += [(line, "GPU tests") for line in extras.get("dev", [])
               if bundle.canonical(Requirement(line).name) in GPU_TEST_NEEDS]
    env = bundle.target_environment(f"{sys.version_info.major}.{sys.version_info.minor}")
    rows = []
    for line, why in wanted:
        for req in bundle.applicable([line], env):
            rows.append((req, why))
    for name in spec.pins:
        try:
            lines = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue  # reported as a missing pin below
        rows += [(req, f"bundle: {name}") for req in bundle.applicable(lines, env)]
    out = []
    for req, why in rows:
        key = bundle.canonical(req.name)
        found = _version(req.name)
        row = {"requirement": str(req), "for": why, "found": found, "ok": None, "note": None}
        if found is None:
            row["ok"] = key in spec.omit
            row["note"] = f"omitted: {spec.omit[key]}" if key in spec.omit else "not installed"
        else:
            row["ok"] = req.specifier.contains(Version(found), prereleases=True)
        out.append(row)
    for name, version in spec.pins.items():  # where each pin came from (whether it is here is install's to say)
        found = _version(name)
        out.append({"requirement": f"{name}=={version}", "for": "bundle pin", "found": found,
                    "ok": True if found is not None else None,
                    "note": "not installed" if found is None else None if found == version
                    else "another version than the pin: no bundle was installed over it"})
    return out


def env() -> dict:
    import torch

    doc = {"python": platform.python_version(), "executable": sys.executable, "platform": platform.platform(),
           "torch": torch.__version__, "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
           "gpus": [], "triton": _version("triton"), "requirements": requirements()}
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            doc["gpus"].append({"name": p.name, "memory_bytes": int(p.total_memory),
                                "capability": f"{p.major}.{p.minor}", "multiprocessors": p.multi_processor_count})
    doc["unmet"] = [r for r in doc["requirements"] if r["ok"] is False]
    return doc


def import_workbench() -> dict:
    t0 = time.perf_counter()
    import workbench

    seconds = time.perf_counter() - t0  # names load on first use: this is milliseconds (issue 30)
    from workbench.cli import build_parser

    build_parser()  # every subcommand's module, as `workbench ...` loads them
    cli_seconds = time.perf_counter() - t0 - seconds
    t1 = time.perf_counter()
    workbench.launch  # noqa: B018  (the trainer's front: torch, torch.distributed and our core)
    launch_seconds = time.perf_counter() - t1
    loaded = sorted({m.split(".")[0] for m in sys.modules} & set(VIEW_MODULES))
    return {"workbench": str(Path(workbench.__file__).resolve().parent), "version": workbench.__version__,
            "import_s": round(seconds, 6), "cli_parser_s": round(cli_seconds, 6),
            "launch_import_s": round(launch_seconds, 3), "view_modules_loaded": loaded}


def views(imported: str, measured: str) -> dict:
    """The notebook view of the imported snapshot, with the recorder's timeline of the same run as overlay:
    what a user sees for a CUDA run, drawn with the bundled plotly, ipywidgets and anywidget."""
    t0 = time.perf_counter()
    from workbench.memory.timeline import MemoryTimeline
    from workbench.widgets import MemoryTimelineView

    import_s = time.perf_counter() - t0
    tl, overlay = MemoryTimeline.load(imported), MemoryTimeline.load(measured)
    t1 = time.perf_counter()
    view = MemoryTimelineView(tl, overlay=overlay)
    draw_s = time.perf_counter() - t1
    traces = list(view.fig.data)
    return {"import_s": round(import_s, 3), "draw_s": round(draw_s, 3), "traces": len(traces),
            "points": int(sum(len(t.x) for t in traces if getattr(t, "x", None) is not None)),
            "x": view.x, "packages": {n: {"version": _version(n), "from": _where(n)}
                                      for n in ("plotly", "ipywidgets", "anywidget")}}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("env", "import", "views") or (argv[0] == "views") != (len(argv) == 3):
        print("error: usage: probe.py env | import | views IMPORTED_DIR MEASURED_DIR", file=sys.stderr)
        return 2
    doc = env() if argv[0] == "env" else import_workbench() if argv[0] == "import" else views(*argv[1:])
    print(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
