"""Launch `posttrain rm`: `python examples/run_rm.py [--config FILE] [overrides...]` (see `--help`)."""

import sys

from posttrain.cli import main

if __name__ == "__main__":
    main(["rm", *sys.argv[1:]], supervise=True)
