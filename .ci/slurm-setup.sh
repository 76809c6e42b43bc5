#!/usr/bin/env bash
# Start a one-node Slurm on localhost without systemd (Debian 12: Slurm 22.05), for the
# `slurm` tests. Idempotent: installs slurm-wlm and munge if missing, (re)writes
# slurm.conf, starts munged, slurmctld and slurmd unless they answer already, and waits
# until the node is idle. Needs root.
#
#   .ci/slurm-setup.sh          start (pids in $QUALIFY_SLURM_STATE/pids, one "name pid" a line)
#   .ci/slurm-setup.sh stop     stop the daemons this script started, by pid
#
# QUALIFY_SLURM_STATE (default /tmp/qualify-slurm) holds the pid file and daemon logs.
set -euo pipefail
STATE="${QUALIFY_SLURM_STATE:-/tmp/qualify-slurm}"
PIDS="$STATE/pids"
mkdir -p "$STATE"

stop() {
    [[ -f "$PIDS" ]] || { echo "slurm-setup: nothing to stop"; return 0; }
    # slurmd, slurmctld, then munged: reverse start order.
    tac "$PIDS" | while read -r name pid; do
        if kill -0 "$pid" 2>/dev/null; then
            kill "$pid" && echo "slurm-setup: stopped $name ($pid)"
            for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        fi
    done
    rm -f "$PIDS"
}

if [[ "${1:-start}" == "stop" ]]; then
    stop
    exit 0
fi

start=$(date +%s)
if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q --no-install-recommends slurm-wlm munge >"$STATE/apt.log" 2>&1 \
        || { apt-get update -q >>"$STATE/apt.log" 2>&1 &&
             apt-get install -y -q --no-install-recommends slurm-wlm munge \
                 >>"$STATE/apt.log" 2>&1; }
fi

host=localhost
cpus=$(nproc --all)
mem_mb=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 ))
real_mem=$(( mem_mb * 9 / 10 ))
conf=/etc/slurm/slurm.conf
mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
new_conf=$(cat <<CONF
# Written by qualify .ci/slurm-setup.sh: one node, localhost, no accounting.
ClusterName=qualify-ci
SlurmctldHost=$host
SlurmUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0
MinJobAge=3600
EnforcePartLimits=ALL
DependencyParameters=kill_invalid_depend
ReturnToService=2
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/slurmctld.log
SlurmdLogFile=$STATE/slurmd.log
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
KillWait=5
NodeName=$host CPUs=$cpus RealMemory=$real_mem State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
CONF
)
if [[ ! -f "$conf" ]] || [[ "$(cat "$conf")" != "$new_conf" ]]; then
    printf '%s\n' "$new_conf" >"$conf"
fi

alive() { [[ -f "$PIDS" ]] && awk -v n="$1" '$1 == n {print $2}' "$PIDS" | \
          { read -r pid && kill -0 "$pid" 2>/dev/null; }; }
record() { sed -i "/^$1 /d" "$PIDS" 2>/dev/null || true; echo "$1 $2" >>"$PIDS"; }

if ! alive munged; then
    install -d -o munge -g munge -m 0755 /run/munge
    [[ -f /etc/munge/munge.key ]] || runuser -u munge -- /usr/sbin/mungekey --create
    runuser -u munge -- /usr/sbin/munged --force
    for _ in $(seq 50); do [[ -s /run/munge/munged.pid ]] && break; sleep 0.1; done
    record munged "$(cat /run/munge/munged.pid)"
fi
if ! alive slurmctld; then
    slurmctld -D >"$STATE/slurmctld.stdout" 2>&1 &
    record slurmctld $!
fi
if ! alive slurmd; then
    slurmd -D -N "$host" >"$STATE/slurmd.stdout" 2>&1 &
    record slurmd $!
fi

for _ in $(seq 120); do
    state=$(sinfo -h -N -n "$host" -o %t 2>/dev/null || true)
    [[ "$state" == "idle" || "$state" == "mix" || "$state" == "alloc" ]] && break
    if [[ "$state" == down* || "$state" == drain* ]]; then
        scontrol update NodeName="$host" State=RESUME 2>/dev/null || true
    fi
    sleep 0.5
done
state=$(sinfo -h -N -n "$host" -o %t 2>/dev/null || true)
if [[ "$state" != "idle" && "$state" != "mix" && "$state" != "alloc" ]]; then
    echo "slurm-setup: node $host is '${state:-unreachable}' after 60 s; logs in $STATE" >&2
    tail -n 20 "$STATE"/slurmctld.log "$STATE"/slurmd.log >&2 || true
    exit 1
fi
echo "slurm-setup: node $host $state (CPUs=$cpus RealMemory=$real_mem) in" \
     "$(( $(date +%s) - start )) s; pids: $(tr '\n' ' ' <"$PIDS")($PIDS)"
