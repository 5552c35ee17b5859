"""Fixtures shared by the tests in tests/worker/ (helpers shared across folders live in tests/support/)."""
