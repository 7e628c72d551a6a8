"""Launch `posttrain eval`: `python examples/run_eval.py [--config FILE] [overrides...]` (see `--help`)."""

import sys

from posttrain.cli import main

if __name__ == "__main__":
    main(["eval", *sys.argv[1:]], supervise=True)
