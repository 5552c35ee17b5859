"""The broker's decisions about workers: registration and loading, their
iterations (tokens and endings routed to clients), dispatch of queued
requests to their credits, and what happens when one is lost or hangs.

The state of each worker lives in :mod:`broker.registry`; this module
changes it. Invariants (kept here):

- a worker never holds more requests than its ``max_inflight`` credits
  (:meth:`WorkerHandler.dispatch` assigns only to a worker with a credit);
- a request lost with a worker goes back to the head of its queue with the
  tokens the client already has (``resume_tokens``), so the next worker
  continues from there: no gap, no duplicate (:meth:`WorkerHandler.lost`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

from broker.config import BrokerConfig
from broker.jobs import JobTable
from broker.models import ServedModels
from broker.outbox import Outbox, ResultsDraft, Side, encoded_size
from broker.prefix import MIN_MATCH, PrefixRouter, prompt_key
from broker.registry import LoadingWorker, WorkerRegistry, WorkerState
from protocol.enums import ErrorCode, FinishReason
from protocol.messages import (
    Assign, Bye, EmbeddingVector, Envelope, Error, Finished, Heartbeat, Iteration, Loading, Logprobs, Message, Register,
    Started, Text, Welcome,
)
from protocol.request import RequestParams

log = logging.getLogger(__name__)

_MAX_HUNG_REMEMBERED = 10_000  # identities of hung workers kept for probation (bounded memory)
_tuple_new = tuple.__new__  # a record built without its Python __new__ (its fields given in full)
_ERROR = FinishReason.ERROR  # (read per request: a global is cheaper than the enum's class, see broker.jobs)


def _logprob_ids(rec: Logprobs) -> Iterator[int]:
    """The token ids a :class:`~protocol.messages.Logprobs` record names: its entries' and its
    prompt entries' alternatives, and its ``prompt_ids``."""
    for e in rec.entries:
        for i, _ in e.top:
            yield i
    for e in rec.prompt or ():
        if e is not None:
            for i, _ in e.top:
                yield i
    yield from rec.prompt_ids or ()


def _overrun(w: WorkerState, job, withheld: int) -> str:
    """The error message of a request ``w`` gave more tokens than its ``max_tokens`` (the job's
    tokens and ``withheld``, those past it, which the broker did not relay)."""
    return (f"worker {w.name} sent {len(job.tokens) + withheld} tokens for a request of max_tokens "
            f"{job.params.max_tokens}; those past it were not relayed and the request was ended there; "
            "check that worker")


class WorkerHandler:
    """Handles every worker event on the registry, the job table and the served models."""

    def __init__(self, config: BrokerConfig, counters: dict[str, int], registry: WorkerRegistry, jobs: JobTable,
                 models: ServedModels) -> None:
        self.config = config
        self.counters = counters
        self.registry = registry
        self._jobs = jobs
        self._models = models
        self._hung: dict[bytes, int | None] = {}  # identity -> progress when found hung
        self.prefixes = PrefixRouter() if config.prefix_routing else None  # what was sent where

    # ------------------------------------------------------------------ joining

    def register(self, identity: bytes, msg: Register, now: float, out: Outbox) -> None:
        """A worker is ready to serve ``msg.model`` (and its aliases): it is
        welcomed, gets requests (unless it was found hung before and has not
        moved since) and clients hear of the model."""
        old = self.registry.get(identity)
        if old is not None:
            # The worker re-registered: it dropped whatever it held.
            self.lost(old, now, out, failed=False)
        welcome = self._models.welcome(now, msg)
        if encoded_size(welcome) > msg.max_message_bytes:
            self._refuse_registration(identity, msg, welcome, out)
            return
        self.registry.loading.pop(identity, None)  # loaded
        w = WorkerState(identity, msg.model, msg.num_slots, msg.max_inflight, msg.info, msg.worker_name, now,
                        max_message_bytes=msg.max_message_bytes)
        if identity in self._hung:
            # Found hung before: on probation until its progress moves past
            # the value it was stuck at.
            w.suspect = True
            w.progress = self._hung[identity]
        self.registry.add(w)
        self._models.served[msg.model] = msg.info
        self._models.claim(msg.model, msg.aliases, msg.worker_name, out)
        self._jobs.queue(msg.model)
        out.send(Side.BACKEND, identity, welcome)
        self.dispatch(msg.model, now, out)
        self._models.tell_clients(now, out)

    def _refuse_registration(self, identity: bytes, msg: Register, welcome: Welcome, out: Outbox) -> None:
        """The worker's frame limit is smaller than its ``welcome`` (which lists
        every model served), so it could never complete its
        registration: it gets no requests, is told why in a short ``error``
        (it registers again after its liveness window, and fits once its limit
        is raised or fewer models are served), and the operator is told what
        to do. Counted in ``control_too_large``; nobody else is affected, but
        a model it alone was loading is no longer waited for."""
        self.counters["control_too_large"] += 1
        limit, size = msg.max_message_bytes, encoded_size(welcome)
        log.warning("worker %s cannot register model %r: the broker's welcome (%d bytes, %d models) exceeds its "
                    "frame limit of %d bytes (max_message_bytes); raise --max-message-bytes on that worker "
                    "(to %d or more)", msg.worker_name or identity.hex()[:8], msg.model, size,
                    len(welcome.models), limit, size)
        out.send(Side.BACKEND, identity, Error(ErrorCode.TOO_LARGE, (
            f"the broker's welcome ({size} bytes) exceeds this worker's frame limit of {limit} bytes "
            f"(max_message_bytes), so it cannot register: raise --max-message-bytes on this worker "
            f"(to {size} or more)")))
        lw = self.registry.loading.get(identity)
        if lw is not None:
            self._loader_gone(lw, out, f"the worker loading it ({lw.name}) cannot register (its "
                                       "max_message_bytes is too small for the broker's welcome)")
            if lw.model in self.config.on_demand_models:  # (it would try again, and be refused again, forever)
                self._models.fail_load(lw.model, f"the worker loading model {lw.model!r} ({lw.name}) cannot "
                                                 f"register it: its max_message_bytes ({limit}) is too small for "
                                                 f"the broker's welcome ({size} bytes)", out)

    def loading(self, identity: bytes, msg: Loading, now: float, out: Outbox) -> None:
        """A worker starts loading ``msg.model``: until it registers (or stops,
        or falls silent), requests for that model wait in its queue."""
        old = self.registry.get(identity)
        if old is not None:  # it restarted its model: whatever it held is void
            self.lost(old, now, out, failed=False)
        self.registry.loading[identity] = LoadingWorker(identity, msg.model, msg.worker_name, now)
        self._models.claim(msg.model, msg.aliases, msg.worker_name, out)
        self._jobs.queue(msg.model)
        log.info("worker %s is loading model %r", msg.worker_name, msg.model)
        out.send(Side.BACKEND, identity, self._models.welcome(now))
        self._models.tell_clients(now, out)

    def _loader_gone(self, lw: LoadingWorker, out: Outbox, why: str | None = None) -> None:
        """A worker stopped loading without registering (it left, fell silent
        or could not register: ``why``). If nobody serves or loads its model
        now and the start-up grace is over, the requests waiting for it end
        ``unknown_model``."""
        del self.registry.loading[lw.identity]
        if self._models.grace_over:
            self._models.fail_unknown(out, why or f"the worker loading it ({lw.name}) stopped")
        self._models.tell_clients(lw.last_seen_s, out)

    def unregistered(self, identity: bytes, msg: Message, now: float, out: Outbox) -> None:
        """A message from a worker that is not registered: one loading its model
        (it heartbeats, or gave up: ``bye``), or one this broker does not know
        (it restarted?), told to register again."""
        lw = self.registry.loading.get(identity)
        if lw is not None:
            lw.last_seen_s = now
            if isinstance(msg, Bye) and not msg.load_failed:
                # told to stop (a signal) while loading: no fault of the model's. Its requests wait for its next
                # load (on demand: its supervisor loads it again while it is wanted), as for a loader that left
                log.info("worker %s stopped while loading model %r (told to stop: %s)", lw.name, lw.model,
                         msg.reason or "no reason given")
                self._loader_gone(lw, out, f"the worker loading it ({lw.name}) was stopped before it loaded it")
            elif isinstance(msg, Bye):
                log.warning("worker %s stopped while loading model %r: %s", lw.name, lw.model, msg.reason)
                # the waiting requests' error says why (a bad option, a file that cannot load, memory)
                self._loader_gone(lw, out, f"the worker loading it ({lw.name}) stopped: {msg.reason}"
                                  if msg.reason else None)
                if lw.model in self.config.on_demand_models:
                    self._models.fail_load(lw.model, f"the worker loading model {lw.model!r} stopped "
                                                     f"({msg.reason or 'no reason given'})", out)
        elif not isinstance(msg, Bye):
            out.send(Side.BACKEND, identity, Error(
                ErrorCode.NOT_REGISTERED, "this broker does not know you (restarted?): register again"))

    # ------------------------------------------------------------------ serving

    def iteration(self, w: WorkerState, msg: Iteration, now: float, out: Outbox) -> None:
        """One engine iteration of ``w``: its tokens, texts, prompt lengths,
        logprobs, embeddings and endings go to their clients; freed credits take queued requests."""
        w.progress_s = now
        if w.suspect:
            self._recovered(w, now, out)
        tokens = msg.tokens
        vocab = w.info.vocab_size
        if tokens and (min(tokens) < 0 or (vocab is not None and max(tokens) >= vocab)):  # (C speed)
            self._foreign_tokens(w, zip(msg.ids, tokens), now, out)
        if msg.logprobs:  # (the ids they name, for the requests that ask)
            named = [(r.request_id, i) for r in msg.logprobs for i in _logprob_ids(r)]
            if named and (min(i for _, i in named) < 0 or (vocab is not None and max(i for _, i in named) >= vocab)):
                self._foreign_tokens(w, named, now, out)
        self._route_tokens(w, msg, now, out)
        jobs = self._jobs.by_key
        me = w.identity
        for key, text in msg.texts:
            job = jobs.get(key)
            if job is not None and job.worker == me and job.client is not None:
                out.result(job.client).texts.append(Text(job.rid, text))
        for key, n, cached in msg.started:  # (text and chat prompts' lengths, with their first tokens)
            job = jobs.get(key)
            if job is not None and job.worker == me and job.client is not None:
                n, cached = self._counts(w, n, cached, job.params)
                if n is not None:  # (else the client learns the length, if at all, from the ending)
                    out.result(job.client).started.append(Started(job.rid, n, cached))
        for rec in msg.logprobs:  # (requests that ask: with their tokens, so under the same rule)
            job = jobs.get(rec.request_id)
            if job is not None and job.worker == me and job.client is not None:
                out.result(job.client).logprobs.append(rec._replace(request_id=job.rid))
        for key, vector in msg.embeddings:  # (embedding requests: with their endings, below)
            job = jobs.get(key)
            if job is not None and job.worker == me and job.client is not None:
                out.result(job.client).embeddings.append(EmbeddingVector(job.rid, vector))
        if msg.finished:
            self._endings(w, msg.finished, now, out)
            self.dispatch(w.model, now, out)

    def _foreign_tokens(self, w: WorkerState, named: Iterable[tuple[int, int]], now: float, out: Outbox) -> None:
        """An iteration of ``w`` names (``named``: ``(broker key, token id)``, its tokens or the
        ids of its logprobs records) token ids outside ``w``'s vocabulary ``[0, vocab_size)``,
        which no model of it can produce: each request with one ends now, ``model_error`` (none
        of its output in the iteration is relayed: a client would render the id, and a migration
        would resume with it), and is cancelled on ``w``, its credit back; the other requests in
        the iteration are served as before. Logged once per worker."""
        table = self._jobs
        jobs = table.by_key
        me = w.identity
        vocab = w.info.vocab_size
        bad: dict[int, int] = {}
        for key, tok in named:
            if (tok < 0 or (vocab is not None and tok >= vocab)) and key not in bad:
                bad[key] = tok
        if "token ids" not in w.faults:
            w.faults.add("token ids")
            log.warning("worker %s produced token ids outside its model's vocabulary [0, %s) (e.g. %d): their "
                        "requests end model_error; is its model the one it registered?", w.name, vocab,
                        next(iter(bad.values())))
        cancels: list[int] = []
        for key, tok in bad.items():
            job = jobs.get(key)
            if job is None or job.worker != me:
                continue
            w.inflight.discard(key)
            cancels.append(key)
            table.finish(job, FinishReason.ERROR, ErrorCode.MODEL_ERROR,
                         f"worker {w.name} produced token id {tok}, outside the model's vocabulary "
                         f"[0, {vocab if vocab is not None else 'vocab_size'}): the request was ended there; "
                         "check that worker", out)
        if cancels:
            out.cancels({me: cancels})
            self.dispatch(w.model, now, out)

    def _route_tokens(self, w: WorkerState, msg: Iteration, now: float, out: Outbox) -> None:
        """Append each new token to its job and to its client's results (the hot
        loop: one pass per token, locals only; the last client's draft lists kept at hand, as
        an iteration's tokens mostly go to few clients). The broker is the trust boundary: a
        token past a request's ``max_tokens`` (a faulty worker's) is never appended nor relayed,
        and its request ends ``model_error`` (:meth:`_overran`)."""
        table = self._jobs
        jobs = table.by_key
        me = w.identity
        results = out.results
        ttft = table.timings["ttft"] if table.record_timings else None
        stale = 0
        last = add_id = add_token = None
        over: dict[int, int] | None = None  # broker key -> tokens withheld past its max_tokens
        for key, tok in zip(msg.ids, msg.tokens):
            job = jobs.get(key)
            if job is None or job.worker != me:
                stale += 1  # the job migrated or ended meanwhile (counted, not its tokens: the rare case)
                continue
            tokens = job.tokens
            if len(tokens) >= job.params[1]:  # (max_tokens) a token past it: withheld
                if over is None:
                    over = {}
                over[key] = over.get(key, 0) + 1
                stale += 1
                continue
            if ttft is not None and job.first_token_s is None:
                job.first_token_s = now
                ttft.append(now - job.arrival_s)
            tokens.append(tok)
            client = job.client
            if client is not None:
                if client != last:
                    r = results.get(client)
                    if r is None:
                        r = results[client] = ResultsDraft()
                    last, add_id, add_token = client, r.ids.append, r.tokens.append
                add_id(job.rid)
                add_token(tok)
        n = len(msg.ids) - stale
        self.counters["tokens_out"] += n
        if n:
            w.iterations += 1
        if over:
            self._overran(w, over, now, out)

    def _overran(self, w: WorkerState, over: dict[int, int], now: float, out: Outbox) -> None:
        """``w`` sent tokens past ``max_tokens`` for the requests of ``over`` (broker key -> the
        tokens withheld): each ends now, ``model_error`` (its tokens up to ``max_tokens`` were
        relayed; none of its other output in the iteration is), and is cancelled on ``w``, its
        credit back; the other requests are served as before. Logged once per worker."""
        self._faulty(w, "tokens past max_tokens", "the tokens past it were withheld and each request that overran "
                     "ended model_error (cancelled on the worker); its other requests are served as before")
        table = self._jobs
        cancels: list[int] = []
        for key, withheld in over.items():
            job = table.by_key[key]
            w.inflight.discard(key)
            cancels.append(key)
            table.finish(job, FinishReason.ERROR, ErrorCode.MODEL_ERROR, _overrun(w, job, withheld), out)
        out.cancels({w.identity: cancels})
        self.dispatch(w.model, now, out)

    def _endings(self, w: WorkerState, finished: tuple[Finished, ...], now: float, out: Outbox) -> None:
        """Requests ``w`` reports ended: each gives back its credit and ends (with
        the broker's verdict, if it decided one while the request ran). Its counts are checked
        (:meth:`_counts`), and its code made to agree with its ``finish_reason`` (an ``error``
        without one gets ``internal``; another ending's is dropped, with its message)."""
        table = self._jobs
        jobs = table.by_key
        me = w.identity
        inflight = w.inflight
        latency = table.timings["latency"] if table.record_timings else None
        done: list = []  # (what JobTable.finish_all takes, in the worker's order: the jobs, their clients' endings)
        ends: list[Finished] = []
        add_job, add_end = done.append, ends.append
        for key, reason, code, message, prompt_tokens, stop_reason, cached in finished:  # (one unpacking each)
            job = jobs.get(key)
            if job is None or job.worker != me or key not in inflight:  # (not its, or named twice)
                continue
            inflight.discard(key)  # the credit comes back
            if latency is not None:
                latency.append(now - job.arrival_s)
            params = job.params
            add_job(job)
            if job.verdict is not None:  # the broker ended it already (the worker's word comes after)
                add_end(Finished(job.rid, _ERROR, *job.verdict))
            else:
                prompt = params[0]
                if not (prompt_tokens is not None and type(prompt) is not str and type(prompt[0]) is int
                        and prompt_tokens == len(prompt)
                        and (cached is None or 0 <= cached <= prompt_tokens)):  # (sound as it comes, mostly)
                    prompt_tokens, cached = self._counts(w, prompt_tokens, cached, params)
                if (reason is _ERROR) is (code is None):  # (an error, and only one, has a code)
                    self._faulty(w, "error codes", "each ending's code was made to agree with its finish_reason "
                                 "(an error with none: internal); its requests are served as before")
                    if code is None:
                        code, message = ErrorCode.INTERNAL, message or f"worker {w.name} ended it with an unnamed error"
                    else:
                        code = message = None
                add_end(_tuple_new(Finished, (job.rid, reason, code, message, prompt_tokens, stop_reason, cached)))
        table.finish_all(done, ends, out)

    def _counts(self, w: WorkerState, prompt_tokens: int | None, cached_tokens: int | None,
                params: RequestParams) -> tuple[int | None, int | None]:
        """A worker's ``prompt_tokens`` and ``cached_tokens`` for one request (``params``), as
        relayed to its client: a count that cannot be true (negative; for a token-id prompt, a
        length other than its own; more tokens cached than the prompt has; a text prompt's
        cached tokens without its length, which the worker knew once it prefilled) becomes None
        (unknown), and the worker is logged once, so a faulty worker's numbers never reach usage,
        handles or JSONL rows. The request itself is unaffected."""
        known = len(params.prompt) if params.is_token_prompt else None  # (a client counts it so)
        bad = prompt_tokens is not None and (prompt_tokens < 0 or (known is not None and prompt_tokens != known))
        if bad:
            prompt_tokens = cached_tokens = None
        elif cached_tokens is not None and not 0 <= cached_tokens <= (
                prompt_tokens if prompt_tokens is not None else known if known is not None else -1):
            bad, cached_tokens = True, None
        if bad:
            self._faulty(w, "token counts", "the counts were dropped (unknown to the client); its requests are "
                         "served as before")
        return prompt_tokens, cached_tokens

    def _faulty(self, w: WorkerState, what: str, done: str) -> None:
        """Log, once per worker, that it reported ``what`` that cannot be true, and ``done``: what the
        broker did about it, its requests included (the counts dropped and the requests served as
        before; the requests that overran ``max_tokens`` ended ``model_error``)."""
        if what not in w.faults:
            w.faults.add(what)
            log.warning("worker %s reported impossible %s (negative, a part larger than its whole, past a "
                        "request's max_tokens, or contradicting what it said before): %s; is it a slotserve worker "
                        "of this version?", w.name, what, done)

    def heartbeat(self, w: WorkerState, msg: Heartbeat, now: float, out: Outbox) -> None:
        """A heartbeat whose ``progress`` moved is progress (a long model step
        heartbeats from its I/O thread without sending an iteration). Its
        ``prefix_cache`` numbers, when it has a prefix cache, are kept for
        ``status`` and the metrics, unless they cannot be true (negative; hits over queries;
        more bytes held than the budget; queries or hits below its last report's)."""
        pc = msg.prefix_cache
        if pc is not None:
            old = w.prefix_cache  # (its counts are cumulative, its blocks within the budget)
            if min(pc) < 0 or pc.hits > pc.queries or pc.used_bytes > pc.budget_bytes or (
                    old is not None and (pc.queries < old.queries or pc.hits < old.hits)):
                self._faulty(w, "prefix-cache numbers", "they were dropped (its last sound report stays); its "
                             "requests are served as before")
            else:
                w.prefix_cache = pc
        p = msg.progress
        if p is not None:
            if w.progress is not None and p != w.progress:
                w.progress_s = now
                if w.suspect:
                    self._recovered(w, now, out)
            w.progress = p

    def dispatch(self, model: str, now: float, out: Outbox) -> None:
        """Assign queued requests of ``model`` to workers with credits, one
        ``assign`` message per worker (a request past its deadline ends instead).

        Each request goes where :meth:`~broker.registry.WorkerRegistry.pick` would send it (most
        free slots, earliest registered on ties), chosen here inline among the workers that had a
        credit when the pass began (none gains one during it): this is once per request. With
        prefix routing, a prompt of :data:`~broker.prefix.MIN_MATCH` units or more goes where
        :meth:`~broker.prefix.PrefixRouter.choose` says instead (a shorter token-id or text prompt
        cannot match: its key is never made)."""
        q = self._jobs.queues.get(model)
        if not q:
            return
        assigns: dict[bytes, list[Envelope]] = {}
        prefixes = self.prefixes
        peers = self.registry.for_model(model)
        if len(peers) < 2:
            prefixes = None  # one worker: nothing to choose (its tree would only cost time)
        finish = self._jobs.finish
        while q:
            ready = [w for w in peers if not w.suspect and len(w.inflight) < w.max_inflight]
            if not ready:
                break
            credits = sum([w.max_inflight - len(w.inflight) for w in ready])
            only = ready[0] if len(ready) == 1 else None
            for job in q.pop_many(credits):  # (best first, as many as there are credits: one each,
                timeout_s = None               # but for a request past its deadline)
                if job.deadline_s is not None:
                    timeout_s = job.deadline_s - now
                    if timeout_s <= 0:
                        finish(job, FinishReason.DEADLINE, None, None, out)
                        continue
                w = only
                if w is None:  # (registry.pick's rule, inline)
                    most = 0
                    for c in ready:
                        held = len(c.inflight)
                        if held < c.max_inflight and (w is None or c.num_slots - held > most):
                            w, most = c, c.num_slots - held
                params = job.params
                if prefixes is not None:  # prefer the worker most likely to hold its prefix (broker.prefix)
                    prompt = params[0]
                    if len(prompt) >= MIN_MATCH or (type(prompt) is tuple and type(prompt[0]) is not int):
                        key = prompt_key(params)
                        if key is not None:
                            w = prefixes.choose(peers, key)  # not None: w above has a credit
                            prefixes.sent(w.identity, key)
                identity = job.worker = w.identity  # (running: its state)
                inflight = w.inflight
                if not inflight:
                    w.progress_s = now  # the hung clock starts when it gets work
                inflight.add(job.key)
                # The worker knows the request by its broker key, with the time
                # left and the tokens the client already has beside its parameters.
                tokens = job.tokens
                entry = _tuple_new(Envelope, (job.key, params, tuple(tokens) if tokens else (), timeout_s))
                entries = assigns.get(identity)
                if entries is None:
                    entries = assigns[identity] = []
                entries.append(entry)
        for identity, entries in assigns.items():
            self.counters["dispatched"] += len(entries)
            out.send(Side.BACKEND, identity, Assign(tuple(entries)))

    # ------------------------------------------------------------------ losing

    def _recovered(self, w: WorkerState, now: float, out: Outbox) -> None:
        """A suspect worker made progress again: it may take requests."""
        log.warning("worker %s, found hung before, is making progress again", w.name)
        w.suspect = False
        self._hung.pop(w.identity, None)
        self.dispatch(w.model, now, out)

    def lost(self, w: WorkerState, now: float, out: Outbox, *, failed: bool) -> None:
        """Remove a worker; migrate its requests to the head of their queue (one holding its
        ``max_tokens`` tokens is complete: it ends ``length``; none holds more, :meth:`_route_tokens`).

        ``failed``: it died or hung (counts toward each request's
        ``max_attempts``), rather than leaving or re-registering cleanly."""
        self.registry.remove(w.identity)
        if self.prefixes is not None:
            self.prefixes.forget(w.identity)  # its cache is gone or will be rebuilt
        self.counters["workers_lost" if failed else "workers_left"] += 1
        table = self._jobs
        q = table.queue(w.model)
        for key in sorted(w.inflight):  # keys grow with arrival: keep arrival order
            job = table.by_key[key]
            job.worker = None  # (queued again: its state)
            if failed:
                job.attempts += 1
            if job.verdict is not None:
                table.finish(job, FinishReason.ERROR, *job.verdict, out)
            elif len(job.tokens) == job.params.max_tokens:  # complete: a resume would be refused
                table.finish(job, FinishReason.LENGTH, None, None, out)  # (never more: _route_tokens)
            elif job.cancel_requested or job.client is None:
                table.finish(job, FinishReason.CANCELLED, None, None, out)
            elif job.attempts >= self.config.max_attempts:
                table.finish(job, FinishReason.ERROR, ErrorCode.WORKER_FAILED,
                             f"the request was lost with {job.attempts} failed workers; "
                             "check the workers' logs", out)
            else:
                self.counters["requeued"] += 1
                q.push_head(job)
        w.inflight.clear()
        self.dispatch(w.model, now, out)

    def check(self, now: float, out: Outbox) -> None:
        """Migrate the requests of dead workers (silent past ``worker_liveness_s``)
        and hung ones (heartbeating, but no progress past ``worker_hung_s``)."""
        cutoff = now - self.config.worker_liveness_s
        for w in self.registry.silent_since(cutoff):
            self.lost(w, now, out, failed=True)
        for lw in [x for x in self.registry.loading.values() if x.last_seen_s < cutoff]:
            log.warning("worker %s fell silent while loading model %r (died, killed or frozen)", lw.name, lw.model)
            self._loader_gone(lw, out)
            if lw.model in self.config.on_demand_models:
                self._models.load_died(lw.model, lw.name, out)
        hung_s = self.config.worker_hung_s
        if hung_s is None:
            return
        for w in self.registry.hung_since(now - hung_s):
            # Alive but stuck: its requests move on. Its next message finds it
            # unknown; it registers afresh (dropping the stale work) and stays
            # on probation until its progress moves.
            log.warning("worker %s holds %d requests but completed no iteration for %.1f s: "
                        "treating it as hung", w.name, len(w.inflight), now - w.progress_s)
            self.counters["workers_hung"] += 1
            if len(self._hung) < _MAX_HUNG_REMEMBERED:
                self._hung[w.identity] = w.progress
            self.lost(w, now, out, failed=True)
