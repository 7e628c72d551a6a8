"""Launch `posttrain kto`: `python examples/run_kto.py [--config FILE] [overrides...]` (see `--help`)."""

import sys

from posttrain.cli import main

if __name__ == "__main__":
    main(["kto", *sys.argv[1:]], supervise=True)
