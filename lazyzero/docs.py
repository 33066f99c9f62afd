"""Generated blocks in Markdown pages, between `<!-- NAME:start -->` and `<!-- NAME:end -->` markers.

The config reference in docs/config.md (`lazyzero config reference --write docs/config.md`) and the
benchmark table in benchmarks/README.md (`python benchmarks/readme_table.py --write`) are such
blocks; tests/test_readme.py checks that each equals what its generator writes now.
"""

from __future__ import annotations


def marked_block(text: str, name: str) -> str:
    """The content of block `name` in `text`."""
    start, end = f"<!-- {name}:start -->\n", f"<!-- {name}:end -->"
    if start not in text or end not in text:
        raise ValueError(f"no '{name}' block in the text: add {start.strip()} and {end} markers")
    return text.split(start, 1)[1].split(end, 1)[0]


def replace_marked_block(text: str, name: str, content: str) -> str:
    """`text` with block `name` replaced by `content` (which should end with a newline)."""
    old = marked_block(text, name)
    start = f"<!-- {name}:start -->\n"
    return text.replace(start + old, start + content, 1)
