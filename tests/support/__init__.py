"""What the tests share, each helper written once (imported as ``tests.support.<module>``):

- ``waits``: :func:`wait_until` and its building block :class:`Deadline`.
- ``reference``: what a request must produce, computed another way (the spec
  re-stated, the in-process engine over SimulatedLLM, transformers' ``generate``).
- ``messages``: wire messages built for tests (``envelope``).
- ``cores``: a socket-free broker core, the peers' identities, reading its sends.
- ``engine``: scripted, gated and clock stand-ins for the engine tests.
- ``cluster``: the cluster harness (free ports, broker and workers on threads, a fake broker);
  ``gateway`` (a cluster with the HTTP gateway) builds on it (fault injection: ``bench.chaos``).
- ``slot_models`` (the tiny random Llama, random prompts, a runner scenario) and
  ``tiny_text`` (a tiny text model with a real tokenizer): tiny models.
- ``lanes``: the markers ``process`` and ``model`` each room's conftest.py gives its tests, read
  from what each test uses (the fast lane is ``-m "not process and not model"``), and the guard
  that fails a test without ``process`` that starts one.
"""
