"""Fixtures shared by the tests in tests/models/ (helpers shared across folders live in tests/support/)."""
