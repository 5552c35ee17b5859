"""Fixtures shared by the tests in tests/gateway/ (helpers shared across folders live in tests/support/)."""

import pytest

from tests.support.gateway import SharedClusters
from tests.support.lanes import mark_lanes
from tests.support.schedule import file_of, files_using

_SHARED = SharedClusters()  # (the test process's: closed by the hook below, or at the session's end)


@pytest.fixture(scope="module")
def text_model(tiny_text_dir) -> str:
    """The tiny text model, served by its folder's name (the ``model`` of HTTP requests)."""
    return tiny_text_dir


@pytest.fixture(scope="session")
def long_text_model(tmp_path_factory) -> str:
    """The tiny text model with a 2,048-token context (the tools' prompts take ~900 of its tokens), made
    once for the test process; read-only. A module serves it as its ``text_model``."""
    from tests.support.tiny_text import make_tiny_text_model

    return make_tiny_text_model(tmp_path_factory.mktemp("tiny-text-2048"), max_positions=2048)


@pytest.fixture(scope="session")
def shared_cluster():
    """The clusters the modules run in a row share (:class:`tests.support.gateway.SharedClusters`);
    what is left runs until the session's end."""
    try:
        yield _SHARED
    finally:
        _SHARED.close()


@pytest.fixture(scope="module")
def cluster(text_model, shared_cluster):
    """A broker, one worker (4 slots) serving ``text_model`` and the gateway on a free port, shared with
    the modules run next to this one that use it with the same ``text_model`` (the suite's order puts
    them side by side: tests/support/schedule.py); a module that needs another cluster, or a fresh
    one, defines its own ``cluster``."""
    from gateway.config import GatewayConfig
    from tests.support.gateway import start_cluster
    from worker.config import WorkerConfig

    return shared_cluster.get(text_model, lambda: start_cluster(
        (WorkerConfig(model=text_model, num_slots=4),), gateway=GatewayConfig(port=0), models=(text_model,)))


@pytest.fixture(scope="module")
def oai(cluster):
    """The official ``openai`` SDK pointed at the module's ``cluster`` gateway (no retries)."""
    import openai

    with openai.OpenAI(base_url=cluster.http_url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


_SHARING: list[set[str]] = []  # [the files of which a test uses the shared clusters], once read


def _shares(item) -> bool:
    """True when a test of ``item``'s file uses the shared clusters (``shared_cluster``), as
    tests/support/schedule.py groups the files."""
    if not _SHARING:
        _SHARING.append(files_using(item.session.items, "shared_cluster"))
    return file_of(item) in _SHARING[0]


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """After the last file in a row that uses the shared clusters (its module's fixtures torn down
    already): stop them, so that they do not run on beside the files that follow."""
    if nextitem is None or not _shares(nextitem):
        _SHARED.close()


def pytest_itemcollected(item):
    """Marks the room's tests ``process`` and ``model`` by what each uses (tests/support/lanes.py)."""
    mark_lanes(item)


def _served(app, client):
    """``app`` in a ``TestClient`` whose ``scripted`` is ``client`` (the scripted broker client it sends
    to), yielded; then the client's answering threads joined."""
    from starlette.testclient import TestClient

    with TestClient(app) as http:
        http.scripted = client
        yield http
    for t in client.threads:
        t.join(10)


@pytest.fixture
def chat_http():
    """The handlers app (chat, completions, ``/tokenize``) over a scripted broker client, no sockets
    (:mod:`tests.support.scripted`): a ``TestClient`` whose ``scripted`` is the client (what it was
    sent: ``submitted``), the letters tokenizer."""
    from gateway.tokenizer import Tokenizers
    from tests.support.scripted import ScriptedClient, ScriptedLink, handlers_app, letters

    client = ScriptedClient()
    yield from _served(handlers_app(Tokenizers(letters), ScriptedLink(client)), client)


@pytest.fixture
def messages_http():
    """The Messages API app over a scripted broker client that answers with a set output, no sockets
    (:class:`tests.gateway.test_tools_stream.OutputClient`): a ``TestClient`` whose ``scripted`` is
    the client."""
    from gateway.config import GatewayConfig
    from tests.gateway.test_tools_stream import OutputClient
    from tests.support.scripted import ScriptedLink, messages_app

    client = OutputClient()
    yield from _served(messages_app(ScriptedLink(client), GatewayConfig()), client)


@pytest.fixture
def responses_http():
    """The Responses API app (a store of 8 responses, 60 s) over a scripted broker client that answers
    with a set output, no sockets (:class:`tests.gateway.test_tools_stream.OutputClient`): a
    ``TestClient`` whose ``scripted`` is the client."""
    from gateway.config import GatewayConfig
    from gateway.response_store import ResponseStore
    from tests.gateway.test_tools_stream import OutputClient
    from tests.support.scripted import ScriptedLink, responses_app

    client = OutputClient()
    yield from _served(responses_app(ScriptedLink(client), GatewayConfig(), ResponseStore(8, 60.0)), client)
