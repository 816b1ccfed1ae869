"""Cross-vocabulary drafting: any drafter model for any target (text translation,
OmniDraft's translation cache, token-level intersection)."""
