#!/usr/bin/env bash
# A separate virtualenv for TRL (the peer in bench/vs_trl.py), so that TRL can never move
# the main venv's pins. It gets the same torch and transformers as the main venv, so both
# sides run the same model code.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${TRL_VENV:-.venv-trl}
TRL_VERSION=${TRL_VERSION:-1.16.0}
[ -x .venv/bin/python ] || { echo "bench/setup_trl.sh: run scripts/setup.sh first (.venv missing)" >&2; exit 2; }
pins=$(.venv/bin/python - <<'PY'
from importlib.metadata import version
print(" ".join(f"{p}=={version(p)}" for p in ("torch", "transformers", "accelerate")))
PY
)
stamp="$VENV/.installed-trl-$TRL_VERSION"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$pins" ]; then
  exit 0
fi
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
# shellcheck disable=SC2086
"$VENV/bin/pip" install -q $pins "trl==$TRL_VERSION" datasets pyyaml
echo "$pins" > "$stamp"
echo "TRL $TRL_VERSION installed in $VENV ($pins)"
