"""The store: instances, actions and snapshots in SQLite."""
