"""`python -m posttrain ...`: the `posttrain` command (posttrain.cli), for an environment whose
scripts folder is not on PATH or a checkout that is not installed."""

from posttrain.cli import main

main()
