"""slotserve's benchmarks, one script a module, run from the repository root as
``python -m bench.<name>`` (``python -m bench.engine``, ``python -m bench.broker --quick``, ...).

What they share is written once: :mod:`bench.common` (the percentile, the HE32
workload, the machine and load record, the results format, process CPU and RSS
readings) and :mod:`bench.systems` (the systems compared with slotserve:
transformers' static and continuous batching, the token timing and the record
of one system's pass). Not part of the installed package: nothing in slotserve
imports it.
"""
