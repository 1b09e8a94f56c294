#!/usr/bin/env bash
# Start a single-node Slurm cluster on this machine, without systemd, for tests.
#
#   sudo deploy/slurm/local_slurm.sh          # install (Debian/Ubuntu), configure, start
#   sudo deploy/slurm/local_slurm.sh stop     # stop slurmd, slurmctld and munged
#
# Idempotent: re-running it when the cluster answers and the config is unchanged does nothing.
# Everything Slurm writes lives under $JAXDIST_SLURM_DIR (default /tmp/jaxdist-slurm);
# the config is /etc/slurm/slurm.conf (written only if absent or written by this script).
#
# The node declares $JAXDIST_SLURM_CPUS CPUs (default 8) and $JAXDIST_SLURM_MEMORY_MB MB
# (default 16384) whatever the machine has (SlurmdParameters=config_overrides), so a
# 6-task step runs on a 2-core VM.
# Process tracking is proctrack/linuxproc and TaskPlugin=task/none: no cgroups needed,
# so it also runs in unprivileged containers.
# srun listens (for its tasks' I/O, the controller, the step) on ports from $JAXDIST_SLURM_SRUN_PORTS
# (default 12000-12999, SrunPortRange) instead of ephemeral ones: a process elsewhere on the machine
# that dials a port it used before (a client retrying a killed server's port) could otherwise reach
# srun's I/O listener, which then loses the step's output ("failed reading io init message").
set -euo pipefail

STATE_DIR="${JAXDIST_SLURM_DIR:-/tmp/jaxdist-slurm}"
CPUS="${JAXDIST_SLURM_CPUS:-8}"
MEMORY_MB="${JAXDIST_SLURM_MEMORY_MB:-16384}"
SRUN_PORTS="${JAXDIST_SLURM_SRUN_PORTS:-12000-12999}"
CONF=/etc/slurm/slurm.conf
MARKER="# Written by jaxdist deploy/slurm/local_slurm.sh"

log() { echo "local_slurm: $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

[ "$(id -u)" -eq 0 ] || die "run as root (it installs packages and starts daemons)"

# Node name: the short host name when it resolves, else localhost.
NODE="${JAXDIST_SLURM_NODE:-$(hostname -s)}"
if ! getent hosts "$NODE" >/dev/null 2>&1; then
    log "host name $NODE does not resolve; using localhost as the node name"
    NODE=localhost
fi

# Stop the daemon whose pid is in file $1 and wait until it is gone.
stop_pidfile() {
    local pid
    [ -s "$1" ] || return 0
    pid="$(cat "$1")"
    kill -0 "$pid" 2>/dev/null || return 0
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 100); do
        kill -0 "$pid" 2>/dev/null || { log "stopped $2 (pid $pid)"; return 0; }
        sleep 0.1
    done
    kill -9 "$pid" 2>/dev/null || true
    log "killed $2 (pid $pid)"
}

stop_all() {
    stop_pidfile "$STATE_DIR/slurmd.pid" slurmd
    stop_pidfile "$STATE_DIR/slurmctld.pid" slurmctld
    stop_pidfile /run/munge/munged.pid munged
}

if [ "${1:-start}" = stop ]; then
    stop_all
    exit 0
fi
[ "${1:-start}" = start ] || die "usage: $0 [start|stop]"

cluster_up() {
    sinfo -h -o '%T' 2>/dev/null | grep -Eq '^(idle|mixed|allocated|completing)$'
}

# --- 1. packages ------------------------------------------------------------------------
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null \
    || ! command -v srun >/dev/null || ! command -v munged >/dev/null; then
    log "installing slurm-wlm and munge"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    apt-get install -y -q --no-install-recommends slurm-wlm munge
fi

# --- 2. munge ---------------------------------------------------------------------------
install -d -o munge -g munge -m 0700 /etc/munge /var/log/munge
install -d -o munge -g munge -m 0711 /var/lib/munge
install -d -o munge -g munge -m 0755 /run/munge
if [ ! -s /etc/munge/munge.key ]; then
    log "creating /etc/munge/munge.key"
    if command -v mungekey >/dev/null; then
        runuser -u munge -- mungekey --create --keyfile=/etc/munge/munge.key
    else
        dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
    fi
fi
chown munge:munge /etc/munge/munge.key
chmod 0400 /etc/munge/munge.key
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    log "starting munged as user munge"
    # --force: start even if a dead munged left its socket behind.
    runuser -u munge -- /usr/sbin/munged --force
    for _ in $(seq 50); do
        munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break
        sleep 0.1
    done
    munge -n | unmunge >/dev/null || die "munged does not answer; see /var/log/munge/munged.log"
fi

# --- 3. slurm.conf ----------------------------------------------------------------------
mkdir -p "$STATE_DIR/state" "$STATE_DIR/spool" /etc/slurm
if [ -e "$CONF" ] && ! grep -qF "$MARKER" "$CONF"; then
    die "$CONF exists and was not written by this script; move it away to use a local test cluster"
fi
NEW_CONF="$(mktemp)"
cat >"$NEW_CONF" <<EOF
$MARKER
ClusterName=jaxdist-local
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CryptoType=crypto/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
EnforcePartLimits=ALL
SlurmdParameters=config_overrides
SrunPortRange=$SRUN_PORTS
StateSaveLocation=$STATE_DIR/state
SlurmdSpoolDir=$STATE_DIR/spool
SlurmctldPidFile=$STATE_DIR/slurmctld.pid
SlurmdPidFile=$STATE_DIR/slurmd.pid
SlurmctldLogFile=$STATE_DIR/slurmctld.log
SlurmdLogFile=$STATE_DIR/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=60
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEMORY_MB State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
if ! cmp -s "$NEW_CONF" "$CONF"; then
    log "writing $CONF (node $NODE, $CPUS CPUs, $MEMORY_MB MB)"
    install -m 0644 "$NEW_CONF" "$CONF"
    CONF_CHANGED=1
fi
rm -f "$NEW_CONF"

# --- 4. daemons ---------------------------------------------------------------------------
running() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

if [ "${CONF_CHANGED:-0}" = 0 ] && cluster_up; then
    log "Slurm already answers:"
    sinfo >&2
    exit 0
fi

if [ "${CONF_CHANGED:-0}" = 1 ]; then
    # A daemon started with an older config would disagree with the new one.
    stop_pidfile "$STATE_DIR/slurmd.pid" slurmd
    stop_pidfile "$STATE_DIR/slurmctld.pid" slurmctld
fi
if ! running "$STATE_DIR/slurmctld.pid"; then
    log "starting slurmctld"
    /usr/sbin/slurmctld
fi
for _ in $(seq 100); do
    scontrol ping 2>/dev/null | grep -q 'is UP' && break
    sleep 0.2
done
scontrol ping | grep -q 'is UP' || die "slurmctld does not answer; see $STATE_DIR/slurmctld.log"
if ! running "$STATE_DIR/slurmd.pid"; then
    log "starting slurmd as node $NODE"
    /usr/sbin/slurmd -N "$NODE"
fi

for _ in $(seq 150); do
    cluster_up && break
    state="$(sinfo -h -o '%T' 2>/dev/null || true)"
    case "$state" in
        down*|drain*|fail*) scontrol update NodeName="$NODE" State=RESUME 2>/dev/null || true ;;
    esac
    sleep 0.2
done
cluster_up || die "node $NODE is not idle ($(sinfo -h -o '%T %E' 2>&1)); see $STATE_DIR/slurmd.log"
log "Slurm is up:"
sinfo >&2
