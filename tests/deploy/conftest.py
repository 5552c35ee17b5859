"""Fixtures shared by the tests in tests/deploy/ (helpers shared across folders live in tests/support/)."""
