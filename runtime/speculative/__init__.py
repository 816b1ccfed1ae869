"""Speculative decoding: the draft-verify loop, the adaptive length policy and its cost
curve, drafters, and drafting on another device at once."""
