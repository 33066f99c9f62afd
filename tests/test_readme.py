"""The documentation stays true: the README's quick start, the config reference in docs/config.md,
the benchmark table in benchmarks/README.md, and the links between the pages."""

import re
import sys
from pathlib import Path

import pytest

from lazyzero.docs import marked_block

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
CONFIG_PAGE = ROOT / "docs" / "config.md"
BENCHMARKS_PAGE = ROOT / "benchmarks" / "README.md"
README_MAX_LINES, MAX_LINE_CHARS = 250, 120


def _between(text: str, start: str, end: str) -> str:
    return text.split(start, 1)[1].split(end, 1)[0]


def test_config_reference_matches_the_pydantic_models():
    from lazyzero.config import config_reference_markdown

    assert marked_block(CONFIG_PAGE.read_text(), "config-reference") == config_reference_markdown(), \
        "run: lazyzero config reference --write docs/config.md"


def test_benchmark_table_matches_the_result_files():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from readme_table import table_markdown

    assert marked_block(BENCHMARKS_PAGE.read_text(), "benchmarks") == table_markdown(), \
        "run: python benchmarks/readme_table.py --write"


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


def test_readme_is_a_short_user_document():
    """Depth goes to docs/; the README stays readable. The quick start commands are exempt from the
    line length: they must stay one line each, as .ci/run runs them."""
    lines = README.splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail to docs/"
    commands = set(_quick_start_commands())
    long = [n for n, line in enumerate(lines, 1) if len(line) > MAX_LINE_CHARS and line not in commands]
    assert not long, f"README.md lines over {MAX_LINE_CHARS} characters: {long}"


def test_readme_links_every_docs_page():
    pages = sorted(path.relative_to(ROOT).as_posix() for path in (ROOT / "docs").glob("*.md"))
    assert pages, "no docs/*.md pages"
    missing = [page for page in pages if f"]({page})" not in README]
    assert not missing, f"README.md does not link {missing}"


MARKDOWN_PAGES = ["README.md", "benchmarks/README.md",
                  *(f"docs/{p.name}" for p in sorted((ROOT / "docs").glob("*.md")))]


@pytest.mark.parametrize("page", MARKDOWN_PAGES)
def test_relative_links_resolve(page):
    """Every relative Markdown link of the page names a file or folder of the repository."""
    path = ROOT / page
    targets = re.findall(r"\]\(([^)\s]+)\)", path.read_text())
    broken = [t for t in targets if not re.match(r"[a-z]+:", t) and not t.startswith("#")
              and not (path.parent / t.split("#", 1)[0]).exists()]
    assert not broken, f"{page}: links to missing files: {broken}"
