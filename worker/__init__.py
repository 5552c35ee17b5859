"""slotserve's in-process engine and model backends (usable with no broker at all).

    from worker import BatchInferenceEngine, SimulatedLLM
    engine = BatchInferenceEngine(SimulatedLLM(), batch_size=4, stop_token=0)
    engine.submit_request([1, 2, 3], max_tokens=5, callback=print)
    engine.run()
"""

from protocol.defaults import AGING_WINDOW as DEFAULT_AGING_WINDOW
from protocol.enums import FinishReason
from protocol.errors import UnsupportedError
from protocol.handle import RequestHandle
from protocol.request import DEFAULT, RequestParams
from worker.engine import BatchInferenceEngine
from worker.errors import DuplicateRequestError, ModelError, QueueFullError
from worker.models.simulated import SimulatedLLM
from worker.scheduler import Policy

__all__ = [
    "DEFAULT",
    "DEFAULT_AGING_WINDOW",
    "BatchInferenceEngine",
    "DuplicateRequestError",
    "FinishReason",
    "ModelError",
    "Policy",
    "QueueFullError",
    "RequestHandle",
    "RequestParams",
    "SimulatedLLM",
    "UnsupportedError",
]
