"""A rank of an embedding run: ``python -m workbench.embedding.worker RUN_DIR`` under torchrun (or alone
for one rank). Reads ``config.json`` and ``embedding.json``; an exception becomes an ``error`` event
carrying the traceback, as in ``workbench.train.worker``."""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path


def main(argv: list[str] | None = None, raise_errors: bool = False) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m workbench.embedding.worker RUN_DIR", file=sys.stderr)
        return 2
    run_dir = Path(argv[0])
    from workbench.config import JobConfig
    from workbench.embedding.config import EmbeddingConfig
    from workbench.embedding.trainer import EMBEDDING_FILE, train_rank
    from workbench.train.events import EventWriter

    try:
        job = JobConfig.load(run_dir / "config.json")
        ecfg = EmbeddingConfig.from_dict(json.loads((run_dir / EMBEDDING_FILE).read_text()))
        train_rank(job, ecfg, run_dir)
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the event stream
        with EventWriter(run_dir, int(os.environ.get("RANK", "0"))) as ev:
            ev.emit("error", message=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
        if raise_errors:
            raise
        traceback.print_exc()
        return 130 if isinstance(exc, KeyboardInterrupt) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
