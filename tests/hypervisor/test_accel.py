"""vmready.hypervisor.accel: the accelerator a VM gets, and the host's verdicts on KVM."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

from twisted.logger import LogLevel, capturedLogs, formatEvent
from twisted.trial.unittest import SynchronousTestCase

from vmready.hypervisor.accel import AccelChoice, KVMVerdict, KVMVerdicts, choose_accel

NO_KVM = "/dev/kvm cannot be opened: No such file or directory"
WORKS = KVMVerdict(True, "guests run under KVM here (first: vm1)", 100.0)
FAILS = KVMVerdict(False, "a guest under KVM showed no sign of life within 30s", 100.0)
# Every state of KVM on a host: the device's problem (None: it opens) and the verdict.
KVM_STATES = [(problem, verdict) for problem in (None, NO_KVM) for verdict in (None, WORKS, FAILS)]
HOST = "linux-6.1.0-18-amd64 qemu-7.2.22"
OTHER_HOST = "linux-6.12.0-1-amd64 qemu-9.2.0"


class ChooseAccelTests(SynchronousTestCase):
    """``choose_accel`` for every request, KVM device state and verdict."""

    def test_tcgRequestIsTcgWhateverKVMDoes(self) -> None:
        expected = AccelChoice("tcg", False, "TCG, as the instance asks (boot.accel=tcg)")
        for problem, verdict in KVM_STATES:
            self.assertEqual(choose_accel("tcg", problem, verdict), expected)

    def test_kvmRequestIsKvmWhateverKVMDoes(self) -> None:
        expected = AccelChoice("kvm", False, "KVM, as the instance asks (boot.accel=kvm)")
        for problem, verdict in KVM_STATES:
            self.assertEqual(choose_accel("kvm", problem, verdict), expected)

    def test_autoWithoutTheKVMDeviceIsTcgSayingWhy(self) -> None:
        expected = AccelChoice(
            "tcg",
            False,
            "TCG: KVM is not available (/dev/kvm cannot be opened: No such file or directory)",
        )
        for verdict in (None, WORKS, FAILS):
            self.assertEqual(choose_accel("auto", NO_KVM, verdict), expected)

    def test_autoWithUntriedKVMIsAKVMTrial(self) -> None:
        self.assertEqual(
            choose_accel("auto", None, None),
            AccelChoice("kvm", True, "KVM, on trial: no guest has run under KVM here yet"),
        )

    def test_autoWithKVMThatRunsGuestsIsKvm(self) -> None:
        self.assertEqual(
            choose_accel("auto", None, WORKS),
            AccelChoice("kvm", False, "KVM: guests run under KVM here (first: vm1)"),
        )

    def test_autoWithKVMThatFailedIsTcgSayingWhy(self) -> None:
        self.assertEqual(
            choose_accel("auto", None, FAILS),
            AccelChoice(
                "tcg",
                False,
                "TCG: KVM does not run guests on this host "
                "(a guest under KVM showed no sign of life within 30s)",
            ),
        )

    def test_onlyAnUntriedKVMIsProbed(self) -> None:
        probed = [
            (requested, problem, verdict)
            for requested in ("auto", "kvm", "tcg")
            for problem, verdict in KVM_STATES
            if choose_accel(requested, problem, verdict).probe
        ]
        self.assertEqual(probed, [("auto", None, None)])

    def test_unknownAcceleratorIsRefused(self) -> None:
        with self.assertRaises(ValueError) as caught:
            choose_accel("xen", None, None)
        self.assertEqual(str(caught.exception), "unknown accelerator 'xen'")


class Clock:
    """A wall clock the test sets."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class KVMVerdictsTests(SynchronousTestCase):
    """The verdicts file: kept per host kernel and QEMU build, read back by the next daemon."""

    def setUp(self) -> None:
        self.directory = self.mktemp()
        os.makedirs(self.directory)
        self.path = os.path.join(self.directory, "kvm-verdicts.json")
        self.clock = Clock(1700000000.5)

    def verdicts(self, key: str = HOST) -> KVMVerdicts:
        return KVMVerdicts(self.path, key, self.clock)

    def write(self, text: str) -> None:
        with open(self.path, "w") as f:
            f.write(text)

    def saved(self) -> Any:
        with open(self.path) as f:
            return json.load(f)

    def warnings(self, make: Callable[[], object]) -> list[str]:
        """The warnings logged while ``make()`` runs."""
        with capturedLogs() as events:
            make()
        return [str(formatEvent(event)) for event in events if event["log_level"] == LogLevel.warn]

    def load(self) -> tuple[KVMVerdicts, list[str]]:
        """The verdicts as a new daemon reads them, and the warnings it logs."""
        loaded: list[KVMVerdicts] = []
        warnings = self.warnings(lambda: loaded.append(self.verdicts()))
        return loaded[0], warnings

    def test_untriedWithoutAFile(self) -> None:
        self.assertIsNone(self.verdicts().verdict)
        self.assertFalse(os.path.exists(self.path))

    def test_recordReturnsTheVerdictAtTheClocksTime(self) -> None:
        verdict = self.verdicts().record(True, "guests run under KVM here")
        self.assertEqual(verdict, KVMVerdict(True, "guests run under KVM here", 1700000000.5))

    def test_recordedVerdictIsTheVerdict(self) -> None:
        verdicts = self.verdicts()
        verdict = verdicts.record(False, "QEMU failed to start a guest under KVM")
        self.assertEqual(verdicts.verdict, verdict)

    def test_verdictSurvivesAReload(self) -> None:
        recorded = self.verdicts().record(False, "no sign of life within 30s")
        self.assertEqual(self.verdicts().verdict, recorded)

    def test_fileIsJsonKeyedByHost(self) -> None:
        self.verdicts().record(True, "guests run under KVM here")
        self.assertEqual(
            self.saved(),
            {HOST: {"works": True, "reason": "guests run under KVM here", "at": 1700000000.5}},
        )

    def test_verdictBelongsToItsHostAndQemuBuild(self) -> None:
        self.verdicts(HOST).record(False, "no sign of life within 30s")
        self.assertIsNone(self.verdicts(OTHER_HOST).verdict)

    def test_recordKeepsOtherKeysVerdicts(self) -> None:
        first = self.verdicts(HOST).record(False, "no sign of life within 30s")
        self.clock.now += 60
        second = self.verdicts(OTHER_HOST).record(True, "guests run under KVM here")
        self.assertEqual(
            (self.verdicts(HOST).verdict, self.verdicts(OTHER_HOST).verdict), (first, second)
        )

    def test_laterVerdictReplacesTheEarlier(self) -> None:
        verdicts = self.verdicts()
        verdicts.record(True, "guests run under KVM here")
        self.clock.now += 60
        later = verdicts.record(False, "QEMU failed to start a guest under KVM")
        self.assertEqual(self.verdicts().verdict, later)

    def test_writeLeavesNoPartialFile(self) -> None:
        self.verdicts().record(True, "guests run under KVM here")
        self.assertEqual(os.listdir(self.directory), ["kvm-verdicts.json"])

    def test_failedWriteLeavesTheFileAsItWas(self) -> None:
        kept = self.verdicts().record(True, "guests run under KVM here")
        os.mkdir(self.path + ".tmp")
        self.warnings(lambda: self.verdicts().record(False, "no sign of life within 30s"))
        self.assertEqual(self.verdicts().verdict, kept)

    def test_failedWriteIsAWarning(self) -> None:
        os.mkdir(self.path + ".tmp")
        warnings = self.warnings(lambda: self.verdicts().record(True, "guests run"))
        self.assertEqual(len(warnings), 1)
        self.assertTrue(
            warnings[0].startswith(f"cannot save the KVM verdict to {self.path}: "), warnings
        )

    def test_unsavedVerdictIsStillTheVerdict(self) -> None:
        verdicts = KVMVerdicts(os.path.join(self.directory, "gone", "kvm.json"), HOST, self.clock)
        self.warnings(lambda: verdicts.record(False, "no sign of life within 30s"))
        self.assertEqual(
            verdicts.verdict, KVMVerdict(False, "no sign of life within 30s", 1700000000.5)
        )

    def test_corruptFileIsIgnoredWithAWarning(self) -> None:
        self.write('{"linux": {"works": tr')
        verdicts, warnings = self.load()
        self.assertIsNone(verdicts.verdict)
        self.assertEqual(len(warnings), 1)
        self.assertTrue(
            warnings[0].startswith(f"ignoring unreadable KVM verdict {self.path}: "), warnings
        )

    def test_fileThatIsNotAnObjectIsIgnoredWithAWarning(self) -> None:
        self.write("[true]\n")
        verdicts, warnings = self.load()
        self.assertIsNone(verdicts.verdict)
        self.assertEqual(warnings, [f"ignoring KVM verdicts {self.path}: not a JSON object"])

    def test_malformedVerdictIsIgnoredWithAWarning(self) -> None:
        self.write(json.dumps({HOST: {"works": "false", "reason": "typed by hand", "at": 1}}))
        verdicts, warnings = self.load()
        self.assertIsNone(verdicts.verdict)
        self.assertEqual(len(warnings), 1)
        self.assertTrue(
            warnings[0].startswith(f"ignoring the KVM verdict for {HOST} in {self.path}: "),
            warnings,
        )

    def test_verdictMissingAFieldIsIgnored(self) -> None:
        self.write(json.dumps({HOST: {"works": True, "reason": "guests run"}}))
        verdicts, warnings = self.load()
        self.assertIsNone(verdicts.verdict)
        self.assertEqual(len(warnings), 1)

    def test_recordReplacesACorruptFile(self) -> None:
        self.write("not json at all")
        self.warnings(lambda: self.verdicts().record(True, "guests run under KVM here"))
        self.assertEqual(self.saved()[HOST]["works"], True)

    def test_integerTimeIsRead(self) -> None:
        self.write(json.dumps({HOST: {"works": True, "reason": "guests run", "at": 5}}))
        self.assertEqual(self.verdicts().verdict, KVMVerdict(True, "guests run", 5.0))
