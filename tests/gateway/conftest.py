"""Fixtures shared by the tests in tests/gateway/ (helpers shared across folders live in tests/support/)."""
