"""Experiments: each published result of the source papers as data, run as one command.

``spec`` reads the experiment files (``specs/*.toml``), ``cells`` turns a spec's cells into
``gradsync bench``/``simulate``/``codecs`` commands or scripts and runs them, ``store`` keeps every
run in sqlite, ``relations`` checks what must hold to call a result reproduced, ``report`` draws
the charts and writes the pages, ``machines`` registers clusters, and ``cli`` is
``gradsync experiment`` and ``gradsync machine``.
"""
