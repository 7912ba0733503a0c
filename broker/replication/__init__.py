"""Replication: log shipping to hot standbys, sync acknowledgements, leadership in etcd.

A member is one broker process with ``-b DIR``. The leader streams its log records (the
binlog record format, :mod:`broker.binlog_format`, each wrapped with the leadership epoch
and a sequence number, :mod:`broker.replication.wire`) to every replica; replicas apply
them to their own queue and binlog and acknowledge them. Who leads is decided by etcd
(a lease-held key, :mod:`broker.replication.member`): no consensus is written here.

Modules: ``wire`` (stream format), ``fanout`` (one queue listener feeding binlog and
stream), ``source`` (leader side: backlog, snapshots, replica sessions, sync holds),
``follower`` (replica side: stream client and apply), ``etcd`` (the v3 JSON API client),
``member`` (roles, election, fencing, stats), ``options`` (CLI flags), ``admin``
(``spark-beanstalk promote`` / ``demote``).
"""
