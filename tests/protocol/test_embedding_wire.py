"""Embeddings on the wire (protocol v10) and their pure helpers: the request field ``kind``, the
``EmbeddingVector`` records of ``iteration`` / ``results``, :mod:`protocol.embedding`'s float32
bytes, Matryoshka truncation and cosine similarity, and :class:`ModelLimits`' kind check."""

from __future__ import annotations

import re
import struct

import pytest

from protocol import embedding as emb
from protocol.codec import decode, encode
from protocol.enums import FinishReason, RequestKind
from protocol.errors import ContextLengthError, UnsupportedError
from protocol.framing import fit, request_ids
from protocol.messages import BROKER_TO_CLIENT, WORKER_TO_BROKER, EmbeddingVector, Finished, Iteration, ModelInfo, \
    Register, Results
from protocol.request import ModelLimits, RequestParams


def test_pack_is_little_endian_float32_and_unpack_inverts_it():
    values = [0.5, -1.25, 3.0e-8, 1.0 / 3.0]
    data = emb.pack(values)
    assert data == struct.pack("<4f", *values)  # OpenAI's base64 payload: little-endian float32
    assert emb.unpack(data) == list(struct.unpack("<4f", data))
    assert emb.unpack(data)[3] != 1.0 / 3.0 and abs(emb.unpack(data)[3] - 1.0 / 3.0) < 1e-7  # (float32 rounding)
    with pytest.raises(ValueError, match="4 bytes each"):
        emb.unpack(b"\x00" * 6)


def test_truncate_keeps_a_prefix_at_unit_length():
    out = emb.truncate([3.0, 4.0, 12.0], 2)
    assert out == [0.6, 0.8]
    assert emb.truncate([0.0, 0.0, 1.0], 2) == [0.0, 0.0]  # (a zero prefix stays zero)
    for bad in (0, 4):
        with pytest.raises(ValueError, match="dimensions must be in"):
            emb.truncate([1.0, 2.0, 3.0], bad)


def test_cosine():
    assert emb.cosine([1.0, 0.0], [2.0, 0.0]) == pytest.approx(1.0)
    assert emb.cosine([1.0, 0.0], [0.0, 3.0]) == pytest.approx(0.0)
    assert emb.cosine([1.0, 1.0], [-1.0, -1.0]) == pytest.approx(-1.0)
    assert emb.cosine([1.0, 2.0], [2.0, 1.0]) == pytest.approx(4.0 / 5.0)
    assert emb.cosine([0.0, 0.0], [1.0, 1.0]) == 0.0
    with pytest.raises(ValueError, match="cannot be compared"):
        emb.cosine([1.0], [1.0, 2.0])


def test_an_embedding_request_takes_text_or_ids_max_tokens_1_and_no_generation_option():
    params = RequestParams("a sentence", 1, kind="embed", priority=-1, timeout_s=5.0)
    assert params.kind == RequestKind.EMBED and type(params.kind) is str
    assert RequestParams([1, 2], 4).kind == RequestKind.GENERATE
    with pytest.raises(ValueError, match="kind must be one of"):
        RequestParams([1], 1, kind="score")
    with pytest.raises(ValueError, match="max_tokens: an embedding generates no token"):
        RequestParams([1], 2, kind="embed")
    with pytest.raises(ValueError, match="temperature: a generation option"):
        RequestParams([1], 1, kind="embed", temperature=0.5)
    with pytest.raises(ValueError, match="stop: a generation option"):
        RequestParams([1], 1, kind="embed", stop=["x"])
    with pytest.raises(ValueError, match="not chat messages"):
        RequestParams([{"role": "user", "content": "hi"}], 1, kind="embed")


def test_model_limits_refuse_the_kind_a_model_does_not_serve_and_an_embedding_over_its_length():
    embed, generate = RequestParams([1, 2, 3], 1, kind="embed"), RequestParams([1, 2, 3], 4)
    with pytest.raises(UnsupportedError, match="gives no embeddings"):
        ModelLimits(10, 64, embeds=False).check(embed)
    with pytest.raises(UnsupportedError, match="generates no tokens"):
        ModelLimits(10, 64, embeds=True).check(generate)
    ModelLimits(10, 64).check(embed)  # (unknown: not checked)
    ModelLimits(10, 3, embeds=True).check(embed)  # the prompt alone must fit: 3 <= 3
    with pytest.raises(ContextLengthError, match=re.escape("input (3 tokens) exceeds the 2 tokens this model embeds at most "
                                                           "(the model's own limit, or a lower --max-model-len); shorten "
                                                           "it or split it into several inputs")):
        ModelLimits(10, 2, embeds=True).check(embed)
    with pytest.raises(ContextLengthError):
        ModelLimits(10, 30, embeds=True).check(RequestParams("text", 1, kind="embed"), prompt_len=31)


def test_embedding_requests_and_vectors_survive_the_wire():
    vector = emb.pack([0.25, -0.5, 1.0])
    it = Iteration(finished=(Finished(7, FinishReason.STOP, prompt_tokens=3),),
                   embeddings=(EmbeddingVector(7, vector),))
    back = decode(encode(it), WORKER_TO_BROKER)
    assert back == it and type(back.embeddings[0].vector) is bytes
    assert request_ids(back) == [7]
    res = Results(finished=(Finished("a", FinishReason.STOP),), embeddings=(EmbeddingVector("a", vector),))
    res = decode(encode(res), BROKER_TO_CLIENT)
    assert emb.unpack(res.embeddings[0].vector) == [0.25, -0.5, 1.0]


def test_a_split_iteration_keeps_each_vector_with_its_ending():
    endings = tuple(Finished(k, FinishReason.STOP, prompt_tokens=2) for k in range(6))
    vectors = tuple(EmbeddingVector(k, emb.pack([float(k)] * 256)) for k in range(6))
    whole = encode(Iteration(finished=endings, embeddings=vectors))
    framed = fit(Iteration(finished=endings, embeddings=vectors), len(whole) // 3)
    assert not framed.refused and len(framed.frames) > 1
    parts = [decode(data, WORKER_TO_BROKER) for data, _ in framed.frames]
    for part in parts:
        assert [v.request_id for v in part.embeddings] == [f.request_id for f in part.finished]
    assert sorted(v.request_id for p in parts for v in p.embeddings) == list(range(6))


def test_register_checks_the_embedding_size_and_matryoshka_dims():
    Register("m", 2, 2, ModelInfo(vocab_size=10, embedding_size=8, matryoshka_dims=(4, 8)))
    for size, dims in ((0, ()), (None, (4,)), (8, (16,)), (8, (0,))):
        with pytest.raises(ValueError, match="embedding_size"):
            Register("m", 2, 2, ModelInfo(vocab_size=10, embedding_size=size, matryoshka_dims=dims))
