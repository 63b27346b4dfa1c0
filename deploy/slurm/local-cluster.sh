#!/usr/bin/env bash
# A real SLURM cluster on this one machine, to try (and test) llamarl's SLURM deployment.
#
#   deploy/slurm/local-cluster.sh up [--nodes N]   install what is missing, start, wait until idle
#   deploy/slurm/local-cluster.sh status           daemons, nodes and jobs
#   deploy/slurm/local-cluster.sh down             stop exactly what `up` started, undo its files
#
# Why virtual nodes: TorchX submits an app as one heterogeneous job, a component per role
# replica, and Slurm 22.05 never places two components of one heterogeneous job on the
# same node. So `up` starts N slurmd daemons on this host (`slurmd -N llamarlK`), each a
# node of its own with its own port; the app needs at least as many nodes as replicas.
# The node names go into a marked block of /etc/hosts (TorchX hands the trainer's node name
# to the other roles as the store's host). Accounting (slurmdbd on a private MariaDB) is
# there because `torchx status` calls sacct.
#
# Needs root and Debian/Ubuntu packages (apt-get install slurm-wlm munge slurmdbd
# mariadb-server, done here when missing). State, logs and pids live in
# $LLAMARL_SLURM_STATE (default /tmp/llamarl-slurm); the configs are written to /etc/slurm,
# where the SLURM commands look for them.
set -euo pipefail

STATE=${LLAMARL_SLURM_STATE:-/tmp/llamarl-slurm}
HERE=$(cd "$(dirname "$0")" && pwd)
MARK="# llamarl local-cluster"
HOSTS_BEGIN="# llamarl-slurm begin (deploy/slurm/local-cluster.sh; removed by down)"
HOSTS_END="# llamarl-slurm end"
CTLD_PORT=${LLAMARL_SLURM_CTLD_PORT:-6817}
DBD_PORT=${LLAMARL_SLURM_DBD_PORT:-6819}
DB_PORT=${LLAMARL_SLURM_DB_PORT:-3406}
NODE_PORT0=${LLAMARL_SLURM_NODE_PORT:-17001}
NODE_PREFIX=llamarl
TIMEOUT_S=60  # every wait below gives up after this long, saying what it waited for

say() { echo "local-cluster: $*" >&2; }
die() { say "$*"; exit 1; }

usage() { sed -n '4,6p' "$0" | sed 's/^# *//' >&2; exit 2; }

# wait_for WHAT CMD...: run CMD every 0.5 s until it succeeds, for at most TIMEOUT_S.
wait_for() {
  local what=$1; shift
  local deadline=$((SECONDS + TIMEOUT_S))
  until "$@" >/dev/null 2>&1; do
    ((SECONDS < deadline)) || die "gave up after ${TIMEOUT_S}s waiting for $what (logs: $STATE/log/)"
    sleep 0.5
  done
}

# detached CMD...: CMD in the background with only descriptors 0-2 open (the redirections
# of the call), so a lock or a pipe the caller holds around `up` (a CI runner's output pipe,
# `flock`) is not held by the daemons until `down`. $! is the daemon's pid (the subshell
# execs it).
detached() {
  (
    for fd in /proc/$BASHPID/fd/*; do
      fd=${fd##*/}
      if ((fd > 2)); then eval "exec $fd>&-" 2>/dev/null || true; fi
    done
    exec "$@"
  ) &
}

# record NAME PID: `down` stops exactly these processes.
record() { echo "$1 $2" >>"$STATE/pids"; }

alive() { [[ -f $STATE/pids ]] && while read -r _ pid; do kill -0 "$pid" 2>/dev/null || return 1; done <"$STATE/pids"; }

install_missing() {
  local need=()
  command -v slurmctld >/dev/null || need+=(slurm-wlm)
  command -v munged >/dev/null || need+=(munge)
  command -v slurmdbd >/dev/null || need+=(slurmdbd)
  command -v mariadbd >/dev/null || need+=(mariadb-server)
  if ((${#need[@]})); then
    say "installing ${need[*]}"
    apt-get update -qq
    # policy-rc.d keeps the packages from starting their own daemons: `up` starts its own.
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
  fi
}

# fill TEMPLATE: the template with every @KEY@ replaced by $KEY.
fill() {
  local text; text=$(<"$HERE/$1")
  for key in STATE HOST CTLD_PORT DBD_PORT DB_PORT DB_PASS NODES NODES_COUNT NODE_PORTS CPUS MEM_MB FIRST_JOB_ID; do
    text=${text//@$key@/${!key:-}}
  done
  printf '%s\n%s\n' "$MARK" "$text"
}

hosts_without_block() {
  awk -v b="$HOSTS_BEGIN" -v e="$HOSTS_END" '$0 == b {skip = 1} !skip {print} $0 == e {skip = 0}' /etc/hosts
}

write_hosts_block() {
  local names=$1 kept
  kept=$(hosts_without_block)
  # /etc/hosts is often a bind mount: rewrite it in place, never rename over it.
  printf '%s\n%s\n127.0.0.1 %s\n%s\n' "$kept" "$HOSTS_BEGIN" "$names" "$HOSTS_END" >/etc/hosts
}

remove_hosts_block() {
  grep -qxF "$HOSTS_BEGIN" /etc/hosts || return 0
  local kept; kept=$(hosts_without_block)
  printf '%s\n' "$kept" >/etc/hosts
}

ours() { [[ ! -e $1 ]] || head -1 "$1" | grep -qxF "$MARK"; }

up() {
  local nodes=4
  while (($#)); do
    case $1 in
      --nodes) nodes=${2:?--nodes needs a number}; shift 2 ;;
      *) usage ;;
    esac
  done
  [[ $nodes =~ ^[1-9][0-9]*$ ]] || die "--nodes must be a positive number, got '$nodes'"
  ((EUID == 0)) || die "needs root (it installs packages and writes /etc/slurm, /etc/hosts)"
  if alive; then
    say "already up (state in $STATE); 'down' first to change it"
    status
    return 0
  fi
  if [[ -f $STATE/pids ]]; then
    # A run that was killed before its `down` (a CI job cut off) leaves its state behind:
    # stop exactly what it recorded and undo its files, then start afresh.
    say "a previous cluster is half up ($STATE/pids): taking it down first"
    down
  fi
  for f in /etc/slurm/slurm.conf /etc/slurm/slurmdbd.conf; do
    ours "$f" || die "$f exists and was not written by this script: another SLURM setup; not touching it"
  done
  install_missing
  local t0=$SECONDS

  HOST=$(hostname -s)
  CPUS=$(nproc)
  MEM_MB=$(($(awk '/^MemAvailable:/ {print $2}' /proc/meminfo) / 1024))
  NODES_COUNT=$nodes
  NODES="$NODE_PREFIX[1-$nodes]"
  NODE_PORTS="[$NODE_PORT0-$((NODE_PORT0 + nodes - 1))]"
  # Seconds since 2026-01-01 (below Slurm's largest job id, 67108863, for two years; then
  # it wraps): job ids, which are llamarl's run ids, do not repeat from one `up` to the next.
  FIRST_JOB_ID=$(( ($(date +%s) - 1767225600) % 60000000 + 1000 ))
  DB_PASS=$(head -c 18 /dev/urandom | base64 | tr -d '/+=')

  mkdir -p "$STATE"/{ctld,spool,run,log}
  # Traversable (MariaDB runs as mysql), not listable; its own files are in db/, mysql's.
  chmod 711 "$STATE"
  : >"$STATE/pids"
  echo "$nodes" >"$STATE/nodes"

  # munge: the key comes with the package; reuse a munged that is already running.
  if ! munge -n </dev/null >/dev/null 2>&1; then
    install -d -o munge -g munge -m 0755 /run/munge
    install -d -o munge -g munge -m 0700 /var/lib/munge /var/log/munge
    detached setpriv --reuid=munge --regid=munge --init-groups /usr/sbin/munged -F >>"$STATE/log/munged.log" 2>&1
    record munged $!
    wait_for munged munge -n
  fi

  # MariaDB for slurmdbd: a private data directory, socket and port.
  fill mariadb.cnf >"$STATE/mariadb.cnf"
  if [[ ! -d $STATE/db/data ]]; then
    install -d -o mysql -g mysql -m 0700 "$STATE/db" "$STATE/db/data"
    mariadb-install-db --defaults-file="$STATE/mariadb.cnf" --skip-test-db >>"$STATE/log/mariadb-install.log" 2>&1 \
      || die "mariadb-install-db failed (see $STATE/log/mariadb-install.log)"
  fi
  detached mariadbd --defaults-file="$STATE/mariadb.cnf" >>"$STATE/log/mariadb.out" 2>&1
  record mariadbd $!
  local sql=(mariadb --no-defaults --socket="$STATE/db/mysqld.sock" -uroot)
  wait_for MariaDB "${sql[@]}" -e "SELECT 1"
  "${sql[@]}" -e "CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1';
    ALTER USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$DB_PASS';
    GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';"

  mkdir -p /etc/slurm
  (umask 077 && fill slurmdbd.conf >/etc/slurm/slurmdbd.conf)
  fill slurm.conf >/etc/slurm/slurm.conf
  write_hosts_block "$(seq -f "$NODE_PREFIX%g" -s ' ' 1 "$nodes")"

  detached slurmdbd -D >>"$STATE/log/slurmdbd.out" 2>&1
  record slurmdbd $!
  wait_for slurmdbd sacctmgr -n list cluster
  detached slurmctld -D -i >>"$STATE/log/slurmctld.out" 2>&1
  record slurmctld $!
  wait_for slurmctld scontrol ping
  for k in $(seq 1 "$nodes"); do
    detached slurmd -D -N "$NODE_PREFIX$k" >>"$STATE/log/slurmd-$NODE_PREFIX$k.out" 2>&1
    record "slurmd-$NODE_PREFIX$k" $!
  done
  wait_for "$nodes idle nodes" all_idle "$nodes"
  # sacct answers once slurmctld has registered the cluster with slurmdbd.
  wait_for "the cluster in slurmdbd" sh -c "sacctmgr -n -P list cluster format=cluster | grep -qx llamarl"
  say "up in $((SECONDS - t0)) s: $nodes nodes ($NODES, $CPUS CPUs and $MEM_MB MB each), partition debug"
}

all_idle() { [[ $(sinfo -h -N -t idle -o %N | sort -u | wc -l) -eq $1 ]]; }

status() {
  if [[ ! -f $STATE/pids ]]; then echo "down"; return 0; fi
  while read -r name pid; do
    if kill -0 "$pid" 2>/dev/null; then echo "$name $pid running"; else echo "$name $pid GONE"; fi
  done <"$STATE/pids"
  sinfo 2>&1 || true
  squeue 2>&1 || true
}

down() {
  if [[ -f $STATE/pids ]]; then
    # Jobs first: their processes belong to no recorded pid, and slurmd must still be
    # there to end them.
    if command -v scancel >/dev/null && scontrol ping >/dev/null 2>&1; then
      scancel --full --quiet --user="$(id -un)" 2>/dev/null || true
      local deadline=$((SECONDS + TIMEOUT_S))
      while [[ -n $(squeue -h -o %i 2>/dev/null) ]] && ((SECONDS < deadline)); do sleep 0.5; done
    fi
    # Then the daemons: SIGTERM to each, SIGKILL to those still there after 20 s.
    local pids=()
    while read -r name pid; do
      # Only if the pid is still that daemon (a pid is reused once its process is gone).
      [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "${name%%-*}" ]] || continue
      kill -TERM "$pid" 2>/dev/null && pids+=("$pid")
    done <"$STATE/pids"
    local deadline=$((SECONDS + 20)) pid
    for pid in "${pids[@]}"; do
      while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.2; done
      if kill -0 "$pid" 2>/dev/null; then
        say "pid $pid ignored SIGTERM for 20 s: SIGKILL"
        kill -KILL "$pid" 2>/dev/null || true
      fi
    done
  fi
  for f in /etc/slurm/slurm.conf /etc/slurm/slurmdbd.conf; do
    if [[ -e $f ]] && ours "$f"; then rm -f "$f"; fi
  done
  remove_hosts_block
  rm -rf "$STATE"
  say "down"
}

case ${1:-} in
  up) shift; up "$@" ;;
  down) down ;;
  status) status ;;
  *) usage ;;
esac
