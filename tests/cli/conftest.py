"""Fixtures shared by the tests in tests/cli/ (helpers shared across folders live in tests/support/)."""
