"""vmready's layers and sizes, read from its source: imports point one way, nowhere cycle.

The rule (docs/architecture.md): each subpackage of ``vmready`` has a rank;
a module may import its own subpackage and subpackages of a *lower* rank,
never a higher or an equal one.  The guest agent imports only the standard
library and the two wire formats it shares with the host.  Only the replay
(its core and its driver) imports fakeqemu, and only its public API; tests outside fakeqemu's own
import nothing of fakeqemu but ``fakeqemu`` and ``fakeqemu.testing``.

Every ``import`` counts wherever it stands (in a function, under
``TYPE_CHECKING``): an import that only the type checker sees still ties
the layers together.

Each subpackage has a face: its ``__init__``'s ``__all__``.  Outside the
subpackage (in ``vmready``, the plugins, fakeqemu and the benchmarks) a module
imports only names of that face, never an inner module; tests are exempt.

Sizes hold too, outside the tests: a module of at most 600 lines, a class of
300, a function of 60; and every ``# type: ignore`` says why on its line.
"""

from __future__ import annotations

import ast
import io
import os
import re
import shutil
import tempfile
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass

from twisted.trial.unittest import SynchronousTestCase

CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Lower imports nothing higher; equal ranks do not import each other.
RANKS = {
    "domain": 0,
    "guestfiles": 0,  # data files (the agent loader), no code of its own
    "protocols": 1,
    "trust": 1,
    "fence": 1,  # the host fence's own process: the standard library only
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
AGENT_SHARES = frozenset({"vmready", "vmready.protocols"})
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

    def counts(self, *imports: tuple[str, str]) -> list[int]:
        """How many violations each (importer, target) import is."""
        return [len(self.violations(importer, target)) for importer, target in imports]

    def test_anImportUpTheLayersIsAViolation(self) -> None:
        [violation] = self.violations("vmready.domain.states", "vmready.lifecycle.core")
        self.assertEqual(
            violation,
            "vmready/domain/states.py:7: vmready.domain.states -> vmready.lifecycle.core "
            "(domain, rank 0, may not import lifecycle, rank 5)",
        )

    def test_anImportDownTheLayersIsFine(self) -> None:
        self.assertEqual(self.violations("vmready.cli.main", "vmready.domain.states"), [])

    def test_equalRanksMayNotImportEachOther(self) -> None:
        self.assertEqual(len(self.violations("vmready.trust.tls", "vmready.protocols.qmp")), 1)

    def test_theAgentImportsNothingButItsSharedFormats(self) -> None:
        self.assertEqual(
            self.counts(
                ("vmready.agent.core", "vmready.domain.states"),
                ("vmready.agent.core", "vmready.protocols"),
                ("vmready.cli.main", "vmready.agent.core"),
            ),
            [1, 0, 1],
        )

    def test_fakeqemuOnlyInTheReplayAndOnlyPublic(self) -> None:
        self.assertEqual(
            self.counts(
                ("vmready.cli.main", "fakeqemu.testing"),
                ("vmready.record.replaydriver", "fakeqemu._machine"),
                ("vmready.record.replaydriver", "fakeqemu.testing"),
            ),
            [1, 1, 0],
        )

    def test_aCycleIsFound(self) -> None:
        self.assertEqual(
            cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}), [["a", "b", "c"]]
        )

    def test_noCycleInALine(self) -> None:
        self.assertEqual(cycles({"a": {"b"}, "b": {"c"}, "c": set()}), [])


# Faces besides each subpackage's ``__init__``: a module, or a package inside a
# subpackage, whose ``__all__`` other subpackages may import from too (each
# subpackage's ``__init__`` says why it splits its face).
SPLIT_FACES = {
    "agentlink": ("vmready.agentlink.transport",),
    "hypervisor": ("vmready.hypervisor.agentbundle", "vmready.hypervisor.guestimage"),
    "record": ("vmready.record.replay",),
    "protocols": (
        "vmready.protocols.qmp",
        "vmready.protocols.prometheus",
        "vmready.protocols.transcriptreader",
    ),
}
# Where imports of vmready go through its faces: everything but the tests.
FACED = ("vmready", "twisted/plugins", "fakeqemu", "benchmarks")


def declared_all(source: str, path: str) -> frozenset[str] | None:
    """The names of a module's ``__all__`` (a literal list or tuple), or None without one."""
    for node in ast.parse(source, path).body:
        if not isinstance(node, ast.Assign):
            continue
        if [getattr(target, "id", None) for target in node.targets] == ["__all__"]:
            return frozenset(ast.literal_eval(node.value))
    return None


def vmready_faces() -> dict[str, frozenset[str] | None]:
    """Every face of vmready's subpackages, by dotted name: the names of its ``__all__``."""
    known = modules("vmready")
    names = [f"vmready.{package}" for package in RANKS if package != "guestfiles"]
    names += ["vmready.agent", "vmready.guestfiles"]
    names += [face for faces in SPLIT_FACES.values() for face in faces]
    found = {}
    for name in sorted(names):
        with open(os.path.join(CHECKOUT, known[name]), encoding="utf-8") as f:
            found[name] = declared_all(f.read(), known[name])
    return found


def face_violations(
    path: str, module: str, source: str, faces: dict[str, frozenset[str] | None]
) -> list[str]:
    """Each import in ``source`` (module ``module``, file ``path``) of another
    subpackage's inside, as ``file:line: what (the face to use)``."""
    own = subpackage(module)
    found = []

    def check(line: int, target: str, name: str | None) -> None:
        if target == "vmready" or subpackage(target) == own:
            return  # ``from vmready import store`` imports a face
        what = target if name is None else f"{name} from {target}"
        if target in faces:
            if name is None or name in (faces[target] or ()):
                return
            found.append(f"{path}:{line}: {module} imports {what}, not in {target}'s face")
            return
        face = max((f for f in faces if target.startswith(f + ".")), key=len, default=None)
        if face is None:
            face = f"vmready.{subpackage(target)}"
        found.append(f"{path}:{line}: {module} imports {what}: use its face {face}")

    for node in ast.walk(ast.parse(source, path)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "vmready":
                    check(node.lineno, alias.name, None)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                if node.module.split(".")[0] == "vmready":
                    check(node.lineno, node.module, alias.name)
    return found


class FaceTests(SynchronousTestCase):
    """Each subpackage is used through its face only."""

    def test_everyFaceDeclaresItsNames(self) -> None:
        faces = vmready_faces()
        self.assertEqual(sorted(name for name, names in faces.items() if names is None), [])

    def test_importsOfAnotherSubpackageGoThroughItsFace(self) -> None:
        faces = vmready_faces()
        found = []
        for package in FACED:
            for module, path in sorted(modules(package).items()):
                with open(os.path.join(CHECKOUT, path), encoding="utf-8") as f:
                    found += face_violations(path, module, f.read(), faces)
        self.assertEqual(found, [])


class FaceCheckerTests(SynchronousTestCase):
    """The face check can fail: each on a small made-up source."""

    FACES: dict[str, frozenset[str] | None] = {
        "vmready.store": frozenset({"Store"}),
        "vmready.hypervisor": frozenset({"HypervisorDriver"}),
        "vmready.hypervisor.guestimage": frozenset({"ensure_guest"}),
    }

    def violations(self, source: str, module: str = "vmready.lifecycle.core") -> list[str]:
        return face_violations("made.py", module, source, self.FACES)

    def test_aNameOfTheFaceIsFine(self) -> None:
        self.assertEqual(self.violations("from vmready.store import Store\n"), [])

    def test_anInnerModuleIsAViolationThatNamesTheFace(self) -> None:
        self.assertEqual(
            self.violations("x = 1\nfrom vmready.store.sqlite import Store\n"),
            [
                "made.py:2: vmready.lifecycle.core imports Store from vmready.store.sqlite: "
                "use its face vmready.store"
            ],
        )

    def test_aNameMissingFromTheFaceIsAViolation(self) -> None:
        self.assertEqual(
            self.violations("def f():\n    from vmready.store import Table\n"),
            [
                "made.py:2: vmready.lifecycle.core imports Table from vmready.store, "
                "not in vmready.store's face"
            ],
        )

    def test_importingAnInnerModuleIsAViolation(self) -> None:
        self.assertEqual(
            self.violations("import vmready.store.sqlite\nfrom vmready.store import sqlite\n"),
            [
                "made.py:1: vmready.lifecycle.core imports vmready.store.sqlite: "
                "use its face vmready.store",
                "made.py:2: vmready.lifecycle.core imports sqlite from vmready.store, "
                "not in vmready.store's face",
            ],
        )

    def test_aSplitFaceIsNamedForItsInside(self) -> None:
        source = "from vmready.hypervisor.guestimage import ensure_guest\n"
        source += "from vmready.hypervisor.guestimage.build import ensure_guest\n"
        self.assertEqual(
            self.violations(source),
            [
                "made.py:2: vmready.lifecycle.core imports ensure_guest from "
                "vmready.hypervisor.guestimage.build: use its face vmready.hypervisor.guestimage"
            ],
        )

    def test_aSubpackageReachesInsideItself(self) -> None:
        source = "from vmready.store.sqlite import Store\nimport vmready.store.table\n"
        self.assertEqual(self.violations(source, module="vmready.store.asyncstore"), [])

    def test_codeOutsideVmreadyUsesTheFacesToo(self) -> None:
        source = "from vmready.hypervisor.driver import HypervisorDriver\n"
        self.assertEqual(len(self.violations(source, module="benchmarks.lifecycle")), 1)

    def test_aFaceIsReadFromItsAll(self) -> None:
        self.assertEqual(
            [declared_all('__all__ = ["a", "b"]\n', "m.py"), declared_all("a = 1\n", "m.py")],
            [frozenset({"a", "b"}), None],
        )


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


# Sizes that hold: a module, a class or a function past these is doing more
# than one thing.  Test modules are exempt; everything else is held.
SIZE_LIMITS = {"module": 600, "class": 300, "function": 60}
HELD = ("vmready", "fakeqemu", "benchmarks", "twisted/plugins")
NO_REASON = "type: ignore without a reason"
# Things over a limit today in files whose owners are bringing them under it:
# (file, thing) -> its size today (for NO_REASON, how many).  An entry may
# only shrink: one that grows past its size, or is back within the limit,
# fails the test and must be deleted.  Nothing else may join this list.
KNOWN_OVER_LIMIT: dict[tuple[str, str], int] = {}
# ``# type: ignore[code]`` then a comment that says why, on the same line.
_EXPLAINED_IGNORE = re.compile(r"type:\s*ignore\[[^\]]+\]\s+#\s*\S")


@dataclass(frozen=True)
class Measure:
    """One thing's size in one file: ``thing`` is ``module``, ``class C`` or ``function C.f``."""

    path: str
    thing: str
    size: int
    where: tuple[int, ...] = ()  # for NO_REASON: the lines

    def limit(self) -> int:
        return 0 if self.thing == NO_REASON else SIZE_LIMITS[self.thing.split()[0]]

    def describe(self) -> str:
        if self.thing == NO_REASON:
            lines = ", ".join(map(str, self.where))
            return (
                f"{self.path}: {self.size} '# type: ignore' without a reason "
                f"(line{'s' if self.size > 1 else ''} {lines}; "
                "limit 0: write '# type: ignore[code]  # why')"
            )
        return f"{self.path}: {self.thing} is {self.size} lines (limit {self.limit()})"


def measures(path: str, source: str) -> list[Measure]:
    """The module, each class and each function (methods and nested ones too) of a source,
    and how many of its ``# type: ignore`` comments give no reason."""
    found = [Measure(path, "module", len(source.splitlines()))]

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                kind = "class" if isinstance(child, ast.ClassDef) else "function"
                assert child.end_lineno is not None
                size = child.end_lineno - child.lineno + 1
                found.append(Measure(path, f"{kind} {prefix}{child.name}", size))
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source, path), "")
    unexplained = tuple(
        token.start[0]
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type == tokenize.COMMENT
        and re.search(r"type:\s*ignore", token.string)
        and not _EXPLAINED_IGNORE.search(token.string)
    )
    found.append(Measure(path, NO_REASON, len(unexplained), unexplained))
    return found


def over_limit(found: list[Measure], known: dict[tuple[str, str], int] | None = None) -> list[str]:
    """Each thing over its limit, and each entry of ``known`` that is no longer right."""
    known = {} if known is None else known
    problems = []
    sizes = {(m.path, m.thing): m for m in found}
    for measure in found:
        if measure.size <= measure.limit():
            continue
        allowed = known.get((measure.path, measure.thing))
        if allowed is None:
            problems.append(measure.describe())
        elif measure.size > allowed:
            problems.append(f"{measure.describe()}, grown from {allowed} in KNOWN_OVER_LIMIT")
    for (path, thing), allowed in sorted(known.items()):
        now_measured = sizes.get((path, thing))
        if now_measured is None or now_measured.size <= now_measured.limit():
            now = "gone" if now_measured is None else f"{now_measured.size}, within its limit"
            problems.append(
                f"{path}: {thing} is listed in KNOWN_OVER_LIMIT at {allowed} but is now "
                f"{now}: delete its entry"
            )
    return problems


def held_sources() -> Iterator[tuple[str, str]]:
    """``(path, source)`` of every module the limits hold, test modules left out."""
    for package in HELD:
        for _, path in sorted(modules(package).items()):
            if os.path.basename(path).startswith("test_"):
                continue
            with open(os.path.join(CHECKOUT, path), encoding="utf-8") as f:
                yield path, f.read()


class SizeLimitTests(SynchronousTestCase):
    """Modules, classes and functions keep within their sizes; every ignore says why."""

    def test_everythingIsWithinItsLimitOrKnown(self) -> None:
        found = [m for path, source in held_sources() for m in measures(path, source)]
        self.assertEqual(over_limit(found, KNOWN_OVER_LIMIT), [])


def _lines(count: int, indent: str = "    ") -> str:
    return "".join(f"{indent}x{n} = {n}\n" for n in range(count))


class SizeCheckerTests(SynchronousTestCase):
    """The size checks can fail: each on a small made-up source."""

    def problems(self, source: str, known: dict[tuple[str, str], int] | None = None) -> list[str]:
        return over_limit(measures("pkg/made.py", source), known)

    def test_aModuleOverItsLimitIsNamed(self) -> None:
        self.assertEqual(
            self.problems(_lines(601, indent="")),
            ["pkg/made.py: module is 601 lines (limit 600)"],
        )

    def test_aModuleAtItsLimitIsFine(self) -> None:
        self.assertEqual(self.problems(_lines(600, indent="")), [])

    def test_aClassOverItsLimitIsNamed(self) -> None:
        self.assertEqual(
            self.problems("class Big:\n" + _lines(300)),
            ["pkg/made.py: class Big is 301 lines (limit 300)"],
        )

    def test_aFunctionOverItsLimitIsNamed(self) -> None:
        self.assertEqual(
            self.problems("def long():\n" + _lines(60)),
            ["pkg/made.py: function long is 61 lines (limit 60)"],
        )

    def test_aMethodIsNamedWithItsClass(self) -> None:
        self.assertEqual(
            self.problems("class Small:\n    async def long(self):\n" + _lines(60, " " * 8)),
            ["pkg/made.py: function Small.long is 61 lines (limit 60)"],
        )

    def test_aFunctionAtItsLimitIsFine(self) -> None:
        self.assertEqual(self.problems("def fits():\n" + _lines(59)), [])

    def test_anIgnoreWithoutAReasonIsCounted(self) -> None:
        source = "a = f()  # type: ignore[misc]\nb = g()  # type: ignore\n"
        self.assertEqual(
            self.problems(source),
            [
                "pkg/made.py: 2 '# type: ignore' without a reason "
                "(lines 1, 2; limit 0: write '# type: ignore[code]  # why')"
            ],
        )

    def test_anIgnoreWithItsReasonIsFine(self) -> None:
        source = "a = f()  # type: ignore[misc]  # f is untyped\n"
        self.assertEqual(self.problems(source), [])

    def test_anIgnoreInAStringIsNotAComment(self) -> None:
        self.assertEqual(self.problems('text = "# type: ignore"\n'), [])

    def known_function(self, size: int) -> list[str]:
        """The problems of a function of ``size`` lines that KNOWN_OVER_LIMIT lists at 61."""
        source = "def long():\n" + _lines(size - 1)
        return self.problems(source, {("pkg/made.py", "function long"): 61})

    def test_aKnownThingMayStayAtItsSize(self) -> None:
        self.assertEqual(self.known_function(61), [])

    def test_aKnownThingMayNotGrow(self) -> None:
        grown = "function long is 62 lines (limit 60), grown from 61 in KNOWN_OVER_LIMIT"
        self.assertEqual(self.known_function(62), [f"pkg/made.py: {grown}"])

    def test_aKnownThingBackWithinItsLimitIsStale(self) -> None:
        self.assertEqual(
            self.known_function(60),
            [
                "pkg/made.py: function long is listed in KNOWN_OVER_LIMIT at 61 but is now "
                "60, within its limit: delete its entry"
            ],
        )

    def test_aKnownThingThatIsGoneIsStale(self) -> None:
        known = {("pkg/made.py", "class Gone"): 400}
        self.assertEqual(
            self.problems("x = 1\n", known),
            [
                "pkg/made.py: class Gone is listed in KNOWN_OVER_LIMIT at 400 but is now "
                "gone: delete its entry"
            ],
        )
