"""Experiment configs: ``get_config(arg)`` per file, the shared parts in :mod:`configs.common`.

Pass a file to a script as ``--config=configs/<name>.py[:arg]``; import one as
``from configs import toy_gagar``.
"""
