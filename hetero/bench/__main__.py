"""`python -m hetero.bench <name> [args]`: one benchmark's process (`hetero.bench.entry`)."""

import sys

from hetero.bench.entry import main

sys.exit(main())
