"""A beanstalkd 1.12 wire-compatible work-queue broker.

Layers, each importable alone, lower ones never importing higher ones:
- ``broker.protocol``: the wire codec (bytes in, named command records out; replies out);
- ``broker.model``, ``broker.queue``: jobs, tubes, clients and the state machine that moves
  them (no I/O, clock injected, one timer heap in ``broker.timers``); beside ``Queue``
  (put / reserve / delete), functions over it: ``broker.queue_verbs`` (the other verbs),
  ``broker.queue_timers`` (what comes due), ``broker.queue_apply`` (replication apply),
  ``broker.stats`` (the stats replies), ``broker.queue_restore`` (recovered jobs back);
- ``broker.binlog*``: persistence, a listener on queue changes (format, files, recovery,
  segments and space);
- ``broker.state``, ``broker.connection``, ``broker.server``: the asyncio glue (what
  connections share, one connection with its flow control, the listeners and timer).
"""

from broker import _build

_build.select()  # compiled (mypyc) hot modules, or the interpreted ones: see broker/_build.py
