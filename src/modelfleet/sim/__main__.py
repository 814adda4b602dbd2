"""``python -m modelfleet.sim``: see ``modelfleet.sim.cli``."""

import sys

from modelfleet.sim.cli import main

sys.exit(main())
