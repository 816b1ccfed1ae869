"""Drafters: model-free (prompt lookup, suffix trees), a same-vocabulary model, and a
model of any vocabulary (:mod:`.xvocab`)."""
