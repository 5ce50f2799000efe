"""`python -m graphsan.cli ...`: the console entry point (as under torchrun)."""

import sys

from graphsan.cli.main import main

sys.exit(main())
