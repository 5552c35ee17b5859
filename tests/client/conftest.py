"""Fixtures shared by the tests in tests/client/ (helpers shared across folders live in tests/support/)."""
