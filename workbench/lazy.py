"""Names a package loads from their modules on first use (PEP 562), so importing it stays light.

    __getattr__, __dir__ = lazy_names(__name__, {"launch": "workbench.train.launcher", ...})

The first access imports the module and binds the name in the package, so later accesses cost nothing.
``tests/test_imports.py`` checks what each entry point imports.
"""

from __future__ import annotations

import sys
from importlib import import_module
from importlib.util import find_spec
from typing import Any, Callable


def lazy_names(package: str, where: dict[str, str], *, submodules: bool = False
               ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``: ``where`` maps a name to the module defining it;
    ``submodules``: any other public name that is a submodule is imported too (``workbench.spmd``)."""
    module = sys.modules[package]

    def __getattr__(name: str) -> Any:
        if name in where:
            value = getattr(import_module(where[name]), name)
        elif submodules and not name.startswith("_") and find_spec(f"{package}.{name}") is not None:
            value = import_module(f"{package}.{name}")
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        setattr(module, name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(module)) | set(where))

    return __getattr__, __dir__
