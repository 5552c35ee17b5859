"""Fill in the middle: a model's own FIM tokens, found in its tokenizer, and the prompt made of them.

A code model trained for FIM reads the code before and after a gap between
special tokens of its vocabulary, then writes the middle. Which tokens, and
their spelling, depend on the family (:data:`FAMILIES`; the spellings are
llama.cpp's, ``llama-vocab.cpp``, which looks them up the same way):

=================  ==================================================  ===================================
family             prefix / suffix / middle                            repo-level and end tokens
=================  ==================================================  ===================================
Qwen2.5-Coder      ``<|fim_prefix|>`` ``<|fim_suffix|>`` ``<|fim_middle|>``  ``<|repo_name|>`` ``<|file_sep|>``;
                                                                       ends ``<|endoftext|>`` ``<|fim_pad|>``
StarCoder(2)       ``<fim_prefix>`` ``<fim_suffix>`` ``<fim_middle>``  ``<repo_name>`` ``<file_sep>``
SantaCoder         ``<fim-prefix>`` ``<fim-suffix>`` ``<fim-middle>``
CodeLlama          ``▁<PRE>`` ``▁<SUF>`` ``▁<MID>`` (or without ``▁``)  ends ``▁<EOT>``
DeepSeek-Coder     ``<｜fim▁begin｜>`` ``<｜fim▁hole｜>`` ``<｜fim▁end｜>``
=================  ==================================================  ===================================

A marker counts only as one *special* token of the tokenizer (an added
token marked special): text the user sends is tokenised with special tokens
split as plain text, so a marker that were an ordinary vocabulary entry could
be forged by the code itself, and a tokenizer that only spells the markers in
pieces has no FIM at all. A tokenizer without all three: :func:`fim_tokens`
is None and :func:`missing_message` says which tokens were looked for.

The prompt is llama.cpp's ``/infill`` prompt (``format_prompt_infill`` in its
server, read in its source): with repo-level tokens (Qwen2.5-Coder's
``<|repo_name|>`` and ``<|file_sep|>``, arXiv:2409.12186)::

    <|repo_name|>myproject\\n<|file_sep|>{chunk 0 filename}\\n{chunk 0 text}...<|file_sep|>filename\\n
    <|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>

(``myproject`` and ``filename`` are llama.cpp's fixed names: the same prompt
as its server's for the same request); without them each extra chunk follows
a ``\\n\\n--- snippet ---\\n\\n`` line. A BOS the tokenizer adds to a text comes
first (llama.cpp puts it after the extra chunks, before the prefix token).
Prefix-suffix-middle order only (llama.cpp's default; ``--spm-infill`` is not
offered). Nothing is cut to fit: a prompt over the context is refused as any
prompt is (llama.cpp keeps the prefix's last 3/4 of a batch instead).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

REPO_NAME = "myproject"
"""The repository name of the repo-level format (llama.cpp's fixed one)."""

FILE_NAME = "filename"
"""The file name given to the file being completed in the repo-level format (llama.cpp's fixed one)."""

SNIPPET_SEPARATOR = "\n\n--- snippet ---\n\n"
"""What precedes each extra chunk when the model has no file separator token (llama.cpp's)."""


@dataclass(frozen=True)
class FimFamily:
    """One family's FIM token spellings (each a tuple of alternatives, the first found wins)."""

    name: str
    prefix: tuple[str, ...]
    suffix: tuple[str, ...]
    middle: tuple[str, ...]
    repo: tuple[str, ...] = ()
    file_sep: tuple[str, ...] = ()
    ends: tuple[str, ...] = ()
    """Tokens that end a middle besides the model's EOS (llama.cpp counts them end-of-generation)."""


FAMILIES = (
    FimFamily("Qwen2.5-Coder", ("<|fim_prefix|>",), ("<|fim_suffix|>",), ("<|fim_middle|>",),
              ("<|repo_name|>",), ("<|file_sep|>",), ("<|endoftext|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")),
    FimFamily("StarCoder", ("<fim_prefix>",), ("<fim_suffix>",), ("<fim_middle>",),
              ("<repo_name>", "<reponame>"), ("<file_sep>",), ("<|endoftext|>", "<fim_pad>", "<file_sep>")),
    FimFamily("SantaCoder", ("<fim-prefix>",), ("<fim-suffix>",), ("<fim-middle>",), (), (),
              ("<|endoftext|>", "<fim-pad>")),
    FimFamily("CodeLlama", ("<PRE>", "▁<PRE>"), ("<SUF>", "▁<SUF>"), ("<MID>", "▁<MID>"), (), (),
              ("<EOT>", "▁<EOT>")),
    FimFamily("DeepSeek-Coder", ("<｜fim▁begin｜>",), ("<｜fim▁hole｜>",), ("<｜fim▁end｜>",), (), (),
              ("<｜end▁of▁sentence｜>", "<|EOT|>")),
)


@dataclass(frozen=True)
class FimTokens:
    """A tokenizer's FIM token ids: ``prefix``, ``suffix``, ``middle``; ``repo`` and ``file_sep``
    (None without the repo-level format); ``ends``: its family's end tokens it has (stop tokens of
    a FIM request, with the model's EOS)."""

    family: str
    prefix: int
    suffix: int
    middle: int
    repo: int | None
    file_sep: int | None
    ends: tuple[int, ...]


def _first(special: Mapping[str, int], spellings: Sequence[str]) -> int | None:
    return next((special[s] for s in spellings if s in special), None)


def fim_tokens(special: Mapping[str, int]) -> FimTokens | None:
    """The FIM tokens of a tokenizer whose special tokens are ``special`` (content -> id), the
    first family of :data:`FAMILIES` with all three; None when none has them."""
    for f in FAMILIES:
        pre, suf, mid = _first(special, f.prefix), _first(special, f.suffix), _first(special, f.middle)
        if pre is not None and suf is not None and mid is not None:
            repo, sep = _first(special, f.repo), _first(special, f.file_sep)
            ends = tuple(dict.fromkeys(special[s] for s in f.ends if s in special))
            return FimTokens(f.name, pre, suf, mid, repo, sep, ends)
    return None


def missing_message(vocab: Mapping[str, int]) -> str:
    """Why a tokenizer has no FIM (``vocab``: its whole vocabulary, content -> id): the tokens looked
    for, and any of them it has only as an ordinary (not special) token."""
    looked = "; ".join(f"{' / '.join(f.prefix[0:1] + f.suffix[0:1] + f.middle[0:1])} ({f.name})" for f in FAMILIES)
    plain = sorted({s for f in FAMILIES for s in f.prefix + f.suffix + f.middle if s in vocab})
    also = (f"; {', '.join(plain)} {'is' if len(plain) == 1 else 'are'} in its vocabulary but not as special "
            "tokens") if plain else ""
    return (f"suffix: this model has no fill-in-the-middle tokens: its tokenizer has none of {looked} as "
            f"special tokens{also}. Fill in the middle needs a code model trained for it (e.g. "
            "qwen2.5-coder-0.5b); leave suffix out for a plain completion")


def render(fim: FimTokens, encode: Callable[[str], list[int]], prefix: str, suffix: str,
           extra: Sequence[tuple[str, str]] = (), bos: Sequence[int] = ()) -> list[int]:
    """The FIM prompt's token ids (the module docstring's layout). ``encode(text)``: the text's ids
    with special tokens split as text and none added (``""`` -> ``[]``); ``extra``: (filename,
    text) chunks; ``bos``: what the tokenizer puts before a text."""
    ids = list(bos)
    if fim.repo is not None:
        ids += [fim.repo, *encode(REPO_NAME + "\n")]
    for filename, text in extra:
        if fim.file_sep is not None:
            ids += [fim.file_sep, *encode(filename + "\n")]
        else:
            ids += encode(SNIPPET_SEPARATOR)
        ids += encode(text)
    if fim.file_sep is not None:
        ids += [fim.file_sep, *encode(FILE_NAME + "\n")]
    ids += [fim.prefix, *encode(prefix), fim.suffix, *encode(suffix), fim.middle]
    return ids
