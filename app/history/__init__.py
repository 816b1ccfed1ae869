"""Chat history: crash-safe SQLite with migrations and full-text search."""
