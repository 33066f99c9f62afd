"""The package version, in a module of its own so that code inside lazyzero can read it without
importing the package face (`lazyzero/__init__.py`, the top of the layering: docs/architecture.md)."""

__version__ = "0.1.0"
