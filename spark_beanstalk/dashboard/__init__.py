"""The web dashboard: overview of servers and tubes, tube pages with actions (see app.py)."""
from spark_beanstalk.dashboard.app import create_app
from spark_beanstalk.dashboard.guard import Guard
from spark_beanstalk.dashboard.sampler import Endpoint

__all__ = ["Endpoint", "Guard", "create_app"]
