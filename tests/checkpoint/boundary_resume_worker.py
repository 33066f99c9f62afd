"""A LazyZeroEngine with lazy checkpoints on 1 real rank saves two checkpoints, or resumes from hostile
copies of them (tests/checkpoint/test_folder_boundary_resume.py).

Usage (under the deepspeed launcher, 1 rank):
  boundary_resume_worker.py save SAVE_DIR          tags step1 and step2, 'latest' = step2
  boundary_resume_worker.py load RESULT_JSON DIR...
    for each `on_damaged_latest` (stop, then fall_back) one engine calls load_checkpoint(DIR) for each
    DIR; RESULT_JSON gets {setting: {DIR: {"error": type name or null, "message": str, "tag": the tag
    loaded, "step": the engine's global_steps after it, "printed": what the load printed}}}.
"""

import contextlib
import io
import json
import sys
from pathlib import Path

import torch

import lazyzero
from lazyzero.testing import destroy_engine, worker_args


def build_engine(on_damaged_latest: str):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9, "zero_optimization": {"stage": 1},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
              "lazyzero": {"checkpoint": {"enabled": True, "on_damaged_latest": on_damaged_latest}}}
    engine, _, _, _ = lazyzero.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def save(save_dir: str) -> None:
    engine = build_engine("stop")
    for step in (1, 2):
        loss = engine(torch.randn(2, 8)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        engine.save_checkpoint(save_dir, tag=f"step{step}")
        engine.wait_for_checkpoints()
    destroy_engine(engine)


def load_one(engine, load_dir: str) -> dict:
    printed = io.StringIO()
    result = {"error": None, "message": "", "tag": None}
    try:
        with contextlib.redirect_stdout(printed):
            load_path, _ = engine.load_checkpoint(load_dir)
        result["tag"] = Path(load_path).parent.name if load_path else None
    except Exception as err:  # what the test checks: the type and the message
        result.update(error=type(err).__name__, message=str(err))
    return {**result, "step": engine.global_steps, "printed": printed.getvalue()}


def main() -> None:
    mode, *rest = worker_args()
    if mode == "save":
        save(rest[0])
        return
    result_file, *dirs = rest
    results = {}
    for setting in ("stop", "fall_back"):
        engine = build_engine(setting)
        results[setting] = {load_dir: load_one(engine, load_dir) for load_dir in dirs}
        destroy_engine(engine)
    Path(result_file).write_text(json.dumps(results))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
