"""The embedding worker's pure pieces: pooling (:mod:`worker.models.pooling`: the modes, normalisation,
reading a sentence-transformers folder's config) and :class:`~worker.embeddings.EmbeddingEngine`
with a stand-in model (batches of at most ``batch_size``, the endings: stop with the vector,
cancelled, deadline, error; the refusals), and the generation engine refusing an embedding."""

from __future__ import annotations

import json
import re

import pytest

from protocol.embedding import pack, unpack
from protocol.enums import FinishReason
from protocol.errors import ContextLengthError, UnsupportedError
from protocol.request import RequestParams
from worker import BatchInferenceEngine, SimulatedLLM
from worker.embeddings import EmbeddingEngine
from worker.errors import DuplicateRequestError, ModelError
from worker.models.pooling import Pooling, is_sentence_transformers, pool, read_pooling

torch = pytest.importorskip("torch")


# ---------------------------------------------------------------------------------------- pooling

HIDDEN = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [100.0, 100.0]],   # 2 tokens, then padding
                       [[0.0, 1.0], [2.0, 2.0], [4.0, 0.0]]])      # 3 tokens
MASK = torch.tensor([[1, 1, 0], [1, 1, 1]])


def test_mean_pooling_skips_the_padding():
    out = pool(HIDDEN, MASK, Pooling("mean", normalize=False))
    assert out.tolist() == [[2.0, 3.0], [2.0, 1.0]]


def test_cls_and_last_pooling_take_the_first_and_the_last_prompt_token():
    assert pool(HIDDEN, MASK, Pooling("cls", False)).tolist() == [[1.0, 2.0], [0.0, 1.0]]
    assert pool(HIDDEN, MASK, Pooling("last", False)).tolist() == [[3.0, 4.0], [4.0, 0.0]]


def test_normalisation_gives_unit_vectors():
    out = pool(HIDDEN, MASK, Pooling("last", True))
    assert out.flatten().tolist() == pytest.approx([0.6, 0.8, 1.0, 0.0])
    assert Pooling("mean", True) != Pooling("mean", False)
    with pytest.raises(ValueError, match="pooling must be one of"):
        Pooling("max", True)


def _folder(tmp_path, modules, pooling: dict, bert: dict | None = None):
    (tmp_path / "modules.json").write_text(json.dumps(
        [{"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{kind}"}
         for i, (kind, path) in enumerate(modules)]))
    (tmp_path / "1_Pooling").mkdir(exist_ok=True)
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 8, **pooling}))
    if bert is not None:
        (tmp_path / "sentence_bert_config.json").write_text(json.dumps(bert))
    return tmp_path


ST = [("Transformer", ""), ("Pooling", "1_Pooling"), ("Normalize", "2_Normalize")]


def test_read_pooling_reads_sentence_transformers_configs_old_and_new(tmp_path):
    folder = _folder(tmp_path, ST, {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False},
                     {"max_seq_length": 256, "do_lower_case": False})
    assert is_sentence_transformers(folder)
    assert read_pooling(folder) == Pooling("mean", True, 256, False)
    _folder(tmp_path, ST[:2], {"pooling_mode": "lasttoken"}, {"max_seq_length": 512, "do_lower_case": True})
    assert read_pooling(folder) == Pooling("last", False, 512, True)
    assert not is_sentence_transformers(tmp_path / "1_Pooling")


@pytest.mark.parametrize("modules, pooling, message", [
    ([*ST[:2], ("Dense", "2_Dense")], {"pooling_mode": "mean"}, "Transformer, Pooling"),
    (ST, {"pooling_mode_max_tokens": True}, "exactly one of"),
    (ST, {"pooling_mode": ["mean", "cls"]}, "exactly one of"),
    (ST, {"pooling_mode": "cls", "include_prompt": False}, "include_prompt"),
])
def test_read_pooling_refuses_what_it_would_not_compute_as_the_library(tmp_path, modules, pooling, message):
    with pytest.raises(ValueError, match=message):
        read_pooling(_folder(tmp_path, modules, pooling))


# ---------------------------------------------------------------------------------------- the engine


class StandIn:
    """An embedding model without weights: a prompt's vector is [its length, its first id, its last id]."""

    embedding_size = 3
    vocab_size = 100
    max_seq_len = 8

    def __init__(self) -> None:
        self.calls: list[int] = []
        self.fail = False
        self.tokenizer = self

    def tokenize(self, text: str) -> list[int]:
        return [len(word) for word in text.split()]

    def embed(self, prompts):
        self.calls.append(len(prompts))
        if self.fail:
            raise RuntimeError("out of memory")
        return [pack([float(len(p)), float(p[0]), float(p[-1])]) for p in prompts]


def test_each_step_embeds_at_most_batch_size_requests_in_one_call():
    model = StandIn()
    engine = EmbeddingEngine(model, 4)
    ended = []
    handles = [engine.submit_request([i + 1] * (i % 3 + 1), callback=ended.append) for i in range(10)]
    text = engine.submit_request("four words are here")
    engine.run()
    assert model.calls == [4, 4, 3]
    assert all(h.finish_reason is FinishReason.STOP and h.done() for h in [*handles, text])
    assert handles[4].embedding == [2.0, 5.0, 5.0] and handles[4].usage.prompt_tokens == 2
    assert text.embedding == [4.0, 4.0, 4.0] and text.prompt == [4, 5, 3, 4] and text.tokens == []
    assert unpack(handles[0].embedding_bytes) == handles[0].embedding
    assert len(ended) == 10 and ended[1] == [2, 2]  # (the callback gets the prompt's ids)


def test_cancelled_overdue_and_failed_requests_end_so():
    now = [0.0]
    model = StandIn()
    engine = EmbeddingEngine(model, 8, clock=lambda: now[0])
    cancelled = engine.submit_request([1], request_id="c")
    late = engine.submit_request([2], timeout_s=1.0)
    assert engine.cancel("c") and not engine.cancel("c") and not engine.cancel("nobody")
    now[0] = 2.0
    assert engine.step() == 0
    assert cancelled.finish_reason is FinishReason.CANCELLED and cancelled.embedding is None
    assert late.finish_reason is FinishReason.DEADLINE
    model.fail = True
    failed = engine.submit_request([3])
    engine.step()
    assert failed.finish_reason is FinishReason.ERROR and isinstance(failed.error, ModelError)
    assert "out of memory" in str(failed.error)
    model.fail = False
    again = engine.submit_request([4])
    engine.step()
    assert again.result(0) == [4] and again.embedding == [1.0, 4.0, 4.0]  # (the failure ended its step only)


def test_the_engine_refuses_what_it_cannot_embed_and_queues_nothing():
    engine = EmbeddingEngine(StandIn(), 2)
    with pytest.raises(UnsupportedError, match="generates no tokens"):
        engine.submit(RequestParams([1, 2], 4))
    # (it said "exceeds the served context of 8 tokens (--max-model-len)", a flag that only lowers the limit)
    with pytest.raises(ContextLengthError, match=re.escape("input (9 tokens) exceeds the 8 tokens this model embeds at "
                                                           "most (the model's own limit, or a lower --max-model-len); "
                                                           "shorten it or split it into several inputs")):
        engine.submit_request(list(range(1, 10)))
    with pytest.raises(ValueError, match="outside the vocabulary|vocabulary"):
        engine.submit_request([100])
    with pytest.raises(ValueError, match="resume_tokens"):
        engine.submit(RequestParams([1], 1, kind="embed"), resume_tokens=[5])
    engine.submit_request([1], request_id=7)
    with pytest.raises(DuplicateRequestError):
        engine.submit_request([2], request_id=7)
    assert engine.num_queued == 1
    with pytest.raises(ValueError, match="batch_size"):
        EmbeddingEngine(StandIn(), 0)


def test_the_generation_engine_refuses_an_embedding_request():
    engine = BatchInferenceEngine(SimulatedLLM(), 2)
    with pytest.raises(UnsupportedError, match="gives no embeddings"):
        engine.submit_request([1, 2], 1, kind="embed")
    with pytest.raises(UnsupportedError, match="gives no embeddings"):
        engine.submit(RequestParams([1, 2], 1, kind="embed"))
    assert engine.num_queued == 0


def test_the_warm_up_of_an_embedding_model_is_one_full_step_and_leaves_no_trace():
    from worker.warmup import needs_warmup, warm_up

    model = StandIn()
    engine = EmbeddingEngine(model, 6)
    assert needs_warmup(model) and not needs_warmup(SimulatedLLM())
    report = warm_up(engine)
    assert (report.iterations, report.max_batch, report.failed) == (1, 6, 0)
    assert model.calls == [6] and engine.num_queued == 0
    assert engine.submit_request([1], request_id="warmup-embed-0").request_id == "warmup-embed-0"  # (its ids freed)
