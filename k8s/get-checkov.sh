#!/usr/bin/env bash
# Installs checkov, the maintained policy checker k8s/check.py runs for pod
# security, into a virtual environment of its own: checkov pins
# packaging<24 and Ray needs packaging>=24.2, so the two cannot share the
# environment the README installs. Prints the path of the checkov program;
# does nothing if it is already there.
#   bash k8s/get-checkov.sh        (k8s/check.py and the tests look there)
set -euo pipefail
version="3.3.30"
home="${HOME:-$(getent passwd "$(id -u)" | cut -d: -f6)}"
dest="${LOOMTRAIN_TOOLS_DIR:-${XDG_CACHE_HOME:-$home/.cache}/loomtrain}/checkov-$version"
# A venv's scripts name its folder, so it is built in place; .installed, written last, marks it
# whole; the lock keeps two test processes from building it at once.
mkdir -p "$(dirname "$dest")"
exec 9>"$dest.lock"
flock 9
if [ -f "$dest/.installed" ]; then
    echo "$dest/bin/checkov"
    exit 0
fi
rm -rf "$dest"
"${PYTHON:-python3}" -m venv "$dest"
# pip's output is shown only if the install fails
"$dest/bin/python" -m pip install -q --disable-pip-version-check "checkov==$version" >"$dest.log" 2>&1 ||
    { cat "$dest.log" >&2; exit 1; }
"$dest/bin/checkov" --version >/dev/null
touch "$dest/.installed"
echo "$dest/bin/checkov"
