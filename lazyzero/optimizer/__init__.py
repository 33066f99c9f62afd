"""lazyzero's optimizers: Adam/AdamW with block-wise 8-bit states and fused clipping."""

from lazyzero._lazy_names import lazy_names

# Resolved on first use, so that importing `lazyzero.optimizer.config` (composed by `lazyzero.config`,
# which imports neither torch nor DeepSpeed) does not import the optimizers and torch with it.
_HOMES = dict.fromkeys(("Adam8bit", "AdamW8bit"), "adam8bit_optimizer")

__getattr__, __dir__ = lazy_names(__name__, _HOMES)
__all__ = sorted(_HOMES)
