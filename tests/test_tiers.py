"""`make test` and `make test-all`: tests/slow.txt names what only `make test-all` (and CI) runs.

An entry that names no test would silently put nothing in the slow tier (or, after a rename, move a slow
test back into `make test`), so every entry must name a file, and a test function in it, that exist.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _entries() -> list[str]:
    # tests/conftest.py's own reader (by path: `import conftest` may find tests/hostile's)
    import importlib.util

    spec = importlib.util.spec_from_file_location("_root_conftest", REPO / "tests" / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module._slow_ids()


def _functions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def test_every_slow_entry_names_an_existing_test_once():
    entries = _entries()
    assert entries, "tests/slow.txt is empty"
    assert len(entries) == len(set(entries)), "tests/slow.txt lists an entry twice"
    for entry in entries:
        file, _, rest = entry.partition("::")
        path = REPO / file
        assert path.is_file() and path.name.startswith("test_"), f"tests/slow.txt: {entry}: no such test file"
        if rest:
            name = rest.split("[", 1)[0].split("::")[-1]
            assert name in _functions(path), f"tests/slow.txt: {entry}: no test {name} in {file}"


def test_make_test_leaves_the_slow_tier_out_and_test_all_and_ci_run_it():
    make = (REPO / "Makefile").read_text()
    recipe = {m.group(1): m.group(2) for m in re.finditer(r"^([\w-]+):[^\n]*\n((?:\t[^\n]*\n)+)", make, re.M)}
    assert '-m "not slow"' in recipe["test"]
    assert "not slow" not in recipe["test-all"] and "pytest" in recipe["test-all"]
    assert "make test-all" in (REPO / ".ci" / "run").read_text()
