"""ParallelConfig -> DeviceMesh.

Mesh dimensions are always ``("pp", "dp_replicate", "dp_shard", "tp")`` in that order (outermost first), so
a rank's coordinates are ``rank = ((p * dp_replicate + r) * dp_shard + s) * tp + t``. Dimensions of size 1
are kept: slicing by name then works the same for every layout.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from workbench.config import MESH_DIMS, ParallelConfig



def build_mesh(parallel: ParallelConfig, device_type: str = "cpu") -> DeviceMesh:
    """The device mesh of an initialised process group whose world size matches ``parallel``."""
    world = torch.distributed.get_world_size()
    if world != parallel.world_size:
        raise ValueError(
            f"the process group has {world} ranks but the layout {parallel.describe()} needs {parallel.world_size}"
        )
    shape = tuple(getattr(parallel, d) for d in MESH_DIMS)
    return init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)


def dp_rank(parallel: ParallelConfig, rank: int) -> int:
    """Index of ``rank`` among the data-parallel ranks: which slice of the global batch it reads.

    The pipeline stages and tp ranks of one data-parallel replica read the same slice.
    """
    _, r, s, _ = parallel.rank_coords(rank)
    return r * parallel.dp_shard + s


def pp_rank(parallel: ParallelConfig, rank: int) -> int:
    """Index of ``rank``'s pipeline stage group (``pp`` is the outermost mesh dimension)."""
    return parallel.rank_coords(rank)[0]
