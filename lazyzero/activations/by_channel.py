"""An attention call's query and key stored with blocks that run along tokens within one channel.

Why: the keys (and queries) of pretrained LLMs carry a few channels whose values are large and nearly
the same on every token (KIVI, "Plug-and-play 2bit KV cache quantization", found the same). A block
along the hidden dimension holds one such channel beside small ones, and its scale, set by the large
value, rounds the small ones away; a block along tokens within a channel holds values of one
magnitude. Each block is also centred on the middle of its range before it is quantized, so a
channel's common offset costs no precision and the block's extreme value lands exactly on a code.
On SmolLM2-135M, q and k at 8 bits stored this way gave a gradient error of 0.015 (lowest cosine
0.9976), against 0.020 and 0.990 for k alone in blocks along the hidden dimension
(docs/activations.md).

The layout is read from strides: the storage must hold `lead x tokens x channels` elements, tokens
being the tensor's second-to-last dimension (SDPA's [batch, heads, tokens, head_dim] query, or the
[batch, tokens, heads x head_dim] storage it is often a view of). Tokens are padded to whole blocks
by repeating the last one. One native call quantizes the storage where it lies, without a copy, and
one restores it (`quantize_token_blocks` and `restore_token_blocks` in lazyzero/ops/quant.py, whose
reference in lazyzero/ops/quant_reference.py, "Blocks along tokens", specifies the maths).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lazyzero.ops.quant import BlockQuantized, quantize_token_blocks, restore_token_blocks
from lazyzero.ops.quant_reference import centred_to_storage


@dataclass(frozen=True)
class TokenLayout:
    """A storage of `lead x tokens x channels` elements, in that order."""

    lead: int
    tokens: int
    channels: int

    @classmethod
    def of(cls, root: torch.Tensor) -> TokenLayout | None:
        """`root`'s storage as lead x tokens x channels, tokens being its second-to-last dimension; None
        when its strides do not lay it out that way. (Any answer restores the storage exactly as it was
        laid out; a wrong one would only put unrelated values in one block.)"""
        if root.dim() < 2 or root.storage_offset() != 0:
            return None
        tokens, channels = root.shape[-2], root.stride(-2)
        numel = root.untyped_storage().nbytes() // root.element_size()
        if tokens < 2 or channels < 1 or numel % (tokens * channels):
            return None
        others = [(size, stride) for dim, (size, stride) in enumerate(zip(root.shape, root.stride()))
                  if dim != root.dim() - 2 and size > 1]
        for size, stride in others:
            within_a_token = (size - 1) * stride < channels
            across_tokens = stride % (tokens * channels) == 0
            if not (within_a_token or across_tokens):
                return None
        return cls(numel // (tokens * channels), tokens, channels)


@dataclass(frozen=True)
class ChannelBlocked:
    """A storage quantized in blocks along tokens, each block centred; `materialize()` restores it."""

    codes: object
    """`BlockQuantized` of the centred blocks ([lead, channels, padded tokens], as fp32 values), or its
    offloaded form."""
    centres: torch.Tensor
    """The middle of each block's range, [lead * channels * padded tokens / block], in the tensor's dtype."""
    layout: TokenLayout
    block_size: int

    @property
    def bits(self) -> int:
        return self.codes.bits

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.centres.numel() * self.centres.element_size()

    def materialize(self) -> torch.Tensor:
        """The storage's elements, flat, in a buffer of their own."""
        layout = self.layout
        if isinstance(self.codes, BlockQuantized):
            return restore_token_blocks(self.codes, self.centres, layout.tokens, layout.channels)
        # Offloaded: the fetched codes come back as the centred fp32 values (`PackedLayout.restore`).
        return centred_to_storage(self.codes.materialize(), self.centres, layout.tokens, layout.channels,
                                  self.block_size)


def quantize_by_channel(root: torch.Tensor, bits: int, block_size: int, stochastic: bool = False,
                        seed: int = 0) -> ChannelBlocked | None:
    """`root`'s whole storage at `bits` in centred blocks of `block_size` tokens within each channel, or None
    when its layout is not lead x tokens x channels (`TokenLayout.of`). The saved tensor is only read."""
    layout = TokenLayout.of(root)
    if layout is None:
        return None
    numel = layout.lead * layout.tokens * layout.channels
    flat = root.detach().as_strided((numel,), (1,), 0)
    codes, centres = quantize_token_blocks(flat, layout.tokens, layout.channels, bits, block_size, stochastic, seed)
    return ChannelBlocked(codes, centres, layout, block_size)
