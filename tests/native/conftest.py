"""Fixtures of the native tests (helpers live in native_helpers.py, imported by the tests)."""
from native_helpers import agent, built, gpu  # noqa: F401  (fixtures)
