#!/usr/bin/env bash
# Builds (once) and prints the path of a compat virtualenv: Python 3.12 with the peers'
# current releases (compat/requirements.txt; `env.sh NAME` uses compat/requirements-NAME.txt).
# It lives outside the checkout, under
# ${RRFP_COMPAT_HOME:-$HOME/.cache/rrfp_async}/compat-[NAME-]<hash of the requirements>, and is
# reused while the requirements (and BUILD below) are unchanged. Environments of other keys are
# left in place (`rm -r` them by hand; each is ~6 GB).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
name=${1:-}
req="$here/requirements${name:+-$name}.txt"
if [[ ! -f "$req" ]]; then
  echo "compat: no $req" >&2
  exit 2
fi
# The key: the requirements and the build steps' version (bump BUILD when the steps change).
BUILD=1
key=$( (cat "$req"; echo "build $BUILD") | sha256sum | cut -c1-12)
home=${RRFP_COMPAT_HOME:-$HOME/.cache/rrfp_async}
prefix="compat-${name:+$name-}"
venv="$home/$prefix$key"
if [[ -f "$venv/.complete" ]]; then
  echo "$venv"
  exit 0
fi
py312=${RRFP_PY312:-}
if [[ -z "$py312" ]]; then
  for cand in python3.12 "$HOME/.pyenv/versions/3.12"*/bin/python3.12; do
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
      py312=$cand
      break
    fi
  done
fi
if [[ -z "$py312" ]]; then
  echo "compat: no Python 3.12 found (set RRFP_PY312)" >&2
  exit 2
fi
echo "compat: building $venv with $py312 (first time only, a few minutes)" >&2
rm -rf "$venv"
mkdir -p "$home"
"$py312" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip >&2
if grep -q "^# pip: no-constraint" "$req"; then
  PIP_CONSTRAINT=/dev/null "$venv/bin/python" -m pip install --quiet -r "$req" >&2
else
  "$venv/bin/python" -m pip install --quiet -r "$req" >&2
fi
# The package's own dependencies, not the package: the tests run the checkout's code
# (PYTHONPATH), so one environment serves every checkout.
"$venv/bin/python" -m pip install --quiet anyio structlog click rich uvloop >&2
touch "$venv/.complete"
echo "$venv"
