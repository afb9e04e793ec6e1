"""The documentation that is generated from code stays in step with it."""

from __future__ import annotations

import os

from twisted.trial.unittest import SynchronousTestCase

from vmready.domain.states import transition_diagram

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs")


class StateModelDocTests(SynchronousTestCase):
    """docs/state-model.md shows the transitions the code actually implements."""

    def test_diagramMatchesTheActionTable(self) -> None:
        with open(os.path.join(DOCS, "state-model.md"), encoding="utf-8") as f:
            text = f.read()
        block = text.split("```mermaid\n", 1)[1].split("```", 1)[0]
        self.assertEqual(block.strip(), transition_diagram().strip())
