#!/usr/bin/env bash
# README's first command: install the package and run the flagship pipeline on an
# embedded broker (no beanstalkd needed: the demo starts our broker itself).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v java >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq openjdk-17-jre-headless
fi
python3 -m pip install -q --disable-pip-version-check -e '.[spark]' --config-settings editable_mode=compat
exec python3 jobs/demo.py "$@"
