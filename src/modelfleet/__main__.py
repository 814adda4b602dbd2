import sys

from modelfleet.cli import main

sys.exit(main())
