"""A deliberately naive implementation of the spec: the baseline for bench/engine.py.

Written the way a newcomer would write the spec's continuous-batching loop:
requests are dicts, the queue is a list popped from the front, every
iteration rebuilds each sequence as ``prompt + generated`` for the model,
checks every slot against every rule in Python, and removes finished
requests with ``list.remove``. It is correct (bench/engine.py checks that its
results equal the real engine's), it is just slow; it exists only so the
engine's bookkeeping cost has something honest to be compared with. Not used
by slotserve itself.
"""

from __future__ import annotations


class NaiveEngine:
    """The spec's engine, plainly: ``submit_request(prompt, max_tokens, callback)`` then ``run()``."""

    def __init__(self, model, batch_size, stop_token=None):
        self.model = model
        self.batch_size = batch_size
        self.stop_token = stop_token
        self.queue = []
        self.active = []

    def submit_request(self, prompt, max_tokens, callback=None, stop_sequences=()):
        if len(prompt) == 0:
            raise ValueError("prompt must not be empty")
        for token in prompt:
            if not isinstance(token, int) or isinstance(token, bool):
                raise ValueError("prompt tokens must be ints")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ValueError("max_tokens must be an int >= 1")
        self.queue.append({
            "prompt": list(prompt),
            "generated": [],
            "max_tokens": max_tokens,
            "callback": callback,
            "stop_sequences": [list(s) for s in stop_sequences],
        })

    def run(self):
        while self.queue or self.active:
            # Refill free slots from the front of the queue.
            while self.queue and len(self.active) < self.batch_size:
                self.active.append(self.queue.pop(0))
            sequences = [r["prompt"] + r["generated"] for r in self.active]
            next_tokens = self.model.next_tokens(sequences)
            finished = []
            for r, token in zip(self.active, next_tokens):
                r["generated"].append(token)
                done = False
                if self.stop_token is not None and token == self.stop_token:
                    done = True
                for s in r["stop_sequences"]:
                    if len(r["generated"]) >= len(s) and r["generated"][-len(s):] == s:
                        done = True
                if len(r["generated"]) >= r["max_tokens"]:
                    done = True
                if done:
                    finished.append(r)
            for r in finished:
                self.active.remove(r)
                if r["callback"] is not None:
                    r["callback"](r["prompt"] + r["generated"])
