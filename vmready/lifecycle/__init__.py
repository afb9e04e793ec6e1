"""Instances over time: actions and their operations, power sync, Ready, events."""

from vmready.lifecycle.actionchecks import MAX_STOP_TIMEOUT
from vmready.lifecycle.agenthistory import LinkChange
from vmready.lifecycle.core import Lifecycle
from vmready.lifecycle.events import EVENT_TYPES, LIFECYCLE, Event, EventBus, rfc3339
from vmready.lifecycle.faults import Fault
from vmready.lifecycle.guestlink import GuestLink
from vmready.lifecycle.hooks import RecorderLookup, SessionHooks
from vmready.lifecycle.liveviews import LiveView, OwnViews, RemoteViews
from vmready.lifecycle.members import DEFAULT_LEASE_SECONDS, Membership
from vmready.lifecycle.metrics import LifecycleMetrics
from vmready.lifecycle.operations import Operation
from vmready.lifecycle.recovery import DEFAULT_SYNC_CONCURRENCY
from vmready.lifecycle.relay import CHANNELS, EventRelay
from vmready.lifecycle.settings import DEFAULT_KVM_PROBE_TIMEOUT, LaunchSettings
from vmready.lifecycle.specs import CONFIG_DRIVE, LAYOUT_KEY, agent_chardev, run_dir_name

__all__ = [
    "CHANNELS",
    "CONFIG_DRIVE",
    "DEFAULT_KVM_PROBE_TIMEOUT",
    "DEFAULT_LEASE_SECONDS",
    "DEFAULT_SYNC_CONCURRENCY",
    "EVENT_TYPES",
    "LAYOUT_KEY",
    "LIFECYCLE",
    "MAX_STOP_TIMEOUT",
    "Event",
    "EventBus",
    "EventRelay",
    "Fault",
    "GuestLink",
    "LaunchSettings",
    "Lifecycle",
    "LifecycleMetrics",
    "LinkChange",
    "LiveView",
    "Membership",
    "Operation",
    "OwnViews",
    "RecorderLookup",
    "RemoteViews",
    "SessionHooks",
    "agent_chardev",
    "rfc3339",
    "run_dir_name",
]
