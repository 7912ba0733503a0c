"""The one home of test helpers: waiting, free ports, server processes.

Tests import from here (`from tests.helpers import wait_until`); the implementations live
in `spark_beanstalk.embedded` so that jobs/ and bench/ share them too.
"""
from __future__ import annotations

from spark_beanstalk.embedded import (
    ServerExitedEarly,
    ServerProcess,
    beanstalkd_process,
    broker_process,
    free_port,
    start_server,
    wait_for_port,
    wait_until,
)

__all__ = [
    "ServerExitedEarly",
    "ServerProcess",
    "beanstalkd_process",
    "broker_process",
    "free_port",
    "start_server",
    "wait_for_port",
    "wait_until",
]
