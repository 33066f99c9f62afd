"""Reading what the collective workers wrote: every rank's facts about every case."""


def cases(ranks: list[dict], prefix: str) -> list[tuple[int, str, dict]]:
    """(rank, case name, facts) of every case whose name starts with `prefix`; at least one."""
    found = [(r, name, facts) for r, result in enumerate(ranks) for name, facts in result.items()
             if name.startswith(prefix)]
    assert found, f"no case starts with {prefix!r}"
    return found
