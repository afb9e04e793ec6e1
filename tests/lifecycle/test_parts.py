"""The lifecycle's parts get collaborators of the types they declare.

``Lifecycle._part`` hands each part, by field name, the lifecycle's attribute
of that name: mypy cannot see through that, so this test checks what it would.
"""

from __future__ import annotations

import types
import typing
from typing import Any

import attrs
from twisted.trial.unittest import TestCase
from zope.interface.interface import InterfaceClass

from tests.fixtures import make_lifecycle


def _does_not_fit(value: Any, declared: Any) -> bool:
    """Whether ``value`` does not fit ``declared`` (a class, an interface, a union, Any)."""
    if declared is Any:
        return False
    if isinstance(declared, InterfaceClass):
        return not declared.providedBy(value)
    if isinstance(declared, types.UnionType) or typing.get_origin(declared) is typing.Union:
        return all(_does_not_fit(value, each) for each in typing.get_args(declared))
    if declared is type(None):
        return value is not None
    origin = typing.get_origin(declared) or declared
    if isinstance(origin, type) and getattr(origin, "_is_protocol", False):
        return False  # a structural type: mypy checks its uses, not this test
    return isinstance(origin, type) and not isinstance(value, origin)


class PartWiringTests(TestCase):
    def test_everyPartGetsCollaboratorsOfTheTypesItDeclares(self) -> None:
        lifecycle = make_lifecycle(self)
        parts = {name: part for name, part in vars(lifecycle).items() if attrs.has(type(part))}
        self.assertGreaterEqual(len(parts), 12)
        wrong = []
        for name, part in parts.items():
            hints = typing.get_type_hints(type(part))
            for field in attrs.fields(type(part)):
                value = getattr(part, field.name)
                if _does_not_fit(value, hints[field.name]):
                    wrong.append(f"{name}.{field.name}: {type(value).__name__}")
        self.assertEqual(wrong, [])
