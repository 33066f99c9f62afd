"""The 8-bit optimizer under ZeRO-3 with NVMe optimizer offload, 2 ranks (tests/optimizer/test_nvme_8bit.py).

The MLP of optim8bit_worker.py (same data and loss), with hidden layers of 1024: DeepSpeed swaps
only sub-groups whose fp32 partition is at least 1 MiB, so each rank's 524288-element share of a
1024 x 1024 matrix is swapped. With sub_group_size 300000 the 8-bit group has two swapped
sub-groups and one small one that stays in memory; the biases keep fp32 states in memory.

Usage (under the deepspeed launcher): optim8bit_nvme_worker.py MODE OUT [lazy] [pipelined]; writes
OUT/MODE_rank<r>.json. With "lazy", the engines use lazyzero's lazy checkpoints; with "pipelined",
save and load swap through the pipelined swapper (lazyzero/optimizer/nvme_swap_pipelined.py).
  offload: for "cpu" and "nvme": losses of 8 steps and the final parameters;
  swap_files: per state precision ("8bit", "fp32": every state fp32), the size of each optimizer
      swap file of this rank after 3 steps;
  save: 4 steps, save to OUT/ckpt, 4 more: losses, final parameters, sha256 of the packed state files;
  load (a later launch, same OUT): a fresh engine on another nvme_path loads OUT/ckpt and runs the
      same 4 steps: the same records.
"""

import hashlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from optim8bit_worker import INPUTS, OUTPUTS, ds_config, full_parameters, train_step

import lazyzero
from lazyzero.config.optimizer_swap import pipelined_buffer_count
from lazyzero.optimizer.nvme_swap import PACKED_FILE_SUFFIX
from lazyzero.testing import destroy_engine, worker_args

HIDDEN = 1024
SUB_GROUP_SIZE = 300_000
# The largest tensors first (state_policy.py): the first 1024 x 1024 matrix covers 40% of the
# eligible elements, so the second keeps fp32 moments.
MIXED_FRACTION = 0.4


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(INPUTS, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, HIDDEN),
                               torch.nn.Tanh(), torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh(),
                               torch.nn.Linear(HIDDEN, OUTPUTS))


def nvme_config(device: str, nvme_path: Path | None = None, min_8bit_size: int = 4096, lazy: bool = False,
                pipelined: bool = False, fraction_8bit: float | None = None) -> dict:
    config = ds_config("3+" + device, min_8bit_size=min_8bit_size, lazy=lazy)
    if fraction_8bit is not None:
        config["lazyzero"]["optimizer"]["fraction_8bit"] = fraction_8bit
    config["zero_optimization"]["sub_group_size"] = SUB_GROUP_SIZE
    if pipelined:
        # DeepSpeed's pipelined swapper, 8-bit states through lazyzero's EightBitPipelinedSwapper.
        config["zero_optimization"]["offload_optimizer"].update(
            pipeline_read=True, pipeline_write=True, buffer_count=pipelined_buffer_count())
    # optim8bit_worker's 1e-2 drives the 1024-wide layers' losses to ~50 within 4 steps.
    config["optimizer"]["params"]["lr"] = 1e-3
    if nvme_path is not None:
        nvme_path.mkdir(parents=True, exist_ok=True)
        config["zero_optimization"]["offload_optimizer"]["nvme_path"] = str(nvme_path)
    return config


def new_engine(config: dict):
    model = build_model()
    engine, _, _, _ = lazyzero.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def swap_folder(engine) -> Path:
    return Path(engine.optimizer.optimizer_swapper.swap_folder)


def swap_file_sizes(engine) -> dict[str, int]:
    return {path.name: path.stat().st_size for path in sorted(swap_folder(engine).iterdir()) if path.is_file()}


def packed_state_digests(engine) -> dict[str, str]:
    """sha256 of each packed 8-bit state file: equal digests, equal optimizer states."""
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(swap_folder(engine).glob(f"*{PACKED_FILE_SUFFIX}"))}


def offload(out: Path, lazy: bool, pipelined: bool) -> dict:
    """8 steps with CPU offload, NVMe offload and pipelined NVMe offload, one 1024 x 1024 matrix with
    8-bit states and the other with fp32 moments (MIXED_FRACTION), so that both kinds of sub-group
    are swapped, as in a planned run whose 8-bit fraction leaves tensors out."""
    results = {}
    for device in ("cpu", "nvme", "nvme_pipelined"):
        name, pipelined = device.removesuffix("_pipelined"), device.endswith("_pipelined")
        engine = new_engine(nvme_config(name, out / f"{device}_offload", pipelined=pipelined,
                                        fraction_8bit=MIXED_FRACTION))
        losses = [train_step(engine, step) for step in range(8)]
        results[device] = {"losses": losses, "parameters": full_parameters(engine),
                           "swapper": type(getattr(engine.optimizer, "optimizer_swapper", None)).__name__,
                           "packed_files": len(packed_state_digests(engine)) if device != "cpu" else 0,
                           # One exp_avg- file per swapped fp32 sub-group.
                           "fp32_moment_files": len(list(swap_folder(engine).glob("exp_avg-*")))
                           if device != "cpu" else 0}
        destroy_engine(engine)
    return results


def swap_files(out: Path, lazy: bool, pipelined: bool) -> dict:
    results = {}
    for precision, min_8bit_size in (("8bit", 4096), ("fp32", 10**9)):
        engine = new_engine(nvme_config("nvme", out / f"nvme_{precision}", min_8bit_size))
        for step in range(3):
            train_step(engine, step)
        results[precision] = swap_file_sizes(engine)
        destroy_engine(engine)
    return results


def save(out: Path, lazy: bool, pipelined: bool) -> dict:
    """4 steps, save, 4 more: the losses, and the parameters and packed states the resume must reach.
    Then the same 4 steps with CPU optimizer offload (the same training, bit for bit) and a save of
    those to OUT/ckpt_cpu, for `reshard`."""
    engine = new_engine(nvme_config("nvme", out / "nvme_first", lazy=lazy, pipelined=pipelined))
    first = [train_step(engine, step) for step in range(4)]
    engine.save_checkpoint(str(out / "ckpt"), tag="step4")
    continued = [train_step(engine, step) for step in range(4, 8)]
    result = {"first": first, "continued": continued, "parameters": full_parameters(engine),
              "packed": packed_state_digests(engine)}
    engine.wait_for_checkpoints()
    destroy_engine(engine)
    engine = new_engine(nvme_config("cpu", lazy=lazy))
    result["first_cpu"] = [train_step(engine, step) for step in range(4)]
    engine.save_checkpoint(str(out / "ckpt_cpu"), tag="step4")
    engine.wait_for_checkpoints()
    destroy_engine(engine)
    return result


def reshard(out: Path, lazy: bool, pipelined: bool) -> dict:
    """On another number of ranks than `save`'s: its CPU-offload checkpoint loaded with CPU offload
    (the re-split of in-memory state), and its NVMe checkpoint loaded with NVMe offload (reading the
    saved swap files, writing this run's); 4 more steps each."""
    results = {}
    for name, device, source in (("cpu_from_cpu", "cpu", "ckpt_cpu"), ("nvme_from_nvme", "nvme", "ckpt")):
        nvme_path = out / f"nvme_reshard_{name}" if device == "nvme" else None
        engine = new_engine(nvme_config(device, nvme_path, lazy=lazy))
        engine.load_checkpoint(str(out / source), tag="step4")
        losses = [train_step(engine, step) for step in range(4, 8)]
        results[name] = {"losses": losses, "parameters": full_parameters(engine),
                         "packed_files": len(packed_state_digests(engine)) if nvme_path else 0}
        destroy_engine(engine)
    return results


def load(out: Path, lazy: bool, pipelined: bool) -> dict:
    """A fresh process (DeepSpeed names swap files by parameter ids, counted per process): a new
    engine on another nvme_path loads the save and runs the same 4 steps."""
    engine = new_engine(nvme_config("nvme", out / "nvme_resumed", lazy=lazy, pipelined=pipelined))
    engine.load_checkpoint(str(out / "ckpt"), tag="step4")
    resumed = [train_step(engine, step) for step in range(4, 8)]
    result = {"resumed": resumed, "parameters": full_parameters(engine), "packed": packed_state_digests(engine)}
    destroy_engine(engine)
    return result


def main() -> None:
    args = worker_args()
    mode, out, options = args[0], Path(args[1]), set(args[2:])
    out.mkdir(parents=True, exist_ok=True)
    modes = {"offload": offload, "swap_files": swap_files, "save": save, "load": load, "reshard": reshard}
    result = modes[mode](out, "lazy" in options, "pipelined" in options)
    (out / f"{mode}_rank{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
