#!/usr/bin/env bash
# Regenerates requirements/constraints.txt, the exact dependency set the README installs:
# a fresh virtualenv, torch at the README's pin, `pip install -e '.[test]'` resolved
# within pyproject.toml's bounds, then every installed package pinned with `==`, except
# torch (installed first by its own pin; GPU machines bring their CUDA build) and llamarl.
#
#     scripts/lock.sh [PYTHON]      # default python3; the pins hold for its version and up
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${1:-python3}"

# The torch pin is the README's, so that the lock and the quickstart cannot disagree.
TORCH=$(grep -om1 'pip install torch==[^ ]*' README.md | cut -d' ' -f3)
[ -n "$TORCH" ] || { echo "no 'pip install torch==...' in README.md" >&2; exit 1; }

VENV=$(mktemp -d)
trap 'rm -rf "$VENV"' EXIT
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install "$TORCH"
"$VENV/bin/pip" install -e '.[test]'

OUT=requirements/constraints.txt
{
  echo "# The exact dependency set the README installs (pip install -e '.[test]' -c $OUT)."
  echo "# Made by scripts/lock.sh with $("$VENV/bin/python" --version) on $(uname -sm), $TORCH installed first."
  echo "# torch and llamarl itself are left out. Edit pyproject.toml's bounds, then rerun the script."
  "$VENV/bin/pip" freeze --exclude-editable | grep -viE '^(torch|llamarl)(==| @)' | LC_ALL=C sort -f -t= -k1,1
} > "$OUT.tmp"
mv "$OUT.tmp" "$OUT"
echo "wrote $OUT ($(grep -vc '^#' "$OUT") pins)"
