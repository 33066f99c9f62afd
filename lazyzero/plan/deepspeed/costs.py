"""Analytic costs of a model preset, for `lazyzero plan` before any profile exists (docs/plan.md).

Every number here is a formula over the preset's dimensions (`lazyzero.models.presets`) for the
llama family trained in bf16 with HF's SDPA attention; each formula says where it comes from. The
result is a `PlanProblem` whose layers are the decoder layers `model.layers.0..L-1` plus one extra
layer, `EMBED_AND_HEAD`, described in `embed_and_head_costs`.
"""

from __future__ import annotations

import fnmatch
import os
import re
import shutil

from lazyzero.activations.config import ActivationsConfig
from lazyzero.models.presets import PRESETS, ModelPreset
from lazyzero.optimizer.config import OptimizerConfig
from lazyzero.plan.solver.problem import BIT_WIDTHS, LayerCosts, Machine, Path, PlanProblem, Tier

GB = 10**9
BF16_BYTES = 2
FP32_BYTES = 4
# Adam's moments per parameter in fp32, and in lazyzero's AdamW8bit (lazyzero/optimizer/adam8bit_optimizer.py): one
# byte per moment and one fp32 scale per block of each moment, 2 + 8/256 = 2.03 B at block 256. Mixed
# precision adds the fp32 master weights (4 B) to either.
_OPTIMIZER_DEFAULTS = OptimizerConfig()
FP32_MOMENT_BYTES_PER_PARAM = 2 * FP32_BYTES
EIGHT_BIT_MOMENT_BYTES_PER_PARAM = 2 + 2 * FP32_BYTES / _OPTIMIZER_DEFAULTS.block_size
# Quantized activations carry one fp32 scale per block (lazyzero/activations, default block 64).
ACTIVATION_SCALE_BYTES_PER_VALUE = FP32_BYTES / ActivationsConfig().block_size
# The loss is computed on fp32 logits; the caching allocator's fragmentation and cuBLAS/NCCL
# workspaces get a flat allowance (a modelling choice, about what a 7B run leaves unaccounted).
ALLOCATOR_SLACK_BYTES = 2 * GB
# Conservative optimizer speeds in bytes of state per second: a CPU Adam streams its state through
# memory at ~10 GB/s on a typical server socket; a GPU step is bound by HBM bandwidth (~2 TB/s).
CPU_ADAM_STATE_BYTES_PER_S = 10 * GB
GPU_ADAM_STATE_BYTES_PER_S = 2000 * GB
# Quality penalties in seconds-equivalent, relative to the layer's forward time. A modelling choice,
# not a measurement: small enough that reduced widths are taken whenever they save time or make a
# plan fit, large enough that 16 bits wins a tie, and 4 bits costs more than 8. A preset has no
# measured gradient errors, so this fixed fallback serves every layer alike and no width is ever
# excluded by `plan.max_grad_error`; a planned run, or `lazyzero plan --profile`, uses the errors its
# profile measured on the model itself instead (problem_from_profile.QUALITY_COST_PER_ERROR).
QUALITY_COST_PER_FWD_S = {16: 0.0, 8: 1e-4, 4: 2e-3}

EMBED_AND_HEAD = "embed_and_head"
_DECODER_LAYER = re.compile(r"^model\.layers\.(\d+)$")


def decoder_layer_name(index: int) -> str:
    """The HF module name of decoder layer `index`, which is also its `LayerCosts.name`."""
    return f"model.layers.{index}"


def decoder_layer_index(name: str) -> int | None:
    """Inverse of `decoder_layer_name`; None for `EMBED_AND_HEAD` and any other name."""
    match = _DECODER_LAYER.match(name)
    return int(match.group(1)) if match else None


def decoder_layer_tensors(preset: ModelPreset) -> dict[str, int]:
    """Element count of each parameter of one llama decoder layer (no biases), by name in the layer.
    k and v are narrower under grouped-query attention: kv_heads heads of hidden / heads each."""
    h, i = preset.hidden, preset.intermediate
    kv_width = h * preset.kv_heads // preset.heads
    return {
        "self_attn.q_proj.weight": h * h, "self_attn.k_proj.weight": h * kv_width,
        "self_attn.v_proj.weight": h * kv_width, "self_attn.o_proj.weight": h * h,
        "mlp.gate_proj.weight": h * i, "mlp.up_proj.weight": h * i, "mlp.down_proj.weight": i * h,
        "input_layernorm.weight": h, "post_attention_layernorm.weight": h,
    }


def embed_and_head_tensors(preset: ModelPreset) -> dict[str, int]:
    """Parameters outside the decoder layers (untied embeddings, as the llama presets have)."""
    h = preset.hidden
    return {"model.embed_tokens.weight": preset.vocab_size * h, "model.norm.weight": h,
            "lm_head.weight": preset.vocab_size * h}


def optimizer_state_bytes(named_numels: dict[str, int], eight_bit: bool, *, master_bytes: int = FP32_BYTES,
                          world_size: int = 1) -> int:
    """Adam state bytes of these tensors on one of `world_size` ranks (ZeRO-3 partitions, rounded up):
    moments plus `master_bytes` per parameter of fp32 master weights (0 when the model itself is fp32).
    With 8-bit states, the tensors that AdamW8bit's policy (lazyzero/optimizer/state_policy.py, default
    OptimizerConfig) keeps in fp32 still count fp32 moments: names matching `fp32_patterns`
    (embeddings, norms) and whole tensors under `min_8bit_size`."""
    total = 0.0
    for name, numel in named_numels.items():
        fp32 = (not eight_bit or numel < _OPTIMIZER_DEFAULTS.min_8bit_size
                or any(fnmatch.fnmatch(name, p) for p in _OPTIMIZER_DEFAULTS.fp32_patterns))
        moments = FP32_MOMENT_BYTES_PER_PARAM if fp32 else EIGHT_BIT_MOMENT_BYTES_PER_PARAM
        total += -(-numel // world_size) * (moments + master_bytes)
    return round(total)


def activation_bytes_per_token(preset: ModelPreset, bits: int) -> float:
    """Bytes one decoder layer saves for backward per token (bf16 model, HF Llama with SDPA, as
    lazyzero's activation packer measures them).

    16 bits: each of the 2 RMSNorms keeps an fp32 copy of its input and the normalized bf16 input
    (6h); attention keeps its input, q, k, v and output (2h each, k and v narrower under GQA); the
    MLP keeps its input and gate, act(gate), up and their product (2h + 4 * 2i).
    8 or 4 bits (lazyzero's default policy, recompute_elementwise on): attention keeps q and k at 16
    bits and v and its output at max(bits, 8) (attention_value_bits), its input is rebuilt from the
    norm's; each norm keeps only its input, at max(bits, 8) bits (norm_bits); the MLP keeps only gate
    and up at `bits` (its input, act(gate) and the product are rebuilt in backward). Quantized values
    carry one fp32 scale per block.
    """
    h, i = preset.hidden, preset.intermediate
    kv_share = preset.kv_heads / preset.heads
    if bits == 16:
        attention = BF16_BYTES * (2 * h + 2 * h * kv_share)  # q, output; k, v
        norms = 2 * (FP32_BYTES + BF16_BYTES) * h
        mlp = BF16_BYTES * h + 4 * BF16_BYTES * i
        return norms + attention + BF16_BYTES * h + mlp  # and the attention's input
    at_least_8 = max(bits, 8) / 8 + ACTIVATION_SCALE_BYTES_PER_VALUE
    attention = BF16_BYTES * (h + h * kv_share) + (h + h * kv_share) * at_least_8  # q, k; output, v
    norms = 2 * h * at_least_8
    mlp = 2 * i * (bits / 8 + ACTIVATION_SCALE_BYTES_PER_VALUE)
    return norms + attention + mlp


def decoder_layer_costs(preset: ModelPreset, index: int, *, seq: int, micro_batch: int,
                        gpu_tflops: float) -> LayerCosts:
    tensors = {f"{decoder_layer_name(index)}.{name}": n for name, n in decoder_layer_tensors(preset).items()}
    params = sum(tensors.values())
    tokens = seq * micro_batch
    # Every weight is used in one multiply-add per token (2 FLOPs); attention adds QK^T and PV,
    # 2 * b * s^2 * h FLOPs each, halved because a causal mask skips the upper triangle.
    fwd_flops = 2 * tokens * params + 4 * micro_batch * seq**2 * preset.hidden / 2
    fwd_s = fwd_flops / (gpu_tflops * 1e12)
    per_token = {bits: activation_bytes_per_token(preset, bits) for bits in BIT_WIDTHS}
    return LayerCosts(
        name=decoder_layer_name(index), fwd_s=fwd_s,
        # Backward computes gradients of both the inputs and the weights: twice the forward's FLOPs.
        bwd_s=2 * fwd_s,
        act_bytes={bits: round(tokens * per_token[bits]) for bits in BIT_WIDTHS},
        # A recomputed layer keeps only its bf16 input (the residual stream).
        input_bytes=tokens * BF16_BYTES * preset.hidden,
        param_bytes=BF16_BYTES * params, grad_bytes=BF16_BYTES * params,
        optim_state_bytes_fp32=optimizer_state_bytes(tensors, eight_bit=False),
        optim_state_bytes_8bit=optimizer_state_bytes(tensors, eight_bit=True),
        quality_cost={bits: QUALITY_COST_PER_FWD_S[bits] * fwd_s for bits in BIT_WIDTHS})


def embed_and_head_costs(preset: ModelPreset, *, seq: int, micro_batch: int, gpu_tflops: float) -> LayerCosts:
    """Embedding, final norm and lm_head as one extra layer after the decoder layers, so that the
    planner places their parameters and states like any other layer's.

    Simplifications: the embedding's parameters are counted as used where lm_head is (at the end of
    the forward, start of the backward) rather than first in the forward; the same bytes move, at
    other windows. The layer saves nothing for backward (the logits are in the workspace), and its
    time is lm_head's matmul (the embedding lookup moves bytes, it computes nothing).
    """
    tensors = embed_and_head_tensors(preset)
    params = sum(tensors.values())
    fwd_s = 2 * seq * micro_batch * preset.hidden * preset.vocab_size / (gpu_tflops * 1e12)
    return LayerCosts(
        name=EMBED_AND_HEAD, fwd_s=fwd_s, bwd_s=2 * fwd_s,
        act_bytes={bits: 0 for bits in BIT_WIDTHS}, input_bytes=0,
        param_bytes=BF16_BYTES * params, grad_bytes=BF16_BYTES * params,
        optim_state_bytes_fp32=optimizer_state_bytes(tensors, eight_bit=False),
        optim_state_bytes_8bit=optimizer_state_bytes(tensors, eight_bit=True),
        quality_cost={bits: QUALITY_COST_PER_FWD_S[bits] * fwd_s for bits in BIT_WIDTHS})


def workspace_bytes(preset: ModelPreset, *, seq: int, micro_batch: int) -> int:
    """fp32 logits of one micro-batch (for the loss) plus the allocator's slack."""
    return micro_batch * seq * preset.vocab_size * FP32_BYTES + ALLOCATOR_SLACK_BYTES


def host_memory_bytes() -> int:
    """The machine's total RAM."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def machine_from_budgets(*, gpu_mem: int, cpu_mem: int | None, nvme_path: str | None, h2d_gbps: float,
                         d2h_gbps: float, nvme_read_gbps: float | None, nvme_write_gbps: float | None) -> Machine:
    """Tiers gpu, cpu and (with `nvme_path`) nvme, sized by the budgets; link speeds in GB/s."""
    tiers = {"gpu": Tier("gpu", gpu_mem), "cpu": Tier("cpu", host_memory_bytes() if cpu_mem is None else cpu_mem)}
    paths = {"h2d": Path("h2d", h2d_gbps * GB), "d2h": Path("d2h", d2h_gbps * GB)}
    if nvme_path is not None:
        if nvme_read_gbps is None or nvme_write_gbps is None:
            raise ValueError("nvme_read_gbps and nvme_write_gbps are needed with nvme_path")
        tiers["nvme"] = Tier("nvme", shutil.disk_usage(nvme_path).free)
        paths["nvme_read"] = Path("nvme_read", nvme_read_gbps * GB)
        paths["nvme_write"] = Path("nvme_write", nvme_write_gbps * GB)
    return Machine(tiers, paths, cpu_adam_s_per_byte=1 / CPU_ADAM_STATE_BYTES_PER_S,
                   gpu_adam_s_per_byte=1 / GPU_ADAM_STATE_BYTES_PER_S)


def problem_from_preset(preset: str, *, gpu_mem: int, cpu_mem: int | None, nvme_path: str | None, seq: int,
                        micro_batch: int, gpu_tflops: float, h2d_gbps: float, d2h_gbps: float,
                        nvme_read_gbps: float | None, nvme_write_gbps: float | None,
                        allowed_bits: tuple[int, ...] = (16, 8, 4)) -> PlanProblem:
    """The planning problem of training preset `preset` (a key of PRESETS) on one GPU with these
    budgets (bytes) and speeds (TFLOP/s, GB/s). `cpu_mem` None: the machine's RAM; `nvme_path`
    None: no NVMe tier, else its free space is the budget."""
    if preset not in PRESETS:
        raise ValueError(f"preset: got {preset!r}; allowed: {', '.join(PRESETS)}")
    if seq < 1 or micro_batch < 1 or gpu_tflops <= 0:
        raise ValueError(f"seq and micro_batch must be >= 1 and gpu_tflops > 0, got {seq}, {micro_batch}, {gpu_tflops}")
    dims = PRESETS[preset]
    shape = dict(seq=seq, micro_batch=micro_batch)
    layers = [decoder_layer_costs(dims, i, gpu_tflops=gpu_tflops, **shape) for i in range(dims.layers)]
    layers.append(embed_and_head_costs(dims, gpu_tflops=gpu_tflops, **shape))
    machine = machine_from_budgets(gpu_mem=gpu_mem, cpu_mem=cpu_mem, nvme_path=nvme_path, h2d_gbps=h2d_gbps,
                                   d2h_gbps=d2h_gbps, nvme_read_gbps=nvme_read_gbps, nvme_write_gbps=nvme_write_gbps)
    return PlanProblem(layers, machine, workspace_bytes(dims, **shape), allowed_bits=allowed_bits,
                       offload_all_or_none=True)
