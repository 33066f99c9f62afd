"""Peak memory of a piece of work; moved into the package (`lazyzero/planner/measure.py`), where the
profiler uses it too. This name stays for the benchmarks that import it."""

from lazyzero.planner.measure import heap_live_bytes, peak_bytes

__all__ = ["heap_live_bytes", "peak_bytes"]
