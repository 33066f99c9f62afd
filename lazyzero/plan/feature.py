"""The memory planner as an engine feature (lazyzero/engine/features.py): before DeepSpeed builds
anything it profiles, solves and rewrites the config into the one the plan implies (deepspeed/engine_setup.py);
while DeepSpeed builds ZeRO-3 it places the planned layers' tensors on NVMe (deepspeed/zero_placement.py); during
training it compares measured with predicted and plans the activations again (deepspeed/monitor.py)."""

from __future__ import annotations

import json
from contextlib import nullcontext

from lazyzero.feature import Feature


class PlanFeature(Feature):
    def __init__(self, lazyzero_config, active_plan=None, **_):
        self.config = lazyzero_config
        self.active_plan = active_plan
        self.monitor = None

    def prepare_run(self, model, ds_config: dict, lazyzero_config, dist) -> dict | None:
        """The planned DeepSpeed config and "lazyzero" section, and the plan for the engine's feature."""
        if not lazyzero_config.plan.enabled:
            return None
        from lazyzero.plan.deepspeed.engine_setup import plan_run

        active_plan = plan_run(model, ds_config, lazyzero_config, dist)
        return {"ds_config": active_plan.setup.ds_config, "lazyzero_config": active_plan.lazyzero_config,
                "active_plan": active_plan}

    def check_parsed_config(self, config_class, model) -> None:
        if self.active_plan is not None:
            from lazyzero.plan.deepspeed.engine_setup import check_planned_config

            check_planned_config(self.active_plan, config_class, model)

    def around_zero_optimizer_build(self, engine):
        # A plan may swap only some layers' optimizer state and parameters to NVMe (deepspeed/zero_placement.py).
        if self.active_plan is None:
            return nullcontext()
        from lazyzero.plan.deepspeed.engine_setup import planned_zero_placement

        return planned_zero_placement(self.active_plan, engine.module)

    def attach(self, engine) -> None:
        if self.active_plan is not None:
            from lazyzero.plan.deepspeed.monitor import PlanMonitor

            self.monitor = PlanMonitor(self.active_plan)

    def after_optimizer_step(self, engine) -> None:
        if self.monitor is not None:
            self.monitor.after_optimizer_step(engine)

    def step_metrics(self, engine) -> dict:
        return self.monitor.step_metrics() if self.monitor is not None else {}

    def keeps_rank_state(self, engine) -> bool:
        return self.monitor is not None

    def rank_state(self, engine) -> dict:
        return {"plan": self.monitor.saved_state()} if self.monitor is not None else {}

    def load_rank_state(self, engine, state: dict) -> None:
        if self.monitor is not None and "plan" in state:
            line = self.monitor.resume_from(engine, state["plan"])
            if engine.global_rank == 0:
                print(line, flush=True)

    def report(self, engine) -> dict:
        """The plan and every comparison of measured with predicted; the placement's tiers."""
        report = {}
        if self.monitor is not None:
            report.update(self.monitor.report(), plan=json.loads(self.active_plan.plan.to_json()))
        if hasattr(engine.optimizer, "tier_report"):
            report["zero_placement"] = engine.optimizer.tier_report()
        return report
