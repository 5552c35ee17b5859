"""slotserve's in-process engine and model backends (usable with no broker at all).

    from worker import BatchInferenceEngine, SimulatedLLM
    engine = BatchInferenceEngine(SimulatedLLM(), batch_size=4, stop_token=0)
    engine.submit_request([1, 2, 3], max_tokens=5, callback=print)
    engine.run()
"""

from protocol.enums import FinishReason
from worker.engine import ENGINE_DEFAULT, BatchInferenceEngine
from worker.errors import DuplicateRequestError, ModelError, QueueFullError
from worker.models.simulated import SimulatedLLM
from worker.request import RequestHandle
from worker.scheduler import DEFAULT_AGING_WINDOW, Policy

__all__ = [
    "DEFAULT_AGING_WINDOW",
    "ENGINE_DEFAULT",
    "BatchInferenceEngine",
    "DuplicateRequestError",
    "FinishReason",
    "ModelError",
    "Policy",
    "QueueFullError",
    "RequestHandle",
    "SimulatedLLM",
]
