"""The project's tools: what a developer runs, never what a server imports.

``import mamba3_step`` loads none of these (tests/package/test_architecture.py holds it). They sit above
the runtime and import from it; nothing in the runtime imports them.

* :mod:`.cli`: ``python -m mamba3_step {demo,verify,inspect,precompile}``
* :mod:`.demo`: the demo's decode, speculative and replay rounds
* :mod:`.verify`: the kernel's PTX executed on the CPU against float64 (with the flush forms' check)
* :mod:`.inspection`: compiler facts read from the cubin and SASS
* :mod:`.precompile`: filling and reading the compile cache
* :mod:`.ptx_tier`: a specialisation compiled and its PTX run by the PTX executor (:mod:`ptx_executor`)
* :mod:`.bytes_model`, :mod:`.issue_model`: the bytes and issue models
* :mod:`.replay_reference`: float64 references of replay's outputs
"""
