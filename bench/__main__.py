"""`python -m bench <name> [args]`: one benchmark's process (`bench.entry`)."""

import sys

from bench.entry import main

sys.exit(main())
