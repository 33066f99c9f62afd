"""Int8 gradient exchange as an engine feature (lazyzero/engine/features.py): installed once the
engine is built (no gradient is reduced before the first backward); its error-feedback residuals
are per-rank state saved with checkpoints."""

from __future__ import annotations

from lazyzero.feature import Feature
from lazyzero.gradients.zero_hooks import install_int8_gradients


class Int8GradientsFeature(Feature):
    def __init__(self, lazyzero_config, **_):
        self.config = lazyzero_config
        self.exchange = None

    def attach(self, engine) -> None:
        if self.config.gradients.enabled:
            self.exchange = install_int8_gradients(engine)

    def _feedback(self) -> bool:
        return self.exchange is not None and self.exchange.error_feedback is not None

    def keeps_rank_state(self, engine) -> bool:
        return self._feedback()

    def rank_state(self, engine) -> dict:
        return {"gradients": self.exchange.state_dict()} if self._feedback() else {}

    def load_rank_state(self, engine, state: dict) -> None:
        if self._feedback():
            self.exchange.load_state_dict(state.get("gradients"))

    def step_metrics(self, engine) -> dict:
        """Of the last optimizer step: `grad_wire_bytes` (bytes this rank sent), `grad_fp32_wire_bytes`
        (what an fp32 reduction of the same buckets sends), `grad_exchange_s` (host seconds in the
        exchanges) and `grad_overflow` (step skipped)."""
        return dict(self.exchange.last_step_metrics) if self.exchange is not None else {}
