"""Model backends, chosen by name (:func:`load_model`).

Heavy imports (torch, transformers) happen only inside the backend that
needs them, so ``import worker`` stays light.
"""

from __future__ import annotations

from worker.models.base import SamplingParams, SlotInput, SlotModel, StatelessModel

__all__ = ["SamplingParams", "SlotInput", "SlotModel", "StatelessModel", "load_model"]


def load_model(name: str, **options):
    """Build a model backend from its name.

    - ``"simulated"``: :class:`worker.SimulatedLLM` with ``options`` passed on.
    - anything else: a Hugging Face causal LM (alias ``smollm2-135m``, a local
      directory, a ``.gguf`` file, or a hub id where a hub is reachable);
      needs the ``hf`` extra.

    Raises ``ValueError`` for a name that cannot be resolved.
    """
    if name == "simulated":
        from worker.models.simulated import SimulatedLLM

        return SimulatedLLM(**options)
    from worker.models.hf import load_hf_model

    return load_hf_model(name, **options)
