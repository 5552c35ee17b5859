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
"""
