# Sourced by scripts/test.sh and scripts/demo.sh (the README's two commands): install what a fresh
# machine lacks from the distribution's packages, with one `apt-get update` however many are missing.
#
#   need COMMAND PACKAGE...   # nothing to do when COMMAND is on the PATH

_need_updated=""

need() {
  local cmd=$1
  shift
  if command -v "$cmd" >/dev/null 2>&1; then
    return 0
  fi
  local sudo=""
  if [ "$(id -u)" != 0 ]; then sudo="sudo"; fi
  if [ -z "$_need_updated" ]; then
    $sudo apt-get update -qq
    _need_updated=1
  fi
  echo "installing $* (no $cmd on this machine)" >&2
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "$@"
}
