"""The specialisations the asynchronous state copy (``StepSpec.async_state_copy``) is compiled and
executed at: the covering set and one of each feature set by default (``ASYNC_DEFAULT``), the feature
sets' other forms with ``--full-matrix`` (``ASYNC_FULL``)."""

from __future__ import annotations

from test_kernel_compile import COVERING, EIGHT_BIT, MULTI_TOKEN, ROTARY, STOCHASTIC

ASYNC_DEFAULT = {**COVERING, "flagship-T4-spec": MULTI_TOKEN["flagship-T4-spec"],
                 "flagship-rotary": ROTARY["flagship-rotary"],
                 "flagship-bf16state-sr": STOCHASTIC["flagship-bf16state-sr"],
                 "flagship-int8state": EIGHT_BIT["flagship-int8state"]}
ASYNC_FULL = {name: spec for name, spec in {**MULTI_TOKEN, **ROTARY, **STOCHASTIC, **EIGHT_BIT}.items()
              if name not in ASYNC_DEFAULT}
