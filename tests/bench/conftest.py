"""Fixtures shared by the tests in tests/bench/ (helpers shared across folders live in tests/support/)."""
