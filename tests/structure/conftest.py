"""Fixtures shared by the tests in tests/structure/ (helpers shared across folders live in tests/support/)."""

from tests.support.lanes import mark_lanes


def pytest_itemcollected(item):
    """Marks the room's tests ``process`` and ``model`` by what each uses (tests/support/lanes.py)."""
    mark_lanes(item)
