"""A client's submit is admitted whole when it can be (``JobTable._admit_all``: every entry a valid
request under a new id, one priority, room in the queue for all) and entry by entry otherwise
(``JobTable._admit_each``): both give the same jobs, keys, queue order, deadlines, counters and
endings."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from broker.config import BrokerConfig
from broker.jobs import JobTable
from broker.outbox import Outbox
from protocol.messages import Rejected
from tests.support.messages import envelope

ENTRY = st.one_of(
    st.builds(lambda rid, prio, timeout: envelope(rid, [1, 2, 3], 4, priority=prio, timeout_s=timeout),
              st.integers(0, 6), st.sampled_from([0, 0, 0, 1]), st.sampled_from([None, None, 2.0])),
    st.builds(lambda rid: Rejected(rid, "bad"), st.integers(0, 6)),
)


def _state(table: JobTable, out: Outbox) -> tuple:
    order = []
    for q in table.queues.values():
        while (job := q.pop()) is not None:
            order.append((job.key, job.rid, job.deadline_s, job.arrival_s, job.tokens))
    return (order, sorted(table.by_key), table.by_client, sorted(table._deadlines), dict(table.counters),
            {c: r.finished for c, r in out.results.items()}, table._next_key)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(ENTRY, max_size=6), max_size=4), st.sampled_from([4, 10, 1000]))
def test_a_submit_admitted_whole_is_one_admitted_entry_by_entry(batches, max_queue):
    def run(whole: bool) -> tuple:
        table = JobTable(BrokerConfig(max_queue=max_queue), dict.fromkeys(("duplicates", "errors", "queue_full"), 0))
        out = Outbox()
        for i, batch in enumerate(batches):
            entries = tuple(batch)
            if whole:
                table.admit(b"c", entries, "m", float(i), out, lambda: None)
            else:
                q = table.queue("m")
                attached = table.of_client.setdefault(b"c", {})
                table._admit_each(b"c", entries, attached, q, "m", float(i), out, lambda: None)
        return _state(table, out)

    assert run(True) == run(False)
