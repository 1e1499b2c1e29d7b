#!/usr/bin/env bash
# Three Keratin nodes on loopback, each with its own data directory, in one command.
#
#   scripts/local-cluster.sh start [DIR]   # build (release) if needed, start nodes 1-3
#   scripts/local-cluster.sh stop  [DIR]   # stop the nodes this script started (by PID)
#   scripts/local-cluster.sh status [DIR]  # which of them run
#
# DIR defaults to ./keratin-cluster. Node N keeps its data in DIR/node-N, its log in
# DIR/node-N.log and its PID in DIR/node-N.pid. Addresses (all 127.0.0.1, from
# KERATIN_PORT_BASE, default 5680):
#
#   node  protocol  http   cluster
#   1     5680      5681   5690
#   2     5682      5683   5691
#   3     5684      5685   5692
#
# The nodes require logins: the first node to form the cluster creates the user `admin` and
# writes its password to DIR/node-N/admin-password. `start` waits for that file and prints
# where it is and commands that use it (the CLI reads the password from
# $KERATIN_DATA_DIR/admin-password). Then any CLI verb works against any node:
# `keratin --server 127.0.0.1:5682 queue declare q`.
# KERATIN_BIN names the binary to run (default: target/release/keratin, built if missing).
set -euo pipefail

cmd="${1:-start}"
dir="${2:-./keratin-cluster}"
root="$(cd "$(dirname "$0")/.." && pwd)"
bin="${KERATIN_BIN:-}"
base="${KERATIN_PORT_BASE:-5680}"
peers=(--peer "1=127.0.0.1:$((base + 10))" --peer "2=127.0.0.1:$((base + 11))" --peer "3=127.0.0.1:$((base + 12))")

running() {
  local pidfile="$dir/node-$1.pid"
  [[ -f "$pidfile" ]] && kill -0 "$(cat "$pidfile")" 2>/dev/null
}

case "$cmd" in
  start)
    if [[ -z "$bin" ]]; then
      target="${CARGO_TARGET_DIR:-$root/target}"
      bin="$target/release/keratin"
      if [[ ! -x "$bin" ]]; then
        (cd "$root" && cargo build --release -p keratin)
      fi
    fi
    mkdir -p "$dir"
    for n in 1 2 3; do
      if running "$n"; then
        echo "node $n already runs (pid $(cat "$dir/node-$n.pid"))"
        continue
      fi
      protocol=$((base + 2 * (n - 1)))
      http=$((protocol + 1))
      "$bin" serve --data-dir "$dir/node-$n" --node-id "$n" \
        --listen "127.0.0.1:$protocol" --http "127.0.0.1:$http" "${peers[@]}" \
        >"$dir/node-$n.log" 2>&1 &
      echo $! >"$dir/node-$n.pid"
      echo "node $n: pid $!, protocol 127.0.0.1:$protocol, http 127.0.0.1:$http, log $dir/node-$n.log"
    done
    # Ready once each node answers on its protocol port (at most 30 s).
    for n in 1 2 3; do
      protocol=$((base + 2 * (n - 1)))
      for _ in $(seq 1 300); do
        if (exec 3<>"/dev/tcp/127.0.0.1/$protocol") 2>/dev/null; then break; fi
        if ! running "$n"; then echo "node $n exited; see $dir/node-$n.log" >&2; exit 1; fi
        sleep 0.1
      done
    done
    # The node that formed the cluster writes the admin password (at most 30 s).
    password=""
    for _ in $(seq 1 300); do
      for n in 1 2 3; do
        if [[ -s "$dir/node-$n/admin-password" ]]; then password="$dir/node-$n/admin-password"; break 2; fi
      done
      sleep 0.1
    done
    echo "cluster up. Run, in one shell:"
    if [[ -n "$password" ]]; then
      data="$(cd "$(dirname "$password")" && pwd)"
      echo "(the admin password is in $data/admin-password; the CLI reads it from \$KERATIN_DATA_DIR)"
      echo "  export KERATIN_DATA_DIR=$data"
    else
      echo "(no node wrote an admin password: logins are off, or the cluster has users already)"
    fi
    echo "  $bin --server 127.0.0.1:$base cluster status"
    echo "  $bin --server 127.0.0.1:$((base + 2)) queue declare orders --partitions 3"
    echo "  $bin --server 127.0.0.1:$((base + 4)) publish orders --count 1000"
    echo "  $bin --server 127.0.0.1:$base consume orders --count 1000"
    ;;
  stop)
    for n in 1 2 3; do
      pidfile="$dir/node-$n.pid"
      if running "$n"; then
        pid="$(cat "$pidfile")"
        kill -TERM "$pid"
        for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        if kill -0 "$pid" 2>/dev/null; then kill -KILL "$pid"; fi
        echo "node $n stopped"
      fi
      rm -f "$pidfile"
    done
    ;;
  status)
    for n in 1 2 3; do
      if running "$n"; then echo "node $n: running (pid $(cat "$dir/node-$n.pid"))"; else echo "node $n: stopped"; fi
    done
    ;;
  *)
    echo "usage: $0 start|stop|status [DIR]" >&2
    exit 2
    ;;
esac
