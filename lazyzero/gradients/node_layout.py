"""How many ranks share a node, for the two-hop int8 gradient exchange (docs/gradients.md).

From `lazyzero.gradients.ranks_per_node` when set (so that "2 nodes x 2 ranks" can be rehearsed
on one machine), else from the launcher: the deepspeed launcher exports LOCAL_SIZE, Open MPI's
mpirun OMPI_COMM_WORLD_LOCAL_SIZE, torchrun LOCAL_WORLD_SIZE. Without either, all ranks are taken
to share one node, and the exchange takes one hop.

Both launchers place ranks node by node (global rank = node * L + local rank), which the two-hop
groups assume; a launcher-given layout is checked against every rank's LOCAL_RANK before use.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from lazyzero.distributed.cpu_threads import LAUNCHER_LOCAL_SIZE
from lazyzero.gradients import NodeGroups, build_node_groups, group_ranks

LAUNCHER_LOCAL_RANK = ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK")


def _first_int(names: tuple[str, ...]) -> int | None:
    for name in names:
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return None


def launcher_ranks_per_node() -> int | None:
    return _first_int(LAUNCHER_LOCAL_SIZE)


def _placed_node_by_node(ranks_per_node: int, device: torch.device) -> bool:
    """True on every rank when each rank's launcher-given local rank is its rank modulo L."""
    local_rank = _first_int(LAUNCHER_LOCAL_RANK)
    misplaced = torch.tensor([float(local_rank is not None and local_rank != dist.get_rank() % ranks_per_node)],
                             device=device)
    dist.all_reduce(misplaced, op=dist.ReduceOp.MAX)
    return not bool(misplaced.item())


def node_groups_for(group: dist.ProcessGroup | None, configured: int | None,
                    device: torch.device) -> NodeGroups | None:
    """The two-hop groups of `group`, or None when the exchange takes one hop (one node, or one
    rank per node). A collective over the default group."""
    world_size = dist.get_world_size()
    ranks_per_node = configured if configured is not None else launcher_ranks_per_node() or world_size
    if ranks_per_node in (1, world_size):
        return None
    if group_ranks(group) != list(range(world_size)):
        raise NotImplementedError(
            "lazyzero.gradients: the two-hop exchange needs data parallelism over all ranks; this run's "
            "data-parallel group is a subset. Set lazyzero.gradients.ranks_per_node to 1 for one hop")
    if configured is None and not _placed_node_by_node(ranks_per_node, device):
        raise ValueError(
            f"lazyzero.gradients: the launcher reports {ranks_per_node} ranks per node, but ranks are not "
            "placed node by node (rank = node * ranks_per_node + local rank); set "
            "lazyzero.gradients.ranks_per_node, or launch with --map-by slot")
    return build_node_groups(group, ranks_per_node)
