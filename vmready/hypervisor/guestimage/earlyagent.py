"""The demo guest's agent started before systemd, by its initramfs, then handed to systemd.

Under emulation systemd takes about a second from its start to running its
first unit (loading units, running generators), and the agent's unit waited
for that.  The demo guest's initramfs starts the agent instead, right after
it has mounted the root disk and before it hands over to systemd:
``vmready-agent-early boot``, chrooted into the root disk, copies the config
drive with the loader's own setup and becomes the agent.  It is then a child
of PID 1, which becomes systemd: when systemd starts ``vmready-agent.service``,
whose drop-in makes it ``Type=forking`` with ``PIDFile=``,
``vmready-agent-early start`` moves the running agent into the unit's cgroup
and exits, and systemd takes the PID from the PID file and supervises it as
its own child: stopped with the unit (at shutdown too, so the agent still says
``STOPPED``), restarted on failure.  When no agent runs (it failed, it exited,
it was stopped), ``start`` runs the setup and starts one, as the plain unit
does.

What changes for the demo guest against the loader's plain unit: systemd
counts the unit started once ``start`` exits, not when the agent says
``READY=1`` (the demo guest has no cloud-init to order after it; its
user-data runner waits for ``/dev/lxd/sock`` itself).  Stock images keep the
loader's unit as it is: their initramfs is their distribution's.
"""

from __future__ import annotations

EARLY_AGENT_PATH = "/usr/local/lib/vmready/vmready-agent-early"


PIDFILE = "/run/vmready-agent.pid"


EARLY_AGENT_SCRIPT = r"""#!/bin/sh
# vmready demo image: the vmready agent started before systemd, and handed to it.
#
#   vmready-agent-early boot    run by the initramfs (chrooted into the root disk, /run
#                               a fresh tmpfs) as it hands over to systemd: writes its
#                               PID to the PID file, copies the config drive and
#                               becomes the agent (a child of PID 1: systemd).
#   vmready-agent-early start   ExecStart of vmready-agent.service (Type=forking,
#                               PIDFile=): when the agent started at boot runs, moves
#                               it into the unit's cgroup and leaves it to systemd;
#                               else copies the drive and starts an agent.
set -eu
# The initramfs's environment has PATH=/bin; systemd gives its services this one.
PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin
export PATH

PROG=vmready-agent-early
# For the tests only: where /proc, /sys, /run and /usr are.
T=${VMREADY_TEST_ROOT:-}
PIDFILE=$T/run/vmready-agent.pid
SETUP=$T/usr/local/lib/vmready/vmready-agent-setup
PYTHON=$T/usr/bin/python3
DRIVE=/run/vmready-agent
# How long `start` waits for an agent still being set up by `boot`, in tenths of a
# second: 45 s, inside the unit's TimeoutStartSec=60 with time left for its own setup.
STARTING_TRIES=${VMREADY_EARLY_TRIES:-450}

say() {
    echo "$PROG: $*" >&2
}

# The program a process runs (its /proc/PID/comm), empty once it is gone.
program_of() {
    comm=
    read -r comm 2>/dev/null <"$T/proc/$1/comm" || true
    echo "$comm"
}

# The PID the PID file names (on stdout); false when there is none.
named_pid() {
    pid=
    read -r pid 2>/dev/null <"$PIDFILE" || true
    case $pid in
        '' | *[!0-9]*) return 1 ;;
    esac
    echo "$pid"
}

# The agent started at boot (its PID on stdout), waiting while it is still being set
# up (it runs this script until it becomes python3); false when it is not running.
running_agent() {
    pid=$(named_pid) || return 1
    tries=0
    while :; do
        case $(program_of "$pid") in
            python3) echo "$pid"; return 0 ;;
            '') return 1 ;;
            "$PROG" | vmready-agent-e) ;; # comm is cut to 15 characters
            *) return 1 ;; # the PID was taken by another program
        esac
        tries=$((tries + 1))
        if [ "$tries" -gt "$STARTING_TRIES" ]; then
            # Stuck in its setup: stopped, so that no second agent comes of it.
            say "the agent started at boot (process $pid) is still in its setup; stopping it"
            kill "$pid" 2>/dev/null || true
            return 1
        fi
        sleep 0.1
    done
}

# This process's cgroup (cgroup v2: the "0::" line of /proc/self/cgroup).
own_cgroup() {
    while IFS= read -r line; do
        case $line in
            0::*) echo "${line#0::}"; return 0 ;;
        esac
    done <"$T/proc/self/cgroup"
    return 1
}

case ${1:-} in
    boot)
        echo "$$" >"$PIDFILE"
        if ! "$SETUP"; then
            rm -f "$PIDFILE"
            say "the agent's setup failed; systemd's vmready-agent.service tries again"
            exit 1
        fi
        exec "$PYTHON" -S -I "$DRIVE/vmready-agent.pyz" --config-drive "$DRIVE"
        ;;
    start)
        if pid=$(running_agent); then
            procs=
            if cgroup=$(own_cgroup); then
                procs=$T/sys/fs/cgroup$cgroup/cgroup.procs
            fi
            if [ -n "$procs" ] && echo "$pid" 2>/dev/null >"$procs"; then
                say "the agent started at boot (process $pid) is this unit's now"
            else
                say "warning: cannot move the agent started at boot (process $pid)" \
                    "into this unit's cgroup; systemd supervises it by its PID"
            fi
            exit 0
        fi
        rm -f "$PIDFILE"
        "$SETUP"
        "$PYTHON" -S -I "$DRIVE/vmready-agent.pyz" --config-drive "$DRIVE" &
        echo "$!" >"$PIDFILE"
        ;;
    *)
        echo "usage: $PROG boot|start" >&2
        exit 2
        ;;
esac
"""


EARLY_AGENT_DROPIN_PATH = "/etc/systemd/system/vmready-agent.service.d/vmready-demo-early.conf"


EARLY_AGENT_DROPIN = f"""# vmready demo image: the initramfs starts the agent before systemd;
# this unit adopts it.
# {EARLY_AGENT_PATH} start leaves the agent in {PIDFILE} running (or starts one, after
# the setup) and exits; systemd supervises that PID: stops it with the unit, restarts it.
[Service]
Type=forking
PIDFile={PIDFILE}
# Not READY=1 from the agent: the unit is started once the agent runs.
NotifyAccess=none
ExecStartPre=
ExecStart=
ExecStart={EARLY_AGENT_PATH} start
"""
