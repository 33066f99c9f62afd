"""Saved-activation quantization against the unquantized 16-bit baseline: bytes, peak memory, step time.

One training step (forward, backward, AdamW step) of a bf16 model from a preset, at a sequence length
where saved activations dominate memory, in one process: the baseline (no lazyzero hooks) and the
default activation policy of `"lazyzero": {"activations": {"enabled": true}}` (attention's q, k, v and
output kept, its input and the norms at 8 bits, MLPs at 4, cheap elementwise recomputation on). Keys:

- `saved_bytes_ratio`: bytes the quantized step stores for backward over the bytes autograd saves in
  the baseline (counted by the packer with every module at 16 bits: the same tensors, unpacked);
- `peak_mem_ratio`: peak memory of a training step, quantized over baseline (GPU max allocated on
  CUDA; on the CPU the C heap's live bytes sampled after every operation, `lazyzero/plan/profile/measure.py`, less
  what the process held before building the model); model, gradients and optimizer state are
  included in both;
- `step_time_ratio`: median step time, quantized over baseline, timed interleaved.
Targets (docs/activations.md): at most 0.30, 0.50 and 1.15. Details: bytes per module kind, the share of the
baseline that the 16-bit attention keeps under the default policy (a floor for `saved_bytes_ratio`),
and the same ratios for an `attention_bits: 8` policy and for `attention_input_bits: 16` (the
attention's input kept exact too).

    python benchmarks/bench_activations.py --quick --out benchmarks/results/bench_activations.json
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `common` sits beside this script
from common import median_seconds, pin_threads, write_results  # noqa: E402

from lazyzero.activations import ActivationPacker, ActivationPolicy  # noqa: E402
from lazyzero.config.models import ActivationsConfig  # noqa: E402
from lazyzero.models.build import build_model  # noqa: E402
from lazyzero.plan.profile.measure import heap_live_bytes, peak_bytes  # noqa: E402

POLICIES = {"default": ActivationsConfig(enabled=True),
            "attention_8bit": ActivationsConfig(enabled=True, attention_bits=8),
            "attention_input_exact": ActivationsConfig(enabled=True, attention_input_bits=16)}
UNQUANTIZED = ActivationsConfig(enabled=True, default_bits=16, attention_bits=16)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer timing repeats; same sizes")
    parser.add_argument("--out", type=Path, help="write the results as JSON to this file")
    parser.add_argument("--preset", default="demo", help="model preset (lazyzero.models.presets)")
    parser.add_argument("--seq", type=int, default=512, help="sequence length")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="CPU threads")
    return parser.parse_args()


class Trainee:
    """A bf16 model, its AdamW and one fixed batch; `step(config)` trains one step under a policy."""

    def __init__(self, preset: str, seq: int, batch: int, device: torch.device):
        self.model = build_model(preset, dtype=torch.bfloat16, max_positions=seq).to(device).train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        vocab = self.model.config.vocab_size
        generator = torch.Generator().manual_seed(0)
        self.input_ids = torch.randint(0, vocab, (batch, seq), generator=generator).to(device)

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


def bytes_by_kind(accounting) -> dict:
    return {str(kind): {"saved": cell.before, "stored": cell.after} for kind, cell in accounting.by_kind().items()}


def main() -> None:
    args = parse_args()
    pin_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    floor = heap_live_bytes() if device.type == "cpu" else 0
    trainee = Trainee(args.preset, args.seq, args.batch, device)
    trainee.step(None)  # optimizer state allocated before anything is measured
    baseline = trainee.step(UNQUANTIZED)
    baseline_bytes = baseline.total().before
    attention_floor = baseline.by_kind().get("attention").before / baseline_bytes

    results, details = {}, {"preset": args.preset, "seq": args.seq, "batch": args.batch, "dtype": "bfloat16",
                            "device": device.type, "baseline_saved_bytes": baseline_bytes,
                            "baseline_bytes_by_kind": bytes_by_kind(baseline),
                            "attention_share_of_baseline": attention_floor}
    peak_baseline = peak_bytes(lambda: trainee.step(None), device, floor)
    details["baseline_peak_bytes"] = peak_baseline
    repeats = 3 if args.quick else 7
    times = median_seconds({name: (lambda config=config: trainee.step(config))
                            for name, config in {"baseline": None, **POLICIES}.items()}, repeats)
    details["median_step_s"] = times
    for name, config in POLICIES.items():
        accounting = trainee.step(config)
        prefix = "" if name == "default" else f"{name}_"
        results[f"{prefix}saved_bytes_ratio"] = accounting.total().after / baseline_bytes
        results[f"{prefix}peak_mem_ratio"] = (peak_bytes(lambda config=config: trainee.step(config), device, floor)
                                              / peak_baseline)
        results[f"{prefix}step_time_ratio"] = times[name] / times["baseline"]
        details[f"{name}_bytes_by_kind"] = bytes_by_kind(accounting)
        if name == "default":
            details["attention_stored_share_of_baseline"] = accounting.by_kind()["attention"].after / baseline_bytes
    write_results(args.out, "bench_activations", args.quick, results, details)


if __name__ == "__main__":
    main()
