"""``python -m vmready.fence``: see ``vmready.fence.program``."""

import sys

from vmready.fence.program import main

sys.exit(main())
