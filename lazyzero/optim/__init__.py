"""lazyzero's optimizers: Adam/AdamW with block-wise 8-bit states and fused clipping."""

from lazyzero.optim.adam8bit import Adam8bit, AdamW8bit

__all__ = ["Adam8bit", "AdamW8bit"]
