"""The `spark-beanstalk` command: the broker and the operator verbs under one name."""
from __future__ import annotations

import click


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="spark-beanstalk")
def main() -> None:
    """spark-beanstalk: a beanstalkd-compatible broker and tools for it."""


def _register_subcommands() -> None:
    from spark_beanstalk import ops, ops_tubes
    from spark_beanstalk.dashboard.command import dashboard_command

    ops.register(main)
    for command in ops_tubes.COMMANDS:
        main.add_command(command)
    main.add_command(dashboard_command)
    try:
        from broker.cli import broker_command
    except ModuleNotFoundError as exc:  # only while broker/cli.py is not written yet
        if exc.name != "broker.cli":
            raise
    else:
        main.add_command(broker_command, name="broker")


_register_subcommands()

if __name__ == "__main__":
    main()
