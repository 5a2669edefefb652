"""``workbench doctor [--json]``: what this machine and this torch can run, and what is skipped and why.

    >>> workbench.doctor.diagnose()      # a Diagnosis; evaluates to a table in a notebook

Reports torch and Python versions, CUDA and its devices, the process-group backends (gloo, NCCL, MPI),
Triton, and every compat feature (``workbench.compat.FEATURES``): available, or skipped with the private
torch symbol the running torch lacks.
"""

from __future__ import annotations

import argparse
import html
import json
import platform
import sys
from dataclasses import asdict, dataclass, field
from importlib import metadata

from workbench.cli_output import emit_json

__all__ = ["Diagnosis", "diagnose", "add_parser", "cmd_doctor"]


@dataclass
class Diagnosis:
    python: str
    torch: str
    torch_cuda: str | None  # the CUDA version torch was built with (None: a CPU build)
    cuda_available: bool
    devices: list[str]
    backends: dict[str, bool]
    nccl: str | None
    triton: str | None
    features: list[dict] = field(default_factory=list)
    kernels: str = ""  # where our Triton kernels run here: "CUDA", "interpreter (CPU tensors)", or why not

    @property
    def skipped(self) -> list[dict]:
        return [f for f in self.features if not f["available"]]

    def to_dict(self) -> dict:
        return {**asdict(self), "skipped": [f["feature"] for f in self.skipped]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def __str__(self) -> str:
        dev = ", ".join(self.devices) if self.devices else "none"
        lines = [
            f"python   {self.python}",
            f"torch    {self.torch}" + (f" (CUDA {self.torch_cuda} build)" if self.torch_cuda else " (CPU build)"),
            f"cuda     {'available' if self.cuda_available else 'not available'}; {len(self.devices)} device(s): {dev}",
            "backends " + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in self.backends.items())
            + (f" (NCCL {self.nccl})" if self.nccl else ""),
            f"triton   {self.triton or 'not installed'}" + (f"; kernels: {self.kernels}" if self.kernels else ""),
            f"features {len(self.features) - len(self.skipped)}/{len(self.features)} available",
        ]
        for f in self.features:
            mark = "ok  " if f["available"] else "SKIP"
            lines.append(f"  {mark} {f['feature']:<32} {f['label']}")
            if not f["available"]:
                lines.append(f"       {f['why']}; {f['if_missing']}")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><td>{html.escape(f['feature'])}</td><td>{html.escape(f['label'])}</td>"
            f"<td style='color:{'#080' if f['available'] else '#b00'}'>{'available' if f['available'] else 'skipped'}</td>"
            f"<td>{html.escape(f['why'] or '')}</td></tr>" for f in self.features)
        head = "".join(f"<li>{html.escape(line)}</li>" for line in str(self).splitlines()[:6])
        return (f"<div><ul>{head}</ul><table><tr><th>feature</th><th>what</th><th>status</th><th>why</th></tr>"
                f"{rows}</table></div>")


def _version(dist_name: str) -> str | None:
    try:
        return metadata.version(dist_name)
    except metadata.PackageNotFoundError:
        return None


def diagnose() -> Diagnosis:
    """Look at this machine and this torch; import nothing heavy (Triton is read from its metadata)."""
    import torch
    import torch.distributed as dist

    from workbench import compat

    cuda = torch.cuda.is_available()
    devices = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else []
    dist_ok = dist.is_available()
    backends = {"gloo": dist_ok and dist.is_gloo_available(), "nccl": dist_ok and dist.is_nccl_available(),
                "mpi": dist_ok and dist.is_mpi_available()}
    nccl = None
    if backends["nccl"]:
        try:
            v = torch.cuda.nccl.version()
            nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception:  # noqa: BLE001 - a build without the NCCL library loaded
            nccl = None
    return Diagnosis(python=platform.python_version(), torch=torch.__version__, torch_cuda=torch.version.cuda,
                     cuda_available=cuda, devices=devices, backends=backends, nccl=nccl,
                     triton=_version("triton") or _version("pytorch-triton"), features=compat.report(),
                     kernels=_kernels_where())


def _kernels_where() -> str:
    """Where workbench's Triton kernels run in this process (loads Triton if installed)."""
    from workbench import kernels

    st = kernels.triton_status()
    if not st.usable:
        return f"unavailable ({st.why})"
    return "Triton's interpreter, on CPU tensors (TRITON_INTERPRET=1)" if st.interpret else "compiled for CUDA"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="what this machine and torch can run: versions, CUDA, backends, features",
                       description="Report torch/Python versions, CUDA devices, process-group backends, Triton, "
                                   "and which workbench features the running torch supports (and why not).")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(func=cmd_doctor)


def cmd_doctor(args: argparse.Namespace) -> int:
    d = diagnose()
    if args.json:
        emit_json({"status": "ok", **d.to_dict()})
    else:
        print(d)
    sys.stdout.flush()
    return 0
