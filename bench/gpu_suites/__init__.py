"""The suites of ``bench/gpu_bench.py``, one module each, and what they share.

A suite module has ``NAME``, ``BATCHES`` (its default ``--batches``), ``add_arguments(parser)`` (its
own options), ``configure(args, run) -> options`` (a ValueError naming the option on bad input),
``check(options) -> list[str]`` (the failures of its bit-for-bit and reference checks; every variant it
times is checked), ``measure(options) -> dict`` (its timed rows, under ``"rows"``) and
``report(result) -> str`` (its table). ``common`` holds the run's settings, ``timing`` the timing.
"""
