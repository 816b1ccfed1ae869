"""Drafters for speculative decoding (see :mod:`tandem.runtime.drafters.base`).

Model-free: :class:`PromptLookupDrafter`, :class:`SuffixDrafter` (with the process-wide
:func:`global_cache`); model: :class:`ModelDrafter` (same vocabulary) and
``tandem.runtime.drafters.xvocab.CrossVocabDrafter`` (any vocabulary; imported lazily
by :func:`tandem.runtime.speculative.build_strategy`); combined: :class:`ChainDrafter`.
"""

from tandem.runtime.drafters.base import Draft, Drafter
from tandem.runtime.drafters.chain import ChainDrafter
from tandem.runtime.drafters.lookup import PromptLookupDrafter
from tandem.runtime.drafters.model import ModelDrafter, same_vocabulary
from tandem.runtime.drafters.suffix import (
    GlobalSuffixCache,
    SuffixDrafter,
    SuffixParams,
    global_cache,
)

__all__ = [
    "ChainDrafter",
    "Draft",
    "Drafter",
    "GlobalSuffixCache",
    "ModelDrafter",
    "PromptLookupDrafter",
    "SuffixDrafter",
    "SuffixParams",
    "global_cache",
    "same_vocabulary",
]
