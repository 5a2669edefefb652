"""Distributed checkpoints: train state on DCP, published atomically, loadable into any layout.

CONTRACT (shared by the writers here and the tools that read checkpoints):

* A run's checkpoints live in ``<run_dir>/checkpoints/``. Each is a directory ``step-000123/`` (6 digits,
  zero-padded; the step is the number of optimizer steps taken) written by
  ``torch.distributed.checkpoint`` (FileSystemWriter: ``.metadata``, ``__<rank>_<i>.distcp``) plus
  ``workbench.json``, the manifest, written LAST by rank 0::

      {"format": "workbench-checkpoint", "version": 1, "step": int, "consumed_samples": int,
       "world_size": int, "layout": ParallelConfig dict, "job": JobConfig dict (model/parallel/train),
       "kinds": [...], "checksum": "xxh3_128", "files": {relative_name: {"bytes": int, "xxh3_128": hex}},
       "created": iso time, "ema": bool, "master_weights": str}

  Checksums are taken while the files are written; checkpoints saved before that list
  ``{"bytes": int, "sha256": hex}`` per file (no "checksum" key), and still load and verify.

* DCP keys (nested state dict, flattened with dots):
  ``model.<fqn>`` (full-model FQNs under every layout, pipeline stages included),
  ``optim.state.<fqn>.exp_avg|exp_avg_sq|step``, ``optim.param_groups.<fqn>.<hyper>`` (flattened
  optimizer state; hyperparameters stored as float64/int64/bool tensors), ``ema.<fqn>`` (optional, fp32),
  ``sched.last_epoch|step_count|base_lrs|last_lr`` (LambdaLR), ``rng.rank<r>.torch|cuda|python|numpy``
  (int tensors, never pickles), ``extra.step``, ``extra.consumed_samples``.
  ``master.<fqn>`` is never written: under ``mixed_precision='bf16'`` the parameters themselves are the
  fp32 master weights, so ``model.*`` holds them (the manifest's ``master_weights`` says which case).
* Publishing is atomic: ``.tmp-step-000123-<nonce>/`` -> fsync -> rename to ``step-000123/`` -> fsync
  parent -> ``latest`` (text "step-000123") via temp + fsync + rename. A directory without a complete,
  checksum-valid ``workbench.json`` is never picked by resume; stale ``.tmp-*`` go at the next save.
* Rotation keeps the newest ``keep`` checkpoints, every ``keep_every``-th step, and ``latest``.

Use::

    workbench train tiny --nproc 2 --tp 2 --steps 100 --ckpt-every 20 --ckpt-async --keep 3 --out runs/a
    workbench train tiny --nproc 2 --dp-shard 2 --steps 200 --resume --out runs/a   # another layout

    from workbench.checkpoint import load
    load("runs/a", model)                                          # weights only, into any layout
    load("runs/a", model, optimizer, scheduler=sched, rng=True)    # the full train state
"""

from workbench.checkpoint.store import CheckpointStore, is_complete, read_manifest, resolve_checkpoint, step_name
from workbench.checkpoint.state import TrainState, model_view
from workbench.checkpoint.saver import EMA, Checkpointer, CheckpointError, save
from workbench.checkpoint.load import LoadResult, check_model_fits, checkpoint_shapes, load, read_metadata
from workbench.checkpoint.safeload import CheckpointFormatError
from workbench.checkpoint.manifest import CheckpointManifest
from workbench.checkpoint.contents import inspect
from workbench.checkpoint.verify import VerifyReport, verify
from workbench.checkpoint.diff import CheckpointDiff, diff
from workbench.checkpoint.formats import ExportResult, export, iter_tensors, load_into, read_tensor
from workbench.checkpoint.stats import tensor_stats
from workbench.checkpoint.param_groups import ParamGroup, param_groups
from workbench.checkpoint.plan_load import LoadPlan, plan_load
