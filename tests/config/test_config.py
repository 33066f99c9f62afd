"""The "lazyzero" config section: defaults, rejection of bad configs (docs/reliability.md, what is tested and 11),
the memory-size parser, the generated reference, and DeepSpeed's view of the same file.

Every rejection is checked for the exact key path and the allowed-values text on the same line, and
for leaving the disk untouched (docs/reliability.md, guarantee 6).
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys

import pytest

from lazyzero.config import (
    LazyZeroConfig,
    LazyZeroConfigError,
    check_config_file,
    config_reference_markdown,
    format_config_summary,
    load_ds_config_file,
    parse_memory_size,
    validate_ds_config,
)
from lazyzero.config.models import FEATURES

DEMO_CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "ds_configs", "cpu_demo.json")


def tree_listing(root) -> list[str]:
    """Every path under `root`, relative and sorted: compared before and after to prove nothing was created."""
    return sorted(os.path.relpath(os.path.join(folder, name), root)
                  for folder, dirs, files in os.walk(root) for name in dirs + files)


def problem_line(error: LazyZeroConfigError, path: str, allowed: str) -> str:
    """The line of `error` that starts with `path: ` and contains `allowed`; fails listing all lines otherwise."""
    for line in error.problems:
        if line.startswith(f"{path}: ") and allowed in line:
            return line
    raise AssertionError(f"no line for {path!r} containing {allowed!r} in:\n{error}")


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """An empty working directory holding one regular file, `a_file`, for "path is a file" cases."""
    (tmp_path / "a_file").write_text("not a directory")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def with_tmp(value, tmp_path):
    """`value` with "{tmp}" in every string replaced by the test's temporary directory."""
    if isinstance(value, dict):
        return {key: with_tmp(item, tmp_path) for key, item in value.items()}
    if isinstance(value, list):
        return [with_tmp(item, tmp_path) for item in value]
    return value.replace("{tmp}", str(tmp_path)) if isinstance(value, str) else value


# ---------------------------------------------------------------------------------------- defaults

@pytest.mark.parametrize("ds_config", [{}, {"lazyzero": {}}, {"train_batch_size": 8, "lazyzero": {"plan": {}}}])
def test_absent_or_empty_section_is_valid_and_every_feature_is_off(ds_config):
    config = validate_ds_config(ds_config)
    assert config == LazyZeroConfig()
    assert config.enabled_features() == []


def test_validation_imports_neither_torch_nor_deepspeed():
    # `lazyzero config check` must answer in a fraction of a second; torch + DeepSpeed take seconds.
    code = ("import sys; from lazyzero.config import validate_ds_config; "
            f"assert validate_ds_config({DEMO_CONFIG!r}).enabled_features() == []; "
            "print(sorted(m for m in ('torch', 'deepspeed') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_enabled_features_lists_switched_on_sections_in_order():
    config = LazyZeroConfig(checkpoint={"enabled": True}, gradients={"enabled": True})
    assert config.enabled_features() == ["gradients", "checkpoint"]
    assert "  gradients    on" in format_config_summary(config).splitlines()
    every = LazyZeroConfig(**{section: {"enabled": True} for section in reversed(FEATURES)})
    assert every.enabled_features() == ["plan", "activations", "gradients", "optimizer", "checkpoint"]


def test_every_capability_is_switched_by_enabled_and_off_by_default():
    for section in FEATURES:
        field = LazyZeroConfig.model_fields[section].annotation.model_fields["enabled"]
        assert field.annotation is bool and field.default is False, section
    assert LazyZeroConfig(optimizer={"enabled": True}).optimizer.type == "adamw8bit"


GRADIENTS_HINT = "removed; use lazyzero.gradients.enabled: true (int8 is the wire format)"
CHECKPOINT_HINT = "removed; use lazyzero.checkpoint.enabled: true for lazy checkpoints (false: DeepSpeed's own)"
RETIRED_SPELLINGS = [
    ({"gradients": {"quantize": "int8"}}, f"lazyzero.gradients.quantize: {GRADIENTS_HINT}"),
    ({"gradients": {"quantize": "none", "block_size": 512}}, f"lazyzero.gradients.quantize: {GRADIENTS_HINT}"),
    ({"checkpoint": {"mode": "lazy"}}, f"lazyzero.checkpoint.mode: {CHECKPOINT_HINT}"),
    ({"checkpoint": {"mode": "deepspeed"}}, f"lazyzero.checkpoint.mode: {CHECKPOINT_HINT}"),
    ({"optimizer": {"type": "none"}}, "lazyzero.optimizer.type: got 'none'; allowed: one of 'adamw8bit', 'adam8bit' "
                                      "(switch the 8-bit optimizer off with lazyzero.optimizer.enabled: false)"),
]


@pytest.mark.parametrize("section, line", RETIRED_SPELLINGS)
def test_retired_switch_spellings_are_refused_naming_the_new_key(section, line):
    with pytest.raises(LazyZeroConfigError) as caught:
        validate_ds_config({"lazyzero": section})
    assert caught.value.problems == [line]


def test_a_value_close_to_a_retired_one_gets_no_hint():
    with pytest.raises(LazyZeroConfigError) as caught:
        validate_ds_config({"lazyzero": {"optimizer": {"type": "sgd"}}})
    assert caught.value.problems == ["lazyzero.optimizer.type: got 'sgd'; allowed: one of 'adamw8bit', 'adam8bit'"]


def test_int8_gradients_are_accepted():
    config = validate_ds_config({"lazyzero": {"gradients": {"enabled": True, "stochastic_rounding": True}}})
    assert config.enabled_features() == ["gradients"]


PLANNED = {"plan": {"enabled": True, "seq_len": 64}}


@pytest.mark.parametrize("ds_settings, path, allowed", [
    ({"zero_optimization": {"stage": 2}}, "zero_optimization.stage",
     "got 2; allowed: 3 while lazyzero.plan.enabled is true"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}},
     "zero_optimization.offload_optimizer.device", "got 'cpu'; allowed: 'none' (or no section)"),
    ({"zero_optimization": {"stage": 3}, "gradient_accumulation_steps": 4}, "gradient_accumulation_steps",
     "got 4; allowed: 1 while lazyzero.plan.enabled is true"),
])
def test_an_enabled_plan_rejects_deepspeed_settings_it_would_overwrite(ds_settings, path, allowed):
    with pytest.raises(LazyZeroConfigError) as caught:
        validate_ds_config({**ds_settings, "lazyzero": PLANNED})
    problem_line(caught.value, path, allowed)


def test_an_enabled_plan_on_stage_3_with_a_sequence_length_is_accepted():
    config = validate_ds_config({"zero_optimization": {"stage": 3}, "lazyzero": PLANNED})
    assert config.enabled_features() == ["plan"] and config.plan.seq_len == 64


def test_headroom_share_is_a_share_and_excludes_a_gpu_byte_budget():
    config = validate_ds_config({"zero_optimization": {"stage": 3},
                                 "lazyzero": {"plan": {**PLANNED["plan"], "headroom_share": 0.3}}})
    assert config.plan.headroom_share == 0.3
    for share in (1.5, -0.1):
        with pytest.raises(LazyZeroConfigError) as caught:
            validate_ds_config({"zero_optimization": {"stage": 3},
                                "lazyzero": {"plan": {**PLANNED["plan"], "headroom_share": share}}})
        problem_line(caught.value, "lazyzero.plan.headroom_share",
                     f"got {share}; allowed: a number from 0 to 1, or null")
    with pytest.raises(LazyZeroConfigError) as caught:
        validate_ds_config({"zero_optimization": {"stage": 3},
                            "lazyzero": {"plan": {**PLANNED["plan"], "headroom_share": 0.3, "gpu_mem": "8GB"}}})
    problem_line(caught.value, "lazyzero.plan.gpu_mem",
                 "got 8000000000; allowed: null while lazyzero.plan.headroom_share is set")


def test_planned_checkpoint_traffic_needs_lazy_checkpoints():
    planned = {"plan": {**PLANNED["plan"], "checkpoint_every": 50}}
    with pytest.raises(LazyZeroConfigError) as caught:
        validate_ds_config({"zero_optimization": {"stage": 3}, "lazyzero": planned})
    problem_line(caught.value, "lazyzero.plan.checkpoint_every",
                 "got 50; allowed: null unless lazyzero.checkpoint.enabled is true")
    config = validate_ds_config({"zero_optimization": {"stage": 3},
                                 "lazyzero": {**planned, "checkpoint": {"enabled": True}}})
    assert config.plan.checkpoint_every == 50


def test_lazyzero_train_plans_for_its_sequences_and_save_interval():
    from lazyzero.train import plan_for_the_run

    ds_config = {"lazyzero": {"plan": {"enabled": True}, "checkpoint": {"enabled": True}}}
    plan_for_the_run(ds_config, seq_len=192, save_every=50)
    assert ds_config["lazyzero"]["plan"] == {"enabled": True, "seq_len": 192, "checkpoint_every": 50}
    without_lazy = {"lazyzero": {"plan": {"enabled": True}}}
    plan_for_the_run(without_lazy, seq_len=192, save_every=50)
    assert "checkpoint_every" not in without_lazy["lazyzero"]["plan"]
    with pytest.raises(SystemExit, match="--seq-len is 128"):
        plan_for_the_run({"lazyzero": {"plan": {"enabled": True, "seq_len": 64}}}, seq_len=128, save_every=0)


def test_validation_does_not_modify_the_given_dict(workdir):
    ds_config = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}},
                 "lazyzero": {"plan": {"gpu_mem": "70GB"}, "optimizer": {"fp32_patterns": ["*bias*"]}}}
    before = copy.deepcopy(ds_config)
    config = validate_ds_config(ds_config, run_deepspeed_checks=False)
    assert ds_config == before
    assert config.plan.gpu_mem == 70 * 10**9


def test_assignment_is_validated_too():
    config = LazyZeroConfig()
    with pytest.raises(ValueError, match="block_size"):
        config.gradients.block_size = 100


# ------------------------------------------------------------------------- bad configs (row 13)

BAD_CONFIGS = [
    # typos at every depth
    ({"gradeints": {}}, "lazyzero.gradeints",
     "unknown key; allowed keys: activations, checkpoint, distributed, gradients, optimizer, plan; "
     "did you mean 'gradients'?"),
    ({"plan": {"gpu_memory": "1GB"}}, "lazyzero.plan.gpu_memory", "did you mean 'gpu_mem'?"),
    ({"activations": {"overides": {}}}, "lazyzero.activations.overides", "did you mean 'overrides'?"),
    ({"checkpoint": {"keep_lsat": 2}}, "lazyzero.checkpoint.keep_lsat",
     "allowed keys: allow_pickle, allow_unverified, background_priority, copy_bandwidth_share, enabled, "
     "exit_timeout_s, host_buffer_limit, keep_last, max_in_flight, on_damaged_latest, save_on_sigterm, "
     "verify_on_load, writer_threads"),
    ({"optimizer": {"Type": "adam8bit"}}, "lazyzero.optimizer.Type", "did you mean 'type'?"),
    ({"gradients": {"enable": True}}, "lazyzero.gradients.enable", "did you mean 'enabled'?"),
    # DeepSpeedConfigModel would swallow a key named "strict"; ours must not.
    ({"plan": {"strict": True}}, "lazyzero.plan.strict",
     "unknown key; allowed keys: allow_8bit_optimizer, allow_recompute"),
    # wrong types
    ([], "lazyzero", "allowed: an object with keys activations, checkpoint, distributed, gradients, optimizer, plan"),
    (None, "lazyzero", "got null; allowed: an object with keys activations"),
    ({"plan": True}, "lazyzero.plan",
     "allowed: an object with keys allow_8bit_optimizer, allow_recompute, allowed_bits"),
    ({"plan": {"enabled": "yes"}}, "lazyzero.plan.enabled", "got 'yes'; allowed: true or false"),
    ({"gradients": {"seed": 1.5}}, "lazyzero.gradients.seed", "got 1.5; allowed: an integer >= 0"),
    ({"checkpoint": {"writer_threads": "4"}}, "lazyzero.checkpoint.writer_threads",
     "got '4'; allowed: an integer from 1 to 64"),
    ({"optimizer": {"fp32_patterns": "*norm*"}}, "lazyzero.optimizer.fp32_patterns",
     "allowed: a list, each item a non-empty string"),
    ({"activations": {"overrides": {"mlp.*": "8"}}}, "lazyzero.activations.overrides['mlp.*']",
     "got '8'; allowed: one of 4, 8, 16"),
    ({"activations": {"recompute_layers": [0, -2]}}, "lazyzero.activations.recompute_layers[1]",
     "got -2; allowed: an integer >= 0"),
    # out of range
    ({"plan": {"max_gap": 1.5}}, "lazyzero.plan.max_gap", "got 1.5; allowed: a number from 0 to 1"),
    ({"plan": {"time_limit_s": 0}}, "lazyzero.plan.time_limit_s", "got 0; allowed: a number > 0"),
    ({"plan": {"replan_margin": float("nan")}}, "lazyzero.plan.replan_margin", "allowed: a number > 0"),
    ({"activations": {"block_size": 48}}, "lazyzero.activations.block_size",
     "got 48; allowed: a power of two from 32 to 4096"),
    ({"gradients": {"block_size": 16384}}, "lazyzero.gradients.block_size", "allowed: a power of two from 32 to 8192"),
    ({"activations": {"default_bits": 2}}, "lazyzero.activations.default_bits", "got 2; allowed: one of 4, 8, 16"),
    ({"activations": {"attention_bits": 4}}, "lazyzero.activations.attention_bits", "allowed: one of 8, 16"),
    ({"activations": {"attention_input_bits": 2}}, "lazyzero.activations.attention_input_bits",
     "got 2; allowed: one of 4, 8, 16"),
    ({"activations": {"recompute_layers": [3, 3]}}, "lazyzero.activations.recompute_layers",
     "allowed: a list of distinct layer indices"),
    ({"activations": {"offload_layers": {"03": "nvme"}}}, "lazyzero.activations.offload_layers['03']",
     "got '03'; allowed: a layer index as a decimal string ('0', '3', ...)"),
    ({"activations": {"offload_layers": {"layer1": "cpu"}}}, "lazyzero.activations.offload_layers['layer1']",
     "allowed: a layer index as a decimal string"),
    ({"activations": {"offload_layers": {"1": "disk"}}}, "lazyzero.activations.offload_layers['1']",
     "got 'disk'; allowed: one of 'cpu', 'nvme'"),
    ({"activations": {"offload_layers": ["1"]}}, "lazyzero.activations.offload_layers",
     "allowed: an object mapping a layer index as a decimal string ('0', '3', ...) to one of 'cpu', 'nvme'"),
    ({"activations": {"offload_prefetch_layers": -1}}, "lazyzero.activations.offload_prefetch_layers",
     "got -1; allowed: an integer >= 0"),
    ({"activations": {"enabled": True, "block_size": 512}}, "lazyzero.activations.block_size",
     "got 512; allowed: at most 256 while lazyzero.activations.keep_outliers is true"),
    # activation offload against the rest of its section
    ({"activations": {"offload_layers": {"1": "cpu"}}}, "lazyzero.activations.offload_layers",
     "got {\"1\": \"cpu\"}; allowed: {} while lazyzero.activations.enabled is false"),
    ({"activations": {"enabled": True, "offload_layers": {"1": "cpu", "2": "cpu"}, "recompute_layers": [2, 1]}},
     "lazyzero.activations.offload_layers", "not in lazyzero.activations.recompute_layers (a recomputed layer keeps "
     "only its input, for the recompute); layers [1, 2] are in both"),
    ({"activations": {"enabled": True, "offload_layers": {"2": "nvme"}}}, "lazyzero.activations.offload_nvme_path",
     "got nothing; allowed: an existing directory this process can write to when a layer of "
     "lazyzero.activations.offload_layers is 'nvme'"),
    ({"checkpoint": {"max_in_flight": 0}}, "lazyzero.checkpoint.max_in_flight", "got 0; allowed: an integer >= 1"),
    ({"distributed": {"timeout_s": 0.5}}, "lazyzero.distributed.timeout_s", "got 0.5; allowed: a number >= 1"),
    ({"gradients": {"enabled": "int8"}}, "lazyzero.gradients.enabled", "got 'int8'; allowed: true or false"),
    ({"optimizer": {"type": "AdamW8bit"}}, "lazyzero.optimizer.type",
     "got 'AdamW8bit'; allowed: one of 'adamw8bit', 'adam8bit'"),
    # bad memory sizes
    ({"plan": {"gpu_mem": "70 parsecs"}}, "lazyzero.plan.gpu_mem",
     "allowed: a byte count > 0, or a string like '70GB'"),
    ({"plan": {"cpu_mem": "auto"}}, "lazyzero.plan.cpu_mem", "got 'auto'; allowed: a byte count > 0"),
    ({"plan": {"gpu_mem": "70G"}}, "lazyzero.plan.gpu_mem", "units B, KB, MB, GB, TB"),
    ({"plan": {"gpu_mem": True}}, "lazyzero.plan.gpu_mem", "got true; allowed: a byte count > 0"),
    ({"checkpoint": {"host_buffer_limit": 0}}, "lazyzero.checkpoint.host_buffer_limit",
     "got 0; allowed: a byte count >= 8388608"),
    ({"checkpoint": {"host_buffer_limit": "1MB"}}, "lazyzero.checkpoint.host_buffer_limit",
     "got '1MB'; allowed: a byte count >= 8388608 (one 8 MiB staging block)"),
    # features whose runtime has not landed
    ({"gradients": {"error_feedback": True}}, "lazyzero.gradients.error_feedback",
     "got true; allowed: false while lazyzero.gradients.enabled is false"),
    # the planner's own settings, and what it decides in the user's stead
    ({"plan": {"enabled": True}}, "lazyzero.plan.seq_len",
     "got nothing; allowed: an integer >= 1 (the sequence length"),
    ({"plan": {"enabled": True, "seq_len": 64}, "activations": {"default_bits": 8}},
     "lazyzero.activations.default_bits",
     "got 8; allowed: absent (conflict with the DeepSpeed settings around it: the planner sets it when "
     "lazyzero.plan.enabled"),
    ({"plan": {"enabled": True, "seq_len": 64}, "optimizer": {"type": "adamw8bit"}}, "lazyzero.optimizer.type",
     "the planner sets it when lazyzero.plan.enabled is true; remove it, or switch the planner off"),
    ({"plan": {"enabled": True, "seq_len": 64}, "optimizer": {"enabled": False}}, "lazyzero.optimizer.enabled",
     "got false; allowed: absent (conflict with the DeepSpeed settings around it: the planner sets it"),
    ({"plan": {"allowed_bits": [16, 2]}}, "lazyzero.plan.allowed_bits[1]", "got 2; allowed: one of 4, 8, 16"),
    ({"plan": {"measure_steps": 0}}, "lazyzero.plan.measure_steps", "got 0; allowed: an integer >= 1"),
    # lazyzero paths on this machine
    ({"plan": {"nvme_path": "{tmp}/missing/deeper"}}, "lazyzero.plan.nvme_path",
     "allowed: an existing directory this process can write to (it does not exist"),
    ({"plan": {"nvme_path": "{tmp}/a_file"}}, "lazyzero.plan.nvme_path", "(it is not a directory)"),
    ({"activations": {"enabled": True, "offload_layers": {"0": "nvme"}, "offload_nvme_path": "{tmp}/missing"}},
     "lazyzero.activations.offload_nvme_path",
     "allowed: an existing directory this process can write to (it does not exist"),
    ({"activations": {"enabled": True, "offload_layers": {"0": "nvme"}, "offload_nvme_path": "{tmp}/a_file"}},
     "lazyzero.activations.offload_nvme_path", "(it is not a directory)"),
]


@pytest.mark.parametrize("section, path, allowed", BAD_CONFIGS)
def test_bad_lazyzero_section_is_rejected_with_key_path_and_allowed_values(workdir, section, path, allowed):
    before = tree_listing(workdir)
    with pytest.raises(LazyZeroConfigError) as caught:
        validate_ds_config({"train_batch_size": 8, "lazyzero": with_tmp(section, workdir)})
    problem_line(caught.value, path, allowed)
    assert tree_listing(workdir) == before


DEEPSPEED_CONFLICTS = [
    ({"zero_optimization": "yes"}, "zero_optimization", "allowed: an object, or true/false"),
    ({"zero_optimization": {"stage": "3"}}, "zero_optimization.stage", "got '3'; allowed: one of 0, 1, 2, 3"),
    ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage", "got 4; allowed: one of 0, 1, 2, 3"),
    ({"zero_optimization": {"stage": 3, "offload_param": 5}}, "zero_optimization.offload_param",
     "allowed: an object, or null"),
    ({"zero_optimization": {"stage": 1, "offload_param": {"device": "cpu"}}}, "zero_optimization.offload_param.device",
     "allowed: 'none' unless zero_optimization.stage is 3 (conflict with the DeepSpeed settings around it"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}},
     "zero_optimization.offload_param.nvme_path",
     "got nothing; allowed: an existing directory this process can write to when "
     "zero_optimization.offload_param.device is 'nvme'"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "{tmp}/missing"}}},
     "zero_optimization.offload_optimizer.nvme_path",
     "allowed: an existing directory this process can write to (it does not exist"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "{tmp}/a_file"}}},
     "zero_optimization.offload_param.nvme_path", "(it is not a directory)"),
    ({"optimizer": {"type": "SGD"}, "lazyzero": {"optimizer": {"enabled": True, "type": "adam8bit"}}},
     "lazyzero.optimizer.enabled",
     "got true; allowed: false unless optimizer.type is Adam or AdamW (conflict with the DeepSpeed settings around it"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "{tmp}",
                                                              "pipeline_read": True}},
      "lazyzero": {"optimizer": {"enabled": True}}}, "zero_optimization.offload_optimizer.buffer_count",
     "got 4; allowed: at least 12 while pipeline_read or pipeline_write is true and lazyzero.optimizer is enabled"),
    ({"zero_optimization": {"stage": 2, "elastic_checkpoint": True}, "lazyzero": {"optimizer": {"enabled": True}}},
     "lazyzero.optimizer.enabled", "allowed: false while zero_optimization.elastic_checkpoint is true"),
    ({"checkpoint": {"load_universal": True}, "lazyzero": {"optimizer": {"enabled": True}}},
     "lazyzero.optimizer.enabled", "allowed: false while checkpoint.load_universal is true"),
    ({"zero_optimization": {"stage": 3, "zero_quantized_gradients": True},
      "lazyzero": {"gradients": {"enabled": True}}},
     "lazyzero.gradients.enabled", "got true; allowed: false while zero_optimization.zero_quantized_gradients is true"),
    ({"zero_optimization": {"stage": 2, "contiguous_gradients": False}, "lazyzero": {"gradients": {"enabled": True}}},
     "lazyzero.gradients.enabled",
     "allowed: false while zero_optimization.contiguous_gradients is false on stage 1 or 2"),
    ({"activation_checkpointing": {"cpu_checkpointing": True}, "lazyzero": {"activations": {"enabled": True}}},
     "activation_checkpointing.cpu_checkpointing",
     "got true; allowed: false while lazyzero.activations.enabled is true"),
    ({"checkpoint": {"writer": {"type": "fast"}}, "lazyzero": {"checkpoint": {"enabled": True}}}, "checkpoint.writer",
     "allowed: absent while lazyzero.checkpoint.enabled is true"),
    ({"checkpoint": {"use_node_local_storage": True}, "lazyzero": {"checkpoint": {"enabled": True}}},
     "checkpoint.use_node_local_storage", "allowed: false while lazyzero.checkpoint.enabled is true"),
]


@pytest.mark.parametrize("ds_config, path, allowed", DEEPSPEED_CONFLICTS)
def test_conflict_with_deepspeed_settings_is_rejected(workdir, ds_config, path, allowed):
    before = tree_listing(workdir)
    with pytest.raises(LazyZeroConfigError) as caught:
        validate_ds_config(with_tmp({"train_batch_size": 8, **ds_config}, workdir))
    problem_line(caught.value, path, allowed)
    assert tree_listing(workdir) == before


@pytest.mark.parametrize("ds_config", [
    {"zero_optimization": True},
    {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}},
    {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "{tmp}"}}},
    {"activation_checkpointing": {"cpu_checkpointing": True}},
    {"checkpoint": {"writer": {"type": "fast"}}},
    {"optimizer": {"type": "SGD"}, "zero_optimization": {"zero_quantized_gradients": True}},
])
def test_deepspeed_settings_that_do_not_conflict_are_accepted(workdir, ds_config):
    validate_ds_config(with_tmp(ds_config, workdir))


def test_eight_bit_optimizer_over_adamw_with_cpu_offload_is_accepted():
    validate_ds_config({"optimizer": {"type": "AdamW"},
                        "lazyzero": {"optimizer": {"enabled": True, "type": "adam8bit"}},
                        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}})


@pytest.mark.parametrize("key_path", ["zero_optimization.offload_param.nvme_path",
                                      "lazyzero.activations.offload_nvme_path"])
def test_read_only_nvme_path_is_rejected(tmp_path, key_path):
    if os.geteuid() != 0:
        read_only = tmp_path / "read_only"
        read_only.mkdir()
        read_only.chmod(0o555)
    elif os.path.isdir("/proc/sys") and not os.access("/proc/sys", os.W_OK):
        # Root passes every permission check except on a read-only mount, which /proc/sys is in containers.
        read_only = "/proc/sys"
    else:
        pytest.skip("running as root with no read-only mount at /proc/sys: os.access reports every directory writable")
    ds_configs = {
        "zero_optimization.offload_param.nvme_path":
            {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(read_only)}}},
        "lazyzero.activations.offload_nvme_path":
            {"lazyzero": {"activations": {"enabled": True, "offload_layers": {"1": "nvme"},
                                          "offload_nvme_path": str(read_only)}}},
    }
    with pytest.raises(LazyZeroConfigError) as caught:
        validate_ds_config(ds_configs[key_path])
    problem_line(caught.value, key_path, f"got '{read_only}'; allowed: an existing directory"
                 " this process can write to (this process may not write to it)")


def test_activation_offload_takes_layer_indices_as_json_object_keys(workdir):
    config = validate_ds_config({"lazyzero": {"activations": {
        "enabled": True, "offload_layers": {"0": "cpu", "12": "nvme"}, "offload_nvme_path": str(workdir),
        "offload_prefetch_layers": 2}}})
    assert config.activations.offload_layers == {0: "cpu", 12: "nvme"}
    assert config.activations.offload_prefetch_layers == 2
    # A "cpu" layer needs no folder: on a machine without CUDA it simply stays in host memory.
    assert validate_ds_config({"lazyzero": {"activations": {"enabled": True, "offload_layers": {"3": "cpu"}}}})


def test_every_problem_is_listed_one_per_line_under_a_count():
    ds_config = {"zero_optimization": {"stage": 9},
                 "lazyzero": {"plan": {"gpu_mem": "lots", "max_gap": -1}, "gradeints": {}}}
    with pytest.raises(LazyZeroConfigError) as caught:
        validate_ds_config(ds_config)
    lines = str(caught.value).splitlines()
    assert lines[0] == "invalid DeepSpeed/lazyzero config (4 problems):"
    assert [line.split(":")[0] for line in lines[1:]] == [
        "lazyzero.plan.gpu_mem", "lazyzero.plan.max_gap", "lazyzero.gradeints", "zero_optimization.stage"]
    assert caught.value.problems == lines[1:]


def test_config_that_is_neither_dict_nor_path_is_rejected():
    with pytest.raises(LazyZeroConfigError,
                       match="DeepSpeed config: got a list; allowed: a dict, or the path of a JSON file"):
        validate_ds_config([("train_batch_size", 8)])


def test_world_size_checks_the_two_hop_layout():
    ds_config = {"lazyzero": {"gradients": {"enabled": True, "ranks_per_node": 3}}}
    validate_ds_config(ds_config, world_size=6)
    with pytest.raises(LazyZeroConfigError) as caught:
        validate_ds_config(ds_config, world_size=4)
    problem_line(caught.value, "lazyzero.gradients.ranks_per_node", "got 3; allowed: a divisor of the world size 4")
    with pytest.raises(ValueError, match="world_size"):
        validate_ds_config({}, world_size=0)


# ------------------------------------------------------------------------------- bad JSON files

BAD_FILES = [
    (b'{"train_batch_size": 8,\n "lazyzero": {"plan": }}', r"config\.json:2:23: invalid JSON: Expecting value"),
    (b'[{"train_batch_size": 8}]', r"config\.json: got a JSON list at the top level; allowed: a JSON object"),
    (b'{"zero_optimization": {"stage": 3, "stage": 2}}',
     r"config\.json: invalid JSON: key 'stage' appears twice in one object; allowed: each key once"),
    (b'{"train_batch_size": NaN}', r"config\.json: invalid JSON: got NaN; allowed: JSON numbers"),
    (b'{"name": "\xff"}', r"config\.json: not UTF-8 text \(byte 10\); allowed: a JSON file"),
    (b"", r"config\.json:1:1: invalid JSON: Expecting value"),
]


@pytest.mark.parametrize("content, expected", BAD_FILES)
def test_bad_json_file_is_rejected_naming_the_file(workdir, content, expected):
    path = workdir / "config.json"
    path.write_bytes(content)
    before = tree_listing(workdir)
    for load in (load_ds_config_file, validate_ds_config):
        with pytest.raises(LazyZeroConfigError) as caught:
            load(path)
        assert re.search(expected, str(caught.value)), str(caught.value)
    assert tree_listing(workdir) == before


@pytest.mark.parametrize("relative, expected", [
    ("missing.json", "missing.json: no such file; allowed: a JSON file"),
    (".", ": got a directory; allowed: a JSON file"),
    ("a_file/config.json", "a_file/config.json: cannot be read (Not a directory); allowed: a readable JSON file"),
])
def test_unreadable_config_path_is_rejected_naming_it(workdir, relative, expected):
    before = tree_listing(workdir)
    with pytest.raises(LazyZeroConfigError, match=re.escape(expected)):
        load_ds_config_file(workdir / relative)
    assert tree_listing(workdir) == before


def test_config_file_round_trip(workdir):
    path = workdir / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 8, "lazyzero": {"checkpoint": {"keep_last": 3}}}))
    assert validate_ds_config(str(path)).checkpoint.keep_last == 3


# -------------------------------------------------------------------------------- memory sizes

@pytest.mark.parametrize("given, expected", [
    (1, 1), (4096, 4096), (7e10, 70 * 10**9), ("512", 512), ("512B", 512), ("512MB", 512 * 10**6),
    ("70GB", 70 * 10**9), ("400GiB", 400 * 2**30), ("1.5GB", 1_500_000_000), ("2 TiB", 2 * 2**40),
    ("64kib", 64 * 1024), (" 3 mb ", 3 * 10**6), ("1TB", 10**12), ("0.5KiB", 512),
])
def test_memory_size_parses(given, expected):
    assert parse_memory_size(given) == expected


@pytest.mark.parametrize("given", [
    0, -1, True, 1.5, float("inf"), "", "GB", "70G", "70 GBs", "-1GB", "0GB", "1e9", "0.3B", "1,5GB", None, [1], "auto",
])
def test_memory_size_rejects(given):
    with pytest.raises(ValueError, match="allowed: a byte count > 0"):
        parse_memory_size(given)


# ------------------------------------------------------------------------ reference and summary

def test_reference_mentions_every_field_and_is_deterministic():
    markdown = config_reference_markdown()
    assert markdown == config_reference_markdown()
    for section, field in LazyZeroConfig.model_fields.items():
        assert f"### `lazyzero.{section}`" in markdown
        for name, sub_field in field.annotation.model_fields.items():
            row = next(line for line in markdown.splitlines() if line.startswith(f"| `{name}` |")
                       and " ".join(sub_field.description.split()) in line)
            assert f"`{json.dumps(sub_field.get_default(call_default_factory=True))}`" in row


def test_every_field_is_documented():
    for field in LazyZeroConfig.model_fields.values():
        for name, sub_field in field.annotation.model_fields.items():
            assert sub_field.description, f"{name} has no docstring"


def test_summary_of_defaults_says_every_feature_is_off():
    summary = format_config_summary(LazyZeroConfig())
    assert summary.splitlines()[0] == "lazyzero 0.1.0: features on: none"
    assert [line.split() for line in summary.splitlines()[1:]] == [[section, "off"] for section in FEATURES]


# ------------------------------------------------------------------------------ DeepSpeed's view

def test_deepspeed_ignores_the_lazyzero_section():
    from deepspeed.runtime.config import DeepSpeedConfig

    section = {"plan": {"gpu_mem": "70GB"}, "gradients": {"block_size": 512}, "unknown_to_deepspeed": [1, 2]}
    parsed = DeepSpeedConfig({"train_batch_size": 4, "lazyzero": section})
    assert parsed.train_batch_size == 4


def test_check_config_file_accepts_the_demo_config_and_runs_deepspeed_checks(workdir):
    before = tree_listing(workdir)
    assert check_config_file(DEMO_CONFIG).enabled_features() == []
    bad = workdir / "bad_batch.json"
    bad.write_text(json.dumps({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 3}))
    with pytest.raises(LazyZeroConfigError) as caught:
        check_config_file(bad)
    assert f"{bad}: DeepSpeed's own parse failed: AssertionError: Check batch related parameters" in str(caught.value)
    assert tree_listing(workdir) == sorted(before + ["bad_batch.json"])


def test_deepspeed_checks_use_the_given_world_size():
    ds_config = {"train_batch_size": 12, "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2}
    validate_ds_config(ds_config, world_size=2, run_deepspeed_checks=True)
    with pytest.raises(LazyZeroConfigError) as caught:
        validate_ds_config(ds_config, world_size=3, run_deepspeed_checks=True)
    assert "(DeepSpeed checked one rank's share: train_batch_size 12 / world size 3)" in str(caught.value)
    with pytest.raises(LazyZeroConfigError) as caught:
        validate_ds_config(ds_config, world_size=5, run_deepspeed_checks=True)
    problem_line(caught.value, "train_batch_size", "got 12; allowed: a multiple of the world size 5")


def test_the_outlier_block_limit_is_the_kernels():
    from lazyzero.activations import config as activations_config
    from lazyzero.ops import quant_reference

    assert activations_config.MAX_OUTLIER_BLOCK == quant_reference.MAX_OUTLIER_BLOCK


NVME_USERS = [
    ({"lazyzero": {"plan": {"nvme_path": "{tmp}"}}}, "lazyzero.plan.nvme_path"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "{tmp}"}}},
     "zero_optimization.offload_param.nvme_path"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "{tmp}"}}},
     "zero_optimization.offload_optimizer.nvme_path"),
    ({"lazyzero": {"activations": {"enabled": True, "offload_layers": {"0": "nvme"}, "offload_nvme_path": "{tmp}"}}},
     "lazyzero.activations.offload_nvme_path"),
]


@pytest.mark.parametrize("settings, path", NVME_USERS)
def test_an_nvme_folder_is_refused_where_deepspeeds_async_io_cannot_load(workdir, monkeypatch, settings, path):
    """Here libaio is installed, so the probe is made to answer as on a machine without it; the refusal
    names the key, what is missing and how to install it."""
    from lazyzero.config import async_io

    config = {"train_batch_size": 8, "lazyzero": {}, **with_tmp(settings, workdir)}
    validate_ds_config(config)  # with async_io loadable: accepted
    missing = "DeepSpeed's async_io op cannot be built here: libaio's header or library is missing"
    monkeypatch.setattr(async_io, "async_io_unavailable", lambda: missing)
    with pytest.raises(LazyZeroConfigError) as caught:
        validate_ds_config(config)
    problem_line(caught.value, path, f"NVMe needs DeepSpeed's async_io op: {missing}. Install libaio (apt-get install")


def test_the_async_io_probe_answers_once_per_process(monkeypatch):
    """The probe compiles against libaio: it runs once, whatever number of NVMe keys a config has."""
    from deepspeed.ops.op_builder import AsyncIOBuilder

    from lazyzero.config.async_io import async_io_unavailable

    calls = []
    real = AsyncIOBuilder.is_compatible
    monkeypatch.setattr(AsyncIOBuilder, "is_compatible",
                        lambda self, verbose=False: calls.append(1) or real(self, verbose))
    async_io_unavailable.cache_clear()
    first = async_io_unavailable()
    assert async_io_unavailable() == first and len(calls) == 1
    assert first is None or "async_io" in first
    async_io_unavailable.cache_clear()
