"""vmready.protocols' face: each name from its module, imported when first asked for."""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

import vmready.protocols
from vmready.protocols import ringbuffer, transcript


class FaceTests(SynchronousTestCase):
    def test_everyNameIsItsModulesOwn(self) -> None:
        for name in vmready.protocols.__all__:
            own = [m for m in (ringbuffer, transcript) if name in vars(m)]
            self.assertEqual(len(own), 1, name)
            self.assertIs(getattr(vmready.protocols, name), getattr(own[0], name), name)

    def test_anUnknownNameIsAnAttributeError(self) -> None:
        with self.assertRaises(AttributeError):
            vmready.protocols.Nothing  # noqa: B018
