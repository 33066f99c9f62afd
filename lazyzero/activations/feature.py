"""Saved-activation quantization as an engine feature (lazyzero/engine/features.py): the packer
around every forward, re-configured between steps when a new plan changes the activation choices."""

from __future__ import annotations

from contextlib import nullcontext

from lazyzero.activations.config import ActivationsConfig
from lazyzero.activations.engine_setup import ActivationMemory
from lazyzero.feature import Feature


class ActivationsFeature(Feature):
    def __init__(self, lazyzero_config, **_):
        self.config = lazyzero_config
        self.memory: ActivationMemory | None = None

    def attach(self, engine) -> None:
        if self.config.activations.enabled:
            self.memory = ActivationMemory(engine.module, self.config.activations, aio_config=engine._config.aio_config)

    def around_forward(self, engine):
        return self.memory.packer if self.memory is not None else nullcontext()

    def reconfigure(self, engine, section: str, settings: dict | None) -> None:
        """Replace the saved-activation setup by a plan's `settings` (an activations config section;
        None: store everything as autograd saves it). Called between optimizer steps."""
        if section != "activations":
            return
        self.close(engine)
        # The user's own settings (block size, rounding, attention and norm widths) stay.
        kept = {name: value for name, value in self.config.activations.model_dump().items()
                if name not in ActivationsConfig.planned_fields}
        self.config.activations = ActivationsConfig(**{**kept, **(settings or {})})
        self.attach(engine)

    def step_metrics(self, engine) -> dict:
        return self.memory.step_metrics() if self.memory is not None else {}

    def report(self, engine) -> dict:
        return self.memory.report() if self.memory is not None else {}

    def close(self, engine) -> None:
        if self.memory is not None:
            self.memory.close()
            self.memory = None
