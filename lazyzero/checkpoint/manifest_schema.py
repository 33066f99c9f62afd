"""The schema of a manifest's body, format 1 (docs/checkpoint.md, docs/reliability.md guarantee 2).

The body hash proves that the manifest was not damaged, not that it was written by lazyzero: anyone
who can write the folder can recompute it. So a manifest that passes its hash is still checked field
by field before any of it is used, and a wrong type or a missing field is refused naming the file,
the field, what was expected and what was found, instead of failing later in whatever reads it.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

# The manifest format this lazyzero writes and reads; a change to the schema below is a new format.
MANIFEST_FORMAT = 1


class FileEntry(BaseModel):
    """One file of the tag folder."""

    model_config = ConfigDict(extra="forbid", strict=True)

    size: int = Field(ge=0)
    """Bytes."""

    hash: str = Field(pattern=r"^[0-9a-f]{32}$")
    """xxh3-128 of the file, 32 lowercase hex digits."""

    rank: int = Field(ge=0)
    """The rank that wrote it."""


class ManifestBody(BaseModel):
    """What `lazyzero_manifest.json` holds under "body" (its hash is beside it, "body_hash")."""

    model_config = ConfigDict(extra="forbid", strict=True)

    format: int
    """MANIFEST_FORMAT of the writer (checked before the schema, with its own message)."""

    hash: str
    """The name of the file hash (checked with the format)."""

    tag: str = Field(min_length=1)
    """The tag it was committed as: the name of its folder."""

    world_size: int = Field(ge=1)
    """Ranks of the run that saved it."""

    global_steps: int = Field(ge=0)
    """DeepSpeed's step counter at the save."""

    created_unix: float
    """Commit time, seconds since the epoch."""

    files: dict[str, FileEntry]
    """Relative path ('/'-separated) -> its entry; the manifest itself is not listed."""

    @model_validator(mode="after")
    def _ranks_within_world(self):
        for relpath, entry in self.files.items():
            if entry.rank >= self.world_size:
                raise ValueError(f"files.{relpath}.rank is {entry.rank}; expected a rank below world_size "
                                 f"{self.world_size}")
        return self


def schema_problems(err: ValidationError) -> str:
    """Each field pydantic refused: where, what was expected and what was found."""
    lines = []
    for problem in err.errors():
        where = ".".join(str(part) for part in problem["loc"]) or "body"
        if problem["type"] == "missing":
            lines.append(f"{where}: missing")
        elif problem["type"] == "value_error":
            lines.append(problem["msg"].removeprefix("Value error, "))
        else:
            found = problem["input"]
            lines.append(f"{where}: {problem['msg'].lower()}, found {_short(found)} ({type(found).__name__})")
    return "; ".join(lines)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
