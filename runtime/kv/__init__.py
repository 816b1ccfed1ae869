"""KV cache compression for the torch engine (sinks + window, CAKE budgets, KIVI/RotateKV)."""
