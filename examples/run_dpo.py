"""Launch `posttrain dpo`: `python examples/run_dpo.py [--config FILE] [overrides...]` (see `--help`)."""

import sys

from posttrain.cli import main

if __name__ == "__main__":
    main(["dpo", *sys.argv[1:]], supervise=True)
