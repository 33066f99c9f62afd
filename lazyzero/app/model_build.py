"""How `lazyzero train` builds its model: whole, or partitioned across the ranks as it is created
(docs/plan.md, "Planning partitioned models").

A whole model costs every rank the whole fp32 model in host memory before ZeRO-3 partitions it: 27
GB per rank for the 7b preset, on machines the planner is asked to fit it into. Built under ZeRO-3
partitioning (`build_model(zero_init_config=...)`), a rank never holds more than its share and one
module; the planner profiles such a model one layer at a time and places it per layer as it does a
whole one. `--zero-init auto` does that for ZeRO stage 3 when the whole fp32 model is over
PARTITIONED_BUILD_BYTES, and builds smaller models whole: they fit anyway, build faster, and the runs
measured in docs/ keep their initialization (the partitioned build draws the weights module by
module on rank 0, in another order).
"""

from __future__ import annotations

import argparse
import os

from lazyzero.config.validate import validate_ds_config
from lazyzero.distributed.job_failure import collective_timeout

PARTITIONED_BUILD_BYTES = 2**30
ZERO_INIT_CHOICES = ("auto", "on", "off")


def zero_init_config(args: argparse.Namespace, ds_config: dict | None, vocab_size: int) -> dict | None:
    """The DeepSpeed config to partition the model by as it is built, or None to build it whole."""
    choice = getattr(args, "zero_init", "off")
    if ds_config is None or choice == "off":
        return None
    stage = int((ds_config.get("zero_optimization") or {}).get("stage", 0))
    if stage != 3:
        if choice == "on":
            raise ValueError(f"--zero-init on: zero_optimization.stage is {stage}; allowed: 3 (only ZeRO-3 "
                             "partitions parameters)")
        return None
    if choice == "on" or _whole_fp32_bytes(args, vocab_size) > PARTITIONED_BUILD_BYTES:
        return ds_config
    return None


def _whole_fp32_bytes(args: argparse.Namespace, vocab_size: int) -> int:
    """The whole model's fp32 bytes from its config alone (0 when the family has no analytic count,
    or the model is a GGUF file, which is read whole anyway)."""
    from lazyzero.models.config import model_config
    from lazyzero.models.params import count_parameters
    from lazyzero.models.pretrained import pretrained_files

    files = pretrained_files(args.model)
    if files is not None and files.gguf_file is not None:
        return 0
    config = model_config(args.model, family=args.family, vocab_size=vocab_size,
                          max_positions=max(args.seq_len, 256))
    try:
        return 4 * count_parameters(config)
    except ValueError:
        return 0


def start_ranks(ds_config: dict) -> None:
    """torch.distributed as `lazyzero.initialize` starts it (which then finds it started): the
    partitioned build needs the ranks before the engine exists."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    port = int(os.environ.get("MASTER_PORT", deepspeed.constants.TORCH_DISTRIBUTED_DEFAULT_PORT))
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(), distributed_port=port,
                               timeout=collective_timeout(validate_ds_config(ds_config)))
