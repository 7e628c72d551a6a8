"""Launch `posttrain sft`: `python examples/run_sft.py [--config FILE] [overrides...]` (see `--help`)."""

import sys

from posttrain.cli import main

if __name__ == "__main__":
    main(["sft", *sys.argv[1:]], supervise=True)
