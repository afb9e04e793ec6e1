"""The store: instances, actions and snapshots in SQLite."""

from vmready.store.asyncstore import AsyncStore
from vmready.store.executor import OutcomeUnknown, StoreClosed, StoreHealth, StoreWriteFailed
from vmready.store.notifications import (
    EVENTS_CHANNEL,
    INSTANCES_CHANNEL,
    MAX_PAYLOAD_BYTES,
    MEMBERS_CHANNEL,
    TRUST_CHANNEL,
    NotificationListener,
)
from vmready.store.postgres import display_location, is_postgres_location
from vmready.store.sqlite import Store
from vmready.store.trust import TrustedCertificate
from vmready.store.view import AgentLookup

__all__ = [
    "EVENTS_CHANNEL",
    "INSTANCES_CHANNEL",
    "MAX_PAYLOAD_BYTES",
    "MEMBERS_CHANNEL",
    "TRUST_CHANNEL",
    "AgentLookup",
    "AsyncStore",
    "NotificationListener",
    "OutcomeUnknown",
    "Store",
    "StoreClosed",
    "StoreHealth",
    "StoreWriteFailed",
    "TrustedCertificate",
    "display_location",
    "is_postgres_location",
]
