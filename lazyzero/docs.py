"""Generated blocks in README.md, between `<!-- NAME:start -->` and `<!-- NAME:end -->` markers."""

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
