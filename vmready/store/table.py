"""Each store operation written once, called at once or queued: ``Table`` and ``@operation``.

A table module (``store.instances`` and its siblings) declares each operation
once, a synchronous method of a ``Table`` subclass marked ``@operation``.  The
table's mode decides how a call runs: on ``Instances[Sync]`` (``Store``'s) at
once; on ``Instances[Async]`` (``AsyncStore``'s) its arguments are copied now
and the call handed to the executor, returning a ``Deferred``.  ``__get__``'s
overloads let mypy check both forms against the one declaration.  A body
always runs on a ``Sync`` table, so inside it every other operation is a
plain call.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from types import MethodType
from typing import Any, Concatenate, Generic, ParamSpec, Protocol, TypeVar, overload

from twisted.internet.defer import Deferred

from vmready.store.database import Database

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")
# A table's mode (its type parameter): Sync or Async.
M = TypeVar("M")


class Sync:
    """The mode of a table whose operations run at once and return their result."""


class Async:
    """The mode of a table whose operations are queued and return a Deferred."""


class Later(Protocol):
    """What queues an ``Async`` table's calls: ``AsyncStore``'s way to its executor."""

    def __call__(self, work: Callable[[], T], /) -> Deferred[T]: ...


class Table(Generic[M]):
    """A group of the store's tables: its ``@operation`` methods, run as its mode says."""

    def __init__(
        self, database: Database, member: str | None = None, later: Later | None = None
    ) -> None:
        self._database = database
        # The cluster member the store acts as (None: the store's only daemon, or any).
        self._member = member
        # Async: where each call goes, and the Sync table over the same database that runs it.
        self._later = later
        self._now: Table[Any] = self if later is None else type(self)(database, member)


class operation(Generic[P, R]):
    """Declares a table's method an operation: at once on a Sync table, queued on an Async one."""

    def __init__(self, method: Callable[Concatenate[Any, P], R]) -> None:
        self._method = method
        # What help() and the docs show: the method's own name and docstring.
        self.__name__ = method.__name__
        self.__doc__ = method.__doc__

    @overload
    def __get__(self, table: None, owner: type[Any]) -> operation[P, R]: ...

    @overload
    def __get__(self, table: Table[Async], owner: type[Any]) -> Callable[P, Deferred[R]]: ...

    @overload
    def __get__(self, table: Table[Any], owner: type[Any]) -> Callable[P, R]: ...

    def __get__(self, table: Table[Any] | None, owner: type[Any]) -> Any:
        if table is None:
            return self
        later = table._later
        if later is None:
            return MethodType(self._method, table)
        method, now = self._method, table._now

        def queued(*args: Any, **kwargs: Any) -> Deferred[Any]:
            args = tuple(_taken(value) for value in args)
            kwargs = {key: _taken(value) for key, value in kwargs.items()}
            return later(lambda: method(now, *args, **kwargs))

        return queued


def _taken(value: T) -> T:
    """An argument as it is now: a mutable container is copied for the engine's thread."""
    if isinstance(value, dict | list | set):
        return copy.deepcopy(value)
    return value
