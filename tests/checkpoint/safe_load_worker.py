"""Plain DeepSpeed checkpoints of a small MLP at ZeRO stages 0-3, in fp32, bf16 and fp16 (dynamic loss
scale), with and without the optimizer offloaded to the CPU: one folder per layout in OUT
(tests/checkpoint/test_safe_load.py).

DeepSpeed's CPU accelerator trains fp16 only where oneDNN supports it (AVX512-FP16 or AMX-FP16 CPUs);
elsewhere the fp16 layout is skipped and named in OUT/skipped.txt.

Usage (under the deepspeed launcher, 1 rank): safe_load_worker.py OUT
"""

from pathlib import Path

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator

from lazyzero.testing import destroy_engine, worker_args

LAYOUTS = {"stage0": (0, "fp32", False), "stage1_bf16": (1, "bf16", False), "stage2": (2, "fp32", False),
           "stage2_fp16": (2, "fp16", False), "stage2_bf16_offload": (2, "bf16", True),
           "stage3": (3, "fp32", False), "stage3_bf16_offload": (3, "bf16", True)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def config(stage: int, precision: str, offload: bool) -> dict:
    zero = {"stage": stage}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    return {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9, "zero_optimization": zero,
            "bf16": {"enabled": precision == "bf16"}, "fp16": {"enabled": precision == "fp16"},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, **({} if offload else {"torch_adam": True})}}}


def save(out: Path, name: str, stage: int, precision: str, offload: bool) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config(stage, precision, offload))
    inputs = torch.randn(2, 8, dtype=DTYPES[precision])
    loss = engine(inputs).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(str(out / name), tag="step1")
    destroy_engine(engine)


def main() -> None:
    out = Path(worker_args()[0])
    skipped = []
    for name, layout in LAYOUTS.items():
        if layout[1] == "fp16" and not get_accelerator().is_fp16_supported():
            skipped.append(name)
            continue
        save(out, name, *layout)
    (out / "skipped.txt").write_text("".join(f"{name}\n" for name in skipped))


if __name__ == "__main__":
    main()
