import sys

from modelfleet.runtime.server import main

sys.exit(main())
