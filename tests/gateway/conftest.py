"""Fixtures shared by the tests in tests/gateway/ (helpers shared across folders live in tests/support/)."""

import pytest

from tests.support.lanes import mark_lanes


@pytest.fixture(scope="module")
def text_model(tiny_text_dir) -> str:
    """The tiny text model, served by its folder's name (the ``model`` of HTTP requests)."""
    return tiny_text_dir


@pytest.fixture(scope="module")
def cluster(text_model):
    """A broker, one worker (4 slots) serving ``text_model`` and the gateway on a free port, for the
    module (a module that needs another cluster defines its own ``cluster``)."""
    from gateway.config import GatewayConfig
    from tests.support.gateway import start_cluster
    from worker.config import WorkerConfig

    c = start_cluster((WorkerConfig(model=text_model, num_slots=4),), gateway=GatewayConfig(port=0),
                      models=(text_model,))
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def oai(cluster):
    """The official ``openai`` SDK pointed at the module's ``cluster`` gateway (no retries)."""
    import openai

    with openai.OpenAI(base_url=cluster.http_url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def pytest_itemcollected(item):
    """Marks the room's tests ``process`` and ``model`` by what each uses (tests/support/lanes.py)."""
    mark_lanes(item)
