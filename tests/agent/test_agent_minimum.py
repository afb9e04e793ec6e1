"""Tests for vmready.agent.minimum: the interpreter the agent needs, said in one line."""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from vmready.agent.minimum import interpreter_problem


class InterpreterTests(SynchronousTestCase):
    def test_python39WithSslWillDo(self) -> None:
        self.assertEqual(interpreter_problem((3, 9, 0), has_ssl=True), "")

    def test_thisPythonWillDo(self) -> None:
        self.assertEqual(interpreter_problem(), "")

    def test_anOlderPythonIsNamed(self) -> None:
        self.assertEqual(
            interpreter_problem((3, 8, 10), has_ssl=True),
            "needs Python 3.9 or newer, and this is Python 3.8.10",
        )

    def test_aPythonWithoutSsl(self) -> None:
        self.assertEqual(
            interpreter_problem((3, 11, 2), has_ssl=False),
            "needs Python's ssl module, and this Python was built without it",
        )
