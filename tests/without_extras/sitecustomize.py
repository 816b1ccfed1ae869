"""Started by Python itself when this folder is on PYTHONPATH: hides the optional extras
(torch, onnxruntime, onnx, safetensors, tokenizers, matplotlib) as if they were not
installed, so a test can run `tandem` the way a default install runs it.

The path finder is wrapped rather than a finder added that raises: ``find_spec`` then
answers None for a hidden module, exactly as it does for one that is absent."""

from __future__ import annotations

import os
import sys
from importlib.machinery import PathFinder

HIDDEN = frozenset(os.environ.get("TANDEM_HIDE_MODULES", "torch onnxruntime onnx safetensors tokenizers matplotlib").split())


class _HidingPathFinder:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.partition(".")[0] in HIDDEN:
            return None
        return PathFinder.find_spec(name, path, target)

    @staticmethod
    def invalidate_caches() -> None:
        PathFinder.invalidate_caches()

    @staticmethod
    def find_distributions(*args, **kwargs):
        """Installed packages' metadata (``importlib.metadata`` asks the meta path's
        finders), less the hidden ones (``onnxruntime-gpu`` counts as ``onnxruntime``)."""
        for dist in PathFinder.find_distributions(*args, **kwargs):
            name = (dist.metadata["Name"] or "").lower().replace("_", "-")
            if name.split("-")[0] not in HIDDEN:
                yield dist


sys.meta_path[:] = [_HidingPathFinder if f is PathFinder else f for f in sys.meta_path]
