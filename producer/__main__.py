"""`python -m producer ...` is the same as the `shardflow` command."""

from producer.cli import main

main()
