"""``python -m benchmarks.e2e``: see the package's docstring."""

import sys

from benchmarks.e2e.cli import main

sys.exit(main())
