"""lazyzero's optimizers: Adam/AdamW with block-wise 8-bit states and fused clipping."""

from importlib import import_module

__all__ = ["Adam8bit", "AdamW8bit"]


def __getattr__(name: str):
    # Resolved on first use, so that importing `lazyzero.optimizer.config` (composed by `lazyzero.config`,
    # which imports neither torch nor DeepSpeed) does not import the optimizers and torch with it.
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module("lazyzero.optimizer.adam8bit_optimizer"), name)
    globals()[name] = value
    return value
