"""The generated text of one request: detokenised as tokens arrive, matched
against text stop strings, and released only once it is final.

:class:`TextStream` is what a request's ``text`` is made of when the engine
follows it token by token (it has stop strings, or someone streams its text):

- **Text** is the decode of the generated tokens (special tokens left out),
  built incrementally by the model's :class:`~worker.models.base.IncrementalDecoder`
  (tokenizers' ``DecodeStream``: a character split across tokens appears once
  complete). When the request ends, anything still incomplete is decoded
  whole, so the final text is exactly ``tokenizer.decode(tokens)``.
  ``DecodeStream`` holds *all* the text of the tokens since its last piece while
  their decode ends in an incomplete character (U+FFFD), also the whole
  characters before it: Qwen2.5's token ``お`` + two bytes of the next character
  showed nothing, so a stop string ``お`` matched one token late, and not at all
  when the request ended at that token. Those whole characters are text at their
  own token here (:meth:`TextStream._complete_held`: the held tokens' decode up to
  its trailing U+FFFD), and ``DecodeStream``'s later piece is taken less them.
- **Stop strings** are matched on that text, character by character, so a
  match is found wherever it starts (inside a token too) and however many
  tokens it spans. The first match to *complete* wins (a tie: the one listed
  first); the request then ends ``"stop"`` and its text ends before the
  string, or after it with ``include_stop_str_in_output`` (vLLM's default and
  option). Its tokens are all the tokens generated, up to and including the
  one that completed the match, as in vLLM: the text may end inside the
  last token.
- **Released text** is what a stream may show: the text minus its longest
  end that is the start of a stop string (held back: it may still become a
  match). Held characters are released when they stop being such a start,
  or when the request ends in another way. Nothing is held with
  ``include_stop_str_in_output`` (the string is shown either way), as vLLM.

The released text after any number of tokens is a function of those tokens
and the stop strings only (the automata below are deterministic), so a
request resumed elsewhere (a migration, a resubmission after a broker
restart) replays its tokens into a new stream and continues exactly where the
old one stopped: the text a caller assembled from the pieces never has a gap,
a duplicate or a broken character.

Matching is Knuth-Morris-Pratt over characters, one automaton per stop
string (as :class:`worker.request.StopMatcher` does over token ids): each
character costs amortised O(1) per string, and an automaton's state -- the
length of the longest end of the text that starts the string -- is exactly
how much to hold back.
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

from worker.request import failure_table

log = logging.getLogger(__name__)


class TextStream:
    """One request's generated text, fed one token at a time (the engine's loop thread).

    - ``codec``: the model's :class:`~worker.models.base.TextCodec`.
    - ``stops``: text stop strings (non-empty), in the caller's order.
    - ``include_stop``: keep the matched string in the text (vLLM's ``include_stop_str_in_output``).
    - ``resumed``: tokens generated for the request elsewhere: replayed here
      (no stop may end the request on them), and their released text counts
      as already taken.

    Raises whatever the decoder raises (the engine ends that request with
    ``"error"``).
    """

    __slots__ = ("_step", "_decode", "_text", "released", "_taken", "_stops", "_failure", "_state", "_include",
                 "_hold", "_pending", "stop_string", "_held", "_early", "_last")

    def __init__(self, codec, stops: Sequence[str] = (), include_stop: bool = False,
                 resumed: Sequence[int] = ()) -> None:
        self._step: Callable[[int], str] = codec.decoder(()).step  # no context: text = decode(tokens)
        self._decode: Callable[[Sequence[int]], str] = codec.decode
        self._text = ""          # decoded so far, whole characters (cut at a matched stop string)
        self.released = 0        # characters of _text that are final (never taken back)
        self._taken = 0          # characters handed out by take()
        self._stops = tuple(stops)
        self._failure = tuple(failure_table(s) for s in self._stops)
        self._state = [0] * len(self._stops)
        self._include = include_stop
        self._hold = bool(self._stops) and not include_stop
        self._pending = False    # tokens fed whose text is not all out yet (an incomplete character?)
        self._held: list[int] = []  # the tokens fed since the decoder's last piece (it holds their text)
        self._early = ""         # the whole characters of the held tokens' text, in _text already
        self._last: int | None = None  # the token that ended the decoder's last piece (context for the held)
        self.stop_string: str | None = None  # the stop string that matched
        for token in resumed:
            self.feed(token, False)
        self._taken = self.released

    @property
    def text(self) -> str:
        """The released text (all of it once :meth:`finish` ran)."""
        return self._text[:self.released]

    def feed(self, token: int, live: bool = True) -> str | None:
        """Add one generated token; return the stop string it completes, else None.

        ``live``: a completed stop string may end the request at this token
        (False while ``min_tokens`` are not reached yet, or when replaying:
        the match is then passed over, as vLLM does). After a match the text is
        final: further tokens are ignored.
        """
        if self.stop_string is not None:
            return None
        piece = self._step(token)
        if piece:
            if self._held:
                piece = self._after_early(piece)
                self._held.clear()
            self._last, self._pending = token, False
            if not piece:  # (all of it was out already)
                return None
        else:
            self._held.append(token)
            self._pending = True
            piece = self._complete_held()
            if not piece:
                return None
        start = len(self._text)
        self._text += piece
        if not self._stops:
            self.released = len(self._text)
            return None
        hit = self._scan(piece, start, live)
        if hit is not None:
            end, stop = hit
            self._text = self._text[:end if self._include else end - len(stop)]
            self.released = len(self._text)
            self.stop_string = stop
            return stop
        held = max(self._state) if self._hold else 0
        self.released = max(self.released, len(self._text) - held)
        return None

    def _complete_held(self) -> str:
        """The whole characters of the held tokens' text not out yet: their decode (after the
        token before them, for a decoder whose text depends on what precedes, as SentencePiece's
        leading space) up to its trailing U+FFFD run, which an incomplete character decodes to and
        which stays held; '' when there is none. Prefix-stable for the byte-level and byte-fallback
        decoders: bytes appended later change only that run."""
        context = [] if self._last is None else [self._last]
        text = self._decode(context + self._held)
        if context:
            before = self._decode(context)
            if not text.startswith(before):
                return ""
            text = text[len(before):]
        text = text.rstrip("\ufffd")
        early = self._early
        if len(text) <= len(early) or not text.startswith(early):
            return ""
        self._early = text
        return text[len(early):]

    def _after_early(self, piece: str) -> str:
        """The decoder's ``piece`` for the held tokens and this one, less what :meth:`_complete_held`
        gave out early."""
        early, self._early = self._early, ""
        if piece.startswith(early):
            return piece[len(early):]
        log.warning("the decoder's text does not extend the text given out early; keeping the early text")
        return piece[len(early):] if len(piece) > len(early) else ""

    def _scan(self, piece: str, start: int, live: bool) -> tuple[int, str] | None:
        """Advance every stop string's automaton over ``piece`` (which begins at
        ``start`` in the text); return (end, string) of the earliest completed
        match when ``live``, else None."""
        best: tuple[int, str] | None = None
        state = self._state
        for k, stop in enumerate(self._stops):
            j, fail, n = state[k], self._failure[k], len(stop)
            for i, ch in enumerate(piece):
                while j and stop[j] != ch:
                    j = fail[j - 1]
                if stop[j] == ch:
                    j += 1
                if j == n:
                    if live:
                        if best is None or start + i + 1 < best[0]:
                            best = (start + i + 1, stop)
                        break  # (its first match; the request ends, its state is not needed again)
                    j = fail[j - 1]  # passed over: go on matching, overlaps included
            state[k] = j
        return best

    def take(self) -> str:
        """The text released since the last call ('' when none)."""
        taken = self._taken
        if taken == self.released:
            return ""
        self._taken = self.released
        return self._text[taken:self.released]

    def finish(self, tokens: Sequence[int]) -> None:
        """The request ended (any reason): release everything. ``tokens``: all its
        generated tokens; when the last ones have not completed a character, the
        text becomes their whole decode (ending in U+FFFD, as ``decode`` gives it)."""
        if self.stop_string is None and self._pending:
            full = self._decode(tokens)
            if full.startswith(self._text):
                self._text = full
            else:  # a tokenizer whose decode is not prefix-stable: keep the streamed text
                log.warning("decode(tokens) does not extend the streamed text; keeping the streamed text")
            self._pending = False
        self.released = len(self._text)
