"""Fixtures shared by the tests in tests/cluster/ (helpers shared across folders live in tests/support/)."""
