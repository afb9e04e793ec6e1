"""What ``setup.cfg`` installs: every package of the checkout, so an installed vmready runs.

The tests import from the checkout, where a package missing from
``setup.cfg``'s list is still found; an installed daemon would fail to
import it (the host fence's ``vmready.fence`` was once missing).
"""

from __future__ import annotations

import configparser
import os

from twisted.trial.unittest import SynchronousTestCase

CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The trees whose every package is installed (``twisted/plugins`` is listed as it is).
INSTALLED_TREES = ("vmready", "fakeqemu")


def listed_packages() -> set[str]:
    config = configparser.ConfigParser()
    config.read(os.path.join(CHECKOUT, "setup.cfg"))
    return {line.strip() for line in config["options"]["packages"].splitlines() if line.strip()}


def checkout_packages() -> set[str]:
    found = set()
    for tree in INSTALLED_TREES:
        for directory, subdirectories, files in os.walk(os.path.join(CHECKOUT, tree)):
            subdirectories[:] = [name for name in subdirectories if name != "__pycache__"]
            if "__init__.py" in files:
                found.add(os.path.relpath(directory, CHECKOUT).replace(os.sep, "."))
    return found


class PackagingTests(SynchronousTestCase):
    def test_everyPackageOfTheCheckoutIsInstalled(self) -> None:
        self.assertEqual(sorted(checkout_packages() - listed_packages()), [])

    def test_everyInstalledPackageIsInTheCheckout(self) -> None:
        listed = {name for name in listed_packages() if name.split(".")[0] in INSTALLED_TREES}
        self.assertEqual(sorted(listed - checkout_packages()), [])
