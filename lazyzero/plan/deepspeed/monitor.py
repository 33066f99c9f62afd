"""Measured against predicted (docs/plan.md): after a few optimizer steps the engine compares the
step time and peak memory it measured with the plan's prediction, logs both, and plans again when
they differ by more than `plan.replan_margin` in CONFIRMING_CHECKS consecutive checks of one plan and
in the plan's typical check (the median step time of all its checks, the newest peak). The new plan
is calibrated with that typical check.

What is measured: the wall time between the ends of consecutive optimizer steps (forward, backward,
step and whatever the training loop does in between, as a user sees it), median over
`plan.measure_steps` steps after the first (which creates the optimizer state and warms caches); and
the peak of the compute memory over those steps: the resident set's high-water mark on a machine
without a GPU (reset after the first step), CUDA's max allocated bytes otherwise. Every rank measures;
the slowest step time and largest peak over the ranks are compared, so all ranks decide alike. The
plan's peak includes lazy checkpoints' snapshot memory; before the first checkpoint it is compared
less that memory (`calibrate.predicted_compute_peak`).

A new plan can change only what the running engine can change: the activation choices (width,
recompute, offload per layer). Placements of parameters and optimizer state are fixed once DeepSpeed
has partitioned them, so the new problem fixes them (`calibrate.calibrated_problem`). It keeps the
widths too where it can (a packed layer its width, an exact one 16 bits or recompute): the new plan
then moves activations without changing what training computes, so that a run's losses do not
depend on when its measurements crossed the margin, and a resumed run repeats them.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, replace

import torch

from lazyzero.plan.deepspeed.calibrate import calibrated_problem, predicted_compute_peak, with_free_widths
from lazyzero.plan.deepspeed.host_memory import compute_peak_bytes, reset_compute_peak
from lazyzero.plan.deepspeed.implied import implied_setup
from lazyzero.plan.report import plan_table
from lazyzero.plan.solver.problem import Plan, PlanInfeasible

# A run re-plans at most this often: each new plan is measured again, and a model that keeps missing
# should be reported, not chased.
MAX_REPLANS = 2
# Checks in a row beyond the margin before a re-plan: one check is a median of a few steps, and one
# burst of load from another process moved one by 20% and spent a re-plan on it; a slow spell of two
# checks then re-planned to a step 12% slower than the rest of the run, so the plan's typical check must
# be beyond the margin too, and is what the new plan is calibrated with (the README job's runs:
# benchmarks/results/records/2026-12-05-planner-readme-job-runs.md).
CONFIRMING_CHECKS = 2
UNPRICED_NOTE = "; a lazy checkpoint was being written, which the plan does not price (plan.checkpoint_every)"


@dataclass(frozen=True)
class PlanCheck:
    """One comparison of measured with predicted, and what was done about it."""

    plan_index: int
    predicted_step_s: float
    measured_step_s: float
    predicted_peak_bytes: float
    measured_peak_bytes: float
    replanned: bool
    snapshot_taken: bool = False
    """Whether a lazy checkpoint's snapshot memory was held (from the first save on): the
    prediction compared is the plan's peak with it, else without it (calibrate.predicted_compute_peak)."""
    unpriced_checkpoint: bool = False
    """Whether a lazy checkpoint's background copies and writes ran during the measured steps while
    the plan did not price them (`plan.checkpoint_every` null): the step time measured is then not the
    plan's step, so it is reported but neither confirms a re-plan nor calibrates one."""

    @property
    def step_time_error(self) -> float:
        return self.measured_step_s / self.predicted_step_s - 1

    @property
    def peak_error(self) -> float:
        return self.measured_peak_bytes / self.predicted_peak_bytes - 1

    def summary(self) -> str:
        return (f"lazyzero plan {self.plan_index}: step time measured {self.measured_step_s:.3f} s vs predicted "
                f"{self.predicted_step_s:.3f} s ({100 * self.step_time_error:+.1f}%), peak memory measured "
                f"{self.measured_peak_bytes / 1e9:.3f} GB vs predicted {self.predicted_peak_bytes / 1e9:.3f} GB "
                f"({100 * self.peak_error:+.1f}%){UNPRICED_NOTE if self.unpriced_checkpoint else ''}"
                f"{'; planning again' if self.replanned else ''}")

    def as_record(self) -> dict:
        return {**asdict(self), "step_time_error": self.step_time_error, "peak_error": self.peak_error}


class PlanMonitor:
    """Counts optimizer steps of a planned run and compares them with the active plan."""

    def __init__(self, active_plan):
        self.active = active_plan
        self.settings = active_plan.lazyzero_config.plan
        self.checks: list[PlanCheck] = []
        self._step_ends: list[float] = []
        self._checkpoint_overlapped = False
        self._plan_index = 0
        self._reported: PlanCheck | None = None
        self._plan_checks: list[PlanCheck] = []
        """The checks of the active plan, newest last."""
        self._no_plan_found = False
        self.activations_in_force = (active_plan.setup.ds_config.get("lazyzero") or {}).get("activations")
        """The "activations" section the engine runs with: the first plan's, then each re-plan's."""
        self.excess_over_budget: list[float | None] = []
        """Per re-plan: how far over the compute-memory budget it had to plan (0.0: within; None: no
        plan at all, the run went on with the one it had)."""

    def after_optimizer_step(self, engine) -> None:
        self._step_ends.append(time.perf_counter())
        if len(self._step_ends) == 1:
            reset_compute_peak()
            self._checkpoint_overlapped = False
        self._checkpoint_overlapped |= _checkpoint_in_flight(engine)
        if len(self._step_ends) < self.settings.measure_steps + 1:
            return
        check = self._compare(engine)
        self._step_ends.clear()
        self.checks.append(check)
        if engine.global_rank == 0:
            print(check.summary(), flush=True)
        if check.replanned:
            self._replan(engine, check, self._typical(check).measured_step_s)
            self._plan_checks = []
        else:
            self._plan_checks.append(check)

    def _compare(self, engine) -> PlanCheck:
        durations = [b - a for a, b in zip(self._step_ends, self._step_ends[1:])]
        # Whether a lazy checkpoint's snapshot memory is held: any rank's (they save together).
        held = float(getattr(getattr(engine, "checkpoint_engine", None), "holds_snapshot_memory", False))
        unpriced = float(self._checkpoint_overlapped and self.settings.checkpoint_every is None)
        measured = torch.tensor([statistics.median(durations), float(compute_peak_bytes()), held, unpriced],
                                dtype=torch.float64)
        measured = measured.to(engine.device)
        torch.distributed.all_reduce(measured, op=torch.distributed.ReduceOp.MAX)
        step_s, peak, held, unpriced = measured.tolist()
        plan = self.active.plan
        taken = held > 0
        predicted_peak = predicted_compute_peak(self.active.problem, plan, taken)
        check = PlanCheck(self._plan_index, plan.predicted_step_s, step_s, predicted_peak, peak, False, taken,
                          unpriced > 0)
        newest = (self._plan_checks + [check])[-CONFIRMING_CHECKS:]
        confirmed = (len(newest) == CONFIRMING_CHECKS and all(map(self._beyond_margin, newest))
                     and self._beyond_margin(self._typical(check)))
        replan = (self.settings.replan and confirmed and self._plan_index < MAX_REPLANS
                  and not self._no_plan_found)
        return replace(check, replanned=replan)

    def _beyond_margin(self, check: PlanCheck) -> bool:
        step_error = 0.0 if check.unpriced_checkpoint else abs(check.step_time_error)
        return max(step_error, abs(check.peak_error)) > self.settings.replan_margin

    def _typical(self, newest: PlanCheck) -> PlanCheck:
        """`newest` with the median step time of every check of its plan, the earlier ones and it: each
        measures the same plan, and a spell of load is not the plan's step; checks that an unpriced lazy
        checkpoint overlapped are left out (none left: the prediction). The peak stays the newest's: it
        is a high-water mark, and a lazy checkpoint's snapshot, once held, is held in every later check."""
        steps = [check.measured_step_s for check in self._plan_checks + [newest] if not check.unpriced_checkpoint]
        return replace(newest, measured_step_s=statistics.median(steps) if steps else newest.predicted_step_s)

    def _replan(self, engine, check: PlanCheck, step_s: float) -> None:
        """Plans the activations again with the plan's typical step time `step_s` and `check`'s peak (the
        newest: a lazy checkpoint's snapshot memory, once held, is held in every later check)."""
        problem = calibrated_problem(self.active.problem, self.active.plan, step_s,
                                     check.measured_peak_bytes, check.snapshot_taken)
        try:
            problem, plan, excess = self._solve_keeping_widths(engine, problem)
        except PlanInfeasible as error:
            # Training goes on with the plan it has: stopping a run that works for a plan that
            # cannot exist would lose the run. Every rank gets the same error, so all go on alike.
            self._no_plan_found = True
            self.excess_over_budget.append(None)
            if engine.global_rank == 0:
                print(f"lazyzero plan: WARNING: no new plan ({error}); training goes on with plan "
                      f"{check.plan_index}, {check.measured_peak_bytes / 1e9:.2f} GB measured.", flush=True)
            return
        setup = implied_setup(problem, plan, base=self.active.setup.ds_config,
                              nvme_path=self.settings.nvme_path)
        self.activations_in_force = setup.ds_config.get("lazyzero", {}).get("activations")
        engine.lazyzero_reconfigure("activations", self.activations_in_force)
        self.active.problem, self.active.plan = problem, plan
        self._plan_index += 1
        if engine.global_rank == 0:
            print(plan_table(problem, plan), end="", flush=True)
            if excess:
                print(self._excess_note(problem, plan), flush=True)
        self.excess_over_budget.append(excess)

    def _solve_keeping_widths(self, engine, problem):
        """(problem, plan, excess over the budget): the plan that keeps the running widths, unless only
        other widths keep the memory within the budget, or nearer to it (the losses then change)."""
        from lazyzero.plan.deepspeed.engine_setup import solve_on_rank_zero

        try:
            kept = (problem, *solve_on_rank_zero(problem, self.settings, torch.distributed, least_excess=True))
        except PlanInfeasible:
            kept = None
        if kept is not None and kept[2] == 0.0:
            return kept
        free = with_free_widths(problem)
        try:
            changed = (free, *solve_on_rank_zero(free, self.settings, torch.distributed, least_excess=True))
        except PlanInfeasible:
            if kept is None:
                raise
            return kept
        if kept is not None and kept[2] <= changed[2]:
            return kept
        if engine.global_rank == 0:
            print(f"lazyzero plan {self._plan_index + 1}: only other activation widths keep the memory within the "
                  "budget (or nearer to it); this plan changes them, and with them the run's losses", flush=True)
        return changed

    def _excess_note(self, problem, plan) -> str:
        """What planning beyond the planning budget means: into `memory_reserve` (a note), or
        beyond the user's budget itself (a warning)."""
        from lazyzero.plan.deepspeed.engine_setup import budget_of

        budget = budget_of(problem.machine.tiers["gpu"].capacity_bytes, self.settings)
        peak = plan.predicted_peak_bytes["gpu"]
        if peak <= budget:
            return (f"lazyzero plan {self._plan_index}: with the placements in force, no activation plan stays "
                    f"out of memory_reserve; this one is predicted at {peak / 1e9:.2f} GB of the "
                    f"{budget / 1e9:.2f} GB budget per rank.")
        return (f"lazyzero plan {self._plan_index}: WARNING: with the parameter and optimizer-state placements in "
                f"force, no activation plan keeps the measured memory within the budget; this one is predicted "
                f"at {peak / 1e9:.2f} GB against {budget / 1e9:.2f} GB per rank. Restart with a larger "
                f"lazyzero.plan.cpu_mem (gpu_mem on CUDA) or memory_reserve to plan the placements again.")

    def saved_state(self) -> dict:
        """What a checkpoint keeps of the plan in force, for `resume_from`."""
        return {"plan_index": self._plan_index, "plan": self.active.plan.to_json(),
                "activations": self.activations_in_force, "no_plan_found": self._no_plan_found}

    def resume_from(self, engine, state: dict) -> str:
        """Continue with the plan that was in force when `state` was saved, so that a resumed run trains
        as the uninterrupted one did; returns what was done, in a line. Only the activation choices can
        change in a built engine: where the saved plan placed parameters or optimizer state otherwise
        than this run's plan (another budget, another profile), this run's plan is kept."""
        saved = Plan.from_json(state["plan"])
        if _placements(saved) != _placements(self.active.plan):
            return (f"lazyzero plan: the checkpoint's plan {state['plan_index']} placed parameters or optimizer "
                    f"state otherwise than this run's plan; this run keeps its own (losses may differ from the "
                    f"uninterrupted run's)")
        self.activations_in_force = state["activations"]
        engine.lazyzero_reconfigure("activations", self.activations_in_force)
        self.active.plan = saved
        self._plan_index, self._no_plan_found = state["plan_index"], state["no_plan_found"]
        self._plan_checks, self._step_ends = [], []
        return f"lazyzero plan: resumed with plan {self._plan_index}, the one in force when the checkpoint was saved"

    def step_metrics(self) -> dict:
        """The newest comparison, once, in the step log (then nothing until the next one)."""
        if not self.checks or self._reported is self.checks[-1]:
            return {}
        self._reported = self.checks[-1]
        return {f"plan_{key}": value for key, value in self.checks[-1].as_record().items()}

    def report(self) -> dict:
        reserve = self.active.lazyzero_config.plan.memory_reserve
        capacity = self.active.problem.machine.tiers["gpu"].capacity_bytes
        return {"plan_checks": [check.as_record() for check in self.checks],
                "replan_excess_over_budget": self.excess_over_budget,
                # The per-rank compute-memory budget the run was planned under (after headroom_share).
                "compute_budget_per_rank_bytes": round(capacity / (1 - reserve))}


def _placements(plan: Plan) -> list[tuple]:
    return [(layer.param_tier, layer.state_tier, layer.state_8bit) for layer in plan.layers]


def _checkpoint_in_flight(engine) -> bool:
    """Whether this rank's lazy checkpoints have work queued or running (copies, writes, the commit)."""
    pending = getattr(getattr(engine, "checkpoint_engine", None), "pending", None)
    return bool(pending()) if callable(pending) else False
