#!/usr/bin/env bash
# A single-node SLURM cluster on this host, for tests and CI.
#
#   scripts/slurm/local-cluster.sh [start]   install slurm-wlm and munge from Debian when missing, write a
#                                            minimal config, start munged, slurmctld and slurmd, and check
#                                            that the node is up and a job completes
#   scripts/slurm/local-cluster.sh stop      stop the daemons this script started
#
# Runs as root on Debian, with or without systemd: the daemons are started directly. Idempotent: with the
# cluster already up and the config unchanged it only checks it. Exits non-zero, saying why, when the
# cluster does not come up.
#
# Environment:
#   _MAESTER_SLURM_DIR   holds slurm.conf, controller state, slurmd spool, logs and pid files
#                        (default /var/lib/maester-slurm); /etc/slurm/slurm.conf links to its slurm.conf so
#                        that sbatch, srun, squeue and scontrol find the cluster without SLURM_CONF
#   _MAESTER_SLURM_CPUS  CPUs the node declares (default: this machine's); more than the machine has lets
#                        more small jobs run at once
# (Not MAESTER_*: maester refuses a MAESTER_* variable that is neither a config key nor one of its switches.)
set -euo pipefail

DIR="${_MAESTER_SLURM_DIR:-/var/lib/maester-slurm}"
CONF="$DIR/slurm.conf"
NODE="$(hostname -s)"
PARTITION=debug
SYSTEM_CONF=/etc/slurm/slurm.conf
MUNGE_KEY=/etc/munge/munge.key
export SLURM_CONF="$CONF"  # this script's own sinfo, sbatch and scontrol talk to this cluster
# Daemons start with a clean environment, not the caller's (which may be a test's).
DAEMON_ENV=(env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8)

say() { echo "local-cluster: $*"; }
die() { echo "local-cluster: error: $*" >&2; exit 1; }

# Print the tail of each daemon log, to explain a failure.
show_logs() {
  local log
  for log in "$DIR/log/slurmctld.log" "$DIR/log/slurmd.log" /var/log/munge/munged.log; do
    if [[ -s "$log" ]]; then
      echo "--- last lines of $log" >&2
      tail -n 20 "$log" >&2
    fi
  done
}

# True when the pid in file $1 belongs to a live process named $2.
running() {
  local pid
  [[ -s "$1" ]] || return 1
  pid="$(cat "$1")"
  [[ -r "/proc/$pid/comm" && "$(cat "/proc/$pid/comm")" == "$2" ]]
}

# Send SIGTERM to the process in pid file $1 (named $2) and wait up to 15 s for it to exit.
stop_daemon() {
  local pid
  running "$1" "$2" || return 0
  pid="$(cat "$1")"
  kill -TERM "$pid"
  for _ in $(seq 1 150); do
    [[ -d "/proc/$pid" ]] || { say "stopped $2 (pid $pid)"; return 0; }
    sleep 0.1
  done
  die "$2 (pid $pid) did not exit within 15 s of SIGTERM"
}

install_packages() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
      && command -v munged >/dev/null; then
    return 0
  fi
  command -v apt-get >/dev/null || die "slurm-wlm and munge are not installed and there is no apt-get to install them"
  say "installing slurm-wlm and munge with apt-get"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq || die "apt-get update failed"
  apt-get install -y -qq --no-install-recommends slurm-wlm munge >"$DIR/log/apt-get.log" 2>&1 \
    || { tail -n 30 "$DIR/log/apt-get.log" >&2; die "apt-get install slurm-wlm munge failed (log: $DIR/log/apt-get.log)"; }
}

start_munge() {
  if [[ ! -s "$MUNGE_KEY" ]]; then
    mkdir -p "$(dirname "$MUNGE_KEY")"
    dd if=/dev/urandom of="$MUNGE_KEY" bs=1024 count=1 status=none
  fi
  # munged refuses keys and directories that other users can write; /run is a fresh tmpfs after a reboot.
  mkdir -p /run/munge /var/lib/munge /var/log/munge
  chown munge:munge /etc/munge "$MUNGE_KEY" /run/munge /var/lib/munge /var/log/munge
  chmod 0700 /etc/munge /var/lib/munge /var/log/munge
  chmod 0755 /run/munge
  chmod 0400 "$MUNGE_KEY"
  if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    return 0
  fi
  "${DAEMON_ENV[@]}" runuser -u munge -- /usr/sbin/munged 9>&- || { show_logs; die "munged did not start"; }
  touch "$DIR/run/munged.ours"
  munge -n | unmunge >/dev/null || { show_logs; die "munged started but a credential does not round-trip (munge -n | unmunge)"; }
  say "started munged"
}

# The node: this machine's topology and memory as slurmd measures them, or _MAESTER_SLURM_CPUS CPUs.
node_line() {
  local measured memory
  measured="$(slurmd -C | head -n 1)"
  [[ "$measured" == NodeName=* ]] || die "slurmd -C did not print a node line: $measured"
  if [[ -n "${_MAESTER_SLURM_CPUS:-}" ]]; then
    [[ "$_MAESTER_SLURM_CPUS" =~ ^[1-9][0-9]*$ ]] || die "_MAESTER_SLURM_CPUS must be a positive integer, got '$_MAESTER_SLURM_CPUS'"
    memory="$(sed -n 's/.*\(RealMemory=[0-9]*\).*/\1/p' <<<"$measured")"
    echo "SlurmdParameters=config_overrides  # slurmd accepts more CPUs than it finds"
    echo "NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$_MAESTER_SLURM_CPUS $memory State=UNKNOWN"
  else
    echo "${measured/NodeName=$NODE/NodeName=$NODE NodeAddr=127.0.0.1} State=UNKNOWN"
  fi
}

# The whole slurm.conf; $1 is the node part from node_line.
write_config() {
  cat <<EOF
# Written by scripts/slurm/local-cluster.sh: a one-node test cluster; edits are overwritten.
ClusterName=maester-local
SlurmctldHost=$NODE(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# A requeued job waits cred_expire seconds before it may start again (default 120).
AuthInfo=cred_expire=10
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
# Several small jobs share the node, each on whole cores; memory is not a consumable resource.
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# No cgroups: processes are tracked through /proc, tasks are not bound.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
MailProg=/bin/true
SwitchType=switch/none
# No slurmdbd, so no sacct; one line per finished job in the completion log instead.
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$DIR/log/jobcomp.txt
JobRequeue=1
# Pending jobs (a requeued job once eligible, a dependency released) start within seconds, not a minute.
SchedulerParameters=sched_interval=2,bf_interval=2
PreemptType=preempt/none
# Seconds between SIGTERM and SIGKILL when a job is requeued, cancelled or out of time.
KillWait=30
# Finished jobs stay visible to scontrol show job for an hour.
MinJobAge=3600
ReturnToService=2
$1
PartitionName=$PARTITION Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
}

# Link /etc/slurm/slurm.conf to ours; a config this script did not write is never replaced.
link_system_conf() {
  if [[ -e "$SYSTEM_CONF" ]] && ! { [[ -L "$SYSTEM_CONF" ]] && head -n 1 "$SYSTEM_CONF" | grep -q local-cluster.sh; }; then
    die "$SYSTEM_CONF exists and was not written by this script; not replacing it"
  fi
  mkdir -p "$(dirname "$SYSTEM_CONF")"
  ln -sfn "$CONF" "$SYSTEM_CONF"
}

start_slurm() {
  local new="$DIR/slurm.conf.new" changed=0 node
  node="$(node_line)"  # on its own line so that a failure in it stops the script
  write_config "$node" >"$new"
  if ! cmp -s "$new" "$CONF"; then
    mv "$new" "$CONF"
    changed=1
  else
    rm "$new"
  fi
  link_system_conf
  if [[ $changed == 1 ]]; then
    stop_daemon "$DIR/run/slurmd.pid" slurmd
    stop_daemon "$DIR/run/slurmctld.pid" slurmctld
  fi
  if ! running "$DIR/run/slurmctld.pid" slurmctld; then
    "${DAEMON_ENV[@]}" slurmctld -f "$CONF" 9>&- || { show_logs; die "slurmctld did not start"; }
    say "started slurmctld"
  fi
  if ! running "$DIR/run/slurmd.pid" slurmd; then
    "${DAEMON_ENV[@]}" slurmd -f "$CONF" 9>&- || { show_logs; die "slurmd did not start"; }
    say "started slurmd"
  fi
}

# Wait until the node accepts jobs (idle, or mixed/allocated when jobs already run on it).
wait_for_node() {
  local state=""
  for _ in $(seq 1 60); do
    state="$(sinfo -h -n "$NODE" -o %T 2>/dev/null || true)"
    case "$state" in
      idle|mixed|allocated|completing) return 0 ;;
      down*|drain*) scontrol update NodeName="$NODE" State=RESUME >/dev/null 2>&1 || true ;;
    esac
    sleep 1
  done
  sinfo -N -l -R >&2 || true
  show_logs
  die "node $NODE is not up after 60 s (sinfo state: '${state:-no answer from slurmctld}')"
}

# Submit `echo ok` and wait up to 60 s for it to complete.
check_job() {
  local id state="" out
  id="$(sbatch --parsable --job-name=local-cluster-check --chdir="$DIR" --output="$DIR/log/check-%j.out" \
    --time=1 --wrap 'echo ok')" || { show_logs; die "sbatch of the check job failed"; }
  for _ in $(seq 1 120); do
    state="$(scontrol show job "$id" -o | grep -o 'JobState=[A-Z_]*' | cut -d= -f2)"
    case "$state" in
      COMPLETED) break ;;
      PENDING|CONFIGURING|RUNNING|COMPLETING) sleep 0.5 ;;
      *) show_logs; die "check job $id ended in state $state" ;;
    esac
  done
  [[ "$state" == COMPLETED ]] || { squeue >&2; show_logs; die "check job $id did not complete within 60 s (state $state)"; }
  out="$DIR/log/check-$id.out"
  [[ "$(cat "$out")" == ok ]] || die "check job $id completed but $out does not say ok"
  rm "$out"
}

start() {
  local t0=$SECONDS t1
  [[ $EUID == 0 ]] || die "must run as root (it installs packages and starts system daemons)"
  mkdir -p "$DIR/state" "$DIR/spool" "$DIR/log" "$DIR/run"
  exec 9>"$DIR/lock"
  flock 9  # one start at a time: parallel test workers may call this together (daemons get 9>&-)
  install_packages
  t1=$SECONDS
  start_munge
  start_slurm
  wait_for_node
  check_job
  say "cluster up: node $NODE, partition $PARTITION, config $CONF; install $((t1 - t0)) s, start and check $((SECONDS - t1)) s"
}

stop() {
  [[ $EUID == 0 ]] || die "must run as root"
  stop_daemon "$DIR/run/slurmd.pid" slurmd
  stop_daemon "$DIR/run/slurmctld.pid" slurmctld
  if [[ -e "$DIR/run/munged.ours" ]]; then
    stop_daemon /run/munge/munged.pid munged
    rm "$DIR/run/munged.ours"
  fi
}

case "${1:-start}" in
  start) start ;;
  stop) stop ;;
  *) die "usage: $0 [start|stop]" ;;
esac
