"""tests/conftest.py's freeze: what is alive at a module's first test (the imports, every collected
test) is left out of the garbage collector's passes, and what a test makes is still collected."""

from __future__ import annotations

import gc
import weakref


def test_what_lived_before_the_module_is_frozen_and_a_tests_cycles_are_still_collected():
    assert gc.get_freeze_count() > 0

    class Node:
        pass

    cycle = Node()
    cycle.self = cycle
    gone = weakref.ref(cycle)
    del cycle
    gc.collect()
    assert gone() is None
