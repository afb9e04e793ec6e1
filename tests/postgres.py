"""A real PostgreSQL server for the tests: initdb and pg_ctl in a temporary directory.

One server per test process, started the first time a test asks for it and
stopped when the process exits.  It listens only on a unix socket in its own
directory (``listen_addresses=''``), so tests never touch a server of the
machine's, and nothing outside can reach it.  Each test gets a database of its
own (``postgres_location``), created from a template that is already migrated
(a fresh database is a file copy, not five migrations) and dropped when the
test ends.

PostgreSQL refuses to run as root; when the tests do, the server runs as the
``postgres`` system user, in a directory handed over to it.

Without PostgreSQL's binaries the tests that need it skip, saying why, unless
``VMREADY_REQUIRE_POSTGRES=1`` (CI) makes that a failure.
"""

from __future__ import annotations

import atexit
import glob
import itertools
import os
import pwd
import shutil
import subprocess
import tempfile
import threading
from typing import Any

import psycopg
from twisted.trial.unittest import SkipTest, SynchronousTestCase

__all__ = [
    "PostgresServer",
    "postgres_location",
    "postgres_server",
    "require_postgres",
]

REQUIRE_VARIABLE = "VMREADY_REQUIRE_POSTGRES"
_TEMPLATE = "vmready_template"
# Settings for a throwaway server: no TCP, small, no fsync (a lost machine loses it all), but
# synchronous commits: a commit is written before it returns, so it survives the server's own
# crash (the tests stop it with -m immediate).  A synchronous standby is named that never
# connects, and commits wait only for the local disk (``local``) unless a session asks for the
# standby (``synchronous_commit = on``): then its COMMIT waits, committed locally, until the
# backend is terminated; the one deterministic way to lose a connection during COMMIT
# after the transaction committed (tests.store.test_postgres' unknown outcome).
_SETTINGS = """
listen_addresses = ''
unix_socket_directories = '{socket_dir}'
synchronous_standby_names = 'vmready_no_such_standby'
synchronous_commit = local
fsync = off
full_page_writes = off
max_connections = 100
shared_buffers = 16MB
log_min_messages = fatal
"""


def _binaries() -> tuple[str, str] | None:
    """(initdb, pg_ctl): from PATH, else the newest /usr/lib/postgresql/*/bin; None if absent."""
    initdb, pg_ctl = shutil.which("initdb"), shutil.which("pg_ctl")
    if initdb and pg_ctl:
        return initdb, pg_ctl
    versions = sorted(
        glob.glob("/usr/lib/postgresql/*/bin"),
        key=lambda path: int(path.split("/")[-2]) if path.split("/")[-2].isdigit() else 0,
    )
    for directory in reversed(versions):
        initdb, pg_ctl = os.path.join(directory, "initdb"), os.path.join(directory, "pg_ctl")
        if os.access(initdb, os.X_OK) and os.access(pg_ctl, os.X_OK):
            return initdb, pg_ctl
    return None


class PostgresServer:
    """One PostgreSQL server in a temporary directory, reached on its unix socket."""

    def __init__(self, initdb: str, pg_ctl: str) -> None:
        self._initdb = initdb
        self._pg_ctl = pg_ctl
        self.directory = tempfile.mkdtemp(prefix="vmready-pg-", dir="/tmp")
        self.data = os.path.join(self.directory, "data")
        self.log = os.path.join(self.directory, "server.log")
        self._user: dict[str, Any] = {}
        if os.geteuid() == 0:
            # initdb and postgres refuse root: the server runs as postgres, in a directory it owns.
            account = pwd.getpwnam("postgres")
            os.chown(self.directory, account.pw_uid, account.pw_gid)
            self._user = {"user": account.pw_uid, "group": account.pw_gid, "extra_groups": []}
        self._names = itertools.count()
        self._lock = threading.Lock()
        self.running = False
        self._run([initdb, "-D", self.data, "-A", "trust", "-U", "postgres", "-E", "UTF8",
                   "--locale=C", "--no-sync"])  # fmt: skip
        with open(os.path.join(self.data, "postgresql.conf"), "a") as conf:
            conf.write(_SETTINGS.format(socket_dir=self.directory))
        self.start()
        with self.admin() as admin:
            admin.execute(f"CREATE DATABASE {_TEMPLATE}")
        self._migrate_template()

    def _run(self, command: list[str]) -> None:
        result = subprocess.run(
            command, capture_output=True, text=True, cwd=self.directory, **self._user
        )
        if result.returncode != 0:
            raise RuntimeError(
                f"{os.path.basename(command[0])} failed ({result.returncode}):"
                f" {result.stderr.strip() or result.stdout.strip()}\n{self.log_tail()}"
            )

    def log_tail(self) -> str:
        """The end of the server's log (for a failure's message)."""
        try:
            with open(self.log) as f:
                return "".join(f.readlines()[-20:])
        except OSError:
            return ""

    def url(self, database: str = "postgres") -> str:
        """The ``postgresql://`` URL of ``database``, through the unix socket."""
        return f"postgresql://postgres@/{database}?host={self.directory}"

    def admin(self) -> psycopg.Connection[Any]:
        """An autocommit connection to the ``postgres`` database (for CREATE/DROP DATABASE)."""
        return psycopg.connect(self.url(), autocommit=True)

    def start(self) -> None:
        """Start the server (unless it runs) and wait until it accepts connections."""
        if self.running:
            return
        self._run([self._pg_ctl, "-D", self.data, "-l", self.log, "-w", "-t", "60", "start"])
        self.running = True

    def stop(self) -> None:
        """Stop the server at once (every connection is cut)."""
        if self.running:
            self._run([self._pg_ctl, "-D", self.data, "-m", "immediate", "-w", "stop"])
            self.running = False

    def restart(self) -> None:
        """Stop the server and start it again (connections are lost, data kept)."""
        self.stop()
        self.start()

    def terminate_backends(self, database: str) -> int:
        """Cut every connection to ``database`` (``pg_terminate_backend``); how many there were."""
        with self.admin() as admin:
            rows = admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = %s AND pid <> pg_backend_pid()",
                (database,),
            ).fetchall()
        return len(rows)

    def _migrate_template(self) -> None:
        # Imported here: the store's tests import this module, not the other way round.
        from vmready.store.sqlite import Store

        Store.open(self.url(_TEMPLATE)).close()

    def create_database(self, migrated: bool = True) -> str:
        """A new database's name: a copy of the migrated template, or empty."""
        with self._lock:
            name = f"test_{os.getpid()}_{next(self._names)}"
        template = f" TEMPLATE {_TEMPLATE}" if migrated else ""
        with self.admin() as admin:
            admin.execute(f"CREATE DATABASE {name}{template}")
        return name

    def drop_database(self, name: str) -> None:
        """Drop ``name``, cutting whatever is still connected to it."""
        if not self.running:
            self.start()
        with self.admin() as admin:
            admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")

    def destroy(self) -> None:
        """Stop the server and remove its directory."""
        try:
            self.stop()
        finally:
            shutil.rmtree(self.directory, ignore_errors=True)


_server: PostgresServer | None = None
_server_lock = threading.Lock()


def _unavailable(reason: str) -> None:
    """Skip, or fail when CI says PostgreSQL must be there."""
    if os.environ.get(REQUIRE_VARIABLE) == "1":
        raise SynchronousTestCase.failureException(
            f"{reason}, and {REQUIRE_VARIABLE}=1 requires the PostgreSQL tests to run"
        )
    raise SkipTest(reason)


def require_postgres() -> None:
    """Skip (or fail, in CI) where PostgreSQL cannot be run."""
    if _binaries() is None:
        _unavailable(
            "PostgreSQL is not installed (no initdb and pg_ctl on PATH or in"
            " /usr/lib/postgresql/*/bin); install the postgresql package to run these tests"
        )
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            _unavailable("running as root, and there is no postgres user to run PostgreSQL as")


def postgres_server() -> PostgresServer:
    """The test process's server, started on first use (skips without PostgreSQL)."""
    global _server
    require_postgres()
    with _server_lock:
        if _server is None:
            binaries = _binaries()
            assert binaries is not None
            _server = PostgresServer(*binaries)
            atexit.register(_server.destroy)
        elif not _server.running:
            _server.start()
        return _server


def postgres_location(testcase: SynchronousTestCase, migrated: bool = True) -> str:
    """The ``postgresql://`` URL of a fresh database, dropped when ``testcase`` ends.

    ``migrated``: already at this vmready's schema version (fast); else empty.
    """
    server = postgres_server()
    name = server.create_database(migrated)
    testcase.addCleanup(server.drop_database, name)
    return server.url(name)
