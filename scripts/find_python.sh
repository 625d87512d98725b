#!/usr/bin/env bash
# Print the path of a working Python >= MIN (default 3.12), or exit 1 with a clear message.
# Order: $PYTHON, python3.13, python3.12, python3, then pyenv's installed versions.
# A pyenv shim that is on PATH but not selected fails when run, so each candidate is really run.
set -u
min="${1:-3.12}"
max="${2:-}"
candidates=()
[ -n "${PYTHON:-}" ] && candidates+=("$PYTHON")
candidates+=(python3.13 python3.12 python3)
for d in "$HOME"/.pyenv/versions/3.1[2-9]* "$HOME"/.pyenv/versions/3.11* /usr/local/bin /usr/bin; do
  [ -x "$d/bin/python3" ] && candidates+=("$d/bin/python3")
  [ -x "$d/python3" ] && candidates+=("$d/python3")
done
check="import sys; lo=tuple(map(int,'$min'.split('.'))); hi='$max';
ok = sys.version_info[:2] >= lo and (not hi or sys.version_info[:2] <= tuple(map(int,hi.split('.'))));
sys.exit(0 if ok else 1)"
for c in "${candidates[@]}"; do
  if path=$(command -v "$c" 2>/dev/null) && "$path" -c "$check" >/dev/null 2>&1; then
    "$path" -c 'import sys; print(sys.executable)'
    exit 0
  fi
done
echo "error: no working Python ${min}${max:+ to $max} found; tried: ${candidates[*]}. Set PYTHON=/path/to/python3.12" >&2
exit 1
