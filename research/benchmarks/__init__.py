"""One module per ``python scripts/bench.py`` subcommand: ``add_arguments(parser)`` and ``main(args)``."""
