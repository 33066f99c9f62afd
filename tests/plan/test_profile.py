"""The planner's profiler (docs/plan.md): what it measures for the tiny model, the cache file and
its fingerprint, NVMe speed through DeepSpeed aio, the CLI, and the same profile on every rank."""

import dataclasses
import json
import os
import tempfile
from pathlib import Path

import pytest
import torch

from lazyzero.activations import ActivationPacker, ActivationPolicy
from lazyzero.cli import main
from lazyzero.config import ActivationsConfig
from lazyzero.models import build_model
from lazyzero.plan.deepspeed.costs import EMBED_AND_HEAD
from lazyzero.plan.profile.data import PROFILE_VERSION
from lazyzero.plan.profile.layers import profiling_batch
from lazyzero.plan.profile.machine import aio_settings, aio_unavailable_reason, nvme_bandwidths
from lazyzero.plan.profile.profiler import (
    ProfileFileError,
    ProfileSettings,
    cached_profile,
    combine,
    load_or_profile,
    profile_model,
    read_profile,
    write_profile,
)
from lazyzero.testing import run_distributed

VOCAB = 300
SHAPE = dict(micro_batch=2, seq_len=32)
# Small and few: these tests check what is measured, not how fast (timings are never asserted).
FAST = ProfileSettings(repeats=2, warmup=1, optimizer_elements=1 << 16, host_copy_bytes=1 << 20, nvme_bytes=1 << 20)
WORKER = Path(__file__).resolve().parent / "profile_worker.py"


def tiny_model(dtype=torch.float32):
    return build_model("tiny", seed=1, vocab_size=VOCAB, dtype=dtype)


@pytest.fixture(scope="module")
def tiny():
    model = tiny_model()
    return model, profile_model(model, **SHAPE, settings=FAST, progress=False)


def packer_bytes_by_layer(model, bits: int) -> dict:
    """What the activation packer stores per layer in one forward of the whole model at default_bits."""
    packer = ActivationPacker(model, ActivationPolicy(ActivationsConfig(default_bits=bits)))
    batch = profiling_batch(SHAPE["micro_batch"], SHAPE["seq_len"], VOCAB, torch.device("cpu"), seed=0)
    try:
        with packer:
            loss = model(**batch).loss
        loss.backward()
    finally:
        packer.remove()
    model.zero_grad(set_to_none=True)
    return {layer: cell.after for layer, cell in packer.accounting.by_layer().items()}


def test_tiny_profile_has_every_layer_with_positive_times(tiny):
    model, profile = tiny
    assert [layer.name for layer in profile.layers] == ["model.layers.0", "model.layers.1", EMBED_AND_HEAD]
    for layer in profile.layers:
        times = [layer.fwd_s, layer.bwd_s, *layer.packed_fwd_s.values(), *layer.packed_bwd_s.values()]
        if layer.kind == "decoder":
            times += [layer.recompute_s, layer.checkpointed_fwd_s, layer.checkpointed_bwd_s]
        assert all(t > 0 for t in times), layer.name
    decoder = profile.layer("model.layers.1")
    assert decoder.measured_as == "model.layers.0"
    # The input a recomputed layer keeps: micro-batch x seq x hidden fp32 values.
    assert decoder.input_bytes == decoder.output_bytes == 2 * 32 * 64 * 4
    assert decoder.transient_fwd_bytes > 0 and decoder.transient_bwd_bytes > 0


def test_activation_bytes_are_ordered_and_equal_the_packers_in_a_direct_run(tiny):
    model, profile = tiny
    decoder, head = profile.layer("model.layers.1"), profile.layer(EMBED_AND_HEAD)
    assert decoder.act_bytes[16] > decoder.act_bytes[8] > decoder.act_bytes[4] > 0
    for bits in (16, 8, 4):
        direct = packer_bytes_by_layer(model, bits)
        assert direct[1] == decoder.act_bytes[bits], bits
        # Layer 0 also stores what every layer receives (rotary cos/sin, mask): once per forward.
        assert direct[0] == decoder.act_bytes[bits] + profile.shared_saved_bytes[bits] > direct[1]
        # The head is measured at 16 bits only, the bytes the planner counts for it at every width.
        assert direct[None] <= head.act_bytes[bits] == head.act_bytes[16]
    assert packer_bytes_by_layer(model, 16)[None] == head.act_bytes[16]


def test_parameter_numel_per_tensor_equals_the_models(tiny):
    model, profile = tiny
    found = {name: info.numel for layer in profile.layers for name, info in layer.tensors.items()}
    assert found == {name: p.numel() for name, p in model.named_parameters()}
    assert {info.dtype for layer in profile.layers for info in layer.tensors.values()} == {"float32"}
    assert profile.memory.param_bytes == 4 * sum(found.values())
    assert profile.memory.rss_bytes > profile.memory.param_bytes


def test_machine_speeds_are_measured_or_say_why_not(tiny):
    machine = tiny[1].machine
    assert machine.bandwidths["host_copy"].bytes_per_s > 0
    for name in ("torch_adamw", "deepspeed_cpu_adam", "lazyzero_adamw8bit"):
        if name in machine.optimizers:
            speed = machine.optimizers[name]
            assert speed.s_per_param > 0 and speed.elements == FAST.optimizer_elements
        else:
            assert machine.skipped[f"optimizer {name}"]
    # fp32 moments: 8 bytes per parameter; 8-bit codes plus one fp32 scale per 256-element block each.
    assert machine.optimizers["torch_adamw"].state_bytes_per_param == 8
    assert machine.optimizers["lazyzero_adamw8bit"].state_bytes_per_param == pytest.approx(2 + 8 / 256)
    assert machine.collectives == {} and machine.skipped["collectives"] == "world size 1"


def test_profile_json_round_trip(tiny, tmp_path):
    profile = tiny[1]
    write_profile(tmp_path / "p.json", profile)
    again = read_profile(tmp_path / "p.json")
    assert again == profile
    assert [p.name for p in tmp_path.iterdir()] == ["p.json"]  # the temporary file was renamed
    # The gradient errors come back keyed by width (JSON keys are strings), every layer its own.
    for layer in again.layers:
        assert list(layer.grad_error) == [16, 8, 4] and layer.grad_error[16] == 0.0
    decoder = [layer.grad_error for layer in again.layers if layer.kind == "decoder"]
    assert all(0 < errors[8] < errors[4] for errors in decoder) and decoder[0] != decoder[1]


def test_a_profile_of_an_older_version_is_refused_by_name(tiny, tmp_path):
    data = json.loads(tiny[1].to_json())
    data["version"] = PROFILE_VERSION - 1
    for layer in data["layers"]:
        del layer["grad_error"]  # what an older profile lacks
    (tmp_path / "old.json").write_text(json.dumps(data))
    with pytest.raises(ProfileFileError, match=f"profile version {PROFILE_VERSION - 1}, this lazyzero reads "
                                               f"version {PROFILE_VERSION}"):
        read_profile(tmp_path / "old.json")


def test_combine_keeps_the_slowest_rank(tiny):
    profile = tiny[1]
    layer = profile.layers[0]
    slower = dataclasses.replace(profile,
                                 layers=(dataclasses.replace(layer, fwd_s=layer.fwd_s * 2),) + profile.layers[1:])
    copy = profile.machine.bandwidths["host_copy"]
    narrower = dataclasses.replace(profile, machine=dataclasses.replace(
        profile.machine, bandwidths={"host_copy": dataclasses.replace(copy, bytes_per_s=copy.bytes_per_s / 2)}))
    combined = combine([narrower, slower])
    assert combined.layers[0].fwd_s == 2 * layer.fwd_s
    assert combined.machine.bandwidths["host_copy"].bytes_per_s == copy.bytes_per_s / 2


def test_cache_is_reused_when_the_fingerprint_matches_and_redone_when_a_field_changes(tiny, tmp_path):
    model, profile = tiny
    path, messages = tmp_path / "profile.json", []
    write_profile(path, profile)
    assert load_or_profile(path, model, **SHAPE, settings=FAST, progress=False, log=messages.append) == profile
    assert messages == []
    longer = load_or_profile(path, model, micro_batch=2, seq_len=48, settings=FAST, progress=False, log=messages.append)
    assert messages == [f"lazyzero profile: measuring {path} (seq_len: 32 in the file, 48 now)"]
    assert read_profile(path) == longer and longer.layers[0].input_bytes == 2 * 48 * 64 * 4
    changed = dataclasses.replace(longer.fingerprint, threads=longer.fingerprint.threads + 1, nvme_path="/elsewhere")
    assert cached_profile(path, changed)[1] == (f"threads: {longer.fingerprint.threads} in the file, "
                                                f"{changed.threads} now; nvme_path: None in the file, '/elsewhere' now")
    data = json.loads(path.read_text())
    data["version"] = 0
    path.write_text(json.dumps(data))
    assert cached_profile(path, longer.fingerprint) == (None, f"profile version 0 in the file, {PROFILE_VERSION} now")


def test_foreign_or_damaged_files_are_refused_naming_them(tiny, tmp_path):
    model, profile = tiny
    foreign, text, damaged = tmp_path / "foreign.json", tmp_path / "notes.txt", tmp_path / "damaged.json"
    foreign.write_text('{"optimizer": {"type": "AdamW"}}')
    text.write_text("not json at all")
    data = json.loads(profile.to_json())
    del data["layers"][0]["fwd_s"]
    damaged.write_text(json.dumps(data))
    for path, what in ((foreign, "not a lazyzero profile"), (text, "not JSON"), (damaged, "damaged lazyzero profile")):
        before = path.read_bytes()
        with pytest.raises(ProfileFileError, match=what) as error:
            load_or_profile(path, model, **SHAPE, settings=FAST, progress=False)
        assert str(path) in str(error.value)
        assert path.read_bytes() == before


@pytest.fixture
def nvme_folder(tmp_path):
    """A folder on a disk (aio opens files with O_DIRECT, which tmpfs refuses): /var/tmp when there is one."""
    if not os.path.isdir("/var/tmp"):
        yield tmp_path
        return
    with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="lazyzero-profile-") as folder:
        yield folder


def test_nvme_bandwidth_through_deepspeed_aio(nvme_folder):
    reason = aio_unavailable_reason()
    if reason:
        pytest.skip(reason)
    aio = aio_settings({"aio": {"block_size": 262144, "queue_depth": 4}})
    speeds, setup = nvme_bandwidths(nvme_folder, 3 << 20, aio, repeats=2, warmup=1)
    assert speeds["nvme_write"].bytes_per_s > 0 and speeds["nvme_read"].bytes_per_s > 0
    assert setup.aio["block_size"] == 262144 and setup.aio["queue_depth"] == 4
    assert setup.file_bytes == 3 << 20 and setup.file_bytes % 262144 == 0
    assert os.listdir(nvme_folder) == []  # the test file is gone
    with pytest.raises(ValueError, match="missing"):
        nvme_bandwidths(os.path.join(nvme_folder, "missing"), 1 << 20, aio, repeats=1, warmup=0)


def test_cli_writes_a_loadable_profile(tmp_path, capsys):
    out = tmp_path / "profile.json"
    assert main(["profile", "--model", "tiny", "--micro-batch", "1", "--seq", "16", "--dtype", "bf16",
                 "--repeats", "1", "--out", str(out)]) == 0
    profile = read_profile(out)
    assert profile.fingerprint.dtype == "bfloat16" and profile.fingerprint.seq_len == 16
    printed = capsys.readouterr().out
    assert "embed_and_head" in printed and f"wrote {out}" in printed
    assert "gradient error per layer" in printed
    assert main(["profile", "--model", "tiny", "--micro-batch", "1", "--seq", "16", "--out", str(tmp_path)]) == 2
    assert str(tmp_path) in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.multiproc
def test_every_rank_obtains_the_same_profile_with_collectives(tmp_path, nvme_folder):
    proc = run_distributed("deepspeed", 2, [str(WORKER), str(tmp_path), str(nvme_folder)], timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:]
    ranks = [(tmp_path / f"rank{r}.json").read_text() for r in range(2)]
    assert ranks[0] == ranks[1] == (tmp_path / "profile.json").read_text()
    profile = read_profile(tmp_path / "profile.json")
    assert profile.fingerprint.world_size == 2
    for name in ("all_gather", "reduce_scatter"):
        speed = profile.machine.collectives[name]
        assert speed.world_size == 2 and speed.s_per_byte > 0
        assert speed.full_bytes == 4 * profile.layers[0].param_numel
    # The second call on every rank reused the file without measuring.
    assert all((tmp_path / f"rank{r}_reused.txt").read_text() == "True []" for r in range(2))


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_calibration_child_killed_by_a_signal_is_run_again_on_every_rank(tmp_path):
    """Rank 1's first engine child aborts before its result (as a gloo teardown once did); both ranks
    run that engine again together and the calibration completes, saying so."""
    marker = tmp_path / "aborted"
    worker = Path(__file__).resolve().parent / "calibration_retry_worker.py"
    proc = run_distributed("deepspeed", 2, [str(worker), str(tmp_path)], timeout=600,
                           env={"LAZYZERO_CALIBRATION_ABORT": f"{marker}@1"})
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert marker.exists(), "the abort hook never fired"
    assert "killed by a signal on a rank" in proc.stdout
    for rank in range(2):
        # The third engine is the model's own depth (engine_calibration.own_depth_engine_layers).
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == [1, 3, 4]


def test_a_model_held_whole_gets_an_engine_at_its_own_depth_where_the_host_has_room(monkeypatch):
    """The third calibration engine: the model's own depth (at most DEEPEST_CALIBRATION_LAYERS), only
    where the model is whole, deeper than the second engine, on the host, and the line through the
    shallow engines' peaks fits the memory free per rank."""
    import psutil
    from transformers import AutoModelForCausalLM

    from lazyzero.plan.profile import engine_calibration as calibration
    from lazyzero.plan.profile.data import EngineRun

    def model(layers: int, device: str = "cpu"):
        config = build_model("tiny", seed=1, vocab_size=300).config
        config.num_hidden_layers = layers
        with torch.device(device):
            return AutoModelForCausalLM.from_config(config)

    free = calibration._free_host_bytes_per_rank()
    assert 0 < free <= psutil.virtual_memory().total
    mb = 2**20
    shallow = [EngineRun(1, 0.1, 100 * mb, 50 * mb, 0), EngineRun(3, 0.3, 140 * mb, 50 * mb, 0)]
    monkeypatch.setattr(calibration, "_free_host_bytes_per_rank", lambda: 180 * mb)
    assert calibration.own_depth_engine_layers(model(5), shallow) == 5  # 180 MB on the line at 5 layers
    assert calibration.own_depth_engine_layers(model(6), shallow) is None  # 200 MB
    assert calibration.own_depth_engine_layers(model(3), shallow) is None
    assert calibration.own_depth_engine_layers(model(5, "meta"), shallow) is None
    monkeypatch.setattr(calibration, "_free_host_bytes_per_rank", lambda: 10**12)
    assert calibration.own_depth_engine_layers(model(14), shallow) == calibration.DEEPEST_CALIBRATION_LAYERS
