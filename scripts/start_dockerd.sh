#!/usr/bin/env bash
# Makes sure a Docker engine answers, for the tests of the docker runtime: nothing to do when
# one does; as root, starts Debian's dockerd (installed by scripts/setup.sh) in the background,
# logging to /var/log/berth-dockerd.log, and waits for it. Where none can start, says why and
# exits 0: those tests then skip, naming the reason.
set -uo pipefail
if docker info >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v dockerd >/dev/null; then
    echo "no Docker engine, and none can be started here (needs root and dockerd)" >&2
    exit 0
fi
echo "starting dockerd (log: /var/log/berth-dockerd.log)" >&2
# Started through Python's subprocess, which closes every inherited descriptor: a dockerd
# started under `flock LOCK cmd` would otherwise hold LOCK for as long as it runs.
python3 -c 'import subprocess, sys
subprocess.Popen(["dockerd"], stdin=subprocess.DEVNULL, stdout=sys.stdout, stderr=subprocess.STDOUT,
                 start_new_session=True)' >/var/log/berth-dockerd.log 2>&1
for _ in $(seq 1 60); do
    if docker info >/dev/null 2>&1; then
        exit 0
    fi
    sleep 0.5
done
echo "dockerd did not answer within 30 s; see /var/log/berth-dockerd.log" >&2
tail -5 /var/log/berth-dockerd.log >&2 || true
exit 0
