#!/usr/bin/env bash
# README's first command: install the package and run the flagship pipeline on an
# embedded broker (no beanstalkd needed: the demo starts our broker itself).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/need.sh
need java openjdk-17-jre-headless  # Spark
python3 -m pip install -q --disable-pip-version-check -e '.[spark]' --config-settings editable_mode=compat
exec python3 jobs/demo.py "$@"
