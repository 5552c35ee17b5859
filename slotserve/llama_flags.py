"""llama-server's flags at slotserve's command line (docs/llama-cpp.md): its names for the settings
slotserve has are aliases of their options (``-m``, ``-np``, ``-t``, ``--host``, ``--port``, ``-cb``:
declared with each option in :mod:`slotserve.cli`), and its flags a command lacks are refused naming
the flag as typed and what to give instead (:class:`LlamaFlagsCommand`). Sources: llama.cpp's
tools/server/README.md (ggml-org/llama.cpp 00dc805), its "Common params" and "Server-specific params".
"""

from __future__ import annotations

import click

__all__ = ["LLAMA_HINT", "LLAMA_NOT_TAKEN", "LLAMA_TAKEN", "LlamaFlagsCommand", "WordOption"]

LLAMA_TAKEN = {
    ("-m", "--model"): "the model",
    ("-np", "--parallel"): "the number of slots",
    ("-t", "--threads"): "the CPU threads",
    ("-cb", "--cont-batching"): "continuous batching, always on",
    ("--host",): "the HTTP server's address",
    ("--port",): "the HTTP server's port",
    ("--api-key",): "the API keys",
    ("--api-key-file",): "the API keys' file",
}
"""llama-server's flags that some ``slotserve`` commands take (each an alias of theirs) -> what the flag
is: a command without it refuses it naming those that take it (found in the commands' options)."""

LLAMA_NOT_TAKEN = {
    ("-c", "--ctx-size"):
        "llama-server's -c (the context) is its whole KV cache, shared out among its -np slots; slotserve sizes "
        "one slot: --max-model-len TOKENS, the -c divided by the -np (-c 8192 -np 4 is --max-model-len 2048 -np 4)",
    ("-ngl", "--gpu-layers", "--n-gpu-layers"):
        "llama-server's -ngl (layers on the GPU) is not supported: slotserve runs the whole model on one "
        "--device, cuda (as -ngl all) or cpu (as -ngl 0); the default, auto, is cuda when torch sees a GPU",
    ("-nocb", "--no-cont-batching"):
        "llama-server's -nocb is not supported: slotserve always batches continuously; -np 1 runs one request "
        "at a time",
    ("-n", "--predict", "--n-predict"):
        "llama-server's -n (tokens to predict) has no server-wide equivalent: each request's max_tokens "
        "(n_predict on /completion and /infill) sets it",
}
"""llama-server's flags that no ``slotserve`` command takes -> the refusal's words: what to give instead."""

LLAMA_HINT = ("Of llama-server's flags, slotserve takes -m, -np, -t, -cb, --host, --port and --api-key "
              "(docs/llama-cpp.md gives the others' equivalents).")
"""Said after an unknown single-dash word (``-fa``) that neither table knows."""


class WordOption(click.Option):
    """An option whose one-letter names (``-m``, ``-t``: llama-server's) are whole words, as llama-server
    reads its flags: ``-mg 0`` and ``-tb 4`` are then unknown options (:class:`LlamaFlagsCommand` names them),
    where click reads a short option's attached value (``-m g``, ``-t b``: a model ``g``, threads ``b``).
    (click has no setting for this: the parser's name tables are moved here, as click fills them.)"""

    def add_to_parser(self, parser, ctx: click.Context) -> None:
        super().add_to_parser(parser, ctx)
        short, long = getattr(parser, "_short_opt", None), getattr(parser, "_long_opt", None)
        if not isinstance(short, dict) or not isinstance(long, dict):  # (a click whose parser differs: its reading)
            return
        for opt in self.opts:
            if opt in short:
                long[opt] = short.pop(opt)


class LlamaFlagsCommand(click.Command):
    """A ``slotserve`` subcommand: an unknown option is named as typed, with what llama-server's flag of
    that name is here. click tries a word it does not know (``-np``) as short options, a letter at a time,
    and named the first letter it lacked: ``No such option '-n'``."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        """click's, whose ``NoSuchOption`` names the word typed (and llama-server's flag, when it is one)."""
        try:
            return super().parse_args(ctx, list(args))
        except click.NoSuchOption as e:
            typed = self._typed(ctx, e.option_name, args)
            why = self._llama_flag(ctx, typed)
            if why is None and typed == e.option_name:
                raise
            raise click.NoSuchOption(typed, message=f"No such option '{typed}'" + (
                f" for `slotserve {ctx.info_name}`: {why}." if why else f". {LLAMA_HINT}"), ctx=ctx) from None

    def _typed(self, ctx: click.Context, name: str, args: list[str]) -> str:
        """The word of ``args`` that click's NoSuchOption(``name``) is about: ``name``, or the first
        single-dash word that is no option here and that click read a letter at a time up to ``name``'s
        (``-np`` for ``-n``; ``-hf`` for ``-f``, its ``-h`` a flag)."""
        if name.startswith("--"):
            return name
        options = [p for p in self.get_params(ctx) if isinstance(p, click.Option)]
        known = {o for p in options for o in p.opts + p.secondary_opts}
        flags = {o for p in options if p.is_flag and not isinstance(p, WordOption) for o in p.opts + p.secondary_opts}
        for arg in args:
            if arg == "--":
                break
            word = arg.split("=", 1)[0]
            if word in known or word.startswith("--") or not word.startswith("-"):
                continue
            for letter in word[1:]:
                if f"-{letter}" == name:
                    return word
                if f"-{letter}" not in flags:  # (another unknown letter, or one whose value the rest is)
                    break
        return name

    @staticmethod
    def _llama_flag(ctx: click.Context, typed: str) -> str | None:
        """What llama-server's flag ``typed`` is here: the commands that take it, or what to give
        instead; None for no flag of llama-server's that slotserve knows."""
        for flags, why in LLAMA_NOT_TAKEN.items():
            if typed in flags:
                return why
        for flags, what in LLAMA_TAKEN.items():
            if typed in flags:
                commands = getattr(ctx.find_root().command, "commands", {})
                takers = [f"`slotserve {name}`" for name, cmd in commands.items()
                          if any(typed in p.opts for p in cmd.params if isinstance(p, click.Option))]
                if not takers:
                    return None
                listed = ", ".join(takers[:-1]) + " and " + takers[-1] if len(takers) > 1 else "".join(takers)
                return f"llama-server's {typed} ({what}) is an option of {listed}"
        return None
