"""Saved-activation quantization against the unquantized 16-bit baseline: bytes, peak memory, step time.

One training step (forward, backward, AdamW step) of a bf16 model from a preset, at a sequence length
where saved activations dominate memory, in one process: the baseline (no lazyzero hooks) and the
default activation policy of `"lazyzero": {"activations": {"enabled": true}}` (attention's q and k at 8 bits
in centred blocks along tokens, its value and output at 8 bits, its logsumexp exact, the rest at 8 bits
with each block's largest value exact, cheap elementwise recomputation and the fused loss head on). Keys:

- `saved_bytes_ratio`: bytes the quantized step stores for backward over the bytes autograd saves in
  the baseline (counted by the packer with every module at 16 bits: the same tensors, unpacked);
- `peak_mem_ratio`: peak memory of a training step, quantized over baseline (GPU max allocated on
  CUDA; on the CPU the C heap's live bytes sampled after every operation, `lazyzero/plan/profile/measure.py`, less
  what the process held before building the model); model, gradients and optimizer state are
  included in both;
- `step_time_ratio`: median step time, quantized over baseline, timed interleaved;
- `grad_rel_l2`, `min_cosine` (and `mlp_4bit_...`): the preset's gradient fidelity under the default
  policy (and `default_bits: 4`), measured as `real_grad_rel_l2` below (fp32, `--real-batch` x
  `--real-seq` tokens of Python source): the 4-bit MLPs that meet the bytes target must meet the
  same quality bound (at most 0.03, at least 0.99) to be a default.
Targets (docs/activations.md): at most 0.30, 0.50 and 1.15. Details: bytes per module kind, the share of the
baseline that the 16-bit attention keeps under the default policy (a floor for `saved_bytes_ratio`),
and the same ratios for the 4-bit policy of earlier releases (`default_bits: 4`), `attention_bits: 16` (q and
k exact, the default before they were stored by channel) and `attention_input_bits: 16` (the attention's
input kept exact too).

With `--model NAME` (a real pretrained model, e.g. smollm2-135m), the same default policy on it, on text
that is not arithmetic (Python source from the standard library), `--real-batch` x `--real-seq` tokens:
- `real_grad_rel_l2`, `real_min_cosine`: one forward and backward in fp32, gradients against the same
  step without hooks: the relative L2 error of all gradients together, and the lowest cosine of one
  parameter's gradient (targets: at most 0.03, at least 0.99);
- `real_saved_bytes_ratio`, `real_peak_mem_ratio`, `real_step_time_ratio`: as above, in bf16
  (targets 0.30, -, 1.15).

    python benchmarks/bench_activations.py --quick --model smollm2-135m --out benchmarks/results/bench_activations.json
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `common` sits beside this script
from common import median_seconds, pin_threads, write_results  # noqa: E402

from lazyzero.activations import ActivationPacker, ActivationPolicy  # noqa: E402
from lazyzero.activations.config import ActivationsConfig  # noqa: E402
from lazyzero.app.data import load_tokenizer  # noqa: E402
from lazyzero.models.build import build_model  # noqa: E402
from lazyzero.plan.profile.measure import heap_live_bytes, peak_bytes  # noqa: E402

POLICIES = {"default": ActivationsConfig(enabled=True),
            "mlp_4bit": ActivationsConfig(enabled=True, default_bits=4),
            "attention_exact": ActivationsConfig(enabled=True, attention_bits=16),
            "attention_input_exact": ActivationsConfig(enabled=True, attention_input_bits=16)}
# The tensors autograd saves without lazyzero, counted by the packer (nothing quantized or fused).
UNQUANTIZED = ActivationsConfig(enabled=True, default_bits=16, attention_bits=16, fused_loss=False)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer timing repeats; same sizes")
    parser.add_argument("--out", type=Path, help="write the results as JSON to this file")
    parser.add_argument("--preset", default="demo", help="model preset (lazyzero.models.presets)")
    parser.add_argument("--seq", type=int, default=512, help="sequence length")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="CPU threads")
    parser.add_argument("--model", help="also measure this real pretrained model (e.g. smollm2-135m): real_* keys")
    parser.add_argument("--real-seq", type=int, default=256, help="sequence length for the real model")
    parser.add_argument("--real-batch", type=int, default=4, help="sequences per step for the real model")
    return parser.parse_args()


class Trainee:
    """A model, its AdamW and one fixed batch; `step(config)` trains one step under a policy."""

    def __init__(self, model, input_ids: torch.Tensor):
        self.model = model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.input_ids = input_ids

    @classmethod
    def from_preset(cls, preset: str, seq: int, batch: int, device: torch.device) -> Trainee:
        model = build_model(preset, dtype=torch.bfloat16, max_positions=seq).to(device)
        generator = torch.Generator().manual_seed(0)
        return cls(model, torch.randint(0, model.config.vocab_size, (batch, seq), generator=generator).to(device))

    def step(self, config: ActivationsConfig | None):
        """One training step (the packer of `config` hooked in for it); returns the packer's
        accounting of it, None for the baseline."""
        packer = None if config is None else ActivationPacker(self.model, ActivationPolicy(config))
        try:
            with packer if packer is not None else contextlib.nullcontext():
                loss = self.model(input_ids=self.input_ids, labels=self.input_ids).loss
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        finally:
            if packer is not None:
                packer.remove()
        return packer.accounting if packer is not None else None


    def gradients(self, config: ActivationsConfig | None) -> dict[str, torch.Tensor]:
        """The parameters' gradients of one forward and backward (no optimizer step)."""
        self.model.zero_grad(set_to_none=True)
        packer = None if config is None else ActivationPacker(self.model, ActivationPolicy(config))
        try:
            with packer if packer is not None else contextlib.nullcontext():
                loss = self.model(input_ids=self.input_ids, labels=self.input_ids).loss
            loss.backward()
        finally:
            if packer is not None:
                packer.remove()
        grads = {name: param.grad.detach().clone() for name, param in self.model.named_parameters()
                 if param.grad is not None}
        self.model.zero_grad(set_to_none=True)
        return grads


def bytes_by_kind(accounting) -> dict:
    return {str(kind): {"saved": cell.before, "stored": cell.after} for kind, cell in accounting.by_kind().items()}


def gradient_fidelity(exact: dict, approximate: dict) -> dict:
    """Relative L2 error of all gradients together, and the lowest per-parameter cosine (with its name)."""
    error = sum(float((approximate[name] - grad).double().pow(2).sum()) for name, grad in exact.items())
    norm = sum(float(grad.double().pow(2).sum()) for grad in exact.values())
    cosines = {name: float(torch.nn.functional.cosine_similarity(approximate[name].double().flatten(),
                                                                 grad.double().flatten(), dim=0))
               for name, grad in exact.items()}
    worst = min(cosines, key=cosines.get)
    return {"grad_rel_l2": (error / norm) ** 0.5, "min_cosine": cosines[worst], "min_cosine_parameter": worst}


def real_text_batch(tokenizer, batch: int, seq: int) -> torch.Tensor:
    """`batch` x `seq` tokens of Python source from the standard library: real text, not arithmetic."""
    import json
    import logging
    import os

    text = "".join(inspect.getsource(module) for module in (json, os, logging, contextlib, argparse))
    ids = tokenizer.encode(text, add_bos=False)
    if len(ids) < batch * seq:
        raise ValueError(f"{len(ids)} tokens of source text, fewer than {batch} x {seq}")
    return torch.tensor(ids[: batch * seq]).view(batch, seq)


def text_fidelity(model, input_ids: torch.Tensor) -> tuple[dict, dict]:
    """Gradient fidelity (`gradient_fidelity`) of the default and of the `default_bits: 4` policy on
    `model` and `input_ids`, against the same forward and backward without hooks."""
    trainee = Trainee(model, input_ids)
    exact = trainee.gradients(None)
    return (gradient_fidelity(exact, trainee.gradients(POLICIES["default"])),
            gradient_fidelity(exact, trainee.gradients(POLICIES["mlp_4bit"])))


def measure_demo_fidelity(preset: str, batch: int, seq: int, device: torch.device) -> tuple[dict, dict]:
    """`grad_rel_l2`, `min_cosine` and their `mlp_4bit_` twins on the preset itself, as the real model's
    are measured (fp32, Python source): whether the 4-bit MLPs that meet the preset's bytes target also
    meet the quality bound (docs/activations.md)."""
    tokenizer = load_tokenizer(None, model=preset)
    torch.manual_seed(0)  # the preset's random initialization
    model = build_model(preset, vocab_size=tokenizer.vocab_size).to(device)
    default, four_bit = text_fidelity(model, real_text_batch(tokenizer, batch, seq).to(device))
    results = {"grad_rel_l2": default["grad_rel_l2"], "min_cosine": default["min_cosine"],
               "mlp_4bit_grad_rel_l2": four_bit["grad_rel_l2"], "mlp_4bit_min_cosine": four_bit["min_cosine"]}
    details = {"fidelity_batch": batch, "fidelity_seq": seq, "min_cosine_parameter": default["min_cosine_parameter"],
               "mlp_4bit_min_cosine_parameter": four_bit["min_cosine_parameter"]}
    return results, details


def measure_real_model(spec: str, batch: int, seq: int, repeats: int, device: torch.device) -> tuple[dict, dict]:
    """The real_* keys (see the module docstring) and their details."""
    tokenizer = load_tokenizer(None, model=spec)
    floor = heap_live_bytes() if device.type == "cpu" else 0
    model = build_model(spec, vocab_size=tokenizer.vocab_size).to(device)
    input_ids = real_text_batch(tokenizer, batch, seq).to(device)
    fidelity, fidelity_4bit = text_fidelity(model, input_ids)
    trainee = Trainee(model.to(torch.bfloat16), input_ids)
    results = {"real_grad_rel_l2": fidelity["grad_rel_l2"], "real_min_cosine": fidelity["min_cosine"]}
    details = {"real_model": spec, "real_batch": batch, "real_seq": seq,
               "real_min_cosine_parameter": fidelity["min_cosine_parameter"],
               "real_mlp_4bit_fidelity": fidelity_4bit}
    results.update(_bytes_memory_time(trainee, {"default": POLICIES["default"]}, repeats, device, floor, "real_",
                                      details))
    return results, details


def _bytes_memory_time(trainee: Trainee, policies: dict, repeats: int, device, floor: int, prefix: str,
                       details: dict) -> dict:
    """saved_bytes_ratio, peak_mem_ratio and step_time_ratio of each policy against the baseline; `floor`:
    what the process held before the model was built (so model, gradients and AdamW state count in both)."""
    trainee.step(None)  # optimizer state allocated before anything is measured
    baseline = trainee.step(UNQUANTIZED)
    baseline_bytes = baseline.total().before
    peak_baseline = peak_bytes(lambda: trainee.step(None), device, floor)
    times = median_seconds({name: (lambda config=config: trainee.step(config))
                            for name, config in {"baseline": None, **policies}.items()}, repeats)
    details.update({f"{prefix}baseline_saved_bytes": baseline_bytes, f"{prefix}baseline_peak_bytes": peak_baseline,
                    f"{prefix}baseline_bytes_by_kind": bytes_by_kind(baseline), f"{prefix}median_step_s": times})
    results = {}
    for name, config in policies.items():
        accounting = trainee.step(config)
        key = prefix if name == "default" else f"{prefix}{name}_"
        results[f"{key}saved_bytes_ratio"] = accounting.total().after / baseline_bytes
        results[f"{key}peak_mem_ratio"] = (peak_bytes(lambda config=config: trainee.step(config), device, floor)
                                           / peak_baseline)
        results[f"{key}step_time_ratio"] = times[name] / times["baseline"]
        details[f"{prefix}{name}_bytes_by_kind"] = bytes_by_kind(accounting)
        print(f"{prefix}{name}: " + ", ".join(f"{k} {v:.3f}" for k, v in results.items() if k.startswith(key)),
              flush=True)
    return results


def main() -> None:
    args = parse_args()
    pin_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    repeats = 3 if args.quick else 7
    floor = heap_live_bytes() if device.type == "cpu" else 0
    trainee = Trainee.from_preset(args.preset, args.seq, args.batch, device)
    details = {"preset": args.preset, "seq": args.seq, "batch": args.batch, "dtype": "bfloat16", "device": device.type}
    results = _bytes_memory_time(trainee, POLICIES, repeats, device, floor, "", details)
    baseline_bytes = details["baseline_saved_bytes"]
    details["attention_share_of_baseline"] = details["baseline_bytes_by_kind"]["attention"]["saved"] / baseline_bytes
    details["attention_stored_share_of_baseline"] = (details["default_bytes_by_kind"]["attention"]["stored"]
                                                     / baseline_bytes)
    del trainee
    fidelity, fidelity_details = measure_demo_fidelity(args.preset, args.real_batch, args.real_seq, device)
    results.update(fidelity)
    details.update(fidelity_details)
    if args.model:
        real_results, real_details = measure_real_model(args.model, args.real_batch, args.real_seq, repeats, device)
        results.update(real_results)
        details.update(real_details)
    write_results(args.out, "bench_activations", args.quick, results, details)


if __name__ == "__main__":
    main()
