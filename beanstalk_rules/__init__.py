"""Rules shared by the broker, the connector and the CLI, each in one home.

One module per rule (tube names, token files, host specs), imported by `broker/`,
`spark_beanstalk/` and the CLIs alike, so the rule cannot drift between them. This package
imports nothing from the others.
"""
