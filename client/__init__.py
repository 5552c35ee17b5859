"""The slotserve client SDK: the engine's API, served by a cluster.

    from client import Client
    with Client("tcp://127.0.0.1:5555") as c:
        c.submit_request([1, 2, 3], max_tokens=5, callback=print)
        c.run()
"""

from client.aio import AsyncClient
from client.client import DEFAULT_ADDRESS, Client
from client.errors import BrokerUnavailable, RemoteError
from client.handle import ClientHandle
from protocol.handle import RequestHandle
from protocol.request import DEFAULT, RequestParams

__all__ = ["AsyncClient", "BrokerUnavailable", "Client", "ClientHandle", "DEFAULT", "DEFAULT_ADDRESS", "RemoteError",
           "RequestHandle", "RequestParams"]
