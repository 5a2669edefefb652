"""The GPU check's offline wheel bundle: the pins of gpu/bundle.toml, as wheels for the GPU machines.

    python gpu/bundle.py download [--dest .gpu-bundle]   # `make gpu-bundle`, on a machine with a registry
    python gpu/bundle.py verify [--dest .gpu-bundle]     # the folder against the pins, offline

``download`` asks pip for exactly the pinned wheels (``--no-deps``, binary only, for CPython 3.12 on
manylinux x86_64), removes any other wheel from the folder, and checks the result: one wheel per pin,
tags the GPU machine can install, no torch/Triton/NVIDIA wheel, and every pin's own requirements met by
the other pins and the GPU image (read from the wheels' METADATA). The GPU check (gpu/check.py) runs the
same checks before it installs anything.

Standard library only, plus ``packaging`` (pip's own copy where it is not installed): this runs under
whatever python makes the bundle, and under the GPU machine's before anything is installed.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path
from typing import Callable, Iterable

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SPEC = HERE / "bundle.toml"
DEFAULT_DEST = REPO / ".gpu-bundle"

# Never in the bundle: the GPU machine's own CUDA torch (and what it brings) is what the check tests.
FORBIDDEN = re.compile(r"^(torch|torchvision|torchaudio|triton|pytorch-triton.*|nvidia-.*|cuda-.*|jax.*)$")


def packaging_modules():
    """``(Requirement, SpecifierSet, Version, canonicalize_name)`` from ``packaging``, else pip's vendored copy."""
    try:
        from packaging.requirements import Requirement
        from packaging.specifiers import SpecifierSet
        from packaging.utils import canonicalize_name
        from packaging.version import Version
    except ImportError:
        from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]
        from pip._vendor.packaging.specifiers import SpecifierSet  # type: ignore[no-redef]
        from pip._vendor.packaging.utils import canonicalize_name  # type: ignore[no-redef]
        from pip._vendor.packaging.version import Version  # type: ignore[no-redef]
    return Requirement, SpecifierSet, Version, canonicalize_name


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


class Spec:
    """gpu/bundle.toml, read: ``pins`` (canonical name -> version), ``image`` (canonical names), ``omit``
    (canonical name -> why), ``target`` (python, abi, platforms)."""

    def __init__(self, path: str | Path = SPEC):
        self.path = Path(path)
        try:
            data = tomllib.loads(self.path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ValueError(f"{self.path}: cannot read the bundle spec ({e}); restore it from git") from None
        self.target = dict(data.get("target", {}))
        self.pins: dict[str, str] = {}
        self.problems: list[str] = []
        for name, version in data.get("pins", {}).items():
            key = canonical(name)
            if key in self.pins:
                self.problems.append(f"{name} is pinned twice (as {key}); keep one version of each")
            if not isinstance(version, str) or not re.fullmatch(r"[0-9][0-9A-Za-z.+!-]*", version):
                self.problems.append(f"{name} = {version!r} is not one exact version; pin it as \"X.Y.Z\"")
            if FORBIDDEN.match(key):
                self.problems.append(f"{name} must not be bundled: the GPU machine's own torch stack is the one tested")
            self.pins[key] = str(version)
        self.image = {canonical(n) for n in data.get("image", {}).get("packages", [])}
        self.omit = {canonical(n): str(why) for n, why in data.get("omit", {}).items()}
        for key in sorted(set(self.pins) & self.image):
            self.problems.append(f"{key} is both pinned and in [image]; the image's would be shadowed")

    @property
    def python(self) -> str:
        return str(self.target.get("python", "3.12"))

    def pip_requirements(self) -> list[str]:
        return [f"{name}=={version}" for name, version in self.pins.items()]


# --------------------------------------------------------------------------------------------------
# Requirements: pyproject's, and each pin's own
# --------------------------------------------------------------------------------------------------


def target_environment(python: str) -> dict[str, str]:
    """Marker values of the GPU machines (CPython ``python`` on Linux x86_64)."""
    return {"python_version": python, "python_full_version": f"{python}.0", "sys_platform": "linux",
            "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
            "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}


def applicable(lines: Iterable[str], env: dict[str, str]) -> list:
    """The ``Requirement`` objects of ``lines`` that apply in ``env`` (extras' requirements left out)."""
    Requirement = packaging_modules()[0]
    out = []
    for line in lines:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate(env):
            out.append(req)
    return out


def pyproject_runtime(pyproject: str | Path = REPO / "pyproject.toml") -> list[str]:
    return list(tomllib.loads(Path(pyproject).read_text())["project"]["dependencies"])


def coverage_problems(spec: Spec, pyproject: str | Path = REPO / "pyproject.toml") -> list[str]:
    """Each pyproject runtime dependency must be in the image, pinned (in its range) or omitted with a reason."""
    _, _, Version, _ = packaging_modules()
    problems = []
    for req in applicable(pyproject_runtime(pyproject), target_environment(spec.python)):
        key = canonical(req.name)
        if key in spec.pins:
            if not req.specifier.contains(Version(spec.pins[key]), prereleases=True):
                problems.append(f"{key}=={spec.pins[key]} is outside pyproject's range {req}; pin a version in it")
        elif key not in spec.image and key not in spec.omit:
            problems.append(f"pyproject needs {req} and gpu/bundle.toml neither pins it, lists it in [image] "
                            "nor omits it with a reason")
    return problems


def closure_problems(spec: Spec, requires_of: Callable[[str, str], list[str] | None]) -> tuple[list[str], list[str]]:
    """Every pin's own requirements, as ``requires_of(name, version)`` gives them (None: not known here),
    met by another pin (in range) or the image. Returns ``(problems, pins whose requirements were not
    known)``."""
    _, _, Version, _ = packaging_modules()
    env = target_environment(spec.python)
    problems, unknown = [], []
    for name, version in spec.pins.items():
        lines = requires_of(name, version)
        if lines is None:
            unknown.append(f"{name}=={version}")
            continue
        for req in applicable(lines, env):
            key = canonical(req.name)
            if key in spec.pins:
                if not req.specifier.contains(Version(spec.pins[key]), prereleases=True):
                    problems.append(f"{name}=={version} needs {req}, but {key} is pinned at {spec.pins[key]}")
            elif key not in spec.image:
                problems.append(f"{name}=={version} needs {req}, which is neither pinned nor in [image]")
    return problems, unknown


# --------------------------------------------------------------------------------------------------
# Wheels
# --------------------------------------------------------------------------------------------------


def wheel_name_version(path: str | Path) -> tuple[str, str] | None:
    """``(canonical name, version)`` from a wheel's file name, or None for a file that is not a wheel."""
    stem = Path(path).name
    if not stem.endswith(".whl"):
        return None
    parts = stem[:-4].split("-")
    if len(parts) not in (5, 6):
        return None
    return canonical(parts[0]), parts[1]


def wheel_installable(path: str | Path, spec: Spec) -> bool:
    """Whether the wheel's tags fit CPython ``spec.python`` on manylinux x86_64."""
    parts = Path(path).name[:-4].split("-")
    pythons, abis, platforms = parts[-3].split("."), parts[-2].split("."), parts[-1].split(".")
    minor = int(spec.python.split(".")[1])
    ok_python = any(p in ("py3", "py2", f"cp3{minor}") or (p.startswith("cp3") and "abi3" in abis
                                                           and int(p[3:]) <= minor) for p in pythons)
    ok_platform = any(p == "any" or (p.startswith("manylinux") and p.endswith("_x86_64")) for p in platforms)
    return ok_python and ok_platform


def wheel_requires(path: str | Path) -> list[str]:
    """The ``Requires-Dist`` lines of a wheel's METADATA (read from the zip, nothing executed)."""
    with zipfile.ZipFile(path) as z:
        meta = [n for n in z.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")]
        if len(meta) != 1:
            raise ValueError(f"{path}: {len(meta)} METADATA files in the wheel; download it again")
        text = z.read(meta[0]).decode("utf-8", "replace")
    out = []
    for line in text.split("\n\n", 1)[0].splitlines():  # the headers end at the first blank line
        if line.startswith("Requires-Dist:"):
            out.append(line.split(":", 1)[1].strip())
    return out


def folder_wheels(dest: str | Path) -> dict[str, list[Path]]:
    """Canonical name -> the wheels of that name in ``dest`` (and ``"?"`` for files that are not wheels)."""
    found: dict[str, list[Path]] = {}
    for f in sorted(Path(dest).iterdir()):
        if f.is_dir() or f.name.startswith("."):
            continue
        nv = wheel_name_version(f)
        found.setdefault(nv[0] if nv else "?", []).append(f)
    return found


def verify_folder(spec: Spec, dest: str | Path) -> tuple[dict[str, Path], list[str]]:
    """The pinned wheels of ``dest`` (canonical name -> path) and what is wrong with the folder: a
    forbidden wheel, a pin without its wheel or with two, a wheel that is not pinned, a wrong version or
    tag, or a pin's requirement unmet."""
    dest = Path(dest)
    problems = list(spec.problems)
    wheels: dict[str, Path] = {}
    found = folder_wheels(dest)
    for key, files in found.items():
        names = ", ".join(f.name for f in files)
        if key == "?":
            problems.append(f"{dest}: {names} are not wheels; remove them")
        elif FORBIDDEN.match(key):
            problems.append(f"{dest}: refused {names}: the GPU machine's own torch stack is the one tested, "
                            "never a wheel's; delete it")
        elif key not in spec.pins:
            problems.append(f"{dest}: {names} is not pinned in gpu/bundle.toml; delete it or run `make gpu-bundle`")
        elif len(files) > 1:
            problems.append(f"{dest}: {names}: one version of each; run `make gpu-bundle` again")
        elif wheel_name_version(files[0])[1] != spec.pins[key]:
            problems.append(f"{dest}: {files[0].name} is not the pinned {key}=={spec.pins[key]}; run `make gpu-bundle`")
        elif not wheel_installable(files[0], spec):
            problems.append(f"{dest}: {files[0].name} does not install on CPython {spec.python}, manylinux x86_64")
        else:
            wheels[key] = files[0]
    missing = [f"{k}=={v}" for k, v in spec.pins.items() if k not in found]
    if missing:
        problems.append(f"{dest}: no wheel for {', '.join(missing)}; run `make gpu-bundle`")
    if wheels and not missing:
        closure, _ = closure_problems(spec, lambda name, version: wheel_requires(wheels[name]) if name in wheels else None)
        problems += closure
    return wheels, problems


def download(spec: Spec, dest: Path, python: str = sys.executable) -> list[Path]:
    """pip download of exactly the pins into ``dest``; wheels no longer pinned are removed first."""
    dest.mkdir(parents=True, exist_ok=True)
    for key, files in folder_wheels(dest).items():
        for f in files:
            if key not in spec.pins or wheel_name_version(f)[1] != spec.pins[key]:
                f.unlink()  # a stale version: one version of each
    cmd = [python, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
           "--python-version", spec.python, "--implementation", "cp", "--abi", str(spec.target.get("abi", "cp312")),
           *[a for p in spec.target.get("platforms", []) for a in ("--platform", p)],
           "--dest", str(dest), *spec.pip_requirements()]
    print("gpu-bundle: " + " ".join(cmd[:3] + ["download", "..."]) + f" {len(spec.pins)} pins -> {dest}",
          file=sys.stderr)
    proc = subprocess.run(cmd)
    if proc.returncode != 0:
        raise RuntimeError(f"pip download failed (exit {proc.returncode}); see pip's message above")
    return sorted(dest.glob("*.whl"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("action", choices=("download", "verify"))
    ap.add_argument("--dest", default=str(DEFAULT_DEST), help="the bundle folder (default: .gpu-bundle)")
    ap.add_argument("--spec", default=str(SPEC), help="the pins (default: gpu/bundle.toml)")
    args = ap.parse_args(argv)
    try:
        spec = Spec(args.spec)
        problems = spec.problems + coverage_problems(spec)
        if problems:
            raise ValueError(problems[0])
        dest = Path(args.dest)
        if args.action == "download":
            download(spec, dest)
        elif not dest.is_dir():
            raise ValueError(f"{dest}: no bundle folder; run `make gpu-bundle` on a machine with a registry")
        wheels, problems = verify_folder(spec, dest)
    except (ValueError, RuntimeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if problems:  # one line: the first problem, then the others after it
        more = f" (and {len(problems) - 1} more: {'; '.join(problems[1:])})" if len(problems) > 1 else ""
        print(f"error: {problems[0]}{more}", file=sys.stderr)
        return 1
    size = sum(p.stat().st_size for p in wheels.values())
    print(f"gpu-bundle: {len(wheels)} wheels, {size / 2**20:.1f} MiB in {dest}: "
          + ", ".join(f"{k}=={spec.pins[k]}" for k in wheels))
    return 0


if __name__ == "__main__":
    sys.exit(main())
