#!/usr/bin/env bash
# A real single-node Slurm cluster on this machine, for trying the sbatch scripts (not for CI).
#
#   bash examples/slurm/local_cluster.sh install   # apt-get install slurm-wlm munge (as root)
#   bash examples/slurm/local_cluster.sh start     # munged, slurmctld, slurmd (no systemd)
#   bash examples/slurm/local_cluster.sh status
#   bash examples/slurm/local_cluster.sh stop
#
# The node offers every CPU of the machine (CPUS, default: nproc) and most of its memory, in a
# partition `debug`. Process tracking is Linux's own (no cgroups), so it runs in containers.
# State and logs live under SLURM_LOCAL_DIR (default /tmp/slurm-local).
# A requeued job is not eligible again before the job credential expires (AuthInfo cred_expire,
# Slurm's default 120 s) and the scheduler's next look at the queue; this cluster sets
# CRED_EXPIRE (default 30 s) and looks every 5 s, so that a requeued job restarts after about 35 s.
set -euo pipefail

DIR=${SLURM_LOCAL_DIR:-/tmp/slurm-local}
CONF=/etc/slurm/slurm.conf
HOST=$(hostname -s)
CPUS=${CPUS:-$(nproc)}
CRED_EXPIRE=${CRED_EXPIRE:-30}
MEM_MB=${MEM_MB:-$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 * 3 / 4 ))}

install() {
    [ "$(id -u)" = 0 ] || { echo "install needs root" >&2; exit 1; }
    DEBIAN_FRONTEND=noninteractive apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge
}

write_conf() {
    mkdir -p /etc/slurm "$DIR"/{state,spool,log}
    cat > "$CONF" <<CONF
# written by examples/slurm/local_cluster.sh
ClusterName=local
SlurmctldHost=$HOST
AuthType=auth/munge
# a requeued job waits this long (seconds) before it may start again (default 120)
AuthInfo=cred_expire=$CRED_EXPIRE
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SchedulerType=sched/backfill
# look for startable jobs every 5 s (defaults: 60 s, backfill 30 s), e.g. a requeued job once eligible
SchedulerParameters=bf_interval=5,sched_interval=5
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
MinJobAge=60
NodeName=$HOST CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
CONF
}

start() {
    write_conf
    if [ ! -s /etc/munge/munge.key ]; then
        mkdir -p /etc/munge
        dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
    fi
    chown munge:munge /etc/munge/munge.key 2>/dev/null || true
    chmod 400 /etc/munge/munge.key
    mkdir -p /run/munge /var/lib/munge /var/log/munge
    chown munge:munge /run/munge /var/lib/munge /var/log/munge 2>/dev/null || true
    pgrep -x munged >/dev/null || runuser -u munge -- /usr/sbin/munged
    pgrep -x slurmctld >/dev/null || slurmctld
    pgrep -x slurmd >/dev/null || slurmd
    for _ in $(seq 30); do
        if sinfo -h -o '%T' 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; then
            sinfo; return 0
        fi
        sleep 1
    done
    echo "slurm did not come up; see $DIR/log/" >&2
    sinfo || true
    exit 1
}

stop() {
    for daemon in slurmd slurmctld; do
        pidfile="$DIR/$daemon.pid"
        if [ -s "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then
            kill "$(cat "$pidfile")"
        fi
    done
    if [ -s /run/munge/munged.pid ]; then kill "$(cat /run/munge/munged.pid)" 2>/dev/null || true; fi
    echo "stopped"
}

status() {
    sinfo && squeue
}

case "${1:-}" in
    install) install ;;
    start) start ;;
    stop) stop ;;
    status) status ;;
    *) echo "usage: $0 install|start|stop|status" >&2; exit 2 ;;
esac
