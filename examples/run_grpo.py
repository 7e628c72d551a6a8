"""Launch `posttrain grpo`: `python examples/run_grpo.py [--config FILE] [overrides...]` (see `--help`)."""

import sys

from posttrain.cli import main

if __name__ == "__main__":
    main(["grpo", *sys.argv[1:]], supervise=True)
