#!/bin/sh
# vmready agent loader: install the vmready-agent systemd unit into this guest.
#
# Run once, as root, from the mounted config drive:
#   mount -t 9p -o trans=virtio,version=9p2000.L,ro config /mnt && /mnt/install.sh && umount /mnt
# From then on the guest starts the agent on every boot: the unit copies the
# config drive (or, on a kernel without 9p, the NoCloud seed) to
# /run/vmready-agent and runs the agent from there; the drive mounted at /mnt
# meanwhile is copied from there. cloud-init's local stage waits for the agent.
# Running it again is harmless: it replaces what changed and restarts the agent
# only then.
#
# install.sh --root DIR (or VMREADY_ROOT=DIR) installs into the guest tree DIR
# instead (an image being built): no systemctl, the unit is enabled by a link.
set -eu

PROG=install.sh
UNIT=vmready-agent.service
UNIT_DIR=/etc/systemd/system
SETUP=/usr/local/lib/vmready/vmready-agent-setup
UDEV_RULE=/etc/udev/rules.d/99-vmready-agent.rules
CLOUD_INIT_DROPIN=$UNIT_DIR/cloud-init-local.service.d/vmready-agent.conf
WRAPPER=/usr/local/bin/vmready-agent
PYTHON=/usr/bin/python3
MIN_PYTHON=3.9
# For the loader's tests only: the running guest's root (its /run, /usr, /etc).
T=${VMREADY_TEST_ROOT:-}

die() {
    echo "$PROG: $*" >&2
    exit 1
}

usage() {
    echo "usage: $PROG [--root DIR]"
    echo "Installs the vmready agent's systemd unit; run it as root from the config drive."
}

root=${VMREADY_ROOT:-}
while [ $# -gt 0 ]; do
    case $1 in
        --root) [ $# -ge 2 ] || die "--root needs a directory"; root=$2; shift 2 ;;
        --root=*) root=${1#--root=}; shift ;;
        -h|--help) usage; exit 0 ;;
        *) usage >&2; die "unknown argument '$1'" ;;
    esac
done

here=$(cd "$(dirname "$0")" && pwd)
for f in systemd/$UNIT systemd/vmready-agent-setup systemd/cloud-init-local.conf \
    udev/99-vmready-agent.rules; do
    [ -f "$here/$f" ] || die "$here/$f is missing: run install.sh from the vmready config drive"
done

# A version "3.11" against MIN_PYTHON: true when new enough.
python_new_enough() {
    major=${1%%.*}
    minor=${1#*.}
    minor=${minor%%.*}
    case $major$minor in *[!0-9]*|'') return 1 ;; esac
    [ "$major" -gt 3 ] || { [ "$major" -eq 3 ] && [ "$minor" -ge "${MIN_PYTHON#3.}" ]; }
}

live=
if [ -n "$root" ]; then
    [ -d "$root" ] || die "--root $root is not a directory"
    root=$(cd "$root" && pwd)
    [ -e "$root/lib/systemd/systemd" ] || [ -e "$root/usr/lib/systemd/systemd" ] ||
        die "$root has no systemd (no /lib/systemd/systemd): the loader needs a systemd guest"
    [ -e "$root$PYTHON" ] || [ -L "$root$PYTHON" ] ||
        die "$root has no $PYTHON: the agent needs Python $MIN_PYTHON or newer"
    target=$(readlink "$root$PYTHON" || true)
    version=${target##*python}
    if [ -n "$target" ] && ! python_new_enough "$version"; then
        die "the agent needs Python $MIN_PYTHON or newer, and $root$PYTHON is Python $version"
    fi
else
    [ "$(id -u)" = 0 ] || die "run me as root"
    [ -d "$T/run/systemd/system" ] ||
        die "this guest does not run systemd (no /run/systemd/system); start the agent from its init system instead: $PYTHON -S -I /run/vmready-agent/vmready-agent.pyz --config-drive /run/vmready-agent"
    [ -x "$T$PYTHON" ] || die "this guest has no $PYTHON: the agent needs Python $MIN_PYTHON or newer with its ssl module"
    version=$("$T$PYTHON" -S -I -c 'import sys; print("%d.%d" % sys.version_info[:2])') ||
        die "$PYTHON does not run"
    python_new_enough "$version" ||
        die "the agent needs Python $MIN_PYTHON or newer, and $PYTHON is Python $version"
    "$T$PYTHON" -S -I -c 'import ssl' 2>/dev/null ||
        die "the agent needs Python's ssl module, and $PYTHON has none"
    root=$T
    live=1
fi

changed=0
# put SOURCE DEST MODE: install a file, replacing it only when its content differs.
put() {
    if [ -f "$root$2" ] && command -v cmp >/dev/null && cmp -s "$1" "$root$2"; then
        chmod "$3" "$root$2"
        return 0
    fi
    mkdir -p "$(dirname "$root$2")"
    cp "$1" "$root$2.new.$$"
    chmod "$3" "$root$2.new.$$"
    mv -f "$root$2.new.$$" "$root$2"
    echo "$PROG: installed $2"
    changed=1
}

wrapper=$(mktemp)
trap 'rm -f "$wrapper"' EXIT
cat >"$wrapper" <<EOF
#!/bin/sh
# vmready-agent, as the vmready loader installed it: the agent the config drive carries.
exec $PYTHON -S -I /run/vmready-agent/vmready-agent.pyz "\$@"
EOF

put "$here/systemd/$UNIT" "$UNIT_DIR/$UNIT" 0644
put "$here/systemd/vmready-agent-setup" "$SETUP" 0755
put "$here/udev/99-vmready-agent.rules" "$UDEV_RULE" 0644
put "$here/systemd/cloud-init-local.conf" "$CLOUD_INIT_DROPIN" 0644
put "$wrapper" "$WRAPPER" 0755

if [ -z "$live" ]; then
    mkdir -p "$root$UNIT_DIR/multi-user.target.wants"
    ln -sfn "$UNIT_DIR/$UNIT" "$root$UNIT_DIR/multi-user.target.wants/$UNIT"
    echo "$PROG: $UNIT enabled in $root"
    exit 0
fi

systemctl daemon-reload
systemctl enable --quiet "$UNIT"
if command -v udevadm >/dev/null; then
    udevadm control --reload || true
fi
# Type=notify: these return once the agent serves /dev/lxd/sock, or it failed.
if [ "$changed" = 1 ] && systemctl is-active --quiet "$UNIT"; then
    action=restart done=restarted
else
    action=start done=started
fi
if ! systemctl "$action" "$UNIT"; then
    # The setup's or the agent's own last word, not systemd's.
    why=$(journalctl -q -u "$UNIT" -t vmready-agent-setup -t python3 -n 1 -o cat 2>/dev/null ||
        true)
    die "$UNIT did not start: ${why:-see journalctl -u $UNIT}"
fi
echo "$PROG: $UNIT enabled and $done"
if grep -q " $here 9p " "$T/proc/mounts"; then
    echo "$PROG: now 'umount $here': a mounted config drive stops the VM from migrating"
fi
