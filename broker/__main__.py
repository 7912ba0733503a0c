"""`python -m broker` is `spark-beanstalk broker`."""
from broker.cli import broker_command

if __name__ == "__main__":
    broker_command(prog_name="python -m broker")
