"""Agreement on overflow: every rank learns whether any rank holds a NaN or Inf (docs/reliability.md
promise 7, row 9).

After a quantized reduce-scatter only the owner of a block sees that block, and a NaN or Inf in
one rank's input reaches only the owners of the affected blocks (as NaN/Inf: the quantizer gives
such blocks a NaN or Inf scale, and the fused sum keeps them non-finite). Ranks must still skip the
step, or lower the loss scale, together; `any_nonfinite` turns the local facts into one shared one.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def any_nonfinite(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> bool:
    """True on every rank of `group` when `tensor` holds a NaN or Inf on at least one rank.

    A collective: every rank of the group must call it. `tensor` may differ in size per rank (an
    owner's chunk), including empty.
    """
    # Built on the tensor's device, so a GPU does not wait for the host before the collective.
    flag = torch.logical_not(torch.isfinite(tensor)).any().to(torch.float32).reshape(1)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())
