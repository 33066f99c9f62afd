"""`import lazyzero` is cheap and shows the real signature of `lazyzero.initialize`."""

import inspect
import subprocess
import sys


def test_import_lazyzero_imports_neither_deepspeed_nor_the_native_ops():
    code = ("import sys, inspect, lazyzero; print(inspect.signature(lazyzero.initialize)); "
            "print(sorted(m for m in sys.modules if m == 'deepspeed' or m.startswith(('deepspeed.', 'lazyzero.ops'))))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    signature, modules = result.stdout.strip().splitlines()
    assert signature.startswith("(args=None, model=None, optimizer=None, model_parameters=None")
    assert modules == "[]"


def test_initialize_takes_the_engine_initializes_arguments_in_the_same_order():
    """The public wrapper and the engine's `initialize` must not drift apart (names, order, defaults)."""
    import lazyzero
    from lazyzero.engine.initialize import initialize

    public = [(p.name, p.default) for p in inspect.signature(lazyzero.initialize).parameters.values()]
    engine = [(p.name, p.default) for p in inspect.signature(initialize).parameters.values()]
    assert public == engine
