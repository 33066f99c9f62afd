"""lazyzero's optimizers: Adam/AdamW with block-wise 8-bit states and fused clipping."""

from lazyzero.optimizer.adam8bit_optimizer import Adam8bit, AdamW8bit

__all__ = ["Adam8bit", "AdamW8bit"]
