"""``python -m slotserve`` = the ``slotserve`` command."""

from slotserve.cli import main

main()
