"""Emulated compute: a model with real-size parameters and gradients whose layers take profiled time.

- :mod:`gradsync.emulate.profile`: per-layer forward/backward times, the shipped profiles of the
  seed papers' models, and the ``--compute emulated[:PROFILE]`` lookup;
- :mod:`gradsync.emulate.derive`: measuring a profile here, or deriving one from FLOPs;
- :mod:`gradsync.emulate.model`: the emulated model itself, a drop-in :class:`~gradsync.models.ModelSpec`;
- :mod:`gradsync.emulate.slow`: stragglers, workers whose emulated compute takes longer (``--slow``).
"""
