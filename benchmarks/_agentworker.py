"""The agent worker: many real ``vmready.agent`` agents in one child process.

Each agent is ``load_config`` + ``build_agent`` on an instance's config drive,
default heartbeat and retries; they share one asyncio loop in a thread, beside
the reactor that serves the parent's commands.  Each agent's serial writes
are stamped with ``time.perf_counter`` (one ``CLOCK_MONOTONIC`` for every
process of the machine), so that the parent can time a status line from the
moment the agent wrote it.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Coroutine
from typing import Any

from twisted.internet.defer import Deferred
from twisted.logger import LogLevel

from benchmarks._children import Handler, log_to, serve_control
from benchmarks._measure import reactor
from vmready.agent import Agent as GuestAgent
from vmready.agent import AgentConfig, build_agent, configure_logging, load_config
from vmready.domain import raise_file_limit

EVENT_TIMEOUT = 30.0
# The agent's first status line and the two the cycles time.
STOPPED_LINE = b"STOPPED\n"
STARTED_LINE = b"STARTED\n"
CONNECTED_LINE = b"CONNECTED\n"


class AgentLoop:
    """The agents' asyncio loop, in a thread beside the reactor that serves the commands."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="agents", daemon=True).start()

    def run(self, coroutine: Coroutine[Any, Any, Any]) -> Deferred[Any]:
        """``coroutine`` run on the agents' loop; its result as a Deferred on the reactor."""
        result: Deferred[Any] = Deferred()

        def done(future: Any) -> None:
            error = future.exception()
            if error is not None:
                reactor.callFromThread(result.errback, error)
            else:
                reactor.callFromThread(result.callback, future.result())

        asyncio.run_coroutine_threadsafe(coroutine, self.loop).add_done_callback(done)
        return result


class StampedAgent:
    """One real agent whose status lines are time-stamped as it hands them to the serial port."""

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.name = config.instance or config.socket
        self.agent: GuestAgent = build_agent(config)
        self.running = False
        self._expected: dict[bytes, asyncio.Future[float]] = {}
        keeper = self.agent.serial
        assert keeper is not None
        write = keeper.write

        def stamped(data: bytes, announce: bool = False) -> bool:
            now = time.perf_counter()
            written = write(data, announce)
            if written:
                waiter = self._expected.pop(data, None)
                if waiter is not None and not waiter.done():
                    waiter.set_result(now)
            return written

        # The one instrument: the keeper's write, wrapped; the agent is otherwise untouched.
        keeper.write = stamped  # type: ignore[method-assign]  # the instrument, as said

    def expect(self, line: bytes) -> asyncio.Future[float]:
        """Resolves to the time ``line`` is next written to the serial port (in the loop)."""
        waiter: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        self._expected[line] = waiter
        return waiter

    async def start(self) -> None:
        """Start the agent (in the agents' loop)."""
        await self.agent.start()
        self.running = True

    async def stop(self) -> None:
        """Stop the agent (in the agents' loop)."""
        self.running = False
        await self.agent.stop()


class AgentWorker:
    """``--role agents``: many agents in one process, started and cycled on command."""

    def __init__(self) -> None:
        self.agents: dict[str, StampedAgent] = {}
        self.loop = AgentLoop()

    def commands(self) -> dict[str, Handler]:
        """What the parent may call."""
        return {
            "start": self.start,
            "stop_agent": self.stop_agent,
            "start_agent": self.start_agent,
            "stop_all": self.stop_all,
        }

    async def start(self, drives: list[str]) -> int:
        """Start an agent on each config drive, one after another."""

        async def start_all() -> int:
            for drive in drives:
                agent = StampedAgent(load_config({"config-drive": drive}))
                self.agents[agent.name] = agent
                await agent.start()
            return len(drives)

        started: int = await self.loop.run(start_all())
        return started

    async def stop_agent(self, name: str, unstamped: bool = False) -> dict[str, Any]:
        """Stop ``name``'s agent; ``unstamped``: no STOPPED line seen is not an error."""
        agent = self.agents[name]

        async def stop_one() -> dict[str, Any]:
            stopped = agent.expect(STOPPED_LINE)
            asked = time.perf_counter()
            await agent.stop()
            if unstamped and not stopped.done():
                # The agent's stop is over (its port closed, flushed) and no STOPPED went
                # through the keeper's write: time from the moment it was asked to stop instead.
                stopped.cancel()
                return {"stopped": asked, "asked": asked, "stamped": False}
            return {"stopped": await asyncio.wait_for(stopped, EVENT_TIMEOUT), "asked": asked}

        result: dict[str, Any] = await self.loop.run(stop_one())
        return result

    async def start_agent(self, name: str) -> dict[str, float]:
        """Start ``name``'s agent again, a new one on the same drive: when it said what."""
        agent = self.agents[name] = StampedAgent(self.agents[name].config)

        async def start_one() -> dict[str, float]:
            started, connected = agent.expect(STARTED_LINE), agent.expect(CONNECTED_LINE)
            await agent.start()
            return {
                "started": await asyncio.wait_for(started, EVENT_TIMEOUT),
                "connected": await asyncio.wait_for(connected, EVENT_TIMEOUT),
            }

        result: dict[str, float] = await self.loop.run(start_one())
        return result

    async def stop_all(self) -> int:
        """Stop every running agent at once."""

        async def stop_running() -> int:
            running = [agent for agent in self.agents.values() if agent.running]
            await asyncio.gather(*(agent.stop() for agent in running))
            return len(running)

        stopped: int = await self.loop.run(stop_running())
        return stopped


def run_agents(directory: str) -> None:
    """``--role agents``: the worker, answering its parent until the parent goes."""
    raise_file_limit()
    log_to(os.path.join(directory, f"agents-{os.getpid()}.log"), LogLevel.info)
    configure_logging()  # the agents' own lines, to stderr: the same log file
    serve_control(AgentWorker().commands())
    reactor.run()
