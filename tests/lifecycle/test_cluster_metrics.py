"""A cluster member's metrics count the instances it runs, so members' scrapes add up."""

from __future__ import annotations

import os
import shutil
import tempfile

from twisted.trial.unittest import TestCase

from tests.fixtures import make_lifecycle
from vmready.domain.states import PowerState, TaskState, VMState
from vmready.lifecycle.core import Lifecycle
from vmready.store.sqlite import Store


def _gauge(lifecycle: Lifecycle, status: str) -> float:
    """The ``vmready_instances`` sample for ``status`` in a scrape."""
    for family in lifecycle.metric_families():
        if family.name == "vmready_instances":
            for sample in family.samples:
                if dict(sample.labels).get("status") == status:
                    return float(sample.value)
    raise AssertionError(f"no vmready_instances sample for {status}")


class MemberMetricsTests(TestCase):
    def test_onlyTheInstancesThisMemberRunsAreCounted(self) -> None:
        directory = tempfile.mkdtemp(prefix="vmready-metrics-")
        self.addCleanup(shutil.rmtree, directory, True)
        path = os.path.join(directory, "vmready.sqlite")
        store = Store.open(path)
        self.addCleanup(store.close)
        for name, member in (("mine", "b"), ("theirs", "a"), ("theirs2", "a")):
            store.instances.create_instance(name, {}, {}, member=member)
            store.instances.finish_task(
                name, TaskState.SPAWNING, VMState.STOPPED, PowerState.SHUTDOWN
            )
        on_b = make_lifecycle(self, store_path=path, member="b")
        self.assertEqual(_gauge(on_b, "STOPPED"), 1)
        on_a = make_lifecycle(self, store_path=path, member="a")
        self.assertEqual(_gauge(on_a, "STOPPED"), 2)
