"""The 8-bit optimizer inside real DeepSpeed runs, 2 ranks (tests/optimizer/test_engine_8bit.py).

A small MLP (fixed seed; data drawn from the step number and the rank) with
`"lazyzero": {"optimizer": {"enabled": true}}` (AdamW8bit), on the layouts given as STAGE[+cpu].

Usage (under the deepspeed launcher); each mode writes OUT/<mode>_rank<r>.json, and
`runs OUT MODE=CASE,CASE ...` runs several modes in one launch:
  norm OUT LAYOUT ...
      one backward per layout; the engine's reported global norm of the averaged gradients, and an
      fp64 reference: the same model in float64 on each rank's batch, gradients averaged over the
      ranks with an fp64 all-reduce. Then the errors of two misuses (`setup_errors`).
  clip OUT LAYOUT ...
      3 steps with clipping at 0.05 (the norms are about 1): parameters with fused clipping, with
      DeepSpeed's separate clip pass (fused_clipping false), and with no clipping at all. fp32
      states (both kernels apply the factor the same way), so that last-bit differences between the
      two factors cannot flip an 8-bit code.
  nonfinite OUT LAYOUT ...
      step 2 gets a NaN in rank 1's gradient: parameters before and after it, and the losses of
      the next 10 steps.
  resume OUT LAYOUT:ENGINE ...
      ENGINE deepspeed|lazy: 6 steps, save, 6 more (losses A); a fresh engine loads the save and
      runs the same 6 steps (losses B), then compares its optimizer codes with the first run's.
  reshard_save OUT LAYOUT ... / reshard_load OUT LAYOUT:SOURCE:SAVED_RANKS ...
      6 steps and a save on one number of ranks (each rank's pieces of the master weights and of
      the fp32-decoded moments beside it); then a load on another number of ranks: its pieces
      against the saved ones cut at the new partition boundaries (relative L2 error per ZeRO-1/2
      group or ZeRO-3 parameter), the step, 10 more losses, and a save on this number of ranks
      (loaded by the next launch in the other direction).
  reshard_refused OUT SOURCE
      the error of a re-split that is refused: OUT/SOURCE on ZeRO-3 with a frozen parameter.
"""

import json
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import lazyzero
from lazyzero.optimizer.adam8bit_optimizer import decode_moments
from lazyzero.testing import destroy_engine, worker_args

INPUTS, HIDDEN, OUTPUTS, BATCH = 16, 100, 4, 8
# The lr a re-split save leaves in the optimizer (a scheduler's doing), unlike the config's 1e-2: a
# re-split load must restore it, or its first step runs at the lr the optimizer was built with.
LR_AT_RESHARD_SAVE = 3e-3


def build_model(dtype=torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    # 100 x 100 = 10000 elements: above min_8bit_size, so the hidden layer gets 8-bit states; each of
    # 2 ranks holds 5000, not a multiple of the 256-element blocks (re-split tests move block edges).
    return torch.nn.Sequential(torch.nn.Linear(INPUTS, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, HIDDEN),
                               torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUTPUTS)).to(dtype)


def ds_config(layout: str, clipping: float = 1.0, fused_clipping: bool = True, lazy: bool = False,
              min_8bit_size: int = 4096, zero_options: dict | None = None) -> dict:
    """LAYOUT is STAGE[+cpu|+nvme:PATH]; zero_options are added to "zero_optimization"."""
    stage, _, offload = layout.partition("+")
    zero = {"stage": int(stage), "stage3_param_persistence_threshold": 0} if int(stage) == 3 else {"stage": int(stage)}
    if offload:
        device, _, nvme_path = offload.partition(":")
        zero["offload_optimizer"] = {"device": device, **({"nvme_path": nvme_path} if nvme_path else {})}
    zero.update(zero_options or {})
    lazyzero_section = {"optimizer": {"enabled": True, "type": "adamw8bit", "min_8bit_size": min_8bit_size,
                                      "fused_clipping": fused_clipping}}
    if lazy:
        lazyzero_section["checkpoint"] = {"enabled": True}
    return {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": clipping,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.95], "weight_decay": 0.01}},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
        "lazyzero": lazyzero_section,
    }


def new_engine(layout: str, **options):
    model = build_model()
    engine, _, _, _ = lazyzero.initialize(model=model, model_parameters=model.parameters(),
                                          config=ds_config(layout, **options))
    return engine


def batch(step: int, rank: int, dtype=torch.float32):
    generator = torch.Generator().manual_seed(1000 * step + rank)
    inputs = torch.randn(BATCH, INPUTS, generator=generator)
    targets = torch.randn(BATCH, OUTPUTS, generator=generator)
    return inputs.to(dtype), targets.to(dtype)


def loss_of(model, step: int, rank: int, dtype=torch.float32):
    inputs, targets = batch(step, rank, dtype)
    return torch.nn.functional.mse_loss(model(inputs), targets)


def train_step(engine, step: int) -> float:
    loss = loss_of(engine, step, engine.global_rank)
    engine.backward(loss)
    engine.step()
    return float(loss)


def full_parameters(engine) -> list[list[float]]:
    """Every parameter in full, gathered under ZeRO-3."""
    import deepspeed

    parameters = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(parameters, enabled=engine.zero_optimization_stage() == 3):
        return [p.detach().double().clone().view(-1).tolist() for p in parameters]


def reference_norm(step: int) -> float:
    model = build_model(torch.float64)
    loss_of(model, step, dist.get_rank(), torch.float64).backward()
    flat = torch.cat([p.grad.view(-1) for p in model.parameters()])
    dist.all_reduce(flat)
    return float((flat / dist.get_world_size()).norm())


def norm(layouts: list[str]) -> dict:
    results = {}
    for layout in layouts:
        engine = new_engine(layout, clipping=1.0)
        train_step(engine, 0)
        reported = engine.get_global_grad_norm()
        results[layout] = {"reported": float(reported), "reference": reference_norm(0)}
        destroy_engine(engine)
    results["setup_errors"] = setup_errors()
    return results


def setup_errors() -> dict:
    """The messages of two misuses: an optimizer passed in code, and no "optimizer" section."""
    messages = {}
    model = build_model()
    for case, arguments in (
            ("client_optimizer", dict(optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=ds_config("2"))),
            ("no_optimizer_section", dict(config={key: value for key, value in ds_config("2").items()
                                                  if key != "optimizer"}))):
        try:
            lazyzero.initialize(model=build_model(), model_parameters=None, **arguments)
            messages[case] = None
        except ValueError as error:
            messages[case] = str(error)
    return messages


def clip(layouts: list[str]) -> dict:
    results = {}
    for layout in layouts:
        runs = {}
        for name, options in (("fused", {"clipping": 0.05}), ("separate", {"clipping": 0.05, "fused_clipping": False}),
                              ("unclipped", {"clipping": 0.0})):
            engine = new_engine(layout, min_8bit_size=10**9, **options)
            for step in range(3):
                train_step(engine, step)
            runs[name] = full_parameters(engine)
            destroy_engine(engine)
        results[layout] = runs
    return results


def nonfinite(layouts: list[str]) -> dict:
    results = {}
    for layout in layouts:
        engine = new_engine(layout)
        losses = [train_step(engine, step) for step in range(2)]
        before = full_parameters(engine)
        poisoned = loss_of(engine, 2, engine.global_rank)
        # A NaN in rank 1's loss makes its gradients NaN: the norm after the reduction is NaN on both ranks.
        engine.backward(poisoned * (float("nan") if engine.global_rank == 1 else 1.0))
        engine.step()
        after = full_parameters(engine)
        losses += [train_step(engine, step) for step in range(3, 13)]
        results[layout] = {"unchanged": before == after, "losses": losses,
                           "skipped_steps": engine.skipped_steps}
        destroy_engine(engine)
    return results


def optimizer_tensors(engine) -> dict:
    inner = engine.optimizer.optimizer if hasattr(engine.optimizer, "optimizer") else engine.optimizer
    tensors = {}
    for index, (param, state) in enumerate(inner.state.items()):
        for key, value in state.items():
            if torch.is_tensor(value):
                tensors[f"{index}/{key}"] = value.detach().clone()
    return tensors


def resume(out: Path, cases: list[str]) -> dict:
    results = {}
    for case in cases:
        layout, engine_kind = case.split(":")
        save_dir = out / f"ckpt_{layout}_{engine_kind}".replace("+", "_")
        lazy = engine_kind == "lazy"
        engine = new_engine(layout, lazy=lazy)
        first = [train_step(engine, step) for step in range(6)]
        engine.save_checkpoint(str(save_dir), tag="step6")
        continued = [train_step(engine, step) for step in range(6, 12)]
        expected_states = optimizer_tensors(engine)
        engine.wait_for_checkpoints()
        destroy_engine(engine)

        engine = new_engine(layout, lazy=lazy)
        engine.load_checkpoint(str(save_dir), tag="step6")
        resumed = [train_step(engine, step) for step in range(6, 12)]
        states = optimizer_tensors(engine)
        same_states = states.keys() == expected_states.keys() and all(
            torch.equal(states[key], expected_states[key]) for key in states)
        has_codes = any(key.endswith("m_codes") for key in states)
        results[case] = {"first": first, "continued": continued, "resumed": resumed,
                         "same_states": same_states, "has_codes": has_codes,
                         "finite": all(math.isfinite(loss) for loss in resumed)}
        destroy_engine(engine)
    return results


def optimizer_pieces(engine) -> dict:
    """This rank's pieces of the fp32 master weights and of both moments (fp32), with the 8-bit
    flag and the step: by group index on ZeRO 1/2 (its flat partition), by parameter name on ZeRO-3
    (each sub-group's flat cut at its parameters' partition sizes, as DeepSpeed lays it out)."""
    optimizer, zero = engine.basic_optimizer, engine.optimizer
    if engine.zero_optimization_stage() != 3:
        return {str(index): flat_piece(optimizer, group, group["params"][0], 0, group["params"][0].numel())
                for index, group in enumerate(optimizer.param_groups)}
    pieces = {}
    for sub_group, params in enumerate(zero.fp16_groups):
        flat = zero.fp32_partitioned_groups_flat[sub_group]
        group = optimizer.param_groups[zero.sub_group_to_group_id[sub_group]]
        offset = 0
        for param in params:
            pieces[engine.param_names[param]] = flat_piece(optimizer, group, flat, offset, param.partition_numel())
            offset += param.partition_numel()
    return pieces


def flat_piece(optimizer, group: dict, flat: torch.Tensor, offset: int, size: int) -> dict:
    state = optimizer.state[flat]
    if "m_codes" in state:
        m, sqrt_v = decode_moments(state, group["block_size"])
        moments = {"exp_avg": m, "exp_avg_sq": sqrt_v * sqrt_v}
    else:
        moments = {key: state[key].view(-1) for key in ("exp_avg", "exp_avg_sq")}
    columns = {"value": flat.detach().view(-1), **moments}
    return {**{key: value[offset:offset + size].float().clone() for key, value in columns.items()},
            "step": state["step"], "eight_bit": "m_codes" in state}


def compare_pieces(loaded: dict, saved: list[dict], rank: int) -> list[dict]:
    """Relative L2 error of each loaded piece against the saved ranks' pieces joined and cut at this
    rank's new boundaries (ZeRO pads only the end of the last piece, with zeros, so joining the saved
    pieces gives the whole tensor, padded)."""
    entries = []
    for key, mine in loaded.items():
        size = mine["value"].numel()
        entry = {"key": key, "eight_bit": mine["eight_bit"], "step": mine["step"], "saved_step": saved[0][key]["step"]}
        for column in ("value", "exp_avg", "exp_avg_sq"):
            whole = torch.cat([part[key][column] for part in saved])
            expected = torch.zeros(size)
            available = max(0, min(size, whole.numel() - rank * size))
            expected[:available] = whole[rank * size:rank * size + available]
            entry[column] = float((mine[column] - expected).norm() / expected.norm().clamp_min(1e-30))
        entries.append(entry)
    return entries


def reshard_config(layout: str) -> dict:
    # ZeRO-3 with small sub-groups: their number and edges depend on the rank count. With CPU offload
    # the lazy checkpoint engine writes the files.
    zero3 = {"zero_options": {"sub_group_size": 3000}} if layout.startswith("3") else {}
    return {**zero3, "lazy": layout.endswith("+cpu")}


def save_with_pieces(engine, directory: Path) -> None:
    engine.save_checkpoint(str(directory), tag="saved")
    engine.wait_for_checkpoints()
    torch.save(optimizer_pieces(engine), directory / f"pieces_rank{engine.global_rank}.pt")


def reshard_save(out: Path, layouts: list[str]) -> dict:
    """Per layout: 6 steps, then a save (to OUT/reshard_<layout>) with each rank's pieces beside it."""
    results = {}
    for layout in layouts:
        engine = new_engine(layout, **reshard_config(layout))
        results[layout] = [train_step(engine, step) for step in range(6)]
        for group in engine.basic_optimizer.param_groups:
            group["lr"] = LR_AT_RESHARD_SAVE
        save_with_pieces(engine, out / f"reshard_{layout}".replace("+", "_"))
        destroy_engine(engine)
    return results


def reshard_load(out: Path, cases: list[str]) -> dict:
    """Per case LAYOUT:SOURCE:SAVED_RANKS: load OUT/SOURCE (saved by SAVED_RANKS ranks) on this number
    of ranks and compare the pieces; 10 more steps; then save again, to OUT/SOURCE_on<ranks>."""
    results = {}
    for case in cases:
        layout, source, saved_ranks = case.split(":")
        engine = new_engine(layout, **reshard_config(layout))
        engine.load_checkpoint(str(out / source), tag="saved")
        saved = [torch.load(out / source / f"pieces_rank{rank}.pt") for rank in range(int(saved_ranks))]
        entries = compare_pieces(optimizer_pieces(engine), saved, dist.get_rank())
        lrs = [group["lr"] for group in engine.basic_optimizer.param_groups]
        losses = [train_step(engine, step) for step in range(6, 16)]
        save_with_pieces(engine, out / f"{source}_on{dist.get_world_size()}")
        destroy_engine(engine)
        results[case] = {"entries": entries, "losses": losses, "lrs": lrs}
    return results


def refused_reshard_error(out: Path, source: str) -> str | None:
    """The message of loading OUT/SOURCE, a ZeRO-3 checkpoint saved by another number of ranks, into
    a model with a frozen parameter: a re-split this version refuses."""
    model = build_model()
    model[0].bias.requires_grad_(False)
    engine, _, _, _ = lazyzero.initialize(model=model, model_parameters=model.parameters(),
                                          config=ds_config("3", **reshard_config("3")))
    try:
        engine.load_checkpoint(str(out / source), tag="saved")
        return None
    except ValueError as error:
        return str(error)
    finally:
        destroy_engine(engine)


MODES = {
    "norm": lambda out, cases: norm(cases),
    "clip": lambda out, cases: clip(cases),
    "nonfinite": lambda out, cases: nonfinite(cases),
    "resume": resume,
    "reshard_save": reshard_save,
    "reshard_load": reshard_load,
    "reshard_refused": lambda out, cases: refused_reshard_error(out, cases[0]),
}


def main() -> None:
    """`MODE OUT CASE ...`, or `runs OUT MODE=CASE,CASE ...` for several modes in one launch
    (one start-up of the ranks instead of one per mode; results by mode in runs_rank<r>.json)."""
    args = worker_args()
    mode, out, rest = args[0], Path(args[1]), args[2:]
    out.mkdir(parents=True, exist_ok=True)
    if mode == "runs":
        result = {}
        for item in rest:
            name, _, cases = item.partition("=")
            result[name] = MODES[name](out, cases.split(","))
    else:
        result = MODES[mode](out, rest)
    (out / f"{mode}_rank{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
