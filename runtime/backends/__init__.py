"""Backends: the one protocol every model runtime implements, and its implementations
(llama.cpp, the torch engine, onnxruntime), opened by file type."""
