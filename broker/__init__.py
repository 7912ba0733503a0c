"""A beanstalkd 1.12 wire-compatible work-queue broker.

Three layers, each importable alone:
- ``broker.protocol``: the wire codec (bytes in, commands out; replies out);
- ``broker.queue``: the queue state machine (jobs, tubes, scheduling; no I/O, clock injected);
- ``broker.server``: the asyncio server that glues them to sockets.
"""

from broker import _build

_build.select()  # compiled (mypyc) hot modules, or the interpreted ones: see broker/_build.py
