import sys

from beamflow.cli import main

sys.exit(main())
