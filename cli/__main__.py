"""``python -m raycheck.cli``: the ``raycheck`` command (``raycheck.cli.main.main``)."""

from raycheck.cli.main import main

main()
