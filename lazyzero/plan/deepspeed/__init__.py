"""The planner's DeepSpeed side (docs/plan.md, "How it works", steps 2, 4 and 5): the costs of a
ZeRO-3 run from a model preset (`costs.py`) or a profile (`problem_from_profile.py`, with DeepSpeed's
swap buffers in `swap_buffers.py`) and their correction by measured engines (`calibrate.py`); the
DeepSpeed config a plan implies (`implied.py`); per-layer NVMe placement inside ZeRO-3's optimizer
(`zero_placement.py`, `resident_gradients.py`); the bounded host heap (`host_memory.py`); the engine
setup that profiles, solves and applies a plan (`engine_setup.py`); and the monitor that re-plans
during training (`monitor.py`)."""
