"""``vmready monitor``'s lines: on a cluster member, each says which member it happened on."""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from vmready.cli.tables import event_line

_STATE = {
    "type": "lifecycle",
    "timestamp": "2026-11-27T20:43:52Z",
    "metadata": {
        "action": "instance-state",
        "source": "/1.0/instances/web1",
        "context": {"status": "Stopped", "error": ""},
    },
}
_OPERATION = {
    "type": "operation",
    "timestamp": "2026-11-27T20:43:52Z",
    "metadata": {"description": "Stop instance web1", "status": "Success", "err": ""},
}


class EventLineTests(SynchronousTestCase):
    def test_aSingleHostsEventsNameNoMember(self) -> None:
        self.assertTrue(
            event_line(_STATE).endswith(" lifecycle instance-state web1 status=Stopped")
        )
        self.assertTrue(event_line(_OPERATION).endswith(" operation Stop instance web1 Success"))

    def test_aClusterMembersEventsEndWithTheirMember(self) -> None:
        self.assertTrue(
            event_line({**_STATE, "location": "host-a"}).endswith(
                " lifecycle instance-state web1 status=Stopped location=host-a"
            )
        )
        self.assertTrue(
            event_line({**_OPERATION, "location": "host-b"}).endswith(
                " Stop instance web1 Success location=host-b"
            )
        )
