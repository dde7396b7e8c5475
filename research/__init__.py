"""Benchmarks and research measurements over the installed package ``train``: not installed with it.

``research.pairs`` is the one pair set-up they share; ``research.benchmarks`` holds one module per
``python scripts/bench.py`` subcommand. The research scripts (``scripts/trees.py``, ``bpd.py``,
``medusa_eval.py``) and ``scripts/bench.py`` put the checkout on the import path; ``train`` never imports
this package (an import-linter contract, pyproject.toml). Some benchmarks need the ``bench`` extra (TRL).
"""
