"""The README stays true: config reference, quick start commands and benchmark table."""

import re
import sys
from pathlib import Path

from lazyzero.docs import marked_block

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _between(text: str, start: str, end: str) -> str:
    return text.split(start, 1)[1].split(end, 1)[0]


def test_config_reference_matches_the_pydantic_models():
    from lazyzero.config import config_reference_markdown

    assert marked_block(README, "config-reference") == config_reference_markdown(), \
        "run: lazyzero config reference --write-readme README.md"


def test_benchmark_table_matches_the_result_files():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from readme_table import table_markdown

    assert marked_block(README, "benchmarks") == table_markdown(), "run: python benchmarks/readme_table.py --write"


def _quick_start_commands() -> list[str]:
    section = _between(README, "## Quick start", "\n## ")
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", section, flags=re.S)]


def test_quick_start_is_exactly_two_commands():
    commands = _quick_start_commands()
    assert len(commands) == 2 and all("\n" not in c for c in commands)
    assert "ds_configs/cpu_demo_planned.json" in commands[0] and "--num_gpus 2" in commands[0]
    assert "pytest" in commands[1]


def test_ci_runs_the_readme_test_command():
    ci_script = (ROOT / ".ci" / "run").read_text()
    assert _quick_start_commands()[1] in ci_script
