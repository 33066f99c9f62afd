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

from transformers import TrainerCallback

from lazyzero.engine.engine import newest_engine
from lazyzero.engine.monitor_metrics import PREFIX, reduced_over_ranks


class TrainerLogsCallback(TrainerCallback):
    """Adds the latest step's lazyzero metrics to every Trainer log entry. A collective when there are
    several ranks: the Trainer logs on every rank at the same steps."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        engine = newest_engine()
        if engine is None or logs is None:
            return
        values = {PREFIX + key: value for key, value in reduced_over_ranks(engine.lazyzero_step_metrics()).items()}
        logs.update(values)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(values)  # the entry the Trainer appended just before the callbacks
