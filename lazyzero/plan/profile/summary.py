"""What `lazyzero profile` prints: the measured layers (one row per measurement, with the layers
that share it), each layer's gradient error per width, the machine's speeds and what could not be
measured."""

from __future__ import annotations

import io

from lazyzero.plan.profile.data import DECODER, LayerProfile, ModelProfile
from lazyzero.plan.solver.problem import BIT_WIDTHS, REDUCED_WIDTHS

TABLE_WIDTH = 120
MB = 1e6
GB = 1e9


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1e3 * seconds:.2f}"


def _layer_groups(profile: ModelProfile) -> list[tuple[str, LayerProfile]]:
    """(label, row) per measurement: "model.layers.0-5" for the decoder layers measured as one."""
    groups: dict[str, list[LayerProfile]] = {}
    for layer in profile.layers:
        groups.setdefault(layer.measured_as, []).append(layer)
    labels = []
    for rows in groups.values():
        label = rows[0].name if len(rows) == 1 else f"{rows[0].name}-{rows[-1].name.rsplit('.', 1)[-1]}"
        labels.append((label, rows[0]))
    return labels


def _layers_table(profile: ModelProfile):
    from rich.table import Table

    shape = profile.fingerprint
    table = Table(title=f"per layer: micro-batch {shape.micro_batch} x {shape.seq_len}, {shape.dtype}, "
                        f"{shape.threads} thread(s); packing: time packing adds to fwd + bwd")
    widths = "/".join(str(b) for b in BIT_WIDTHS)
    for column in ("layers", "fwd ms", "bwd ms", "recompute ms", f"saved MB @{widths}", "packing ms @8/4",
                   "input MB", "params M"):
        table.add_column(column, justify="right")
    for label, row in _layer_groups(profile):
        packing = [row.packed_fwd_s[b] + row.packed_bwd_s[b] - row.fwd_s - row.bwd_s for b in (8, 4)]
        table.add_row(label, _ms(row.fwd_s), _ms(row.bwd_s), _ms(row.recompute_s),
                      "/".join(f"{row.act_bytes[b] / MB:.2f}" for b in BIT_WIDTHS), "/".join(_ms(t) for t in packing),
                      f"{row.input_bytes / MB:.2f}", f"{row.param_numel / 1e6:.2f}")
    return table


def _grad_error_table(profile: ModelProfile):
    """Each decoder layer's own measurement (grad_error.py): errors differ between layers of one shape."""
    from rich.table import Table

    table = Table(title="gradient error per layer")
    for column in ("layer", *(f"{bits} bits" for bits in REDUCED_WIDTHS)):
        table.add_column(column, justify="right")
    for row in profile.layers:
        if row.kind == DECODER:
            table.add_row(row.name, *(f"{row.grad_error[bits]:.4f}" for bits in REDUCED_WIDTHS))
    return table


def _machine_table(profile: ModelProfile):
    from rich.table import Table

    machine = profile.machine
    table = Table(title=f"machine: {machine.device_name} ({machine.device_type}, {machine.threads} thread(s))")
    for column in ("measurement", "value", "detail"):
        table.add_column(column)
    for name, band in machine.bandwidths.items():
        table.add_row(name, f"{band.bytes_per_s / GB:.2f} GB/s",
                      f"{band.test_bytes / MB:.0f} MB in {_ms(band.seconds)} ms")
    for name, speed in machine.optimizers.items():
        table.add_row(name, f"{1e9 * speed.s_per_param:.2f} ns/param",
                      f"{speed.state_bytes_per_param:.2f} B state/param, {speed.backend}, {speed.device}")
    for name, speed in machine.collectives.items():
        table.add_row(name, f"{1 / speed.s_per_byte / GB:.2f} GB/s",
                      f"{speed.full_bytes / MB:.2f} MB {speed.dtype}, {speed.world_size} ranks, "
                      f"{_ms(speed.seconds)} ms")
    memory = profile.memory
    table.add_row("process RSS", f"{memory.rss_bytes / GB:.3f} GB",
                  f"model parameters {memory.param_bytes / GB:.3f} GB, buffers {memory.buffer_bytes / MB:.2f} MB")
    return table


def profile_table(profile: ModelProfile) -> str:
    from rich.console import Console

    buffer = io.StringIO()
    console = Console(file=buffer, width=TABLE_WIDTH, force_terminal=False, color_system=None)
    console.print(_layers_table(profile))
    console.print(_grad_error_table(profile))
    console.print("gradient error: relative L2 of a layer's parameter gradients (or, if larger, of its input "
                  "gradient) with its activations stored at that width, against exact")
    console.print(_machine_table(profile))
    shared = profile.shared_saved_bytes
    if shared:
        console.print(f"saved once per forward by the first layer (rotary cos/sin, mask): {shared[16] / MB:.2f} MB")
    for name, reason in profile.machine.skipped.items():
        console.print(f"not measured: {name}: {reason}")
    console.print(f"profiled in {profile.profile_s:.1f} s")
    return buffer.getvalue()
