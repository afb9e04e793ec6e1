"""Record and replay agent sessions.

``replay`` is a face of its own: it runs fakeqemu in memory (with trial's helpers),
which the daemon, recording, never loads.
"""

from vmready.record.recording import Recorders, RecordingGuestResource

__all__ = ["Recorders", "RecordingGuestResource"]
