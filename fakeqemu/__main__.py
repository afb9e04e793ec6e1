"""``python -m fakeqemu``: the same as ``fakeqemu-system-x86_64``."""

from fakeqemu._main import main

main()
