"""slotserve's tests, one folder per part of the code; shared helpers in ``tests.support``."""
