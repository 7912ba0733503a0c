"""The web dashboard: overview of servers and tubes, tube pages with actions (see app.py).

Import from the submodules; this package's __init__ stays empty of imports so that
`spark-beanstalk`'s other verbs do not load aiohttp and jinja2.
"""
