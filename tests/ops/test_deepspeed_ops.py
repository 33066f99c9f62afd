"""`lazyzero ops build`'s DeepSpeed half (lazyzero/ops/deepspeed_ops.py): what it says when a builder is
not the accelerator's or cannot build here. Nothing here compiles: the builds themselves run in the
README's test command, before the suite."""

from deepspeed.accelerator import get_accelerator

from lazyzero.ops import deepspeed_ops
from lazyzero.ops.native_build import format_status


def test_a_builder_the_accelerator_lacks_is_unavailable_not_failed():
    status = deepspeed_ops.build_one("NoSuchOpBuilder", verbose=False)
    assert status.state == "unavailable" and status.reason


def test_async_io_without_libaio_names_the_install_command(monkeypatch):
    builder_class = type(get_accelerator().create_op_builder("AsyncIOBuilder"))
    monkeypatch.setattr(builder_class, "is_compatible", lambda self, verbose=False: False)
    monkeypatch.setattr(builder_class, "load", lambda self, verbose=False: (_ for _ in ()).throw(AssertionError))
    status = deepspeed_ops.build_one("AsyncIOBuilder", verbose=False)
    assert (status.backend, status.state) == ("ds:async_io", "unavailable")
    assert "libaio" in status.reason and "apt-get install libaio-dev" in status.reason
    assert "ds:async_io" in format_status([status])


def test_a_failed_build_reports_the_compilers_first_error(monkeypatch):
    builder_class = type(get_accelerator().create_op_builder("CPUAdamBuilder"))

    def failing_load(self, verbose=False):
        raise RuntimeError("Error building extension 'cpu_adam'\ncpu_adam.cpp:3: error: no member 'x'\n")

    monkeypatch.setattr(builder_class, "is_compatible", lambda self, verbose=False: True)
    monkeypatch.setattr(builder_class, "load", failing_load)
    status = deepspeed_ops.build_one("CPUAdamBuilder", verbose=False)
    assert status.state == "failed" and "error: no member 'x'" in status.reason
