"""Small value classes without ``dataclasses``, for what runs before the agent's loop.

``dataclasses`` imports ``inspect`` (and with it ``ast``, ``dis``,
``tokenize``…) and builds every class's methods with ``exec`` when its module
is imported: under emulation that is a visible share of the time to the
agent's first ``STARTED`` (``firstword``) and of every ``vmready-agent
notify``.  The few value classes those need derive from ``Record``, which
gives equality, a hash and a repr from the class's ``__slots__`` (its
fields); the rest of the agent keeps its dataclasses.
"""

from __future__ import annotations


class Record:
    """Equality, hash and repr from ``__slots__``, as a dataclass would have them."""

    __slots__: tuple[str, ...] = ()

    def values(self) -> tuple[object, ...]:
        """The fields' values, in ``__slots__``' order."""
        return tuple(getattr(self, name) for name in self.__slots__)

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        assert isinstance(other, Record)
        return self.values() == other.values()

    def __hash__(self) -> int:
        return hash(self.values())

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.__slots__)
        return f"{type(self).__name__}({fields})"
