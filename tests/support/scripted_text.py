"""A scripted model with a real tokenizer behind the whole in-process stack (broker and worker on
threads, the real client, the gateway's app): what tests of every entry point over a real
vocabulary (SmolLM2's, Qwen2.5's) share."""

from __future__ import annotations

import contextlib

from tests.support.vocab import QWEN, SMOLLM2, kept_tokenizer


TEXT = "Hello there, friend."
"""What a :class:`ScriptedText` writes unless told otherwise."""


class ScriptedText:
    """A model with the real tokenizer ``tok`` that writes ``text``'s tokens, then its EOS, then again
    (past an ignored EOS): the next token follows the sequence's last one in that script, its first
    after any token not in it (a prompt's last token: none of the script's). ``prompts``: each prompt
    it was given (a sequence whose last token is none of the script's: a request's first step)."""

    def __init__(self, tok, text: str = TEXT) -> None:
        from worker.models.hf_text import HFTextCodec

        self.tokenizer = HFTextCodec(tok)
        self.vocab_size = len(tok)
        self.eos_token_ids = (tok.eos_token_id,)
        self.script = [*self.tokenizer.encode(text), tok.eos_token_id]
        assert len(set(self.script)) == len(self.script)  # (each token's successor is one)
        self._next = {t: self.script[(i + 1) % len(self.script)] for i, t in enumerate(self.script)}
        self.prompts: list[tuple[int, ...]] = []

    def next_tokens(self, sequences):
        self.prompts += [tuple(s) for s in sequences if s[-1] not in self._next]
        return [self._next.get(s[-1], self.script[0]) for s in sequences]


@contextlib.contextmanager
def scripted_stack(vocab: str, text: str, *, gateway_tokenizer: bool = False):
    """``(http, client, model, tok)`` over a :class:`ScriptedText` of ``text`` served as ``"m"``:
    the gateway app (starlette's TestClient), a client, the model and the transformers tokenizer of
    ``vocab`` (``"smollm2"`` or ``"qwen2.5"``; pytest skips where it is not installed).
    ``gateway_tokenizer``: the gateway renders with the model's tokenizer too (else it has none)."""
    import pytest
    from starlette.testclient import TestClient

    from client import Client
    from gateway.app import create_app
    from gateway.config import GatewayConfig
    from gateway.tokenizer import Tokenizer
    from tests.support.cluster import ThreadCluster
    from tests.support.waits import wait_until

    tok = kept_tokenizer(SMOLLM2 if vocab == "smollm2" else QWEN)
    if tok is None:
        pytest.skip(f"{vocab}'s tokenizer is not installed")
    model = ScriptedText(tok, text)
    loader = (lambda name: Tokenizer(model.tokenizer, tok)) if gateway_tokenizer else None
    with ThreadCluster() as cluster:
        cluster.add_worker(model, model="m")
        app = create_app(GatewayConfig(broker=cluster.frontend), loader)
        with Client(cluster.frontend, model="m") as c, TestClient(app) as http:
            c.wait_for_model(30)
            wait_until(lambda: http.get("/v1/models").json()["data"], 30, "the gateway to see the model")
            yield http, c, model, tok
