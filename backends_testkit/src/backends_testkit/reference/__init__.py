"""The ``reference`` backend: the driver for the project's own reference engine.

It speaks a small JSON dialect (:mod:`backends_testkit.reference.wire`) served by
:mod:`backends_testkit.reference.emulator` over the numpy reference engine, in-process (an httpx transport) or on
a real port. It is the embedded default engine of the demo and the first backend the conformance suite runs
on; it is also a complete example of a backend: hooks in ``hooks.py``, wire mapping in ``wire.py``.
"""
