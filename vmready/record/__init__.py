"""Record and replay agent sessions."""
