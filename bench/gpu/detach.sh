#!/usr/bin/env bash
# On the GPU machine: session.sh's cases in a process of their own that outlives the device call.
#   bash bench/gpu/detach.sh CASE [CASE...]    (the same command again, in the next call, finds it)
# The first call starts `session.sh CASE...` with setsid, its results under /tmp/cudabuild-job/out;
# every call (the first too) waits up to WAIT seconds (default 540) for it to finish, then copies
# what it has so far to $OUT, with the job's log. A call made once the machine has gone back finds
# no job and starts it afresh. JOB names the folder, for two jobs on one machine.
set -uo pipefail
cd "$(dirname "$0")/../.."
job=${JOB:-/tmp/cudabuild-job}
mkdir -p "$job/out"
if [ ! -f "$job/started" ]; then
  date +%s > "$job/started"
  OUT="$job/out" BUDGET=${BUDGET:-1500} setsid nohup bash bench/gpu/session.sh "$@" > "$job/log" 2>&1 < /dev/null &
  echo "detach: started session.sh $* (pid $!)"
else
  echo "detach: job running since $(( $(date +%s) - $(cat "$job/started") )) s ago"
fi
deadline=$(( $(date +%s) + ${WAIT:-540} ))
while [ "$(date +%s)" -lt "$deadline" ]; do
  done_cases=$(grep -c ": rc=" "$job/out/cases.txt" 2>/dev/null)
  [ "${done_cases:-0}" -ge "$#" ] && break
  sleep 5
done
cp -r "$job/out/." "${OUT:-/tmp/out}/" 2>/dev/null
cp "$job/log" "${OUT:-/tmp/out}/job.log" 2>/dev/null
tail -c 4000 "$job/log"
echo; echo "detach: $(grep -c ": rc=" "$job/out/cases.txt" 2>/dev/null || echo 0) of $# cases done after $(( $(date +%s) - $(cat "$job/started") )) s"
