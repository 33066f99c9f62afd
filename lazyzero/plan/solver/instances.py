"""A planning instance shared by the slow solver test and `benchmarks/bench_planner.py` (docs/plan.md's
`solve_s_80_layers`): an 80-layer model on one GPU with host memory and NVMe."""

from __future__ import annotations

from lazyzero.plan.solver.problem import LayerCosts, Machine, Path, PlanProblem, Tier

GB = 10**9


def llama_like_80_layers(offload_all_or_none: bool = False) -> PlanProblem:
    """About 6.7e9 parameters in 80 layers (hidden 2560, sequence 4096, micro-batch 1), made-up but
    plausible speeds: 300 TFLOP/s, 25 GB/s PCIe, 3 / 5 GB/s NVMe write / read, CPU Adam 1e9 params/s.
    `offload_all_or_none`: with DeepSpeed's rule that a kind of tensor is offloaded in every layer or
    in none (`PlanProblem.offload_all_or_none`)."""
    params = 6.7e9 / 80
    act16 = 34 * 4096 * 2560  # saved bytes per layer (Korthikanti et al. 2022, flash attention)
    scales = act16 // 64  # one 2-byte scale per block of 64 values (128 bytes at 16 bits)
    layer = dict(fwd_s=2.3e-3, bwd_s=4.6e-3, act_bytes={16: act16, 8: act16 // 2 + scales, 4: act16 // 4 + scales},
                 input_bytes=2 * 4096 * 2560, param_bytes=int(2 * params), grad_bytes=int(2 * params),
                 optim_state_bytes_fp32=int(12 * params), optim_state_bytes_8bit=int(6 * params),
                 quality_cost={16: 0.0, 8: 1e-4, 4: 1e-3})
    layers = [LayerCosts(f"layer{i}", **layer) for i in range(80)]
    tiers = {"gpu": Tier("gpu", 24 * GB), "cpu": Tier("cpu", 64 * GB), "nvme": Tier("nvme", 2000 * GB)}
    paths = {"d2h": Path("d2h", 25e9), "h2d": Path("h2d", 25e9), "nvme_write": Path("nvme_write", 3e9),
             "nvme_read": Path("nvme_read", 5e9)}
    return PlanProblem(layers, Machine(tiers, paths, 1 / 12e9, 1 / 1e12), workspace_bytes=2 * GB,
                       checkpoint_bytes_per_step=GB, offload_all_or_none=offload_all_or_none)
