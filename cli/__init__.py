"""The ``raycheck`` command line, the top layer: ``main`` holds the app and ``raycheck run``; ``policy``,
``storage`` (``inspect``, ``verify``), ``merge``, ``replay`` and ``experiment`` each hold one command.
``python -m raycheck.cli`` is the ``raycheck`` command (as ``ray job submit`` runs it)."""
