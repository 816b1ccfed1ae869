"""`tandem bench`: plain Tandem against every drafting mode and llama-cpp-python."""
