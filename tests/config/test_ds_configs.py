"""Every shipped DeepSpeed config passes lazyzero's validation and DeepSpeed's own parse."""

from pathlib import Path

import pytest

from lazyzero.config import check_config_file

CONFIG_DIR = Path(__file__).parents[2] / "ds_configs"
CONFIGS = sorted(CONFIG_DIR.glob("*.json"))


def test_the_required_configs_are_shipped():
    names = {path.name for path in CONFIGS}
    assert {"cpu_demo.json", "cpu_zero3_nvme.json", "gpu_1x24gb.json", "gpu_8x80gb.json"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_is_valid(path):
    check_config_file(path, world_size=2 if path.name.startswith("cpu") else None)


def test_nvme_config_really_puts_state_on_nvme():
    """max_in_cpu 0 is what makes DeepSpeed keep parameters on NVMe (docs/deepspeed-internals.md: placement)."""
    import json

    zero = json.loads((CONFIG_DIR / "cpu_zero3_nvme.json").read_text())["zero_optimization"]
    assert zero["offload_param"]["device"] == "nvme" and zero["offload_param"]["max_in_cpu"] == 0
    assert zero["offload_optimizer"]["device"] == "nvme"
