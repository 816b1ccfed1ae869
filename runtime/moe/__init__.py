"""Mixture-of-experts: the expert layer and expert offloading (cache, stores)."""
