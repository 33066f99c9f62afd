"""Package names resolved on first use (PEP 562), for the packages whose face must stay light.

A package such as `lazyzero.activations` holds both its config section (imported by `lazyzero.config`,
which imports neither torch nor DeepSpeed) and the torch code the section configures; importing the
package must therefore not import the code its public names live in. Each such `__init__.py` gives
`lazy_names` a mapping name -> home module and binds what it returns:

    __getattr__, __dir__ = lazy_names(__name__, {"ActivationPolicy": "policy", ...})

The home module is relative to the package ("policy" is `lazyzero.activations.policy`). A name is
imported on its first use and then kept on the package, so the second use costs a dictionary look-up.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from importlib import import_module
from typing import Any


def lazy_names(package: str, homes: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """`__getattr__` and `__dir__` for `package`, each name in `homes` imported from its home module."""

    def __getattr__(name: str) -> Any:
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(import_module(f"{package}.{homes[name]}"), name)
        vars(sys.modules[package])[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(homes))

    return __getattr__, __dir__

