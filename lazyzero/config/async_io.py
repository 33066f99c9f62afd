"""Whether DeepSpeed's async_io op, which every NVMe path of a run goes through (ZeRO's NVMe offload, the
planner's NVMe tier, the activation offload's files), can load on this machine (docs/reliability.md,
guarantee 6: refused before anything starts, not deep inside DeepSpeed's first swap)."""

from __future__ import annotations

import functools

from lazyzero.config.errors import Problem

LIBAIO_INSTALL = ("apt-get install libaio-dev (Debian, Ubuntu), dnf install libaio-devel (Fedora, RHEL) or "
                  "conda install -c conda-forge libaio")


@functools.lru_cache(maxsize=1)
def async_io_unavailable() -> str | None:
    """None when DeepSpeed can build its async_io op here; else why it cannot. Probed once per process
    (DeepSpeed compiles a test program against libaio)."""
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        if AsyncIOBuilder().is_compatible(verbose=False):
            return None
        return "DeepSpeed's async_io op cannot be built here: libaio's header or library is missing"
    except Exception as error:  # noqa: BLE001 - a probe that fails is itself the finding
        return f"DeepSpeed's async_io op could not be probed ({type(error).__name__}: {error})"


def async_io_problems(path: str) -> list[Problem]:
    """A problem at key `path` (an NVMe folder the run would use) when async_io cannot load here."""
    why = async_io_unavailable()
    if why is None:
        return []
    return [Problem(path, f"NVMe needs DeepSpeed's async_io op: {why}. Install libaio ({LIBAIO_INSTALL}), then "
                          "start again; or use no NVMe folder")]
