"""lazyzero's step metrics in the Hugging Face Trainer's own logs (docs/architecture.md, "Through the
trainers"): `Trainer(..., callbacks=[lazyzero.TrainerLogsCallback()])`.

DeepSpeed's monitor already receives them when the config enables one (monitor_metrics.py); this
callback puts them where Trainer users look too: every log entry (`logging_steps`) gains
`lazyzero/<key>` with the values of the latest optimizer step, reduced over the ranks as for the
monitor, in `trainer.state.log_history` (and so `trainer_state.json`) and in the `logs` the callbacks
after this one receive (the console printer, and reporters listed after it). The Trainer does not
hand callbacks its engine, so the newest LazyZeroEngine of the process is used.
"""

from __future__ import annotations

import time

from transformers import TrainerCallback

from lazyzero.engine.engine import newest_engine
from lazyzero.engine.monitor_metrics import PREFIX, reduced_over_ranks


class TrainerLogsCallback(TrainerCallback):
    """Adds the latest step's lazyzero metrics to every Trainer log entry. A collective when there are
    several ranks: the Trainer logs on every rank at the same steps.

    One key comes with every engine, DeepSpeed's own included: `lazyzero/step_s`, the seconds from the
    start of the latest optimizer step's first forward to the end of its optimizer step (the slowest
    rank's; saving and logging come after it)."""

    def __init__(self):
        self._step_began = self._step_s = None

    def on_step_begin(self, args, state, control, **kwargs):
        self._step_began = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if self._step_began is not None:
            self._step_s = time.perf_counter() - self._step_began

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None:
            return
        values = {PREFIX + key: value for key, value in reduced_over_ranks(self._step_metrics()).items()}
        logs.update(values)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(values)  # the entry the Trainer appended just before the callbacks

    def _step_metrics(self) -> dict:
        engine = newest_engine()
        metrics = dict(engine.lazyzero_step_metrics()) if engine is not None else {}
        if self._step_s is not None:
            metrics["step_s"] = self._step_s
        return metrics
