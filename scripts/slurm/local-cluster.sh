#!/usr/bin/env bash
# A SLURM cluster of one or more nodes on this host, for tests and CI.
#
#   scripts/slurm/local-cluster.sh [start] [--nodes N]
#       install slurm-wlm and munge from Debian when missing, write a minimal config, start munged, slurmctld
#       and a slurmd per node, and check that the nodes are up and a job completes on all of them
#   scripts/slurm/local-cluster.sh stop       stop the daemons this script started, and what runs on the nodes
#   scripts/slurm/local-cluster.sh kill-node NODE
#       lose a node: SIGKILL its slurmd and every process on it, as when a machine dies (`start` brings it back)
#
# One node (the default) is this host itself, at 127.0.0.1. With N >= 2 the nodes are node1..nodeN: each a
# slurmd in its own UTS and mount namespaces (unshare), so it has its own hostname and its own /tmp and /dev/shm
# ($DIR/nodes/<node>/tmp and shm, bind-mounted there), on its own loopback address (127.0.0.2, 127.0.0.3, ...)
# and port; everything else (the repository, job directories, /etc, /run/munge) they share with the host, as
# nodes share a cluster file system. A repository under /tmp is bound into each node's /tmp at the same path.
# The controller stays on the host; /etc/hosts gets a marked block with the nodes' addresses, for the
# rendezvous at the first node's hostname.
#
# Runs as root on Debian, with or without systemd: the daemons are started directly. Idempotent: with the
# cluster already up and the config unchanged it only checks it. Exits non-zero, saying why, when the
# cluster does not come up.
#
# Environment:
#   _MAESTER_SLURM_DIR   holds slurm.conf, controller state, slurmd spool, logs and pid files
#                        (default /var/lib/maester-slurm); /etc/slurm/slurm.conf links to its slurm.conf, when
#                        it is free, so that sbatch, srun, squeue and scontrol find the cluster without
#                        SLURM_CONF; a second cluster (another directory) is reached with SLURM_CONF=$DIR/slurm.conf
#   _MAESTER_SLURM_CPUS  CPUs each node declares (default: this machine's); more than the machine has lets
#                        more small jobs run at once
#   _MAESTER_SLURM_PORT  slurmctld's port; the nodes' slurmd take the next ones (default: SLURM's 6817 and
#                        6818, 6819, ...): a second cluster on this host needs other ports
# (Not MAESTER_*: maester refuses a MAESTER_* variable that is neither a config key nor one of its switches.)
set -euo pipefail

DIR="${_MAESTER_SLURM_DIR:-/var/lib/maester-slurm}"
DEFAULT_DIR=/var/lib/maester-slurm
CONF="$DIR/slurm.conf"
HOST="$(hostname -s)"
PARTITION=debug
SYSTEM_CONF=/etc/slurm/slurm.conf
MUNGE_KEY=/etc/munge/munge.key
HOSTS=/etc/hosts
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd -P)"
PORT="${_MAESTER_SLURM_PORT:-6817}"
export SLURM_CONF="$CONF"  # this script's own sinfo, sbatch and scontrol talk to this cluster
# Daemons start with a clean environment, not the caller's (which may be a test's).
DAEMON_ENV=(env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8)
NODES=1   # --nodes
NAMES=()  # the nodes: this host for one node, node1..nodeN for more

say() { echo "local-cluster: $*"; }
die() { echo "local-cluster: error: $*" >&2; exit 1; }

# NAMES for NODES nodes.
set_names() {
  local i
  NAMES=()
  if [[ $NODES == 1 ]]; then NAMES=("$HOST"); return; fi
  for i in $(seq 1 "$NODES"); do NAMES+=("node$i"); done
}

# NODES and NAMES of the cluster that $CONF describes (for stop and kill-node).
read_names() {
  NAMES=()
  [[ -s "$CONF" ]] && mapfile -t NAMES < <(sed -n 's/^NodeName=\([^ ]*\) .*/\1/p' "$CONF")
  NODES=${#NAMES[@]}
}

# Print the tail of each daemon log, to explain a failure.
show_logs() {
  local log
  for log in "$DIR/log/slurmctld.log" "$DIR"/log/slurmd*.log /var/log/munge/munged.log; do
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

# Node $1's (1-based) address: this host's for one node, else 127.0.0.(1+i).
node_addr() { if [[ $NODES == 1 ]]; then echo 127.0.0.1; else echo "127.0.0.$((1 + $1))"; fi; }

# The nodes: this machine's topology and memory as slurmd measures them, or _MAESTER_SLURM_CPUS CPUs; with
# several nodes, each at its own address and port.
node_lines() {
  local measured memory shape i port=""
  measured="$(slurmd -C | head -n 1)"
  [[ "$measured" == NodeName=* ]] || die "slurmd -C did not print a node line: $measured"
  shape="${measured#NodeName=* }"
  if [[ -n "${_MAESTER_SLURM_CPUS:-}" ]]; then
    [[ "$_MAESTER_SLURM_CPUS" =~ ^[1-9][0-9]*$ ]] || die "_MAESTER_SLURM_CPUS must be a positive integer, got '$_MAESTER_SLURM_CPUS'"
    memory="$(sed -n 's/.*\(RealMemory=[0-9]*\).*/\1/p' <<<"$measured")"
    echo "SlurmdParameters=config_overrides  # slurmd accepts more CPUs than it finds"
    shape="CPUs=$_MAESTER_SLURM_CPUS $memory"
  fi
  for i in $(seq 1 "$NODES"); do
    [[ $NODES == 1 ]] || port=" Port=$((PORT + i))"
    echo "NodeName=${NAMES[i - 1]} NodeAddr=$(node_addr "$i")$port $shape State=UNKNOWN"
  done
}

# The whole slurm.conf; $1 is the node part from node_lines. One node's is the same as before there were several.
write_config() {
  local what="a one-node test cluster" nodes="${NAMES[0]}" spool="$DIR/spool" slurmd="slurmd"
  if [[ $NODES != 1 ]]; then
    what="a $NODES-node test cluster"; nodes="node[1-$NODES]"; spool="$DIR/spool/%n"; slurmd="slurmd-%n"
  fi
  cat <<EOF
# Written by scripts/slurm/local-cluster.sh: $what; edits are overwritten.
ClusterName=maester-local
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# A requeued job waits cred_expire seconds before it may start again (default 120).
AuthInfo=cred_expire=10
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$spool
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/$slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/$slurmd.log
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
EOF
  if [[ $NODES != 1 ]]; then
    cat <<EOF
# Several nodes on one host: ports of their own, and a lost node is DOWN (its jobs NODE_FAIL, requeued when
# requeueable) 20 s after its slurmd stops answering, not SLURM's 300.
SlurmctldPort=$PORT
SlurmdTimeout=20
EOF
  elif [[ -n "${_MAESTER_SLURM_PORT:-}" ]]; then
    printf 'SlurmctldPort=%s\nSlurmdPort=%s\n' "$PORT" "$((PORT + 1))"
  fi
  cat <<EOF
$1
PartitionName=$PARTITION Nodes=$nodes Default=YES MaxTime=INFINITE State=UP
EOF
}

# Link /etc/slurm/slurm.conf to ours, so that plain SLURM commands reach this cluster. A config this script did
# not write is never replaced; one it wrote for another cluster only by the default cluster's start.
link_system_conf() {
  if [[ -e "$SYSTEM_CONF" ]] && ! { [[ -L "$SYSTEM_CONF" ]] && head -n 1 "$SYSTEM_CONF" | grep -q local-cluster.sh; }; then
    die "$SYSTEM_CONF exists and was not written by this script; not replacing it"
  fi
  if [[ -L "$SYSTEM_CONF" && "$(readlink "$SYSTEM_CONF")" != "$CONF" && "$DIR" != "$DEFAULT_DIR" ]]; then
    say "$SYSTEM_CONF is another cluster's: reach this one with SLURM_CONF=$CONF"
    return 0
  fi
  mkdir -p "$(dirname "$SYSTEM_CONF")"
  ln -sfn "$CONF" "$SYSTEM_CONF"
}

# The marked block of /etc/hosts that names this cluster's nodes (several nodes only); rewritten in place.
HOSTS_MARK="# nodes of the local cluster in $DIR (local-cluster.sh)"
remove_hosts() {
  local kept
  grep -qF "$HOSTS_MARK" "$HOSTS" 2>/dev/null || return 0
  kept="$(grep -vF "$HOSTS_MARK" "$HOSTS")"
  printf '%s\n' "$kept" >"$HOSTS"
}
write_hosts() {
  local i other
  other="$(grep -F '# nodes of the local cluster in ' "$HOSTS" | grep -vF "$HOSTS_MARK" | head -n 1 || true)"
  [[ -z "$other" ]] || die "$HOSTS already names another local cluster's nodes ($other): stop that cluster first"
  remove_hosts
  for i in $(seq 1 "$NODES"); do
    printf '%s %s %s\n' "$(node_addr "$i")" "${NAMES[i - 1]}" "$HOSTS_MARK" >>"$HOSTS"
  done
}

# The boot of a node, in its new UTS and mount namespaces: its hostname, its own /tmp and /dev/shm (with the
# paths that must stay shared bound back in), then slurmd. Arguments: node, its directory, config, shared paths.
NODE_BOOT='set -e
node=$1 root=$2 conf=$3; shift 3
hostname "$node"
mount --bind /tmp "$root/host-tmp"
mount --bind "$root/tmp" /tmp
mount --bind "$root/shm" /dev/shm
for path in "$@"; do mkdir -p "$path"; mount --bind "$root/host-tmp/${path#/tmp/}" "$path"; done
exec slurmd -f "$conf"'

# The uts namespace of a node's processes (recorded at its start), to find them all when it is lost or stopped.
node_ns_file() { echo "$DIR/run/$1.uts"; }

start_node() {
  local node="$1" root="$DIR/nodes/$1" shared=() pid
  [[ "$REPO/" != /tmp/* && "$REPO/" != /dev/shm/* ]] || shared+=("$REPO")
  mkdir -p "$root/tmp" "$root/shm" "$root/host-tmp" "$DIR/spool/$node"
  chmod 1777 "$root/tmp" "$root/shm"
  "${DAEMON_ENV[@]}" unshare --uts --mount --propagation private /bin/bash -c "$NODE_BOOT" boot "$node" "$root" \
    "$CONF" "${shared[@]}" 9>&- || { show_logs; die "slurmd of $node did not start"; }
  for _ in $(seq 1 50); do
    running "$DIR/run/slurmd-$node.pid" slurmd && break
    sleep 0.1
  done
  running "$DIR/run/slurmd-$node.pid" slurmd || { show_logs; die "slurmd of $node did not write its pid file"; }
  pid="$(cat "$DIR/run/slurmd-$node.pid")"
  readlink "/proc/$pid/ns/uts" >"$(node_ns_file "$node")"
  say "started slurmd of $node ($(node_addr "${node#node}"), hostname $(nsenter -t "$pid" -u hostname))"
}

# SIGKILL every process of node $1 (its slurmd, job steps and their processes): all that share its namespace.
kill_node_processes() {
  local ns proc pids=()
  [[ -s "$(node_ns_file "$1")" ]] || return 0
  ns="$(cat "$(node_ns_file "$1")")"
  for proc in /proc/[0-9]*; do
    [[ "$(readlink "$proc/ns/uts" 2>/dev/null)" == "$ns" ]] && pids+=("${proc#/proc/}")
  done
  [[ ${#pids[@]} == 0 ]] || { kill -KILL "${pids[@]}" 2>/dev/null || true; say "killed ${#pids[@]} process(es) of $1"; }
}

start_slurm() {
  local new="$DIR/slurm.conf.new" lines node
  lines="$(node_lines)"  # on its own line so that a failure in it stops the script
  write_config "$lines" >"$new"
  if ! cmp -s "$new" "$CONF"; then
    [[ ! -s "$CONF" ]] || stop_slurm
    mv "$new" "$CONF"
  else
    rm "$new"
  fi
  link_system_conf
  if [[ $NODES == 1 ]]; then remove_hosts; else write_hosts; fi
  if ! running "$DIR/run/slurmctld.pid" slurmctld; then
    "${DAEMON_ENV[@]}" slurmctld -f "$CONF" 9>&- || { show_logs; die "slurmctld did not start"; }
    say "started slurmctld"
  fi
  if [[ $NODES == 1 ]]; then
    if ! running "$DIR/run/slurmd.pid" slurmd; then
      "${DAEMON_ENV[@]}" slurmd -f "$CONF" 9>&- || { show_logs; die "slurmd did not start"; }
      say "started slurmd"
    fi
    return
  fi
  for node in "${NAMES[@]}"; do
    if ! running "$DIR/run/slurmd-$node.pid" slurmd; then
      kill_node_processes "$node"  # what was left of a lost node
      start_node "$node"
    fi
  done
}

# Wait until every node accepts jobs (idle, or mixed/allocated when jobs already run on it).
wait_for_nodes() {
  local node state=""
  for node in "${NAMES[@]}"; do
    for _ in $(seq 1 60); do
      state="$(sinfo -h -n "$node" -o %T 2>/dev/null || true)"
      case "$state" in
        idle|mixed|allocated|completing) break ;;
        down*|drain*) scontrol update NodeName="$node" State=RESUME >/dev/null 2>&1 || true ;;
      esac
      sleep 1
    done
    case "$state" in
      idle|mixed|allocated|completing) ;;
      *) sinfo -N -l -R >&2 || true; show_logs
         die "node $node is not up after 60 s (sinfo state: '${state:-no answer from slurmctld}')" ;;
    esac
  done
}

# Submit a job that prints each node's hostname (srun, one task a node) and wait up to 60 s for it to complete.
check_job() {
  local id state="" out expected
  id="$(sbatch --parsable --job-name=local-cluster-check --chdir="$DIR" --output="$DIR/log/check-%j.out" \
    --nodes="$NODES" --ntasks-per-node=1 --time=1 --wrap 'srun hostname')" || { show_logs; die "sbatch of the check job failed"; }
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
  expected="$(printf '%s\n' "${NAMES[@]}")"
  [[ "$(sort "$out")" == "$expected" ]] || die "check job $id completed but $out does not name the nodes ${NAMES[*]}: $(cat "$out")"
  rm "$out"
}

start() {
  local t0=$SECONDS t1
  [[ $EUID == 0 ]] || die "must run as root (it installs packages and starts system daemons)"
  if [[ $NODES != 1 && ( "$DIR/" == /tmp/* || "$DIR/" == /dev/shm/* ) ]]; then
    die "_MAESTER_SLURM_DIR=$DIR: with several nodes it must not lie under /tmp or /dev/shm, which each node has of its own"
  fi
  set_names
  mkdir -p "$DIR/state" "$DIR/spool" "$DIR/log" "$DIR/run"
  exec 9>"$DIR/lock"
  flock 9  # one start at a time: parallel test workers may call this together (daemons get 9>&-)
  install_packages
  t1=$SECONDS
  start_munge
  start_slurm
  wait_for_nodes
  check_job
  say "cluster up: node(s) ${NAMES[*]}, partition $PARTITION, config $CONF; install $((t1 - t0)) s, start and check $((SECONDS - t1)) s"
}

# Stop slurmctld and the nodes' slurmd, with every process left on a node of several.
stop_slurm() {
  local NODES NAMES node  # the cluster $CONF describes, not the one being started
  read_names
  stop_daemon "$DIR/run/slurmd.pid" slurmd
  if [[ $NODES -gt 1 ]]; then
    for node in "${NAMES[@]}"; do
      stop_daemon "$DIR/run/slurmd-$node.pid" slurmd
      kill_node_processes "$node"
      rm -f "$(node_ns_file "$node")"
    done
  fi
  stop_daemon "$DIR/run/slurmctld.pid" slurmctld
}

stop() {
  [[ $EUID == 0 ]] || die "must run as root"
  stop_slurm
  remove_hosts
  if [[ -e "$DIR/run/munged.ours" ]]; then
    stop_daemon /run/munge/munged.pid munged
    rm "$DIR/run/munged.ours"
  fi
}

kill_node() {
  local NODES NAMES
  [[ $EUID == 0 ]] || die "must run as root"
  read_names
  [[ $NODES -gt 1 && " ${NAMES[*]} " == *" $1 "* ]] || die "kill-node $1: not a node of the several-node cluster in $DIR (nodes: ${NAMES[*]:-none})"
  kill_node_processes "$1"
}

usage="usage: $0 [start [--nodes N] | stop | kill-node NODE]"
command="${1:-start}"
[[ $# == 0 ]] || shift
case "$command" in
  start)
    while [[ $# -gt 0 ]]; do
      case "$1" in
        --nodes) [[ $# -ge 2 && "$2" =~ ^[1-9][0-9]?$ ]] || die "--nodes takes a number of nodes from 1 to 99"; NODES="$2"; shift 2 ;;
        --nodes=*) [[ "${1#--nodes=}" =~ ^[1-9][0-9]?$ ]] || die "--nodes takes a number of nodes from 1 to 99"; NODES="${1#--nodes=}"; shift ;;
        *) die "$usage" ;;
      esac
    done
    start ;;
  stop) [[ $# == 0 ]] || die "$usage"; stop ;;
  kill-node) [[ $# == 1 ]] || die "$usage"; kill_node "$1" ;;
  *) die "$usage" ;;
esac
