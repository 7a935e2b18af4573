#!/usr/bin/env bash
# A GPU job longer than one device call (ten minutes), on one warm machine, without cutting it at each call's end.
#
#   bash benchmarks/leased_gpu/background.sh start NAME COMMAND [ARG ...]   # returns at once; the job runs on
#   bash benchmarks/leased_gpu/background.sh wait NAME SECONDS [WATCH ...]  # until the job ends or SECONDS pass
#
# The device tool kills what a call leaves running when it returns, except a process that started a new session
# (setsid), which runs on until the machine goes back (30 s after the last call returns; /work/.library/device).
# So `start` puts the job in its own session and each later call `wait`s for it: one process trains from the first
# call to the last, where resumed jobs pay, at every call's end, a SIGTERM, a checkpoint, a new process, the
# checkpoint's load and the compile again (the 8-layer recipe cell of 2026-12-03: 331 s in its first job, 423 s in the
# second). The price: nothing survives a lost machine (the next call more than 30 s late, as on 2026-12-03), and
# a job that must outlive its machine still needs checkpoints brought back (carry.py).
#
# Files, under /tmp/bg (outside the checkout, which each call's copy replaces): NAME.log (the job's stdout and
# stderr), NAME.pid, NAME.rc (its exit status, written when it ends). Give the job an output folder outside the
# call's $OUT (emptied before every call), e.g. OUT=/tmp/bg/NAME.out, and copy what must come back in the last call.
# `wait` prints the tail of the job's log and the last lines of each WATCH file that exists (a cell's log), then
# exits 0 when the job has ended (its status is in NAME.rc and printed), 3 while it still runs, 2 when no job NAME
# was started on this machine (a fresh one: the last call came too late).
set -uo pipefail
BG=${BG:-/tmp/bg}
cmd=${1:-}
name=${2:-}
[[ -n $cmd && -n $name ]] || { echo "usage: background.sh start NAME COMMAND... | wait NAME SECONDS [WATCH...]" >&2; exit 2; }
mkdir -p "$BG"
case $cmd in
  start)
    shift 2
    (( $# )) || { echo "background.sh start $name: no command" >&2; exit 2; }
    if [[ -f $BG/$name.pid && ! -f $BG/$name.rc ]] && kill -0 "$(cat "$BG/$name.pid")" 2>/dev/null; then
      echo "background.sh: job $name already runs (pid $(cat "$BG/$name.pid"))" >&2; exit 2
    fi
    rm -f "$BG/$name.rc"
    # the status file is written by the job's own shell, in the new session, when the command ends
    setsid bash -c '"$@"; echo $? > "'"$BG/$name.rc"'"' _ "$@" > "$BG/$name.log" 2>&1 < /dev/null &
    echo $! > "$BG/$name.pid"
    echo "background.sh: job $name started (pid $!, log $BG/$name.log)" >&2
    ;;
  wait)
    secs=${3:?background.sh wait NAME SECONDS}
    shift 3
    [[ -f $BG/$name.pid ]] || { echo "background.sh: no job $name on this machine (a fresh machine?)" >&2; exit 2; }
    t0=$(date +%s)
    while [[ ! -f $BG/$name.rc ]] && (( $(date +%s) - t0 < secs )); do
      kill -0 "$(cat "$BG/$name.pid")" 2>/dev/null || break  # killed without writing its status
      sleep 5
    done
    for f in "$@"; do [[ -f $f ]] && { echo "== $f"; tail -n 3 "$f"; }; done
    echo "== $BG/$name.log"; tail -n 15 "$BG/$name.log"
    if [[ -f $BG/$name.rc ]]; then
      echo "== job $name ended: exit $(cat "$BG/$name.rc") (waited $(( $(date +%s) - t0 )) s)"; exit 0
    fi
    if ! kill -0 "$(cat "$BG/$name.pid")" 2>/dev/null; then
      echo "== job $name is gone without an exit status (killed)"; exit 2
    fi
    echo "== job $name still runs after $(( $(date +%s) - t0 )) s of waiting"; exit 3
    ;;
  *)
    echo "background.sh: unknown command $cmd (start | wait)" >&2; exit 2 ;;
esac
