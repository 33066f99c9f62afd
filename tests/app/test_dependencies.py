"""What a plain `pip install -e .` must bring (pyproject.toml): transformers builds a model partitioned by
zero.Init (`lazyzero train`'s large presets, lazyzero/models/build.py) only with accelerate installed, at
a version it checks at that moment. CI installs accelerate for the real model anyway (.ci/run), so only
the declared requirement shows that a user's install has it."""

import importlib.metadata

from packaging.requirements import Requirement


def test_the_base_install_brings_what_a_partitioned_model_build_needs():
    from transformers.dependency_versions_table import deps

    base = {req.name: req for req in map(Requirement, importlib.metadata.requires("lazyzero")) if req.marker is None}
    assert "accelerate" in base, sorted(base)
    needed = Requirement(deps["accelerate"])
    lowest = min(spec.version for spec in base["accelerate"].specifier if spec.operator == ">=")
    assert needed.specifier.contains(lowest), (str(base["accelerate"]), str(needed))
