"""process_results of the slotserve_facts_gen task (lm-eval imports it by the YAML's ``!function``)."""

import re


def process_results(doc: dict, results: list[str]) -> dict[str, float]:
    """``acc`` 1.0 when the gold answer (``choices[answer]``) appears in the reply as
    whole words, ignoring case ("The capital of France is Paris." is correct for
    "Paris"), else 0.0. ``results``: the one generated reply."""
    gold = doc["choices"][doc["answer"]]
    found = re.search(rf"(?<!\w){re.escape(gold)}(?!\w)", results[0], re.IGNORECASE)
    return {"acc": 1.0 if found else 0.0}
