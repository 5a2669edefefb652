"""The one door to torch's private APIs, with feature detection.

Everything the workbench uses from torch that is not public API is named here, once, as a path
``"module:attr.attr"``. Other modules import it from here (``from workbench.compat import DTensorSpec``)
or call a helper (``compat.custom_op_handlers()``), never from ``torch.*._x`` themselves, so a torch
upgrade that moves a private symbol breaks one line in one file.

A **feature** is a part of the workbench and the private symbols it needs (``FEATURES``). On a torch
that lacks one of them, the feature is skipped with one line on stderr, the first time something asks
for it::

    workbench: SPMD rule family 'elementwise' skipped: torch 2.11.0 lacks
    torch.distributed.tensor._ops._pointwise_ops:_common_pointwise_single_dim_strategy

and everything else keeps working. ``workbench doctor`` lists every feature with its status.

Tests simulate an older torch through the real detection path: ``WORKBENCH_COMPAT_HIDE`` is a comma list
of symbol paths, their last names (``_sorted_batch_p2p``) or feature names (``spmd.elementwise``) to treat
as missing.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

TORCH_VERSION = torch.__version__.split("+")[0]
HIDE_ENV = "WORKBENCH_COMPAT_HIDE"


class MissingTorchAPI(ImportError):
    """A private torch symbol this workbench feature needs is not in the running torch."""


# --------------------------------------------------------------------------------------------------
# Symbols: the short name the workbench uses -> where it lives in torch
# --------------------------------------------------------------------------------------------------

_DT = "torch.distributed.tensor"
_PROP = f"{_DT}:DTensor._op_dispatcher.sharding_propagator"

SYMBOLS: dict[str, str] = {
    # dispatcher, pytree, op objects
    "OpOverload": "torch._ops:OpOverload",
    "OpOverloadPacket": "torch._ops:OpOverloadPacket",
    "pytree": "torch.utils._pytree",
    "TorchDispatchMode": "torch.utils._python_dispatch:TorchDispatchMode",
    "is_traceable_wrapper_subclass": "torch.utils._python_dispatch:is_traceable_wrapper_subclass",
    "return_and_correct_aliasing": "torch.utils._python_dispatch:return_and_correct_aliasing",
    "current_graph_task_id": "torch._C:_current_graph_task_id",  # != -1 while autograd's engine runs
    "cuda_record_memory_history": "torch.cuda.memory:_record_memory_history",
    "cuda_dump_snapshot": "torch.cuda.memory:_dump_snapshot",
    # DTensor internals
    "funcol": "torch.distributed._functional_collectives",
    "AsyncCollectiveTensor": "torch.distributed._functional_collectives:AsyncCollectiveTensor",
    "DTensorSpec": f"{_DT}._dtensor_spec:DTensorSpec",
    "TensorMeta": f"{_DT}._dtensor_spec:TensorMeta",
    "compute_local_shape_and_global_offset": f"{_DT}._utils:compute_local_shape_and_global_offset",
    "redistribute_local_tensor": f"{_DT}._redistribute:redistribute_local_tensor",
    "RuntimeSchemaInfo": f"{_DT}._op_schema:RuntimeSchemaInfo",
    "SingleDimStrategyInfo": f"{_DT}._ops.single_dim_strategy:_SingleDimStrategyInfo",
    "common_pointwise_single_dim_strategy": f"{_DT}._ops._pointwise_ops:_common_pointwise_single_dim_strategy",
    "BINARY_ADDITIVE_RULES": f"{_DT}._ops._pointwise_ops:_BINARY_ADDITIVE_RULES",
    "DecompShardingStrategy": f"{_DT}._sharding_prop:DecompShardingStrategy",
    "StridedShard": f"{_DT}.placement_types:_StridedShard",
    "c10d_functional": "torch.ops:_c10d_functional",
    "resolve_process_group": "torch.distributed.distributed_c10d:_resolve_process_group",
    "process_group_unbox": "torch._C._distributed_c10d:ProcessGroup.unbox",  # a c10d op's group -> ProcessGroup
    # process groups, FSDP2, DDP, ZeRO, pipelining, activation checkpointing, DCP
    "FakeStore": "torch.testing._internal.distributed.fake_pg:FakeStore",
    "HSDPMeshInfo": "torch.distributed.fsdp._fully_shard._fsdp_common:HSDPMeshInfo",
    "sorted_batch_p2p": "torch.distributed.pipelining.schedules:_sorted_batch_p2p",
    "wait_batch_p2p": "torch.distributed.pipelining.schedules:_wait_batch_p2p",
    "checkpoint_wrapper": "torch.distributed.algorithms._checkpoint.checkpoint_wrapper:checkpoint_wrapper",
    "CheckpointImpl": "torch.distributed.algorithms._checkpoint.checkpoint_wrapper:CheckpointImpl",
    "get_fqns": "torch.distributed.checkpoint.state_dict:_get_fqns",
    # fake execution (memory prediction): tensors with sizes and no storage, collectives that move nothing
    "FakeTensorMode": "torch._subclasses.fake_tensor:FakeTensorMode",
    "FakeTensor": "torch._subclasses.fake_tensor:FakeTensor",
    "disable_current_modes": "torch.utils._python_dispatch:_disable_current_modes",
    "dispatch_mode_stack": "torch.utils._python_dispatch:_get_current_dispatch_mode_stack",
    "fake_meta_handlers": "torch._subclasses.fake_tensor:_DISPATCH_META_HANDLERS",
    "fake_handle_directly": "torch._subclasses.fake_tensor:_DISPATCH_HANDLE_DIRECTLY",
    # what a CUDA step runs, for fake steps on CPU tensors that target CUDA (workbench.prediction.cuda_ops)
    "library_destroy": "torch.library:Library._destroy",  # a Library's registrations undone at once
    "sdp_priority_order": "torch._C:_get_sdp_priority_order",
    "sdpa_flash_cuda": "torch.ops:aten._scaled_dot_product_flash_attention",
    "sdpa_efficient_cuda": "torch.ops:aten._scaled_dot_product_efficient_attention",
    "sdpa_cudnn_cuda": "torch.ops:aten._scaled_dot_product_cudnn_attention",
    # torch's own op samples (the conformance harness's --source opinfo); needs the test-only package
    # expecttest, so it is imported on demand (op_db()), never at startup or by `workbench doctor`
    "op_db": "torch.testing._internal.common_methods_invocations:op_db",
}

# Private attributes reached through objects (helpers below); listed so features can name them.
_ATTRS = {
    "op_dispatcher": f"{_DT}:DTensor._op_dispatcher",
    "custom_op_handlers": f"{_DT}:DTensor._op_dispatcher._custom_op_handlers",
    "op_strategy_funcs": f"{_PROP}.op_strategy_funcs",
    "op_single_dim_strategy_funcs": f"{_PROP}.op_single_dim_strategy_funcs",
    "op_to_schema_info": f"{_PROP}.op_to_schema_info",
    "op_to_schema_info_for_single_dim_strategy": f"{_PROP}.op_to_schema_info_for_single_dim_strategy",
    "register_single_dim_op_strategy": f"{_PROP}.register_single_dim_op_strategy",
    "clear_propagator_cache_cpp": "torch._C:_clear_DTensor_sharding_propagator_cache",
    "fsdp_state": "torch.distributed.fsdp:FSDPModule._get_fsdp_state",
    "zero_partition": "torch.distributed.optim:ZeroRedundancyOptimizer._partition_parameters",
    "ddp_verify_shapes": "torch.nn.parallel.distributed:_verify_param_shape_across_processes",
    "ddp_sync_states": "torch.nn.parallel.distributed:_sync_module_states",
    "gpipe_check_inputs": "torch.distributed.pipelining.schedules:ScheduleGPipe._check_inputs",
    "gpipe_initialize_stage": "torch.distributed.pipelining.schedules:ScheduleGPipe._initialize_stage",
    "gpipe_maybe_compute_loss": "torch.distributed.pipelining.schedules:ScheduleGPipe._maybe_compute_loss",
    "gpipe_maybe_get_loss": "torch.distributed.pipelining.schedules:ScheduleGPipe._maybe_get_loss",
    "gpipe_update_losses": "torch.distributed.pipelining.schedules:ScheduleGPipe._update_losses",
    "pipeline_warmup_vote": "torch.distributed.pipelining.stage:PipelineStage._warmup_forward_vote",  # 2.13+
    "explain_redistribute_api": f"{_DT}._api:redistribute_local_tensor",
    "explain_redistribute_dispatch": f"{_DT}._dispatch:redistribute_local_tensor",
}


def _path(name: str) -> str:
    return SYMBOLS.get(name) or _ATTRS.get(name) or name


# --------------------------------------------------------------------------------------------------
# Features
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Feature:
    name: str
    label: str  # how the skip line names it
    needs: tuple[str, ...]  # short names (SYMBOLS / _ATTRS) or full paths
    requires: tuple[str, ...] = ()  # other features
    if_missing: str = "skipped"
    # Where the symbols exist but an older torch's DTensor behaves differently (no rule for an op, a view
    # rule that refuses a reshape), the first torch the feature's checks pass on, and what differs.
    min_torch: str | None = None
    older: str = ""


_SPMD_CORE = ("op_dispatcher", "custom_op_handlers", "op_strategy_funcs", "op_single_dim_strategy_funcs",
              "op_to_schema_info", "op_to_schema_info_for_single_dim_strategy", "clear_propagator_cache_cpp",
              "OpOverload", "pytree")

FEATURES: dict[str, Feature] = {f.name: f for f in [
    Feature("spmd.registry", "SPMD rule installation", _SPMD_CORE,
            if_missing="no SPMD rule of ours is installed; DTensor uses torch's own rules"),
    Feature("spmd.elementwise", "SPMD rule family 'elementwise'",
            ("common_pointwise_single_dim_strategy", "BINARY_ADDITIVE_RULES", "RuntimeSchemaInfo", "TensorMeta",
             "SingleDimStrategyInfo", "register_single_dim_op_strategy",
             f"{_DT}._ops.single_dim_strategy:_SingleDimStrategyInfo.allow_uneven_sharding"),
            requires=("spmd.registry",)),
    Feature("spmd.reductions", "SPMD rule family 'reductions'",
            ("funcol", "DTensorSpec", "TensorMeta", "compute_local_shape_and_global_offset"),
            requires=("spmd.registry",)),
    Feature("spmd.norms", "SPMD rule family 'norms'",
            ("funcol", "AsyncCollectiveTensor", "DTensorSpec", "TensorMeta", "redistribute_local_tensor",
             "StridedShard", "return_and_correct_aliasing"),
            requires=("spmd.registry", "spmd.reductions"), min_torch="2.13",
            older="a DTensor rule for batch_norm, and a view rule that keeps a channel-sharded instance_norm sharded"),
    Feature("spmd.indexing", "SPMD rule family 'indexing'",
            ("compute_local_shape_and_global_offset",), requires=("spmd.registry", "spmd.reductions"),
            min_torch="2.13", older="a DTensor rule for in-place index_put_ that our fallback hands ops to"),
    Feature("spmd.kernels", "SPMD rules for workbench's kernel ops",
            ("compute_local_shape_and_global_offset", "redistribute_local_tensor", "DTensorSpec", "TensorMeta",
             "AsyncCollectiveTensor"), requires=("spmd.registry", "spmd.reductions")),
    Feature("spmd.comm", "collective byte counting (spmd explain, conformance)",
            ("c10d_functional", "resolve_process_group")),
    Feature("spmd.explain", "workbench spmd explain",
            ("TorchDispatchMode", "pytree", "OpOverloadPacket", "redistribute_local_tensor",
             "explain_redistribute_api", "explain_redistribute_dispatch", "FakeStore"),
            requires=("spmd.registry", "spmd.comm")),
    Feature("pipeline.lean_schedule", "pipeline schedule 'GPipeLean'",
            ("sorted_batch_p2p", "wait_batch_p2p", "gpipe_check_inputs", "gpipe_initialize_stage",
             "gpipe_maybe_compute_loss", "gpipe_maybe_get_loss", "gpipe_update_losses"),
            if_missing="pp_schedule='GPipeLean' is refused; GPipe, 1F1B and Interleaved1F1B work"),
    Feature("plan.fake_pg", "plans on a fake process group", ("FakeStore",),
            if_missing="workbench plan cannot simulate a job"),
    Feature("plan.simulate", "plan simulation of FSDP2 and DDP",
            ("HSDPMeshInfo", "StridedShard", "fsdp_state", "ddp_verify_shapes",
             "ddp_sync_states", "op_dispatcher", f"{_DT}._redistribute"), requires=("plan.fake_pg",)),
    # Apart: checking it imports torch.distributed.optim (~0.2 s of CPU), which only zero=1 plans use.
    Feature("plan.zero1", "plan simulation of ZeRO-1", ("zero_partition",), requires=("plan.simulate",)),
    Feature("memory.probe", "memory probe (per-category bytes)",
            ("TorchDispatchMode", "is_traceable_wrapper_subclass", "pytree")),
    Feature("memory.recorder", "memory timelines (workbench train --memory, workbench memory predict)",
            ("TorchDispatchMode", "is_traceable_wrapper_subclass", "pytree", "current_graph_task_id")),
    Feature("memory.fake_step", "memory prediction (a training step under FakeTensorMode)",
            ("FakeTensorMode", "FakeTensor", "disable_current_modes", "dispatch_mode_stack", "fake_meta_handlers",
             "fake_handle_directly", "FakeStore"),
            if_missing="workbench cannot predict memory by running a fake step"),
    Feature("memory.cuda_ops", "CUDA's kernels in fake steps on CPU tensors (memory predict --device cuda without a GPU)",
            ("TorchDispatchMode", "library_destroy", "sdp_priority_order", "sdpa_flash_cuda", "sdpa_efficient_cuda", "sdpa_cudnn_cuda"),
            requires=("memory.fake_step",),
            if_missing="a CUDA prediction on a machine without a GPU runs the CPU's kernels (attention's saved "
                       "statistics, the optimizer's temporaries)"),
    Feature("time.predict", "step-time prediction (workbench time predict)",
            ("TorchDispatchMode", "current_graph_task_id", "resolve_process_group", "FakeTensor"),
            requires=("memory.fake_step",), if_missing="workbench cannot predict step time"),
    Feature("train.activation_checkpointing", "activation checkpointing", ("checkpoint_wrapper", "CheckpointImpl")),
    Feature("checkpoint.ema", "EMA weights in checkpoints", ("get_fqns",)),
]}


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split("+")[0].split(".")[:2] if x.isdigit())


def _hidden() -> set[str]:
    return {s.strip() for s in os.environ.get(HIDE_ENV, "").split(",") if s.strip()}


def _is_hidden(path: str, hidden: set[str]) -> bool:
    return path in hidden or path.rsplit(":", 1)[-1].rsplit(".", 1)[-1] in hidden


def _resolve(path: str) -> Any:
    """The object at ``"module:attr.attr"`` (or a module), or ``MissingTorchAPI`` naming the path."""
    if _is_hidden(path, _hidden()):
        raise MissingTorchAPI(f"torch {TORCH_VERSION} lacks {path} (hidden by {HIDE_ENV})")
    mod, _, attrs = path.partition(":")
    try:
        obj = importlib.import_module(mod)
        for a in attrs.split(".") if attrs else ():
            obj = getattr(obj, a)
    except (ImportError, AttributeError) as e:
        raise MissingTorchAPI(f"torch {TORCH_VERSION} lacks {path}") from e
    return obj


def get(name: str) -> Any:
    """A private torch symbol by its short name (``SYMBOLS``) or path; ``MissingTorchAPI`` if absent."""
    return _resolve(_path(name))


def __getattr__(name: str) -> Any:  # ``from workbench.compat import DTensorSpec``
    if name in SYMBOLS:
        return get(name)
    raise AttributeError(f"module 'workbench.compat' has no attribute {name!r}")


def missing(feature: str) -> list[str]:
    """The symbol paths (or required features) ``feature`` needs that the running torch lacks."""
    f = FEATURES[feature]
    hidden = _hidden()
    if feature in hidden:
        return [_path(n) for n in f.needs]
    out = [f"feature {r}" for r in f.requires if missing(r)]
    if f.min_torch and _version(TORCH_VERSION) < _version(f.min_torch):
        out.append(f"{f.older} (needs torch {f.min_torch} or newer)")
    for n in f.needs:
        try:
            _resolve(_path(n))
        except MissingTorchAPI:
            out.append(_path(n))
    return out


def available(feature: str) -> bool:
    return not missing(feature)


def skip_reason(feature: str) -> str | None:
    """``"torch 2.11.0 lacks <path>"`` for a feature that cannot run, else None."""
    gone = missing(feature)
    if not gone:
        return None
    why = f"torch {TORCH_VERSION} lacks {gone[0]}" + (f" (+{len(gone) - 1} more)" if len(gone) > 1 else "")
    if feature in _hidden() or any(_is_hidden(g, _hidden()) for g in gone):
        why += f" (hidden by {HIDE_ENV})"
    return why


_warned: set[str] = set()


def check(feature: str) -> bool:
    """True when ``feature`` can run; otherwise say so once per process (one stderr line) and return False."""
    why = skip_reason(feature)
    if why is None:
        return True
    if feature not in _warned:
        _warned.add(feature)
        print(f"workbench: {FEATURES[feature].label} skipped: {why}", file=sys.stderr, flush=True)
    return False


def require(feature: str, what: str, fix: str) -> None:
    """Raise one ``ValueError`` line when ``what`` needs a feature the running torch lacks."""
    why = skip_reason(feature)
    if why is not None:
        raise ValueError(f"{what} is unavailable: {why}; {fix}")


def report() -> list[dict]:
    """Every feature: name, label, available, and why not (for ``workbench doctor``)."""
    return [{"feature": f.name, "label": f.label, "available": (why := skip_reason(f.name)) is None,
             "why": why, "if_missing": None if why is None else f.if_missing} for f in FEATURES.values()]


# --------------------------------------------------------------------------------------------------
# Helpers over private attributes
# --------------------------------------------------------------------------------------------------


def op_dispatcher() -> Any:
    """DTensor's op dispatcher (``DTensor._op_dispatcher``)."""
    return get("op_dispatcher")


def sharding_propagator() -> Any:
    return op_dispatcher().sharding_propagator


def custom_op_handlers() -> dict:
    """DTensor's op -> handler table, which runs before sharding propagation."""
    return get("custom_op_handlers")


def clear_sharding_caches() -> None:
    """Forget DTensor's cached sharding decisions: the Python propagator's and redistribute's LRU caches
    and the C++ fast path's."""
    prop = sharding_propagator()
    owners = [prop]
    try:
        owners.append(_resolve(f"{_DT}._redistribute"))
    except MissingTorchAPI:
        pass
    for owner in owners:
        for attr in dir(owner):
            fn = getattr(owner, attr, None)
            if callable(getattr(fn, "cache_clear", None)):
                fn.cache_clear()
    try:
        get("clear_propagator_cache_cpp")()
    except MissingTorchAPI:
        pass


def single_dim_strategy_info(fn: Any, like: Any = None) -> Any:
    """Wrap a single-dim strategy for DTensor; copy torch's flags from ``like`` (its own entry for the op)
    where the running torch has them (2.12 added uneven and different-mesh flags)."""
    cls = get("SingleDimStrategyInfo")
    fields = getattr(cls, "__dataclass_fields__", {})
    flags = {"allow_unbacked_sharding": None, "allow_uneven_sharding": True, "different_mesh_args": None}
    if like is not None:
        flags = {k: getattr(like, k, v) for k, v in flags.items()}
    return cls(func=fn, **{k: v for k, v in flags.items() if k in fields and v is not None})


def op_db() -> list:
    """torch's OpInfo database (``torch.testing._internal.common_methods_invocations.op_db``): every op's
    sample inputs, as torch's own test suite uses them. ``MissingTorchAPI`` in one line where it cannot be
    imported (it needs the test-only package ``expecttest``; importing it takes seconds)."""
    path = SYMBOLS["op_db"]
    if _is_hidden(path, _hidden()):
        raise MissingTorchAPI(f"torch {TORCH_VERSION}'s OpInfo samples are unavailable: {path} is hidden by {HIDE_ENV}")
    mod, _, attr = path.partition(":")
    try:
        return getattr(importlib.import_module(mod), attr)
    except Exception as e:  # noqa: BLE001 - any import failure of torch's test helpers means "unavailable"
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        hint = "; install it with `pip install expecttest`" if "expecttest" in why else ""
        raise MissingTorchAPI(f"torch {TORCH_VERSION}'s OpInfo samples are unavailable: importing "
                              f"{mod} failed ({why}){hint}") from None


def has_composite_implicit_kernel(op: Any) -> bool:
    """True when ``op`` decomposes (CompositeImplicitAutograd) before reaching DTensor."""
    return bool(torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), torch._C.DispatchKey.CompositeImplicitAutograd))


def op_schema(op: Any) -> Any:
    """An OpOverload's ``FunctionSchema`` (``op._schema``; torch has no public accessor): its arguments'
    names, types, defaults and which are keyword-only."""
    schema = getattr(op, "_schema", None)
    if schema is None:
        raise RuntimeError(f"{op} has no schema on torch {torch.__version__}; `workbench doctor` lists what it lacks")
    return schema


def local_tensor(t: Any) -> torch.Tensor:
    """A DTensor's local shard without autograd bookkeeping (``t._local_tensor``)."""
    return t._local_tensor


def dtensor_spec(t: Any) -> Any:
    """A DTensor's ``DTensorSpec`` (``t._spec``)."""
    return t._spec


def fsdp_param_groups(module: Any) -> list:
    """An FSDP2 module's parameter groups (``module._get_fsdp_state()._fsdp_param_groups``; torch 2.11
    has one group per module, ``_fsdp_param_group``, or None)."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        one = getattr(state, "_fsdp_param_group", None)
        groups = [] if one is None else [one]
    return list(groups)


def quiet_fsdp_view_output_warning() -> None:
    """Stop FSDP2's "returned a view tensor ... wrong gradients" UserWarning for our Transformer only.

    Under tensor parallelism the output head (``ColwiseParallel(use_local_output=True)``) ends in
    ``DTensor.to_local()``, which returns a view of the all-gathered logits (autograd needs a new tensor
    object), so the FSDP2 root's output is a view. torch 2.13 warns on every such output because an
    in-place op on it (``logits += bias``) would drop the root's pre-backward hook and its all-gather. Our
    logits are only ever read: the step's and the pipeline's loss is ``F.cross_entropy(logits.float()...)``,
    so the hook always runs. Avoiding the view would mean a copy of the logits (the largest activation) or
    a DTensor loss. The filter names the class and torch's module, so the warning still reaches anyone
    else's model, and ours wherever this is not called.
    """
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning,
                            message=r"FSDP2-wrapped module \(FSDPTransformer\) returned a view tensor",
                            module=r"torch\.distributed\.fsdp\._fully_shard\._fsdp_state")


def zero_partition(optimizer: Any) -> list | None:
    """ZeRO-1's parameter groups per rank (``ZeroRedundancyOptimizer._partition_parameters()``), else None."""
    fn = getattr(optimizer, "_partition_parameters", None)
    return None if fn is None else fn()


@contextmanager
def ddp_without_rank_sync() -> Iterator[None]:
    """DDP's constructor without its cross-rank shape check and rank-0 weight broadcast (both read tensor
    values, which meta tensors do not have)."""
    from unittest import mock

    ddp = importlib.import_module("torch.nn.parallel.distributed")
    with mock.patch.object(ddp, "_verify_param_shape_across_processes", lambda *a, **k: None), \
            mock.patch.object(ddp, "_sync_module_states", lambda *a, **k: None):
        yield


def redistribute_hook_modules() -> list:
    """The DTensor modules that call ``redistribute_local_tensor`` through a module-level name, so a
    scoped wrapper (``spmd.explain``) must patch each."""
    return [_resolve(f"{_DT}.{m}") for m in ("_api", "_dispatch", "_redistribute")]


def call_trimmed(fn: Any, *args: Any) -> Any:
    """Call a private torch method with as many of ``args`` as its signature takes: newer torches append
    optional parameters (2.13's ``_initialize_stage(args, kwargs, target, loss_kwargs)`` is 2.11's
    ``_initialize_stage(args, kwargs)``), so the trailing ones are dropped where it lacks them."""
    import inspect

    params = inspect.signature(fn).parameters.values()
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return fn(*args)
    n = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)
    return fn(*args[:n])


@contextmanager
def outside_dispatch_modes() -> Iterator[None]:
    """Run the code inside with no TorchDispatchMode active (no FakeTensorMode, no recorder): for small
    bookkeeping computations whose values are needed, such as a DTensor shard's global offset, which
    torch computes with tensors and then reads with ``int()``."""
    try:
        disable = get("disable_current_modes")
    except MissingTorchAPI:
        yield
        return
    with disable():
        yield


def in_fake_mode() -> bool:
    """True while a FakeTensorMode is active (tensors made now have sizes but no storage or values)."""
    try:
        fake_cls = get("FakeTensorMode")
        stack = get("dispatch_mode_stack")()
    except MissingTorchAPI:
        return False
    return any(isinstance(m, fake_cls) for m in stack)


def is_fake(t: Any) -> bool:
    """True for a FakeTensor, or a tensor subclass (DTensor) whose local tensor is one."""
    try:
        fake_cls = get("FakeTensor")
    except MissingTorchAPI:
        return False
    if isinstance(t, fake_cls):
        return True
    inner = getattr(t, "_local_tensor", None)
    return isinstance(inner, fake_cls)


def static_pipeline_stage(stage: Any) -> Any:
    """Make a pipeline stage built with its boundary shapes (``input_args``/``output_args``) use them
    without asking its neighbours, and check every microbatch against them.

    torch 2.13's schedules first hold a vote over the pipeline's ranks (each stage says whether its
    shapes are static) and read the result with ``.item()``; on a fake process group there is no result
    to read, and every stage of a fake run is static, so the vote is answered locally. 2.13 checks
    microbatches against the given shapes only at debug level DETAIL; here always (2.11 always does).
    torch 2.11 holds no vote.
    """
    if hasattr(stage, "_warmup_forward_vote"):
        stage._warmup_forward_vote = lambda *a, **k: torch.tensor([1], dtype=torch.int32)
        stage._warmup_backward_result = lambda *a, **k: torch.tensor([1], dtype=torch.int32)
    if hasattr(stage, "_runtime_validate"):
        stage._runtime_validate = True
    return stage


_FAKE_MODE_CLS: list = []


def fake_tensor_mode(**kwargs: Any) -> Any:
    """A ``FakeTensorMode(**kwargs)`` that passes operators on DTensors straight to DTensor.

    A dispatch mode sees every operator before any tensor subclass does, so each DTensor operator first
    reaches FakeTensorMode, which builds part of a cache key, meets the DTensor, gives up (an exception
    and a bypass record) and returns ``NotImplemented``; then DTensor runs it on its local fake tensors.
    That detour was 7% of a fake llama-70b step (tp=8, sp, FSDP2). This mode returns ``NotImplemented`` at once,
    after the same two checks FakeTensorMode makes before it (operators it answers for any tensor)."""
    if not _FAKE_MODE_CLS:
        base = get("FakeTensorMode")
        meta_handlers, handle_directly = get("fake_meta_handlers"), get("fake_handle_directly")
        from torch.distributed.tensor import DTensor

        class FakeTensorModePassingDTensor(base):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if DTensor in types and func not in meta_handlers and func not in handle_directly:
                    return NotImplemented
                return super().__torch_dispatch__(func, types, args, kwargs or {})

        _FAKE_MODE_CLS.append(FakeTensorModePassingDTensor)
    return _FAKE_MODE_CLS[0](**kwargs)


_PLAIN_MODE_CLS: list = []


def unguarded_dispatch_mode() -> type:
    """A ``TorchDispatchMode`` base whose subclasses' ``__torch_dispatch__`` is not wrapped in
    ``torch._dynamo.disable``, for modes that never run under ``torch.compile`` (the memory recorder:
    ``TrainConfig`` refuses ``memory`` with ``compile``). torch wraps every subclass's method
    (``_should_skip_dynamo``), which costs about 1.3 us per operator, a fifth of what recording adds.
    On a torch without that hook, the plain ``TorchDispatchMode``."""
    if not _PLAIN_MODE_CLS:
        base = get("TorchDispatchMode")
        if hasattr(base, "_should_skip_dynamo"):
            class UnguardedDispatchMode(base):
                @classmethod
                def _should_skip_dynamo(cls) -> bool:
                    return False

            base = UnguardedDispatchMode
        _PLAIN_MODE_CLS.append(base)
    return _PLAIN_MODE_CLS[0]
