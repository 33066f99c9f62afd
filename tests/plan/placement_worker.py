"""Per-layer ZeRO-3 tiers (lazyzero/plan/deepspeed/zero_placement.py) in real 2-rank runs
(tests/plan/test_zero_placement.py).

A Llama with hidden size 1024: each rank's share of every weight matrix is at least 1 MiB in fp32
and in bf16, so DeepSpeed's swappers take it; the norm weights are too small and stay in memory.
bf16, clipping at 1.0 (the grad norms are about 13, so it is active), random tokens drawn from the
step and the rank. The engine is `LazyZeroEngine` with its stage-3 optimizer built under
`zero_placement`, as the engine will do once the planner hands it a placement (PlacedEngine).

Usage (under the deepspeed launcher): placement_worker.py OUT SPEC [SPEC ...]; each SPEC is one run,
`name:optimizer:offload:layers[:options]`, its record written to OUT/<name>_rank<r>.json:
  optimizer  adam (DeepSpeed's CPU Adam) | adam8bit (lazyzero's 8-bit AdamW, fused clipping)
  offload    none | cpu (offload_optimizer.device none / cpu, no placement) | nvme (nvme, no
             placement: DeepSpeed's own) | tiered (nvme and a placement: the layers given on NVMe, the
             rest in memory)
  layers     decoder layers placed on NVMe ("1"; "-" none; "all" every parameter, embeddings too)
  options    comma-separated: params (with tiered: the same parameters' bf16 partitions on NVMe too,
             offload_param nvme); save (save after SAVE_AT steps, keep training); resume=NAME (load
             NAME's checkpoint, train the steps after it); wide (sub_group_size 1e6 instead of one
             parameter per sub-group); layers=N (default 2); intermediate=N (default 1024); steps=N
             (default 5); rss (measure only: losses and memory); check=NAME (no training: whether
             NAME's checkpoint may be restored here, check_checkpoint_tiers)
  The record: losses, grad norms, sha256 of the final parameters, sub-groups (names, elements,
  swapped), swap file names, ds_id of each parameter, tier report, the DeepSpeed methods replaced over
  a lazyzero override while the engine was built (lazyzero/patch_point.py), seconds, and memory: RSS
  after init and after training (freed heap returned first), peak RSS of the training steps and of
  the process.
`errors` as a SPEC: the message of each misuse (errors_rank<r>.json).
"""

import ctypes
import hashlib
import json
import resource
import time
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.checkpoint.constants import FP32_FLAT_GROUPS
from deepspeed.runtime.zero.partition_parameters import Init

import lazyzero
import lazyzero.engine.engine as engine_module
from lazyzero.checkpoint.sub_group_tiers import check_checkpoint_tiers
from lazyzero.models import build_model
from lazyzero.patch_point import applied_patches
from lazyzero.plan.deepspeed.zero_placement import ZeroPlacement, zero_placement
from lazyzero.testing import destroy_engine, worker_args, write_json_from_every_rank

VOCAB, SEQUENCE, BATCH, SAVE_AT = 300, 16, 2, 3


class PlacedEngine(engine_module.LazyZeroEngine):
    """LazyZeroEngine whose ZeRO-3 optimizer is built under `zero_placement(placement)`: the
    one-argument form, whose settings checks happen at the optimizer's construction."""

    placement = None

    def _configure_zero_optimizer(self, optimizer):
        with zero_placement(PlacedEngine.placement):
            return super()._configure_zero_optimizer(optimizer)


def model_config(out: Path, layers: int, intermediate: int) -> Path:
    config = {"model_type": "llama", "hidden_size": 1024, "intermediate_size": intermediate,
              "num_hidden_layers": layers, "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": VOCAB,
              "max_position_embeddings": 64}
    path = out / f"llama_{layers}_{intermediate}.json"
    write_json_from_every_rank(path, config)
    return path


def ds_config(optimizer: str, offload: str, nvme: Path, options: dict, stage: int = 3) -> dict:
    offload_optimizer = {"device": offload if offload in ("none", "cpu") else "nvme", "pin_memory": False}
    if offload not in ("none", "cpu"):
        offload_optimizer.update(nvme_path=str(nvme), buffer_count=4)
    zero = {"stage": stage, "offload_optimizer": offload_optimizer,
            # One parameter per sub-group, so that every run cuts them alike, unless "wide".
            "sub_group_size": 1_000_000 if "wide" in options else 1}
    if stage == 3:
        # Release every gathered parameter after use (no reuse across forward and backward), so that
        # the bf16 swap buffers suffice for one layer's parameters at a time.
        zero.update(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=0, stage3_max_reuse_distance=0)
    if "params" in options:
        zero["offload_param"] = {"device": "nvme", "nvme_path": str(nvme), "pin_memory": False,
                                 "buffer_count": 8, "buffer_size": 1_100_000}
    config = {"train_micro_batch_size_per_gpu": BATCH, "gradient_clipping": 1.0, "bf16": {"enabled": True},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8,
                                                        "weight_decay": 0.01}},
              "zero_optimization": zero, "steps_per_print": 1_000_000,
              "aio": {"block_size": 1 << 20, "queue_depth": 8, "intra_op_parallelism": 1, "single_submit": False,
                      "overlap_events": True},
              "lazyzero": {}}
    if optimizer == "adam8bit":
        config["lazyzero"]["optimizer"] = {"enabled": True, "type": "adamw8bit"}
    return config


def parse(spec: str) -> tuple[str, str, str, str, dict]:
    name, optimizer, offload, layers, *rest = spec.split(":")
    options = dict(item.partition("=")[::2] for item in (rest[0].split(",") if rest else []))
    return name, optimizer, offload, layers, options


def placement_for(model, layers: str, params: bool) -> ZeroPlacement:
    names = [name for name, _ in model.named_parameters()]
    modules = names if layers == "all" else [] if layers == "-" else [f"model.layers.{x}" for x in layers.split(",")]
    return ZeroPlacement.from_modules(names, modules, modules if params else None)


def new_engine(model, config: dict, placement):
    PlacedEngine.placement = placement
    engine_module.LazyZeroEngine = PlacedEngine
    # Numbered from 0 as in a fresh process: swap files are named by ds_id, and a run resumed in
    # this process must find the ones its checkpoint saved.
    Init.param_id = 0
    engine, _, _, _ = lazyzero.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def train(engine, steps: range, record: dict) -> None:
    """Train `steps`, appending each step's loss and global grad norm (before clipping) to `record`."""
    for step in steps:
        generator = torch.Generator().manual_seed(1000 * step + engine.global_rank)
        ids = torch.randint(0, VOCAB, (BATCH, SEQUENCE), generator=generator)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        record.setdefault("losses", []).append(loss.item())
        record.setdefault("grad_norms", []).append(float(engine.get_global_grad_norm()))


def parameter_digest(engine) -> str:
    """sha256 of every (gathered) parameter after training: equal digests, equal models."""
    digest = hashlib.sha256()
    for _, param in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([param]):
            digest.update(param.detach().float().numpy().tobytes())
    return digest.hexdigest()


def sub_groups(engine) -> list[dict]:
    zero = engine.optimizer
    names = {id(p): name for name, p in engine.module.named_parameters()}
    return [{"ds_id": zero.fp32_partitioned_groups_flat[i].ds_id, "names": [names[id(p)] for p in group],
             "numel": int(zero.fp16_partitioned_groups_flat_numel[i]),
             "swapped": bool(zero._swappable_optimizer_subgroup(i))}
            for i, group in enumerate(zero.fp16_groups)]


def swap_buffer_bytes(engine) -> dict[str, int]:
    """Host bytes of DeepSpeed's NVMe swappers' buffers (what lazyzero/plan/deepspeed/swap_buffers.py
    predicts): the optimizer swapper's, and the parameter swapper's pool and partitioned buffer."""
    def size(tensor) -> int:
        return 0 if tensor is None else tensor.numel() * tensor.element_size()

    held = {}
    swapper = getattr(engine.optimizer, "optimizer_swapper", None)
    if swapper is not None:
        held["optimizer"] = sum(size(t) for t in swapper.swap_buffer_manager.all_buffers)
    param_swapper = getattr(next(engine.module.parameters()), "nvme_swapper", None)
    if param_swapper is not None:
        held["parameters"] = size(param_swapper.buffers) + size(param_swapper.partitioned_swap_buffer)
    return held


def swap_files(nvme: Path, kind: str) -> list[str]:
    """Names of this rank's swap files: kind "optimizer", or "params" (16-bit parameters)."""
    pattern = f"optimizer/rank{dist.get_rank()}/*" if kind == "optimizer" else f"*params/rank{dist.get_rank()}/*"
    return sorted(path.name for path in (nvme / "zero_stage_3").glob(pattern))


def follow_schedule(engine, out: Path, name: str, options: dict, record: dict) -> None:
    """Check a checkpoint, resume from it, or train (saving on the way), as the options say."""
    steps = int(options.get("steps", 5))
    saved = options.get("check", options.get("resume"))
    if saved is not None:
        record["check"] = checkpoint_tiers_error(engine, out / f"ckpt_{saved}" / f"step{SAVE_AT}")
    if "check" in options:
        return
    if "resume" in options:
        engine.load_checkpoint(str(out / f"ckpt_{saved}"))
        train(engine, range(SAVE_AT, steps), record)
        return
    train(engine, range(SAVE_AT if "save" in options else steps), record)
    if "save" in options:
        engine.save_checkpoint(str(out / f"ckpt_{name}"), tag=f"step{SAVE_AT}")
        train(engine, range(SAVE_AT, steps), record)


def kernel_status_bytes(key: str) -> int:
    """A memory figure of this process from /proc/self/status (VmRSS, VmHWM: peak RSS)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def live_rss_bytes() -> int:
    """RSS once the allocator has returned freed heap pages: what the process really holds."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return kernel_status_bytes("VmRSS")


def reset_peak_rss() -> None:
    """Restart VmHWM from the current RSS (Linux clear_refs 5): the peak of the training steps alone."""
    Path("/proc/self/clear_refs").write_text("5")


def run(out: Path, spec: str) -> None:
    name, optimizer, offload, layers, options = parse(spec)
    started = time.perf_counter()
    nvme = out / f"nvme_{name}"
    nvme.mkdir(exist_ok=True)
    model = build_model(str(model_config(out, int(options.get("layers", 2)), int(options.get("intermediate", 1024)))),
                        seed=3, dtype=torch.bfloat16)
    placement = placement_for(model, layers, "params" in options) if offload == "tiered" else None
    patched_before = len(applied_patches())
    engine = new_engine(model, ds_config(optimizer, offload, nvme, options), placement)
    record = {"init_s": time.perf_counter() - started, "rss_after_init": live_rss_bytes(),
              "replaced_over_override": sorted(patch.target for patch in applied_patches()[patched_before:]
                                               if patch.over_override)}
    reset_peak_rss()
    follow_schedule(engine, out, name, options, record)
    record.update(peak_rss_training=kernel_status_bytes("VmHWM"), rss_after_training=live_rss_bytes(),
                  peak_rss_process=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    if "rss" not in options:
        record.update(digest=parameter_digest(engine), sub_groups=sub_groups(engine),
                      optimizer_files=swap_files(nvme, "optimizer"), param_files=swap_files(nvme, "params"),
                      ds_ids={param: p.ds_id for param, p in engine.module.named_parameters()},
                      tier_report=engine.optimizer.tier_report() if placement is not None else None,
                      swap_buffer_bytes=swap_buffer_bytes(engine))
    record["run_s"] = time.perf_counter() - started
    (out / f"{name}_rank{engine.global_rank}.json").write_text(json.dumps(record))
    destroy_engine(engine)


def checkpoint_tiers_error(engine, tag_folder: Path) -> str:
    """check_checkpoint_tiers on this rank's optimizer file of a saved checkpoint: its message, or "ok"."""
    [path] = tag_folder.glob(f"*zero_pp_rank_{dist.get_rank()}_mp_rank_00_optim_states.pt")
    saved = torch.load(path, weights_only=False)["optimizer_state_dict"]
    try:
        check_checkpoint_tiers(engine.optimizer, saved[FP32_FLAT_GROUPS])
    except ValueError as error:
        return str(error)
    return "ok"


def misuse_errors(out: Path) -> dict[str, str]:
    """Each refused placement: 'ExceptionType: message'. Nothing trains."""
    nvme = out / "nvme_errors"
    nvme.mkdir(exist_ok=True)
    layer_1 = lambda model, params=False: placement_for(model, "1", params)  # noqa: E731
    typo = lambda model: ZeroPlacement(optimizer_nvme=frozenset({"model.layers.1.mlp.upp_proj.weight"}))  # noqa: E731
    cases = {
        "optimizer_device_cpu": (ds_config("adam", "cpu", nvme, {}), layer_1),
        "stage_2": (ds_config("adam", "cpu", nvme, {}, stage=2), layer_1),
        "params_without_offload_param": (ds_config("adam", "tiered", nvme, {}), lambda m: layer_1(m, True)),
        "unknown_name": (ds_config("adam", "tiered", nvme, {}), typo),
        "zero_init_model": (ds_config("adam", "tiered", nvme, {"params": ""}), lambda m: layer_1(m, True)),
    }
    errors = {}
    for case, (config, placement) in cases.items():
        model_file = str(model_config(out, 2, 1024))
        if case == "zero_init_model":
            with deepspeed.zero.Init(config_dict_or_path={"zero_optimization": {"stage": 3},
                                                          "train_micro_batch_size_per_gpu": BATCH}):
                model = build_model(model_file, seed=3, dtype=torch.bfloat16)
        else:
            model = build_model(model_file, seed=3, dtype=torch.bfloat16)
        try:
            new_engine(model, config, placement(model))
            errors[case] = "no error"
        except Exception as error:  # noqa: BLE001 - the test reads type and message
            errors[case] = f"{type(error).__name__}: {error}"
    return errors


def main() -> None:
    out, *specs = worker_args()
    out = Path(out)
    for spec in specs:
        if spec == "errors":
            errors = misuse_errors(out)  # initializes torch.distributed, which the file name needs
            (out / f"errors_rank{dist.get_rank()}.json").write_text(json.dumps(errors))
        else:
            run(out, spec)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
