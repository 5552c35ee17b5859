"""Fixtures shared by the tests in tests/protocol/ (helpers shared across folders live in tests/support/)."""
