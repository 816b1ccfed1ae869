"""The torch engine: Llama-family decoders in plain torch (CUDA when present, else CPU)."""
