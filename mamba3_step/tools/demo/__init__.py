"""``python -m mamba3_step demo``: a small multi-layer decode over a state pool, checked bit for bit.

:mod:`.decode` runs it (requests joining, leaving and forking, padded batches) and then the
speculative round (:mod:`.speculative`) and the replay round (:mod:`.replay`).
"""
