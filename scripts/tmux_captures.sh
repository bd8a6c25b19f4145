#!/usr/bin/env bash
# Terminal captures of `fedcli train` and `fedcli sweep` at 80 and 160 columns, taken in tmux.
#
#   scripts/tmux_captures.sh            # writes docs/terminal/{train,sweep}-{80,160}{-live,}.txt
#   OUT=/tmp/captures scripts/tmux_captures.sh
#
# Each command runs in a detached tmux session of the given size (a real terminal: the live
# progress bar and the sweep's live table, not the plain lines a log file gets), with .venv/bin
# on PATH as after `source .venv/bin/activate`. The pane is read with `tmux capture-pane -p`
# every 0.2 s: NAME-live.txt is the screen midway through (the first capture showing round >=
# half of the total), NAME.txt the screen once the command has exited. The commands run in a
# scratch folder, shown in the captures as $SHOWN_AS (default /home/you/fedcli-demo), so that
# they carry no path of the machine that made them; lines are wrapped again at the pane's
# width after that substitution, as the terminal wraps them. Needs tmux and .venv (make test
# creates it); trains lsq: 1-3 minutes in all.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-docs/terminal}
FEDCLI=${FEDCLI:-fedcli}
SHOWN_AS=${SHOWN_AS:-/home/you/fedcli-demo}
PY=$PWD/.venv/bin/python
export PATH="$PWD/.venv/bin:$PATH"
command -v tmux >/dev/null || { echo "tmux_captures: tmux not installed (apt-get install tmux)" >&2; exit 2; }
mkdir -p "$OUT"
work=$(cd "$(mktemp -d)" && pwd -P)  # the real path: the one fedcli prints
sessions=()
cleanup() {
    for s in "${sessions[@]}"; do tmux kill-session -t "$s" 2>/dev/null || true; done
    rm -rf "$work"
}
trap cleanup EXIT

cat > "$work/spec.yaml" <<'EOF'
experiment: lsq-sweep
base: {task: lsq, rounds: 30}
grid: {algo: [fedavg, scaffold]}
seeds: [0, 1]
EOF

trim() {  # the pane's trailing blank lines carry nothing
    sed -e :a -e '/^\n*$/{$d;N;ba' -e '}'
}

# neutral COLUMNS < joined pane: the scratch folder shown as $SHOWN_AS, each line wrapped at COLUMNS again
neutral() {
    "$PY" -c '
import sys
cols, work, shown = int(sys.argv[1]), sys.argv[2], sys.argv[3]
for line in sys.stdin.read().replace(work, shown).splitlines():
    line = line.rstrip()
    while len(line) > cols:
        print(line[:cols])
        line = line[cols:]
    print(line)
' "$1" "$work" "$SHOWN_AS"
}

# capture NAME COLUMNS MIDWAY COMMAND...: run COMMAND in a COLUMNS x 30 pane; MIDWAY is a regex
# (grep -E) that marks the live screen worth keeping.
capture() {
    local name=$1 cols=$2 midway=$3; shift 3
    local session="fedcli-capture-$$-$name" screen="$work/screen" live=""
    sessions+=("$session")
    # the prompt line shows what runs, as if typed; the pane stays open after the command exits
    tmux new-session -d -s "$session" -x "$cols" -y 30 -c "$work" \
        "printf '$ %s\n' \"fedcli ${*:2}\"; TERM=xterm-256color COLUMNS= PATH='$PATH' $*; echo \"[exit \$?]\"; sleep 3600"
    for _ in $(seq 1 3000); do
        sleep 0.2
        tmux capture-pane -p -J -t "$session" > "$screen"  # -J: wrapped lines joined, re-wrapped by neutral
        if [ -z "$live" ] && grep -Eq "$midway" "$screen" && ! grep -q '^\[exit ' "$screen"; then
            neutral "$cols" < "$screen" | trim > "$OUT/$name-live.txt"
            live=yes
        fi
        grep -q '^\[exit ' "$screen" && break
    done
    neutral "$cols" < "$screen" | trim > "$OUT/$name.txt"
    tmux kill-session -t "$session"
    echo "$OUT/$name.txt${live:+ and $name-live.txt}: $(grep -o '^\[exit [0-9]*\]' "$OUT/$name.txt")"
}

for cols in 80 160; do
    capture "train-$cols" "$cols" '^ ?(2[0-9]|3[0-9])/40 ' \
        "$FEDCLI" train --task lsq --rounds 40 --root "train-$cols" --no-mlflow
    capture "sweep-$cols" "$cols" '│ running +│ +[1-9][0-9]*/30 ' \
        "$FEDCLI" sweep spec.yaml --root "sweep-$cols" --no-mlflow --workers 2
done
