"""The documentation that is generated from code stays in step with it."""

from __future__ import annotations

import os

from twisted.trial.unittest import SynchronousTestCase

from vmready.cli.tables import DEFAULT_COLUMNS, LIST_COLUMNS, parse_columns
from vmready.domain.states import (
    PowerState,
    TaskState,
    VMState,
    operator_status,
    transition_diagram,
)

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs")


class StateModelDocTests(SynchronousTestCase):
    """docs/state-model.md shows the transitions the code actually implements."""

    def test_diagramMatchesTheActionTable(self) -> None:
        with open(os.path.join(DOCS, "state-model.md"), encoding="utf-8") as f:
            text = f.read()
        block = text.split("```mermaid\n", 1)[1].split("```", 1)[0]
        self.assertEqual(block.strip(), transition_diagram().strip())


def _table_rows(text: str, heading: str) -> list[list[str]]:
    """The cells of the markdown table whose header row starts with ``| heading |``."""
    lines = text.split(f"| {heading} |", 1)[1].splitlines()[2:]
    rows = []
    for line in lines:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


class OperatorStatusDocTests(SynchronousTestCase):
    """docs/state-model.md's operator status tables say what ``operator_status`` does."""

    def setUp(self) -> None:
        with open(os.path.join(DOCS, "state-model.md"), encoding="utf-8") as f:
            self.text = f.read()

    def test_everyTaskIsListedWithItsStatus(self) -> None:
        rows = _table_rows(self.text, "task_state in progress")
        self.assertEqual(
            sorted(task for task, _ in rows), sorted(task.value for task in TaskState)
        )
        for task, status in rows:
            self.assertEqual(
                operator_status(VMState.ACTIVE, TaskState(task), PowerState.RUNNING, True),
                status,
            )

    def test_everyRestingStateIsListedWithItsStatus(self) -> None:
        rows = _table_rows(self.text, "no task: vm_state (power_state)")
        listed = {when.split(" ", 1)[0] for when, _ in rows}
        self.assertEqual(listed, {state.value for state in VMState})
        for when, status in rows:
            vm_state = VMState(when.split(" ", 1)[0])
            power = PowerState.RUNNING
            if when.startswith("active ("):
                power = PowerState(when[len("active (") :].split(",")[0].rstrip(")").strip())
            ready = "ready" in when
            self.assertEqual(operator_status(vm_state, None, power, ready), status, when)


class ListColumnsDocTests(SynchronousTestCase):
    """docs/operator-guide.md lists exactly the columns ``vmready list -c`` takes."""

    def test_theColumnTableMatchesTheCode(self) -> None:
        with open(os.path.join(DOCS, "operator-guide.md"), encoding="utf-8") as f:
            text = f.read()
        rows = _table_rows(text, "letter")
        self.assertEqual(
            [(letter.strip("`"), name.strip("`"), header) for letter, name, header, _ in rows],
            [(column.letter, column.name, column.header) for column in LIST_COLUMNS],
        )
        headers = " ".join(column.header for column in parse_columns(DEFAULT_COLUMNS))
        self.assertIn(f"The default columns are {headers};", text.replace("\n", " "))
