"""What the checkpoint views call each field, and how they print a number: one table for every face.

The core's field names (``n_tensors``, ``abs_mean``, ``layout_description``) are for code; a person reads
"tensors", "mean |x|", "layout". The server sends this table beside its checkpoint answers (the Lab tab
labels its tables with it; a name it lacks is data, such as a tensor kind, and shows as it is) and the
notebook's CheckpointBrowser uses :func:`label` and :func:`format_number`, so the two show the same words
and the same digits::

    label("n_params_model")      -> "model parameters"
    format_number(0.000123456)   -> "1.235e-04"
    format_number(12345.678)     -> "1.235e+04"
    format_number(0.0123456)     -> "0.01235"
    format_number(1048576)       -> "1,048,576"
"""

from __future__ import annotations

import math
from typing import Any, Iterable

__all__ = ["LABELS", "label", "labels_for", "format_number", "SIGNIFICANT"]

SIGNIFICANT = 4  # digits of a float: enough to compare two tensors' statistics, few enough to read

LABELS = {
    # manifest summary
    "format": "format", "step": "step", "world_size": "ranks", "layout": "layout",
    "layout_description": "layout", "n_tensors": "tensors", "n_hyperparameters": "hyper-parameter entries",
    "n_packed_hyperparameter_items": "packed hyper-parameter items", "n_entries": "stored entries",
    "total_bytes": "total size", "bytes_by_kind": "size by kind", "n_params_model": "model parameters",
    "dtypes": "dtypes", "n_files": "files", "quant": "quantized", "n_param_groups": "param groups",
    "n_hyperparameter_values": "hyper-parameter values",
    # key table
    "key": "key", "dtype": "dtype", "shape": "shape", "kind": "kind", "bytes": "size", "n_shards": "shards",
    "ranks": "ranks", "file": "file", "rank": "rank", "offsets": "offsets", "lengths": "lengths",
    "chunks": "chunks",
    # one tensor's statistics (workbench.checkpoint.stats)
    "numel": "elements", "min": "min", "max": "max", "mean": "mean", "std": "std", "abs_mean": "mean |x|",
    "norm": "L2 norm", "zeros": "zeros", "non_finite": "non-finite",
    # verify (VerifyReport.to_dict)
    "path": "path", "ok": "ok", "problems": "problems", "warnings": "warnings", "checked": "checked",
    "problem": "problem", "fix": "fix", "message": "message", "files_hashed": "files hashed",
    "bytes_hashed": "bytes hashed", "tensors": "tensors", "hyperparameter_entries": "hyper-parameter entries",
    "quantized_moments": "quantized moments", "files": "files", "tensors_loaded": "tensors read",
    "bytes_loaded": "bytes read",
    # diff (CheckpointDiff.to_dict)
    "a": "A", "b": "B", "identical": "identical", "verdict": "verdict", "banner": "summary",
    "differ_kinds": "kinds that differ", "kind_differences": "differences by kind", "only_in_a": "only in A",
    "only_in_b": "only in B", "added": "only in B (a kind both hold)", "removed": "only in A (a kind both hold)",
    "changed": "changed shape or dtype", "kinds": "kinds compared", "n_compared": "tensors compared",
    "n_equal": "tensors equal", "n_added": "only in B (a kind both hold)", "n_removed": "only in A (a kind both hold)",
    "n_changed": "changed shape or dtype", "by_tensor_kind": "values by tensor kind",
    "top_changes": "largest changes", "tensor_kind": "tensor kind", "values_differ": "values differ",
    "compared": "compared", "max_rel_norm": "largest ||b - a|| / ||a||", "rel_norm": "||b - a|| / ||a||",
    "max_abs": "max |b - a|", "equal": "equal", "a_dtype": "A dtype", "a_shape": "A shape", "b_dtype": "B dtype",
    "b_shape": "B shape", "hyperparameters": "optimizer hyper-parameters", "status": "status",
    "n_differ": "values differ", "packed_items": "packed items", "note": "note",
    "hyperparameter_changes": "hyper-parameter changes", "name": "name", "params": "parameters",
    # load dry run (LoadPlan.to_dict)
    "src": "checkpoint", "like": "layout of", "model": "model", "target": "target layout",
    "target_description": "target layout", "source_layout": "saved layout", "source_world_size": "saved ranks",
    "layout_error": "layout error", "missing": "missing", "n_missing": "missing", "unexpected": "not used by the target",
    "n_unexpected": "not used by the target", "reshaped": "reshaped", "checkpoint_shape": "checkpoint shape",
    "target_shape": "target shape", "dtype_changes": "dtype changes", "checkpoint_dtype": "checkpoint dtype",
    "target_dtype": "target dtype", "notes": "notes", "bytes_to_read": "to read", "loadable": "loadable",
    "reasons": "reasons",
}


def label(name: str) -> str:
    """The label of field ``name``: from :data:`LABELS`, else its words (``n_`` dropped, ``_`` as spaces)."""
    if name in LABELS:
        return LABELS[name]
    words = name[2:] if name.startswith("n_") else name
    return words.replace("_", " ")


def labels_for(names: Iterable[str]) -> dict[str, str]:
    """``{name: label}`` for the fields of an answer, with the whole table (what the Lab tab looks its
    headers up in)."""
    return {**LABELS, **{n: label(n) for n in names}}


def format_number(v: Any) -> str:
    """A number as the views print it: integers with thousands separators, floats to :data:`SIGNIFICANT`
    significant digits (scientific below 1e-3 and from 1e4 on), NaN and infinities by name."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    if isinstance(v, int):
        return f"{v:,}"
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    if v == 0:
        return "0"
    if 1e-3 <= abs(v) < 10 ** SIGNIFICANT:
        text = f"{v:.{SIGNIFICANT}g}"  # %g drops the trailing zeros (0.5, not 0.5000)
        if "e" not in text:  # (9999.7 rounds up to 1e+04)
            return text
    return f"{v:.{SIGNIFICANT - 1}e}"
