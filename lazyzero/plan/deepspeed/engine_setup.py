"""The memory planner inside `lazyzero.initialize` (`"lazyzero": {"plan": {"enabled": true}}`, docs/plan.md).

Before DeepSpeed builds anything: profile the model on this machine (or reuse the profile file),
turn the profile into the planning problem of one rank (`problem_from_profile`), solve it on rank 0
and broadcast the plan (CBC under a time limit need not give every rank the same answer), and
rewrite the DeepSpeed config into the one the plan implies (`lazyzero.plan.deepspeed.implied`). The engine
is then built from that config, with the plan beside it so that it can compare what it measures with
what was predicted (`monitor.py`).
"""

from __future__ import annotations

import copy
import json
import os
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

from lazyzero.config import LazyZeroConfig, validate_ds_config
from lazyzero.config.errors import LazyZeroConfigError, Problem
from lazyzero.gradients.node_layout import launcher_ranks_per_node
from lazyzero.plan.deepspeed.calibrate import smallest_compute_budget, solve_with_least_excess
from lazyzero.plan.deepspeed.costs import EMBED_AND_HEAD, decoder_layer_index
from lazyzero.plan.deepspeed.host_memory import bound_host_heap, compute_memory_bytes
from lazyzero.plan.deepspeed.implied import ImpliedSetup, calibration_ds_config, implied_setup
from lazyzero.plan.deepspeed.priced_gradients import int8_gradients_priced
from lazyzero.plan.deepspeed.problem_from_profile import problem_for_config, training_dtype
from lazyzero.plan.deepspeed.zero_placement import ZeroPlacement, placement_problems, zero_placement
from lazyzero.plan.profile.layers import model_sizes_of
from lazyzero.plan.profile.materialize import held_on_compute_device, is_partitioned
from lazyzero.plan.profile.profiler import ProfileSettings, load_or_profile, model_config_sha256
from lazyzero.plan.report import plan_table, plot_memory
from lazyzero.plan.solver.problem import Plan, PlanInfeasible, PlanProblem, check_act_widths
from lazyzero.plan.solver.simulate import check_within_budgets, evaluate_layers

# Copy-speed tests of 64 MiB instead of the profiler's default 256 MiB: a planned run profiles inside
# its memory budget, and 64 MiB is still far beyond any cache.
PROFILE_COPY_BYTES = 64 * 2**20


@dataclass
class ActivePlan:
    """The plan a run was built from, with what it needs to be checked and revised."""

    problem: PlanProblem
    plan: Plan
    setup: ImpliedSetup
    lazyzero_config: LazyZeroConfig
    """The validated "lazyzero" section of `setup.ds_config`, with the user's plan settings."""


def plan_run(model: torch.nn.Module, ds_config: dict, config: LazyZeroConfig, dist) -> ActivePlan:
    """Profile, plan and return the setup every rank builds its engine from (all ranks call this)."""
    if not torch.cuda.is_available():
        bound_host_heap()
    problem, sizes, ds_config = problem_for_run(model, ds_config, config.plan, dist, config.activations)
    if config.plan.plan_path is not None:
        plan = given_plan(problem, config.plan.plan_path)
    else:
        plan, _ = solve_on_rank_zero(problem, config.plan, dist)
    setup = implied_setup(problem, plan, base=_base_config(ds_config), nvme_path=_absolute(config.plan.nvme_path),
                          sizes=sizes)
    planned = validate_ds_config(setup.ds_config, world_size=dist.get_world_size())
    planned.plan = config.plan
    active = ActivePlan(problem, plan, setup, planned)
    if dist.get_rank() == 0:
        _show(active)
    return active


def problem_for_run(model: torch.nn.Module, ds_config: dict, settings, dist, activations=None):
    """This rank's planning problem: the profile (measured now, or the cached one) under the budgets;
    with its model sizes and the DeepSpeed config with the plan's decision on int8 gradients
    (priced_gradients.py). `activations`: the run's ActivationsConfig, whose width rules (block size,
    kept outliers, norm and attention widths) the profile measures bytes, times and gradient errors
    under, as the plan will run them (None: the defaults)."""
    if settings.gpu_mem is not None and not torch.cuda.is_available():
        raise ValueError(f"lazyzero.plan.gpu_mem: got {settings.gpu_mem}; allowed: null on a machine without CUDA "
                         "(training computes in host memory: budget it with lazyzero.plan.cpu_mem)")
    if settings.headroom_share is not None and settings.cpu_mem is not None and not torch.cuda.is_available():
        raise ValueError(f"lazyzero.plan.cpu_mem: got {settings.cpu_mem}; allowed: null while lazyzero.plan."
                         "headroom_share is set on a machine without CUDA (headroom_share sets the memory "
                         "training computes in)")
    cast_to_training_dtype(model, training_dtype(ds_config))
    # What this rank holds besides the model, before profiling: that stays. Measured before, so that a
    # launch that profiles and one that reuses the profile plan alike (the profile's leftovers, about
    # 150 MB for SmolLM2, fall within memory_reserve). Of a model partitioned by zero.Init, a rank
    # holds its partitions; the plan counts those. On CUDA both are the device's: a model still on
    # the host takes none of its memory yet.
    process_bytes = rounded_process_bytes(compute_memory_bytes() - held_on_compute_device(model))
    size = PROFILE_COPY_BYTES
    offload_to_nvme = settings.nvme_path is not None and not torch.cuda.is_available()
    engine_config = calibration_ds_config(ds_config, model_sizes_of(model, dist.get_world_size()),
                                          _absolute(settings.nvme_path), offload_to_nvme)
    profile = load_or_profile(_profile_path(settings, model), model,
                              micro_batch=int(ds_config.get("train_micro_batch_size_per_gpu", 1)),
                              seq_len=settings.seq_len, nvme_path=settings.nvme_path, ds_config=ds_config,
                              activations=activations,
                              settings=ProfileSettings(host_copy_bytes=size, nvme_bytes=size, device_copy_bytes=size),
                              log=lambda line: print(line, flush=True), engine_config=engine_config)

    ds_config, decision = int8_gradients_priced(profile, ds_config, settings)
    if decision is not None and dist.get_rank() == 0:
        print(decision, flush=True)
    problem, sizes = problem_for_config(profile, ds_config, settings, dist.get_world_size(), _local_ranks(dist),
                                        process_bytes=process_bytes, decide=lambda work: on_rank_zero(work, dist))
    if problem.headroom is not None and dist.get_rank() == 0:
        print(headroom_line(problem, settings), flush=True)
    return problem, sizes, ds_config


# The process's own memory enters the plan rounded up to this: two launches of one job measure it a
# few MB apart, and a plan that moved with those MB would train another launch (a resume of the same
# job) otherwise than the first; rounded, they plan alike (docs/plan.md, "Resuming a planned run").
PROCESS_BYTES_STEP = 64 * 2**20


def rounded_process_bytes(measured: int) -> int:
    """`measured` (what the rank holds besides the model) rounded up to PROCESS_BYTES_STEP."""
    return -(-max(0, measured) // PROCESS_BYTES_STEP) * PROCESS_BYTES_STEP


def headroom_line(problem: PlanProblem, settings) -> str:
    """What `plan.headroom_share` came to on this machine, in the user's per-rank budget terms."""
    headroom = problem.headroom
    key = "gpu_mem" if problem.machine.has_host else "cpu_mem"
    return (f"lazyzero plan: headroom_share {headroom.share:g} -> {key} "
            f"{budget_of(headroom.capacity_bytes, settings) / 1e9:.2f} GB per rank (least with a plan "
            f"{budget_of(headroom.least_bytes, settings) / 1e9:.2f} GB, every tensor in memory "
            f"{budget_of(headroom.in_memory_bytes, settings) / 1e9:.2f} GB; after memory_reserve "
            f"{settings.memory_reserve:g})")


def cast_to_training_dtype(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """DeepSpeed casts whole parameters to the training dtype when it partitions them; doing it first
    makes the profile time the layers in the dtype they will train in. A model zero.Init partitioned
    already has the dtype zero.Init gave it (its config's), which casting cannot change."""

    found = next(p.dtype for p in model.parameters() if p.is_floating_point())
    if found == dtype:
        return
    if any(is_partitioned(p) for p in model.parameters()):
        name = str(dtype).removeprefix("torch.")
        raise ValueError(f"the model was partitioned by deepspeed.zero.Init in {str(found).removeprefix('torch.')}, "
                         f"but this config trains in {name} (bf16/fp16 sections); build it under "
                         "deepspeed.zero.Init(config_dict_or_path=<this config>) so that its partitions are "
                         f"{name} (docs/plan.md, \"Planning partitioned models\")")
    model.to(dtype)


def _profile_path(settings, model: torch.nn.Module) -> str:
    """`plan.profile_path`, else one file per model architecture in the user's cache folder."""
    if settings.profile_path is not None:
        return settings.profile_path
    folder = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "lazyzero" / "profiles"
    folder.mkdir(parents=True, exist_ok=True)
    return str(folder / f"{model_config_sha256(model)[:16]}-seq{settings.seq_len}.json")


def _local_ranks(dist) -> int:
    """Ranks sharing this host's memory budget (from the launcher; without one, all ranks)."""
    return launcher_ranks_per_node() or dist.get_world_size()


def solve_on_rank_zero(problem: PlanProblem, settings, dist, least_excess: bool = False) -> tuple[Plan, float]:
    """Rank 0 solves (MILP with its greedy warm start); every rank receives the same plan, or the same
    error. With `least_excess`, a compute-memory budget that admits no plan is raised as little as
    needed (`calibrate.solve_with_least_excess`). Returns the plan and that excess (0.0: none)."""

    def solve_here() -> tuple[str, float]:
        from rich.console import Console

        from lazyzero.plan.solver.milp import solve

        with Console(stderr=True).status(f"lazyzero plan: solving ({problem.num_layers} layers, "
                                         f"limit {settings.time_limit_s:g} s)"):
            if least_excess:
                plan, excess = solve_with_least_excess(problem, settings.time_limit_s, settings.max_gap)
            else:
                try:
                    plan, excess = solve(problem, time_limit_s=settings.time_limit_s, max_gap=settings.max_gap), 0.0
                except PlanInfeasible as error:
                    raise _budget_advice(problem, settings, error) from None
        return plan.to_json(), excess

    plan_json, excess = on_rank_zero(solve_here, dist)
    return Plan.from_json(plan_json), excess


def _budget_advice(problem: PlanProblem, settings, error) -> Exception:
    """The solver's PlanInfeasible, with the budget key to raise and about how far (searched)."""
    if "gpu" not in error.tiers:
        return error
    key = "gpu_mem" if problem.machine.has_host else "cpu_mem"
    capacity = problem.machine.tiers["gpu"].capacity_bytes
    needed = smallest_compute_budget(problem)
    shared = "" if key == "gpu_mem" else "; cpu_mem is per node, shared by its ranks"
    advice = (f"about {budget_of(needed, settings) / 1e9:.2f} GB per rank would admit one" if needed is not None
              else f"not even {budget_of(4 * capacity, settings) / 1e9:.2f} GB per rank would")
    return PlanInfeasible(f"lazyzero.plan.{key}: no plan fits {budget_of(capacity, settings) / 1e9:.2f} GB per rank "
                          f"({capacity / 1e9:.2f} GB planned after memory_reserve {settings.memory_reserve:g}); "
                          f"{advice}{shared}. The solver said: {error}", error.tiers)


def budget_of(capacity: float, settings) -> float:
    """The per-rank budget a user gives for a planning capacity (the budget less `memory_reserve`)."""
    return capacity / (1 - settings.memory_reserve)


def on_rank_zero(work, dist):
    """`work()` on rank 0, its result broadcast to every rank; an exception there is raised on every
    rank (as the same type where it can be rebuilt from its message), so that no rank waits forever
    in a collective its peer left."""
    payload = [None]
    if dist.get_rank() == 0:
        try:
            payload[0] = ("ok", work())
        except Exception as error:  # noqa: BLE001 - every error must reach the other ranks
            payload[0] = ("error", (type(error).__name__, str(error), getattr(error, "tiers", None)))
            torch.distributed.broadcast_object_list(payload, src=0)
            raise
    torch.distributed.broadcast_object_list(payload, src=0)
    status, value = payload[0]
    if status == "ok":
        return value
    kind, message, tiers = value
    if kind == PlanInfeasible.__name__:
        raise PlanInfeasible(message, tiers)
    raise RuntimeError(f"rank 0 failed: {kind}: {message}")


def given_plan(problem: PlanProblem, path: str) -> Plan:
    """The per-layer choices of the plan in `path`, with predictions made anew for this run's problem
    (the file's were for the problem it was solved for); same layers, within every budget."""
    try:
        plan = Plan.from_json(Path(path).read_text())
    except (OSError, ValueError, TypeError, KeyError) as error:
        raise ValueError(f"lazyzero.plan.plan_path: {path} is not a readable plan.json ({error})") from None
    if len(plan.layers) != problem.num_layers:
        raise ValueError(f"lazyzero.plan.plan_path: {path} plans {len(plan.layers)} layers; this model has "
                         f"{problem.num_layers} ({', '.join(c.name for c in problem.layers)})")
    try:
        check_act_widths(problem, plan.layers)
    except ValueError as error:
        raise ValueError(f"lazyzero.plan.plan_path: {path}: {error}; lazyzero.plan.max_grad_error sets the bound") \
            from None
    plan = evaluate_layers(problem, plan.layers, plan.source, plan.status)
    check_within_budgets(problem, plan)
    return plan


def _base_config(ds_config: dict) -> dict:
    """The user's config without the plan section: the implied config is validated as a plain one
    (its activation and optimizer sections are the plan's, which an enabled plan section forbids)."""
    base = copy.deepcopy(ds_config)
    base.setdefault("lazyzero", {}).pop("plan", None)
    return base


def _absolute(path: str | None) -> str | None:
    return None if path is None else str(Path(path).resolve())


def _show(active: ActivePlan) -> None:
    """Print the plan; with `plan.output_dir`, write plan.json, ds_config.json and memory.png there."""
    print(plan_table(active.problem, active.plan), end="", flush=True)
    folder = active.lazyzero_config.plan.output_dir
    if folder is None:
        return
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan.json").write_text(active.plan.to_json())
    (out / "ds_config.json").write_text(json.dumps(active.setup.ds_config, indent=2) + "\n")
    plot_memory(active.problem, active.plan, out / "memory.png")
    print(f"lazyzero plan: wrote {out / 'plan.json'}, {out / 'ds_config.json'}, {out / 'memory.png'}")


def planned_zero_placement(active: ActivePlan, model: torch.nn.Module):
    """Around ZeRO-3's construction: only the planned layers' optimizer states and parameters go to NVMe."""
    placement = zero_placement_of(active, model)
    if placement is None:
        return nullcontext()

    return zero_placement(placement)


def check_planned_config(active: ActivePlan, config_class, model) -> None:
    """DeepSpeed's parse of the planned config can realize the plan (one step, one placement)."""
    problems = []
    if config_class.gradient_accumulation_steps != 1:
        problems.append(Problem.conflict("gradient_accumulation_steps", config_class.gradient_accumulation_steps,
                                         "1 while lazyzero.plan.enabled is true",
                                         "the planner models one forward and backward per optimizer step"))
    placement = zero_placement_of(active, model)
    if placement is not None:
        problems += placement_problems(placement, config_class.zero_config)
    if problems:
        raise LazyZeroConfigError(problems)


def zero_placement_of(active: ActivePlan | None, model: torch.nn.Module):
    """The ZeroPlacement of the plan's NVMe layers (None: nothing is offloaded to NVMe; an empty one
    when DeepSpeed offloads to NVMe but the plan keeps every layer in memory)."""
    zero = active.setup.ds_config.get("zero_optimization", {}) if active is not None else {}
    if all(zero.get(name, {}).get("device") != "nvme" for name in ("offload_param", "offload_optimizer")):
        return None

    params = active.setup.param_nvme_layers
    return ZeroPlacement(optimizer_nvme=frozenset(layer_parameter_names(model, active.setup.optimizer_nvme_layers)),
                         param_nvme=frozenset(layer_parameter_names(model, params)) if params else None)


def layer_parameter_names(model: torch.nn.Module, layers: tuple[str, ...]) -> list[str]:
    """Parameters of the problem's layers: a decoder layer's are under its module name; those of
    `EMBED_AND_HEAD` are every parameter outside the decoder layers."""
    names = [name for name, _ in model.named_parameters()]
    decoder = [n for n in names if decoder_layer_index(".".join(n.split(".")[:3])) is not None]
    chosen = set()
    for layer in layers:
        if layer == EMBED_AND_HEAD:
            chosen.update(set(names) - set(decoder))
        else:
            chosen.update(n for n in decoder if n.startswith(layer + "."))
    return [n for n in names if n in chosen]
