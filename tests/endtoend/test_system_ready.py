"""Ready end to end with real processes: ``twistd vmready``, the CLI, fakeqemu VMs, agents.

A fakeqemu guest is a host process, so its agent runs as one too
(``python -m vmready.agent.main --config-drive <drive>``) and a guest program
is any process that talks to the agent's socket.  See ``tests/system.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess

from twisted.trial.unittest import SynchronousTestCase

from tests.system import DEADLINE, READY_KEY, EventReader, System

NAME = "web1"


def launch_with_agent(system: System, events: EventReader) -> subprocess.Popen[bytes]:
    """Launch NAME, start its agent and wait until the agent is CONNECTED; the agent."""
    system.cli("launch", NAME, "--memory", "128")
    agent = system.start_agent(NAME)
    waited = system.cli("wait", NAME, "agent", "--timeout", "30")
    system.case.assertEqual(waited.stdout, f"{NAME}: agent CONNECTED\n")
    events.wait_for_action(NAME, "instance-agent-connected")
    return agent


def make_ready(system: System, events: EventReader) -> subprocess.Popen[bytes]:
    """Launch NAME with its agent and have its workload declare Ready; the agent."""
    agent = launch_with_agent(system, events)
    notified = system.notify(NAME)
    system.case.assertEqual(notified.returncode, 0, notified.stderr)
    system.cli("wait", NAME, "status=ready", "--timeout", "30")
    return agent


class ReadyScenarioTests(SynchronousTestCase):
    """Issue #4 point 12: launch, agent link, Ready, stop, start, daemon restart."""

    def setUp(self) -> None:
        self.system = System(self)
        self.system.start_daemon()
        self.events = self.system.events()

    def test_agentLinkThenReadyAsTheOperatorSeesIt(self) -> None:
        system = self.system
        system.cli("launch", NAME, "--memory", "128")
        self.assertEqual(system.listed_status(NAME), "RUNNING")
        [port] = system.guest_api_ports()
        system.start_agent(NAME)
        waited = system.cli("wait", NAME, "agent", "--timeout", "30")
        self.assertEqual(waited.stdout, f"{NAME}: agent CONNECTED\n")
        self.events.wait_for_action(NAME, "instance-agent-connected")
        self.assertEqual(
            self.events.actions(NAME, "instance-agent-"),
            ["instance-agent-started", "instance-agent-connected"],
        )
        # The daemon answered STARTED with its guest API's port, and the agent dialed it.
        self.assertIn(f"host says CONNECT 2:{port}: dialing", system.agent_log())
        self.assertEqual(system.info(NAME)["agent"]["status"], "connected")

        ready_wait = system.cli_in_background("wait", NAME, "status=ready", "--timeout", "30")
        self.assertEqual(system.listed_status(NAME), "RUNNING")
        self.assertIsNone(ready_wait.poll(), "wait status=ready returned before Ready")
        notified = system.notify(NAME)
        self.assertEqual((notified.returncode, notified.stderr), (0, ""))
        out, err = ready_wait.communicate(timeout=DEADLINE)
        self.assertEqual((ready_wait.returncode, out, err), (0, f"{NAME}: READY\n", ""))

        self.assertEqual(system.listed_status(NAME), "READY")
        info = system.info(NAME)
        self.assertEqual((info["status"], info["config"][READY_KEY]), ("Ready", "true"))
        self.events.wait_for_action(NAME, "instance-ready")

    def test_metricsShowTheBootAsItHappened(self) -> None:
        system = self.system
        make_ready(system, self.events)
        values = {
            line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in system.cli("metrics").stdout.splitlines()
            if not line.startswith("#")
        }
        self.assertEqual(values['vmready_instances{status="READY"}'], 1)
        self.assertEqual(values['vmready_agent_links{state="connected"}'], 1)
        self.assertEqual(values['vmready_actions_total{action="create",result="success"}'], 1)
        self.assertEqual(values["vmready_ready_latency_seconds_count"], 1)
        # The agent's PATCH of Ready, through the daemon's own guest API site.
        self.assertGreaterEqual(
            values['vmready_guest_api_requests_total{method="PATCH",code="200"}'], 1
        )
        self.assertGreater(values['vmready_qmp_ring_reads_total{result="ok"}'], 0)
        # At least the agent's STARTED and CONNECTED lines.
        self.assertGreaterEqual(
            values["vmready_qmp_ring_read_bytes_total"], len(b"STARTED\nCONNECTED\n")
        )

    def test_stopMakesReadyFalseAndTheNextBootNeedsItsOwnNotify(self) -> None:
        system = self.system
        first_agent = make_ready(system, self.events)

        system.cli("stop", NAME, "--force")
        info = system.info(NAME)
        self.assertEqual(
            (info["status"], info["config"][READY_KEY], info["agent"]["status"]),
            ("Stopped", "false", "stopped"),
        )
        self.events.wait_for_action(NAME, "instance-agent-stopped")
        # The guest died with its VM; so does its agent.
        first_agent.kill()
        first_agent.wait(timeout=DEADLINE)

        system.cli("start", NAME)
        system.start_agent(NAME, "agent2.log")
        system.cli("wait", NAME, "agent", "--timeout", "30")
        # A new boot: the workload has not said Ready yet, and the agent does not remember it.
        info = system.info(NAME)
        self.assertEqual((info["status"], info["config"][READY_KEY]), ("Running", "false"))
        self.assertNotIn("reasserting", system.agent_log("agent2.log"))

        # This time the workload speaks HTTP to the agent's socket itself.
        ready_wait = system.cli_in_background("wait", NAME, "status=ready", "--timeout", "30")
        answer = system.guest_request(NAME, "PATCH", "/1.0", b'{"state":"Ready"}')
        self.assertEqual(
            (answer.status, answer.content_type, answer.body), (200, "application/json", b"{}\n")
        )
        out, _ = ready_wait.communicate(timeout=DEADLINE)
        self.assertEqual((ready_wait.returncode, out), (0, f"{NAME}: READY\n"))
        self.assertEqual(system.listed_status(NAME), "READY")

    def test_daemonRestartClearsReadyAndTheAgentReReportsIt(self) -> None:
        system = self.system
        agent = make_ready(system, self.events)
        [old_port] = system.guest_api_ports()

        # Hold the agent still, so what the new daemon did at start can be seen before the
        # agent answers it (a slow guest; nothing is lost meanwhile).
        agent.send_signal(signal.SIGSTOP)
        self.addCleanup(_continue, agent)
        self.events.close()
        # twistd shuts down cleanly, then exits by the signal it got (its exit status says so).
        self.assertEqual(system.stop_daemon(signal.SIGTERM), -signal.SIGTERM)
        self.assertIn("Server Shut Down.", system.daemon_log())
        system.start_daemon()
        events = system.events()

        [new_port] = system.guest_api_ports()
        self.assertNotEqual(new_port, old_port)
        # The new daemon forgot Ready at start: it cannot know the guest's state.
        info = system.info(NAME)
        self.assertNotIn(READY_KEY, info["config"])
        self.assertEqual(info["status"], "Running")
        self.assertEqual(system.listed_status(NAME), "RUNNING")
        self.assertIn(f"cleared {READY_KEY} on 1 instances", system.daemon_log())

        agent.send_signal(signal.SIGCONT)
        ready_again = system.cli("wait", NAME, "status=ready", "--timeout", "30")
        self.assertEqual(ready_again.stdout, f"{NAME}: READY\n")
        events.wait_for_action(NAME, "instance-ready")
        connected = system.cli("wait", NAME, "agent", "--timeout", "30")
        self.assertEqual(connected.stdout, f"{NAME}: agent CONNECTED\n")
        self.assertEqual(system.listed_status(NAME), "READY")
        self.assertEqual(system.info(NAME)["config"][READY_KEY], "true")
        log = system.agent_log()
        new_socket = os.path.join(system.directory, f"guest-api.sock_{new_port}")
        self.assertIn(f"host says CONNECT 2:{new_port}: dialing", log)
        self.assertIn(f"connected to the host at {new_socket}", log)
        # Ready came back from the agent's memory: one notify, then one reassertion.
        self.assertEqual(log.count("the workload declared Ready"), 1)
        self.assertEqual(log.count("reasserting the workload's Ready"), 1)

    def test_agentRestartedInTheSameBootReReportsReady(self) -> None:
        system = self.system
        agent = make_ready(system, self.events)
        agent.terminate()  # as systemd restarting vmready-agent would
        self.assertEqual(agent.wait(timeout=DEADLINE), 0)
        stopped = self.events.wait_for_action(NAME, "instance-agent-stopped")
        info = system.info(NAME)
        # The workload is still up: only its agent stopped.
        self.assertEqual((info["status"], info["agent"]["status"]), ("Ready", "stopped"))

        system.start_agent(NAME, "agent2.log")
        self.events.wait_for_action(NAME, "instance-agent-connected", after=stopped)
        self.assertEqual(
            self.events.actions(NAME, "instance-agent-")[-2:],
            ["instance-agent-started", "instance-agent-connected"],
        )
        self.assertIn("reasserting the workload's Ready", system.agent_log("agent2.log"))
        info = system.info(NAME)
        self.assertEqual(
            (info["status"], info["config"][READY_KEY], info["agent"]["status"]),
            ("Ready", "true", "connected"),
        )

    def test_guestRebootClearsReady(self) -> None:
        system = self.system
        agent = make_ready(system, self.events)
        connected = self.events.wait_for_action(NAME, "instance-agent-connected")
        self.assertEqual(system.control(NAME, "reboot"), b"ok\n")
        # A rebooting guest loses its processes and its tmpfs: the agent and its memory.
        agent.kill()
        agent.wait(timeout=DEADLINE)
        shutil.rmtree(system.agent_settings(NAME)["state_dir"], ignore_errors=True)
        system.start_agent(NAME, "agent2.log")
        started = self.events.wait_for_action(NAME, "instance-agent-started", after=connected)
        self.events.wait_for_action(NAME, "instance-agent-connected", after=started)

        # The new boot's workload has not declared Ready (yet).
        info = system.info(NAME)
        self.assertEqual((info["status"], info["config"].get(READY_KEY)), ("Running", "false"))
        state = system.guest_request(NAME, "GET", "/1.0")
        self.assertEqual(json.loads(state.body)["state"], "Started")
        self.assertEqual(system.listed_status(NAME), "RUNNING")


def _continue(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGCONT)


class FaultTests(SynchronousTestCase):
    """Issue #4 point 11: each fault, its documented recovery, and nothing lost."""

    def setUp(self) -> None:
        self.system = System(self)
        self.system.start_daemon()
        self.events = self.system.events()

    def assertNoTraceback(self) -> None:
        self.assertNotIn("Traceback", self.system.daemon_log())

    def test_killedAgentLeavesReadyUntilTheVMStopsThenANewAgentReconnects(self) -> None:
        system = self.system
        agent = make_ready(system, self.events)
        agent.send_signal(signal.SIGKILL)
        agent.wait(timeout=DEADLINE)

        # Until its heartbeat is missed the host cannot tell; nothing changes meanwhile.
        self.assertEqual(system.listed_status(NAME), "READY")
        self.assertEqual(system.info(NAME)["config"][READY_KEY], "true")
        # Then the silence (--agent-silence-timeout, 15 s) says it went away; the workload's
        # Ready stays, since the VM still runs.
        self.events.wait_for_action(NAME, "instance-agent-stopped")
        info = system.info(NAME)
        self.assertEqual(
            (info["status"], info["config"][READY_KEY], info["agent"]["status"]),
            ("Ready", "true", "stopped"),
        )
        # The history says why: the agent never said STOPPED.
        self.assertRegex(
            info["agent"]["history"][-1]["reason"],
            r"^lost: the agent (said nothing for [0-9.]+s \(no heartbeat\)|closed its port)",
        )

        # The guest powers its VM off: not ready any more, and the agent is stopped with it.
        self.assertEqual(system.control(NAME, "poweroff"), b"ok\n")
        system.cli("wait", NAME, "status=stopped", "--timeout", "30")
        # STOPPED shows from QEMU's SHUTDOWN event; the instance settles when the process
        # is gone.
        self.events.wait_for_action(NAME, "instance-shutdown")
        info = system.info(NAME)
        self.assertEqual(
            (info["status"], info["config"][READY_KEY], info["agent"]["status"]),
            ("Stopped", "false", "stopped"),
        )
        self.assertEqual(info["vm_state"], "stopped")

        system.cli("start", NAME)
        system.start_agent(NAME, "agent2.log")
        waited = system.cli("wait", NAME, "agent", "--timeout", "30")
        self.assertEqual(waited.stdout, f"{NAME}: agent CONNECTED\n")
        self.assertEqual(system.listed_status(NAME), "RUNNING")
        self.assertEqual(system.notify(NAME).returncode, 0)
        system.cli("wait", NAME, "status=ready", "--timeout", "30")
        self.assertNoTraceback()

    def test_killedDaemonsStaleGuestSocketIsReplacedAndReadyReturns(self) -> None:
        system = self.system
        agent = make_ready(system, self.events)
        before = system.info(NAME)
        [old_port] = system.guest_api_ports()
        self.events.close()
        system.stop_daemon(signal.SIGKILL)
        self.assertEqual(system.guest_api_ports(), [old_port])  # left behind

        system.start_daemon()
        [new_port] = system.guest_api_ports()
        self.assertNotEqual(new_port, old_port)
        waited = system.cli("wait", NAME, "status=ready", "--timeout", "30")
        self.assertEqual(waited.stdout, f"{NAME}: READY\n")
        system.cli("wait", NAME, "agent", "--timeout", "30")
        self.assertEqual(system.listed_status(NAME), "READY")
        after = system.info(NAME)
        for field in ("uuid", "config", "limits", "vm_state", "power_state"):
            self.assertEqual(after[field], before[field], field)
        self.assertIsNone(agent.poll())
        log = system.agent_log()
        self.assertIn(f"host says CONNECT 2:{new_port}: dialing", log)
        self.assertEqual(log.count("the workload declared Ready"), 1)
        self.assertEqual(log.count("reasserting the workload's Ready"), 1)
        self.assertNoTraceback()

    def test_vanishedVMIsAnErrorAndItsAgentGivesUp(self) -> None:
        system = self.system
        agent = make_ready(system, self.events)
        os.kill(system.vm_pid(NAME), signal.SIGKILL)

        waited = system.cli("wait", NAME, "status=error", "--timeout", "30")
        self.assertEqual(waited.stdout, f"{NAME}: ERROR\n")
        info = system.info(NAME)
        self.assertEqual(
            (info["status"], info["error"], info["config"][READY_KEY], info["agent"]["status"]),
            (
                "Error",
                "QEMU process exited unexpectedly "
                "(QMP monitor disconnected without a SHUTDOWN event)",
                "false",
                "stopped",
            ),
        )
        self.assertEqual(system.listed_status(NAME), "ERROR")
        # Its serial port is gone for good: the agent retries a bounded number of times, then
        # exits with an error instead of looping.
        self.assertEqual(agent.wait(timeout=DEADLINE), 1)
        self.assertIn("serial port unusable after", system.agent_log())
        self.events.wait_for_action(NAME, "instance-error")

        # The documented way out of ERROR: start it; its next boot's agent connects again.
        system.cli("start", NAME)
        system.start_agent(NAME, "agent2.log")
        system.cli("wait", NAME, "agent", "--timeout", "30")
        self.assertEqual(system.listed_status(NAME), "RUNNING")
        self.assertEqual(system.notify(NAME).returncode, 0)
        system.cli("wait", NAME, "status=ready", "--timeout", "30")
        self.assertNoTraceback()

    def test_garbageOnTheSerialLineIsIgnoredAndConnectStillAnswered(self) -> None:
        system = self.system
        system.cli("launch", NAME, "--memory", "128")
        [port] = system.guest_api_ports()
        guest = system.guest_port(NAME)
        self.addCleanup(guest.close)
        garbage = [
            bytes(range(256)) * 4,  # binary, NULs and invalid UTF-8, newlines among it
            b"\xff\xfe\xfd not utf-8\n",
            b"x" * 10_000 + b"\n",  # longer than a status line may be
            b"y" * 200_000,  # more than the ring holds, without a newline
            b"\n",
            b"CONNECT\n",
            b"CONNECT 2:\n",
            b"CONNECT x:y\n",
            b"CONNECT 2:99999999999999\n",
            b"CONNECT 2:1234\n",  # reads like the host's own echo
            b"started\n",
            b"STARTED \n",
            b"\r\n",
        ]
        for chunk in garbage:
            guest.send(chunk)
        self.assertEqual(system.info(NAME)["agent"]["status"], "unknown")
        guest.send(b"STARTED\n")
        line = guest.wait_for_line(lambda line: line.startswith(b"CONNECT "), "CONNECT")
        self.assertEqual(line, f"CONNECT 2:{port}".encode())
        self.events.wait_for_action(NAME, "instance-agent-started")
        self.assertEqual(system.info(NAME)["agent"]["status"], "started")
        self.assertEqual(system.listed_status(NAME), "RUNNING")

        # The garbage changed nothing: a real agent still connects and reports Ready.
        guest.close()
        system.start_agent(NAME)
        system.cli("wait", NAME, "agent", "--timeout", "30")
        self.assertEqual(system.notify(NAME).returncode, 0)
        system.cli("wait", NAME, "status=ready", "--timeout", "30")
        self.assertNoTraceback()

    def test_badPatchesAreRefusedAsTheGuestSeesThemAndChangeNothing(self) -> None:
        system = self.system
        launch_with_agent(system, self.events)
        refusals = [
            (
                b'{"state":',
                400,
                b"Invalid request body: Expecting value: line 1 column 10 (char 9)",
            ),
            (b'{"state":"ready"}', 400, b'Invalid state "ready"'),
            (b'{"state":1}', 400, b'Invalid state ""'),
            (
                b'{"state":"Ready","pad":"' + b"x" * (1024 * 1024) + b'"}',
                413,
                b"Request body too large (limit 1048576 bytes)",
            ),
        ]
        for ready in (False, True):
            if ready:
                self.assertEqual(system.notify(NAME).returncode, 0)
                system.cli("wait", NAME, "status=ready", "--timeout", "30")
            before = system.info(NAME)
            for body, status, text in refusals:
                answer = system.guest_request(NAME, "PATCH", "/1.0", body)
                self.assertEqual((answer.status, answer.body), (status, text + b"\n"), body[:40])
                self.assertTrue(answer.content_type.startswith("text/plain"), answer)
            after = system.info(NAME)
            self.assertEqual(
                (after["status"], after["config"]), (before["status"], before["config"])
            )
            state = system.guest_request(NAME, "GET", "/1.0")
            self.assertEqual(state.status, 200)
            self.assertEqual(json.loads(state.body)["state"], "Ready" if ready else "Started")
        # Withdrawing Ready emits no instance-ready: a marker after which every instance-ready
        # the refused PATCHes might have caused has arrived.
        self.assertEqual(system.notify(NAME, "started").returncode, 0)
        first_ready = self.events.wait_for_action(NAME, "instance-ready")
        marker = self.events.wait_for(
            lambda event: (
                event["metadata"]["action"] == "instance-state"
                and event["metadata"]["context"]["status"] == "Running"
            ),
            "the instance back to Running after Ready",
            after=first_ready,
        )
        self.assertEqual(
            self.events.actions(NAME, "instance-ready", until=marker), ["instance-ready"]
        )
        self.assertNoTraceback()

    def test_noiseOnTheSerialLineDoesNotFloodTheDaemonLog(self) -> None:
        system = self.system
        system.cli("launch", NAME, "--memory", "128")
        guest = system.guest_port(NAME)
        self.addCleanup(guest.close)
        lines_before = system.daemon_log().count("\n")
        guest.send(b"x\n" * 20_000)  # 40 KB: fits in the ring, nothing is overwritten
        guest.send(b"STARTED\n")
        guest.wait_for_line(lambda line: line.startswith(b"CONNECT "), "CONNECT")
        # Every noise line was read (and judged) before the CONNECT was written.
        logged = system.daemon_log().count("\n") - lines_before
        self.assertLess(logged, 100)


class OperatorSocketTests(SynchronousTestCase):
    """The operator API on its unix socket, as any HTTP client may speak to it."""

    def test_requestWithoutHostHeaderIsAnswered(self) -> None:
        system = System(self)
        system.start_daemon()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(DEADLINE)
            sock.connect(system.socket_path)
            sock.sendall(b"GET /1.0/instances HTTP/1.0\r\n\r\n")  # HTTP/1.0 needs no Host
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
        self.assertTrue(answer.startswith(b"HTTP/1.0 200 "), answer)
        self.assertNotIn("Traceback", system.daemon_log())
