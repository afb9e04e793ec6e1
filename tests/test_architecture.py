"""vmready's layers, read from its source: imports point one way, and nowhere do they cycle.

The rule (docs/architecture.md): each subpackage of ``vmready`` has a rank;
a module may import its own subpackage and subpackages of a *lower* rank,
never a higher or an equal one.  The guest agent imports only the standard
library and the two wire formats it shares with the host.  Only the replay
(its core and its driver) imports fakeqemu, and only its public API; tests outside fakeqemu's own
import nothing of fakeqemu but ``fakeqemu`` and ``fakeqemu.testing``.

Every ``import`` counts wherever it stands (in a function, under
``TYPE_CHECKING``): an import that only the type checker sees still ties
the layers together.
"""

from __future__ import annotations

import ast
import os
import shutil
import tempfile
from collections.abc import Iterator

from twisted.trial.unittest import SynchronousTestCase

CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Lower imports nothing higher; equal ranks do not import each other.
RANKS = {
    "domain": 0,
    "guestfiles": 0,  # data files (the agent loader), no code of its own
    "protocols": 1,
    "trust": 1,
    "store": 2,
    "hypervisor": 3,
    "agentlink": 4,
    "lifecycle": 5,
    "api": 6,
    "record": 7,
    "cli": 8,
    "daemon": 9,
}
# What the guest agent may import of vmready: it runs in a stock guest.
AGENT_SHARES = frozenset(
    {"vmready", "vmready.protocols.ringbuffer", "vmready.protocols.transcript"}
)
FAKEQEMU_PUBLIC = frozenset({"fakeqemu", "fakeqemu.testing"})
# The replay's modules that run fakeqemu in memory: its core and its driver.
FAKEQEMU_USERS = frozenset({"vmready.record.replaycore", "vmready.record.replaydriver"})


def modules(package: str) -> dict[str, str]:
    """Every module under ``package`` (a directory of the checkout), by dotted name."""
    found = {}
    for directory, _, names in os.walk(os.path.join(CHECKOUT, package)):
        for name in names:
            if not name.endswith(".py"):
                continue
            path = os.path.join(directory, name)
            dotted = os.path.relpath(path, CHECKOUT)[: -len(".py")].replace(os.sep, ".")
            found[dotted.removesuffix(".__init__")] = os.path.relpath(path, CHECKOUT)
    return found


def imports(path: str, known: dict[str, str]) -> Iterator[tuple[int, str]]:
    """``(line, module)`` for each absolute import in the file.

    ``from P import N`` imports the module ``P.N`` when there is one, else ``P``.
    """
    with open(os.path.join(CHECKOUT, path), encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                yield node.lineno, submodule if submodule in known else node.module


def subpackage(module: str) -> str | None:
    """``vmready.hypervisor.driver`` → ``hypervisor``; the root ``vmready`` → None."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "vmready" else None


def layer_violations(graph: dict[str, list[tuple[int, str]]], where: dict[str, str]) -> list[str]:
    """Each import against the layer rule, as ``file:line: importer -> imported (why)``."""
    found = []
    for importer, targets in sorted(graph.items()):
        source = subpackage(importer)
        for line, target in targets:
            place = f"{where[importer]}:{line}: {importer} -> {target}"
            if target.split(".")[0] == "fakeqemu":
                if importer not in FAKEQEMU_USERS:
                    found.append(f"{place} (only the replay may use fakeqemu)")
                elif target not in FAKEQEMU_PUBLIC:
                    found.append(f"{place} (fakeqemu's private module)")
                continue
            if target.split(".")[0] != "vmready":
                continue
            imported = subpackage(target)
            if source == "agent":
                if imported != "agent" and target not in AGENT_SHARES:
                    found.append(f"{place} (the guest agent imports only its shared formats)")
                continue
            if imported == "agent":
                found.append(f"{place} (the guest agent is guest code)")
                continue
            if source is None or imported is None or source == imported:
                continue
            if source not in RANKS or imported not in RANKS:
                found.append(f"{place} (a subpackage without a rank)")
            elif RANKS[imported] >= RANKS[source]:
                found.append(
                    f"{place} ({source}, rank {RANKS[source]}, may not import "
                    f"{imported}, rank {RANKS[imported]})"
                )
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph.get(node, ())):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def import_graph(package: str) -> tuple[dict[str, list[tuple[int, str]]], dict[str, str]]:
    known = modules(package)
    everything = {**known, **modules("fakeqemu")}
    return {name: list(imports(path, everything)) for name, path in known.items()}, known


class LayerRuleTests(SynchronousTestCase):
    """vmready's own code keeps the rule."""

    def test_importsPointDownTheLayersOnly(self) -> None:
        graph, where = import_graph("vmready")
        self.assertEqual(layer_violations(graph, where), [])

    def test_noImportCycleAnywhereInVmready(self) -> None:
        graph, _ = import_graph("vmready")
        edges = {name: {t for _, t in targets if t in graph} for name, targets in graph.items()}
        self.assertEqual(cycles(edges), [])

    def test_everySubpackageHasARank(self) -> None:
        packages = {
            name
            for name in os.listdir(os.path.join(CHECKOUT, "vmready"))
            if os.path.isfile(os.path.join(CHECKOUT, "vmready", name, "__init__.py"))
        }
        self.assertEqual(packages - {"agent"}, set(RANKS))

    def test_testsUseOnlyFakeqemusPublicAPI(self) -> None:
        known = modules("fakeqemu")
        found = []
        for name, path in sorted(modules("tests").items()):
            if name.startswith("tests.fakeqemu"):
                continue  # fakeqemu's own tests test its inside
            for line, target in imports(path, known):
                if target.split(".")[0] == "fakeqemu" and target not in FAKEQEMU_PUBLIC:
                    found.append(f"{path}:{line}: {target}")
        self.assertEqual(found, [])


class CheckerTests(SynchronousTestCase):
    """The checks can fail: each on a small made-up graph."""

    def violations(self, importer: str, target: str) -> list[str]:
        where = {importer: importer.replace(".", "/") + ".py"}
        return layer_violations({importer: [(7, target)]}, where)

    def test_anImportUpTheLayersIsAViolation(self) -> None:
        self.assertEqual(
            self.violations("vmready.domain.states", "vmready.lifecycle.core"),
            [
                "vmready/domain/states.py:7: vmready.domain.states -> vmready.lifecycle.core "
                "(domain, rank 0, may not import lifecycle, rank 5)"
            ],
        )

    def test_anImportDownTheLayersIsFine(self) -> None:
        self.assertEqual(self.violations("vmready.cli.main", "vmready.domain.states"), [])

    def test_equalRanksMayNotImportEachOther(self) -> None:
        self.assertEqual(len(self.violations("vmready.trust.tls", "vmready.protocols.qmp")), 1)

    def test_theAgentImportsNothingButItsSharedFormats(self) -> None:
        self.assertEqual(
            [
                len(self.violations("vmready.agent.core", "vmready.domain.states")),
                len(self.violations("vmready.agent.core", "vmready.protocols.ringbuffer")),
                len(self.violations("vmready.cli.main", "vmready.agent.core")),
            ],
            [1, 0, 1],
        )

    def test_fakeqemuOnlyInTheReplayAndOnlyPublic(self) -> None:
        self.assertEqual(
            [
                len(self.violations("vmready.cli.main", "fakeqemu.testing")),
                len(self.violations("vmready.record.replaydriver", "fakeqemu._machine")),
                len(self.violations("vmready.record.replaydriver", "fakeqemu.testing")),
            ],
            [1, 1, 0],
        )

    def test_aCycleIsFound(self) -> None:
        self.assertEqual(
            cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}), [["a", "b", "c"]]
        )

    def test_noCycleInALine(self) -> None:
        self.assertEqual(cycles({"a": {"b"}, "b": {"c"}, "c": set()}), [])


def private_twisted_imports(path: str) -> list[str]:
    """Each import of a private Twisted module or name in the file, as ``file:line: what``."""
    with open(os.path.join(CHECKOUT, path), encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "twisted" and any(part.startswith("_") for part in parts):
                found.append(f"{path}:{node.lineno}: {name}")
    return found


class PublicTwistedTests(SynchronousTestCase):
    """vmready, fakeqemu and the plugins use Twisted's public API: no private module or name."""

    def test_noPrivateTwistedImport(self) -> None:
        found = [
            violation
            for package in ("vmready", "fakeqemu", "twisted/plugins")
            for path in modules(package).values()
            for violation in private_twisted_imports(path)
        ]
        self.assertEqual(found, [])

    def test_aPrivateModuleOrNameIsFound(self) -> None:
        directory = tempfile.mkdtemp(prefix="vmr-arch-")
        self.addCleanup(shutil.rmtree, directory)
        path = os.path.join(directory, "m.py")
        with open(path, "w", encoding="utf-8") as f:
            f.write(
                "from twisted.web._newclient import Request\n"
                "from twisted.internet.endpoints import _WrappingFactory, serverFromString\n"
                "import twisted.web.client\n"
            )
        relative = os.path.relpath(path, CHECKOUT)
        self.assertEqual(
            private_twisted_imports(relative),
            [
                f"{relative}:1: twisted.web._newclient.Request",
                f"{relative}:2: twisted.internet.endpoints._WrappingFactory",
            ],
        )
