"""slotserve: a dynamic-batching LLM inference engine, run as a multiprocess
worker pool over ZeroMQ.

This package is the front door: the ``slotserve`` CLI, the local launcher,
and a namespaced re-export of the public API::

    from slotserve import Client, BatchInferenceEngine, SimulatedLLM
"""

from client import BrokerUnavailable, Client, RemoteError
from worker import BatchInferenceEngine, SimulatedLLM

__all__ = ["BatchInferenceEngine", "BrokerUnavailable", "Client", "RemoteError", "SimulatedLLM"]
