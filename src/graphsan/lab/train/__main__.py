"""`python -m graphsan.lab.train ...`: the same as `graphsan train ...`."""

import sys

from graphsan.lab.train.cli import run

if __name__ == "__main__":
    sys.exit(run())
