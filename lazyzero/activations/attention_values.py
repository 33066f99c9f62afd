"""Which tensors an attention module saves are its query and key, its values, its output or the output
projection's input.

The policy stores the values, the output and the output projection's input at `attention_value_bits`,
q and k at `attention_bits` by channel, and keeps the logsumexp exact (lazyzero/activations/policy.py
says why). They cannot be told apart by module: the attention's own
backward saves all of them in one node. So while a managed attention module runs, `AttentionRoles`
watches its call of `torch.nn.functional.scaled_dot_product_attention` (the path transformers'
"sdpa" attention takes) through a torch function mode, and answers for each saved storage:
- during that call: the value's storage, and a tensor of the query's dtype and size that is neither
  the query's nor the key's storage (the attention's output), are values; the rest (q, k, the
  logsumexp, a dropout mask) is not;
- after it: what the module saves is the output projection's input (a view of the output, or its
  copy) and is a value;
- before it, or when the module never calls SDPA (eager attention): nothing is.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from lazyzero.activations.stored import storage_root

_SDPA = torch.nn.functional.scaled_dot_product_attention


class AttentionRoles(TorchFunctionMode):
    """Enter around one attention module's forward; `is_value(tensor)` and `is_query_or_key(tensor)` inside
    the pack hook."""

    def __init__(self):
        super().__init__()
        self._call: tuple[torch.Tensor, ...] | None = None  # (query, key root, value root) during SDPA
        self._called = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not _SDPA:
            return func(*args, **kwargs)
        query, key, value = (list(args[:3]) + [kwargs.get(name) for name in ("query", "key", "value")[len(args):]])
        self._call = (query, storage_root(key), storage_root(value))
        try:
            return func(*args, **kwargs)
        finally:
            self._call = None
            self._called = True

    def is_value(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor`, being saved now, is the value, the output or the output projection's input."""
        if self._call is None:
            return self._called
        query, key_root, value_root = self._call
        root = storage_root(tensor)
        if root is value_root:
            return True
        return (root is not storage_root(query) and root is not key_root and tensor.dtype == query.dtype
                and tensor.numel() == query.numel())

    def is_query_or_key(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor`, being saved now, is (a view of) the query or the key of the SDPA call running."""
        if self._call is None:
            return False
        query, key_root, _ = self._call
        root = storage_root(tensor)
        return root is key_root or root is storage_root(query)
