"""Fixtures shared by the tests in tests/broker/ (helpers shared across folders live in tests/support/)."""
