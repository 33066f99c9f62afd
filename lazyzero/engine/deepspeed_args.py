"""What lazyzero reads of `deepspeed.initialize`'s arguments without importing DeepSpeed: its default
port and the config that `args` names. Shared by `lazyzero.initialize` (initialize.py) and the route
of `deepspeed.initialize` (deepspeed_route.py), which imports initialize.py; standard library only, so
that `import lazyzero` stays light (docs/architecture.md)."""

from __future__ import annotations

from typing import Any

# DeepSpeed's TORCH_DISTRIBUTED_DEFAULT_PORT (deepspeed/constants.py), the default of deepspeed.initialize's
# distributed_port; written out so that `import lazyzero` does not import DeepSpeed.
# tests/engine/test_public_api.py keeps every signature here equal to DeepSpeed's.
DEEPSPEED_DEFAULT_PORT = 29500


def config_in_args(args: Any) -> Any:
    """The config `args` names: `args.deepspeed_config`, or the deprecated `args.deepscale_config`
    that DeepSpeed's initialize still reads; both given is refused, as there."""
    current, deprecated = getattr(args, "deepspeed_config", None), getattr(args, "deepscale_config", None)
    if current is not None and deprecated is not None:
        raise ValueError("args gives both deepspeed_config and the deprecated deepscale_config; give deepspeed_config")
    return current if current is not None else deprecated
