"""Planned runs (docs/plan.md): `"lazyzero": {"plan": {"enabled": true}}` in a real 2-rank `lazyzero train`.

One launch applies a given plan whose every choice differs from DeepSpeed's defaults (a layer's
activations at 4 bits offloaded to NVMe, another layer recomputed with its parameters and optimizer
state on NVMe, 8-bit optimizer states) and checks that the run realized each of them; with a tiny
re-planning margin it also plans again after the first comparison of measured with predicted. A slow
test solves for a host-memory budget below what the run needs with everything in memory and checks
that training stays within it.
"""

import json
from pathlib import Path

import pytest

from lazyzero.plan.solver.problem import LayerPlan
from lazyzero.testing import run_distributed

ROOT = Path(__file__).resolve().parents[2]
# Wide enough that each rank's share of a weight reaches DeepSpeed's 1 MiB NVMe swap threshold in bf16.
MODEL = {"model_type": "llama", "hidden_size": 1024, "intermediate_size": 2048, "num_hidden_layers": 2,
         "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 300, "max_position_embeddings": 64}
SEQ_LEN = 32
GB = 10**9


def planned_config(tmp_path: Path, **plan) -> dict:
    nvme = tmp_path / "nvme"
    nvme.mkdir(exist_ok=True)
    return {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": 3}, "steps_per_print": 10**9,
        "lazyzero": {"plan": {"enabled": True, "nvme_path": str(nvme), "profile_path": str(tmp_path / "profile.json"),
                              "output_dir": str(tmp_path / "plan"), **plan}},
    }


def train(tmp_path: Path, config: dict, steps: int, eval_problems: int = 0):
    (tmp_path / "model.json").write_text(json.dumps(MODEL))
    (tmp_path / "ds_config.json").write_text(json.dumps(config))
    out = tmp_path / "run"
    argv = ["--module", "lazyzero.train", "--deepspeed_config", str(tmp_path / "ds_config.json"),
            "--model", str(tmp_path / "model.json"), "--seq-len", str(SEQ_LEN), "--max-steps", str(steps),
            "--train-examples", "200", "--eval-problems", str(eval_problems), "--eval-max-new-tokens", "4",
            "--output-dir", str(out)]
    proc = run_distributed("deepspeed", 2, argv, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return proc.stdout, records, json.loads((out / "report.json").read_text())


def plan_file(tmp_path: Path, layers: list[LayerPlan]) -> Path:
    """A plan.json with these choices; a planned run predicts anew for its own problem."""
    from dataclasses import asdict

    path = tmp_path / "given_plan.json"
    windows = 2 * len(layers) + 1
    path.write_text(json.dumps({"layers": [asdict(lp) for lp in layers], "act_transfers": [],
                                "checkpoint_transfers": [0.0] * windows, "predicted_step_s": 0.0,
                                "predicted_peak_bytes": {}, "objective": 0.0, "source": "greedy",
                                "status": "heuristic"}))
    return path


@pytest.mark.slow  # 42 s; the README's main job is a planned run that re-plans
@pytest.mark.multiproc
def test_a_given_plan_is_realized_and_measured_then_replanned(tmp_path):
    layers = [LayerPlan("keep", 4, "nvme", "gpu", "gpu", True),       # layer 0: 4-bit, offloaded
              LayerPlan("recompute", 16, "gpu", "nvme", "nvme", True),  # layer 1: recomputed, on NVMe
              LayerPlan("keep", 16, "gpu", "gpu", "gpu", True)]        # embeddings and head
    # The given plan stores layer 0 at 4 bits whatever this random model's measured gradient error
    # there: the bound is lifted (the bound itself: test_quality_bound.py).
    config = planned_config(tmp_path, cpu_mem=16 * GB, plan_path=str(plan_file(tmp_path, layers)),
                            measure_steps=1, replan_margin=1e-6, max_grad_error=1.0)
    # With an evaluation before and after training: decoding under the planner's ZeRO-3 settings
    # (parameters released after each use) must leave nothing in flight.
    printed, records, report = train(tmp_path, config, steps=5, eval_problems=2)
    assert report["eval_accuracy_before"] is not None and report["eval_accuracy_after"] is not None

    implied = json.loads((tmp_path / "plan" / "ds_config.json").read_text())
    zero, section = implied["zero_optimization"], implied["lazyzero"]
    assert zero["offload_param"]["device"] == zero["offload_optimizer"]["device"] == "nvme"
    assert section["activations"]["recompute_layers"] == [1]
    assert section["activations"]["offload_layers"] == {"0": "nvme"}
    assert section["optimizer"]["enabled"] is True and section["optimizer"]["type"] == "adamw8bit"
    # Realized: the first steps moved layer 0's stored activations to NVMe, only layer 1's
    # tensors were placed there, and measured and predicted were compared once per step.
    assert records[0]["activation_offloaded_bytes"] > 0
    tiers = report["zero_placement"]
    assert tiers["optimizer_nvme_elements"] > 0 and tiers["param_nvme_elements"] > 0
    assert tiers["optimizer_memory_elements"] > 0 and tiers["param_memory_elements"] > 0
    checks = report["plan_checks"]
    # Every check is beyond the margin of 1e-6; the second in a row confirms it (monitor.CONFIRMING_CHECKS).
    assert not checks[0]["replanned"] and checks[1]["replanned"]
    assert checks[0]["predicted_step_s"] > 0 and checks[0]["measured_peak_bytes"] > 0
    # The profile's engine calibration ran engines with their decoder layers swapped, and with their
    # parameters alone swapped (their NVMe speeds price the plan's swaps), and removed their swap files.
    from lazyzero.plan.profile.profiler import read_profile

    runs = read_profile(tmp_path / "profile.json").engine.runs
    assert ([(run.layers, run.nvme, run.params_only) for run in runs]
            == [(1, False, False), (3, False, False), (3, True, False), (3, True, True)])
    assert all(run.step_s > 0 for run in runs)
    assert not list((tmp_path / "nvme").glob("lazyzero-calibration-*"))
    assert "lazyzero plan 0: step time measured" in printed
    # The new plan may change activations only: parameters and states stay where they were put.
    new_layers = report["plan"]["layers"]
    assert ([(lp["param_tier"], lp["state_tier"]) for lp in new_layers]
            == [(lp.param_tier, lp.state_tier) for lp in layers])
    assert all(r["loss"] == r["loss"] and r["loss"] < 10 for r in records)


@pytest.mark.multiproc
@pytest.mark.slow
def test_a_budget_below_the_all_in_memory_peak_is_kept(tmp_path):
    """A budget halfway between the least that admits a plan and what the all-in-memory plan needs
    per rank (both from the profile, moved by what a first run measured beyond its prediction):
    the run's peak resident set stays within 1.1 x that budget (the issue's criterion) and the plan
    moved something off or shrank it."""
    from lazyzero.config import PlanConfig
    from lazyzero.plan.deepspeed.calibrate import smallest_compute_budget
    from lazyzero.plan.deepspeed.problem_from_profile import problem_for_config
    from lazyzero.plan.profile.profiler import read_profile
    from lazyzero.plan.solver.simulate import evaluate_layers

    generous = planned_config(tmp_path, cpu_mem=32 * GB, seq_len=SEQ_LEN, measure_steps=1, replan=False)
    _, _, first = train(tmp_path, generous, steps=3)
    settings = PlanConfig(**generous["lazyzero"]["plan"])
    problem, _ = problem_for_config(read_profile(tmp_path / "profile.json"), generous, settings, 2, 2)
    # What the run held beyond this problem's prediction for its plan (the process grew since its
    # profile's snapshot; what the memory model does not see): the same for any plan of this model.
    first_plan = [LayerPlan(**lp) for lp in first["plan"]["layers"]]
    unseen = first["plan_checks"][0]["measured_peak_bytes"] - \
        evaluate_layers(problem, first_plan, "greedy").predicted_peak_bytes["gpu"]
    in_memory = evaluate_layers(problem, [LayerPlan("keep", 16, "gpu", "gpu", "gpu", False)] * problem.num_layers,
                                "greedy").predicted_peak_bytes["gpu"] + unseen
    least = smallest_compute_budget(problem, low=0, high=in_memory, rounds=12) / (1 - settings.memory_reserve) + unseen
    assert least < in_memory, (least, in_memory)
    budget = int((least + in_memory) / 2)
    tight = planned_config(tmp_path, cpu_mem=2 * budget)
    _, records, report = train(tmp_path, tight, steps=5)
    planned = report["plan"]["layers"]
    assert any(lp["act_bits"] < 16 or lp["act_mode"] == "recompute" or lp["state_8bit"]
               or "nvme" in (lp["act_tier"], lp["state_tier"], lp["param_tier"]) for lp in planned)
    assert max(r["peak_mem_bytes"] for r in records) <= 1.1 * budget
