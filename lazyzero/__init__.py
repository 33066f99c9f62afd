"""lazyzero: memory planning, quantization, 8-bit optimizers and lazy checkpoints for DeepSpeed ZeRO.

Importing lazyzero never compiles anything and never imports DeepSpeed eagerly: `initialize` and
`LazyZeroEngine` are resolved on first use so that `lazyzero config check` stays fast.
"""

__version__ = "0.1.0"

__all__ = ["initialize", "LazyZeroEngine", "LazyZeroConfig", "LazyZeroConfigError", "__version__"]


def __getattr__(name):
    if name == "initialize":
        from lazyzero.runtime.initialize import initialize

        return initialize
    if name == "LazyZeroEngine":
        from lazyzero.runtime.engine import LazyZeroEngine

        return LazyZeroEngine
    if name in ("LazyZeroConfig", "LazyZeroConfigError"):
        from lazyzero import config

        return getattr(config, name)
    raise AttributeError(f"module 'lazyzero' has no attribute {name!r}")
