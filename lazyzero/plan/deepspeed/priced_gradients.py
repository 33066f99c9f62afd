"""Whether a planned run keeps lazyzero's int8 gradient exchange (`plan.price_int8_gradients`, docs/plan.md).

The int8 exchange (AGoQ) trades compute for bytes on the wire: it quantizes each bucket, sends a
quarter (fp32) or half (bf16) of the bytes and sums locally, and with error feedback it keeps an
fp32 residual per gradient element, and a lazy checkpoint snapshots those residuals. Where the wire
is fast, as between ranks of one host that exchange through shared memory, the quantization costs
more time than the bytes save, and the residuals cost memory besides. The profile measures both
collectives on this machine over one decoder layer's gradients in the training dtype
(profile/machine.py): the plan keeps the exchange where it measured faster per byte than DeepSpeed's
own reduce-scatter, and switches the section off otherwise. The rule is on time alone: memory is
then the plan's to budget, with the exchange's residuals in it.
"""

from __future__ import annotations

import copy

EXCHANGE = "int8_reduce_scatter"
EXCHANGE_WITH_FEEDBACK = "int8_reduce_scatter_error_feedback"
DEEPSPEEDS = "reduce_scatter"


def int8_gradients_priced(profile, ds_config: dict, settings) -> tuple[dict, str | None]:
    """`ds_config` with `lazyzero.gradients.enabled` as the plan decides it, and the line that says
    why (None where `settings.price_int8_gradients` is off or the section is off already)."""
    gradients = (ds_config.get("lazyzero") or {}).get("gradients") or {}
    if not settings.price_int8_gradients or gradients.get("enabled") is not True:
        return ds_config, None
    name = EXCHANGE_WITH_FEEDBACK if gradients.get("error_feedback", False) else EXCHANGE
    int8, theirs = profile.machine.collectives.get(name), profile.machine.collectives.get(DEEPSPEEDS)
    if int8 is None or theirs is None:
        return _switched_off(ds_config), ("lazyzero plan: int8 gradients off: the profile measured no "
                                         f"{name if int8 is None else DEEPSPEEDS} to price them against "
                                         "(profile it again with lazyzero >= this version)")
    keep = int8.s_per_byte < theirs.s_per_byte
    exchange = "int8 exchange" + (" with error feedback" if name == EXCHANGE_WITH_FEEDBACK else "")
    line = (f"lazyzero plan: int8 gradients {'kept' if keep else 'off'}: the {exchange} took "
            f"{int8.seconds * 1e3:.1f} ms per {theirs.full_bytes / 1e6:.1f} MB layer against "
            f"{theirs.seconds * 1e3:.1f} ms for DeepSpeed's {theirs.dtype} reduce-scatter on {theirs.world_size} "
            f"ranks ({int8.s_per_byte / theirs.s_per_byte:.2f} x)")
    return (ds_config if keep else _switched_off(ds_config)), line


def _switched_off(ds_config: dict) -> dict:
    """A copy of `ds_config` whose "gradients" section is off (its other settings dropped with it)."""
    decided = copy.deepcopy(ds_config)
    decided["lazyzero"]["gradients"] = {"enabled": False}
    return decided
