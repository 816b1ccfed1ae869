"""Autocomplete: k drafts by superposed decoding, fill-in-the-middle prompts, `/infill`."""
