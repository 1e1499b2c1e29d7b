#!/usr/bin/env bash
# bench/cluster.sh: three-node clusters on loopback for the replicated comparison (issue 14).
# `MODE=cluster bash bench/compare.sh` installs the peers, builds keratin-bench and runs this
# file as `bench/cluster.sh run`; `keratin-bench compare-cluster` calls it back as
# `bench/cluster.sh ctl VERB ...` to kill-and-restart nodes in its failover case.
#
# What it starts (recipe and pitfalls: docs/peers.md), all on 127.0.0.1,
# on ports of its own (the single-node comparison uses 25673/25674, 24223 and 25680/25681):
# - RabbitMQ rabbit{1,2,3}@localhost: AMQP 25701-25703, distribution 25711-25713, and an epmd
#   of its own on 24370 (ERL_EPMD_PORT), so that neither another epmd nor a cleanup elsewhere
#   can take it away; one cookie in a HOME shared by the servers and rabbitmqctl.
# - NATS n1..n3 (cluster "kbench"): clients 24231-24233, routes 26231-26233, monitoring
#   28231-28233 (/healthz), JetStream file store each.
# - Keratin nodes 1..3 (`keratin serve --node-id N --peer ...`, the release binary KERATIN_BIN):
#   clients 25721-25723, HTTP admin 25731-25733, cluster transport 25741-25743, a data
#   directory each. (keratin-single, the one-node column, is started by keratin-bench itself.)
# State lives under CLUSTER_BASE (a fresh directory under BENCH_DIR); every process started is
# recorded in a pid file there, and the exit trap stops them by those pids (TERM, then KILL after
# STOP_WAIT_S), also on failure and Ctrl-C, then removes CLUSTER_BASE. Servers run in sessions
# of their own (setsid), so a Ctrl-C reaches the script and its trap, not the brokers; they are
# started from subshells, so no `wait` of this script ever waits on a server.
#
# ctl verbs (CLUSTER_BASE in the environment, as `run` exports it):
#   pid SYSTEM N          the process id to kill -9 for node N (RabbitMQ: the beam; NATS and
#                         Keratin: the server)
#   restart SYSTEM N      start node N again on its data; returns once it is back in the cluster
#                         (Keratin: it serves, knows the metadata leader and a leader for every
#                         partition it holds)
#   leader SYSTEM QUEUE   RabbitMQ only: `list_queues name leader members online` from a live node
#   nodes SYSTEM          the client address of each node, one a line
# SYSTEM is keratin-cluster, rabbitmq-quorum or nats-r3.
#
# Settings (environment, from compare.sh): ROUNDS (2), SECONDS_PER_RUN (3), CLUSTER_BACKLOG
# (50000), CLUSTER_SYSTEMS (keratin-cluster,keratin-single,rabbitmq-quorum,nats-r3; only the
# clusters named are started), CLUSTER_CASES (publish,publish-3,publish-3p,publish-3p-3,consume,latency,failover), WRITE_DOCS (1),
# KERATIN_BIN (the release `keratin`, needed for keratin-cluster).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
SELF=$ROOT/bench/cluster.sh
RABBIT_BIN=/usr/lib/rabbitmq/bin/rabbitmq-server
# Not /usr/sbin/rabbitmqctl: as root that wrapper runs `su rabbitmq`, another HOME and cookie.
CTL=/usr/lib/rabbitmq/bin/rabbitmqctl
EPMD_PORT=24370
AMQP_BASE=25700
DIST_BASE=25710
NATS_BASE=24230
ROUTE_BASE=26230
MONITOR_BASE=28230
KERATIN_BASE=25720
KERATIN_HTTP_BASE=25730
KERATIN_PEER_BASE=25740
STOP_WAIT_S=${STOP_WAIT_S:-15}
# How long a node gets to boot, or to be back in its cluster after a restart.
BOOT_TIMEOUT_S=${BOOT_TIMEOUT_S:-120}

say() { printf 'cluster.sh: %s\n' "$*" >&2; }
die() { say "$*"; exit 1; }

# The Erlang side: one cookie for servers and CLI, epmd on loopback on our own port.
erlang_env() {
    export HOME=$CLUSTER_BASE/rmq-home ERL_EPMD_ADDRESS=127.0.0.1 ERL_EPMD_PORT=$EPMD_PORT
    export RABBITMQ_CTL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}"
}

# alive PID: the process exists and is not a zombie (PID 1 here reaps orphans late, and
# `kill -0` succeeds on a zombie).
alive() {
    local state
    state=$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null) || return 1
    [ -n "$state" ] && [ "$state" != Z ]
}

ctl_rabbit() { local n=$1; shift; timeout 60 "$CTL" -n "rabbit$n@localhost" "$@"; }

# --- nodes ----------------------------------------------------------------------------------------
start_epmd() {
    erlang_env
    (
        setsid epmd -port "$EPMD_PORT" -address 127.0.0.1 </dev/null >"$CLUSTER_BASE/epmd.log" 2>&1 &
        echo $! >"$CLUSTER_BASE/epmd.pid"
    )
    local i
    for i in $(seq 1 50); do
        (exec 3<>/dev/tcp/127.0.0.1/$EPMD_PORT) 2>/dev/null && return 0
        sleep 0.1
    done
    die "epmd did not listen on 127.0.0.1:$EPMD_PORT"
}

# rabbit_start N: node N in the background, its beam pid in rabbitN/pid once it boots.
rabbit_start() {
    local n=$1 d=$CLUSTER_BASE/rabbit$1
    mkdir -p "$d"
    [ -f "$d/enabled_plugins" ] || echo '[].' >"$d/enabled_plugins"
    printf 'loopback_users.guest = true\ndisk_free_limit.absolute = 50000000\n' >"$d/rabbitmq.conf"
    rm -f "$d/pid"
    (
        erlang_env
        export RABBITMQ_NODENAME=rabbit$n@localhost RABBITMQ_NODE_IP_ADDRESS=127.0.0.1 \
            RABBITMQ_NODE_PORT=$((AMQP_BASE + n)) RABBITMQ_DIST_PORT=$((DIST_BASE + n)) \
            RABBITMQ_BASE=$d RABBITMQ_MNESIA_BASE=$d/mnesia RABBITMQ_LOG_BASE=$d/log \
            RABBITMQ_CONFIG_FILE=$d/rabbitmq.conf RABBITMQ_ENABLED_PLUGINS_FILE=$d/enabled_plugins \
            RABBITMQ_PID_FILE=$d/pid \
            RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}"
        setsid "$RABBIT_BIN" >>"$d/stdout.log" 2>&1 </dev/null &
        echo $! >"$d/wrapper.pid"
    )
}

rabbit_wait() {
    local n=$1
    erlang_env
    timeout "$BOOT_TIMEOUT_S" "$CTL" -n "rabbit$n@localhost" wait "$CLUSTER_BASE/rabbit$n/pid" >/dev/null 2>&1 ||
        die "rabbit$n did not boot within $BOOT_TIMEOUT_S s (log: $CLUSTER_BASE/rabbit$n/log)"
}

# nats_start N: node N in the background, routes to the other two.
nats_start() {
    local n=$1 d=$CLUSTER_BASE/nats$1 routes="" m
    mkdir -p "$d/js"
    for m in 1 2 3; do
        [ "$m" = "$n" ] || routes="$routes${routes:+, }nats-route://127.0.0.1:$((ROUTE_BASE + m))"
    done
    # No `sync_interval`: nats-server 2.9.10 refuses the field ("unknown field"); its file store
    # syncs on its own timer (2 min), not before an ack.
    cat >"$d/nats.conf" <<EOF
server_name: n$n
listen: 127.0.0.1:$((NATS_BASE + n))
http: 127.0.0.1:$((MONITOR_BASE + n))
jetstream { store_dir: "$d/js" }
cluster { name: kbench, listen: 127.0.0.1:$((ROUTE_BASE + n)), routes: [ $routes ] }
EOF
    (
        setsid nats-server -c "$d/nats.conf" >>"$d/server.log" 2>&1 </dev/null &
        echo $! >"$d/pid"
    )
}

# nats_wait N: node N answers /healthz with ok (JetStream up and current with the meta group).
nats_wait() {
    local n=$1 i
    for i in $(seq 1 $((BOOT_TIMEOUT_S * 5))); do
        if curl -fsS -m 1 "http://127.0.0.1:$((MONITOR_BASE + n))/healthz" 2>/dev/null | grep -q '"ok"'; then
            return 0
        fi
        sleep 0.2
    done
    die "nats n$n was not healthy within $BOOT_TIMEOUT_S s (log: $CLUSTER_BASE/nats$n/server.log)"
}

# keratin_start N: node N in the background, peers 1..3, its pid in keratinN/pid.
keratin_start() {
    local n=$1 d=$CLUSTER_BASE/keratin$1 peers=() m
    [ -x "${KERATIN_BIN:-}" ] || die "KERATIN_BIN (${KERATIN_BIN:-unset}) is not an executable keratin"
    mkdir -p "$d/data"
    for m in 1 2 3; do peers+=(--peer "$m=127.0.0.1:$((KERATIN_PEER_BASE + m))"); done
    # No logins: the benchmark measures the data path (RabbitMQ runs with its guest login,
    # NATS without any); keratin-bench auth measures logins.
    (
        KERATIN_SERVER__AUTH=none setsid "$KERATIN_BIN" serve --node-id "$n" --listen "127.0.0.1:$((KERATIN_BASE + n))" \
            --http "127.0.0.1:$((KERATIN_HTTP_BASE + n))" "${peers[@]}" --data-dir "$d/data" \
            >>"$d/server.log" 2>&1 </dev/null &
        echo $! >"$d/pid"
    )
}

# keratin_wait N: node N serves (its HTTP admin answers GET /api/v1/cluster), knows the
# metadata group's leader, and knows a leader for every partition it holds.
keratin_wait() {
    local n=$1 i doc pid
    pid=$(cat "$CLUSTER_BASE/keratin$n/pid")
    for i in $(seq 1 $((BOOT_TIMEOUT_S * 5))); do
        alive "$pid" || die "keratin node $n exited (log: $CLUSTER_BASE/keratin$n/server.log)"
        if doc=$(curl -fsS -m 1 "http://127.0.0.1:$((KERATIN_HTTP_BASE + n))/api/v1/cluster" 2>/dev/null) &&
            grep -q '"meta_leader":[0-9]' <<<"$doc" && ! grep -q '"leader":null' <<<"$doc"; then
            return 0
        fi
        sleep 0.2
    done
    die "keratin node $n did not serve with its leaders known within $BOOT_TIMEOUT_S s (log: $CLUSTER_BASE/keratin$n/server.log)"
}

keratin_cluster_up() {
    local n
    for n in 1 2 3; do keratin_start "$n"; done
    for n in 1 2 3; do keratin_wait "$n"; done
    say "Keratin: $(curl -fsS -m 1 "http://127.0.0.1:$((KERATIN_HTTP_BASE + 1))/api/v1/cluster" | grep -o '"meta_leader":[0-9]*' | head -1)"
}

rabbit_cluster_up() {
    local n
    start_epmd
    for n in 1 2 3; do rabbit_start "$n"; done
    for n in 1 2 3; do rabbit_wait "$n"; done
    for n in 2 3; do
        ctl_rabbit "$n" stop_app >/dev/null
        ctl_rabbit "$n" reset >/dev/null
        # Prints a harmless "Failed to create a tracked connection table ... node_not_running".
        ctl_rabbit "$n" join_cluster rabbit1@localhost >/dev/null 2>&1
        ctl_rabbit "$n" start_app >/dev/null
    done
    ctl_rabbit 1 await_online_nodes 3 >/dev/null || die "the RabbitMQ cluster did not reach 3 nodes"
    say "RabbitMQ: $(ctl_rabbit 1 cluster_status --formatter json | grep -o '"running_nodes":\[[^]]*\]')"
}

nats_cluster_up() {
    local n
    for n in 1 2 3; do nats_start "$n"; done
    for n in 1 2 3; do nats_wait "$n"; done
    say "NATS: $(grep -h 'JetStream cluster new metadata leader' "$CLUSTER_BASE"/nats?/server.log | tail -1 | sed 's/.*\] //')"
}

# stop_pid PID: TERM, KILL after STOP_WAIT_S; a zombie counts as gone.
stop_pid() {
    local pid=$1 i
    alive "$pid" || return 0
    kill -TERM "$pid" 2>/dev/null || return 0
    for i in $(seq 1 $((STOP_WAIT_S * 10))); do
        alive "$pid" || return 0
        sleep 0.1
    done
    kill -KILL "$pid" 2>/dev/null || true
}

# Every process this run started, from the pid files: servers first, epmd last.
stop_everything() {
    local f pid stops=()
    [ -n "${CLUSTER_BASE:-}" ] && [ -d "$CLUSTER_BASE" ] || return 0
    for f in "$CLUSTER_BASE"/rabbit?/pid "$CLUSTER_BASE"/nats?/pid "$CLUSTER_BASE"/keratin?/pid; do
        if [ -f "$f" ] && pid=$(cat "$f") && [ -n "$pid" ]; then
            stop_pid "$pid" &
            stops+=($!)
        fi
    done
    # The parallel stops only: the servers are no children of this shell (started in subshells).
    for pid in "${stops[@]}"; do wait "$pid" 2>/dev/null || true; done
    for f in "$CLUSTER_BASE"/rabbit?/wrapper.pid "$CLUSTER_BASE"/epmd.pid; do
        [ -f "$f" ] && pid=$(cat "$f") && [ -n "$pid" ] && stop_pid "$pid"
    done
    return 0
}

# --- the hook of keratin-bench compare-cluster -------------------------------------------------
check_system() {
    case $1 in
    keratin-cluster | rabbitmq-quorum | nats-r3) ;;
    *) die "unknown system $1; use keratin-cluster, rabbitmq-quorum or nats-r3" ;;
    esac
}

ctl() {
    [ -n "${CLUSTER_BASE:-}" ] && [ -d "$CLUSTER_BASE" ] || die "ctl: CLUSTER_BASE is not set to the run's directory"
    local verb=${1:-} system=${2:-} n=${3:-}
    check_system "$system"
    case $verb in
    pid)
        case $system in
        rabbitmq-quorum) cat "$CLUSTER_BASE/rabbit$n/pid" ;;
        nats-r3) cat "$CLUSTER_BASE/nats$n/pid" ;;
        keratin-cluster) cat "$CLUSTER_BASE/keratin$n/pid" ;;
        esac
        ;;
    restart)
        case $system in
        rabbitmq-quorum)
            rabbit_start "$n"
            rabbit_wait "$n"
            ctl_rabbit "$n" await_online_nodes 3 >/dev/null || die "rabbit$n did not rejoin"
            ;;
        nats-r3)
            nats_start "$n"
            nats_wait "$n"
            ;;
        keratin-cluster)
            keratin_start "$n"
            keratin_wait "$n"
            ;;
        esac
        ;;
    leader)
        [ "$system" = rabbitmq-quorum ] || die "leader: only for rabbitmq-quorum (NATS names its leader in stream info)"
        local queue=$3 m pid
        erlang_env
        for m in 1 2 3; do
            pid=$(cat "$CLUSTER_BASE/rabbit$m/pid" 2>/dev/null) || continue
            alive "$pid" || continue
            if ctl_rabbit "$m" list_queues name leader members online -q --no-table-headers 2>/dev/null |
                grep -F "$queue"; then
                return 0
            fi
        done
        die "leader: no live node lists queue $queue"
        ;;
    nodes)
        for m in 1 2 3; do
            case $system in
            rabbitmq-quorum) echo "amqp://guest:guest@127.0.0.1:$((AMQP_BASE + m))/%2f" ;;
            nats-r3) echo "nats://127.0.0.1:$((NATS_BASE + m))" ;;
            keratin-cluster) echo "127.0.0.1:$((KERATIN_BASE + m))" ;;
            esac
        done
        ;;
    *) die "unknown verb $verb; use pid, restart, leader or nodes" ;;
    esac
}

# --- the run -----------------------------------------------------------------------------------
run() {
    local bench=${BENCH:?BENCH: the keratin-bench binary} bench_dir=${BENCH_DIR:-/var/tmp}
    local rounds=${ROUNDS:-2} seconds=${SECONDS_PER_RUN:-3} backlog=${CLUSTER_BACKLOG:-50000}
    local systems=${CLUSTER_SYSTEMS:-keratin-cluster,keratin-single,rabbitmq-quorum,nats-r3}
    local cases=${CLUSTER_CASES:-publish,publish-3,publish-3p,publish-3p-3,consume,latency,failover}
    CLUSTER_BASE=$(mktemp -d "$bench_dir/keratin-cluster.XXXXXX")
    export CLUSTER_BASE
    trap 'stop_everything; rm -rf "$CLUSTER_BASE"' EXIT
    trap 'exit 130' INT TERM
    mkdir -p "$CLUSTER_BASE/rmq-home"
    head -c32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$CLUSTER_BASE/rmq-home/.erlang.cookie"
    chmod 400 "$CLUSTER_BASE/rmq-home/.erlang.cookie"

    # Only the clusters named are started (CLUSTER_SYSTEMS=keratin-cluster runs Keratin alone).
    local has=",$systems,"
    say "starting the clusters of $systems in $CLUSTER_BASE"
    # NATS and Keratin boot in a second; start them while the Erlang nodes boot.
    [[ $has == *,nats-r3,* ]] && nats_cluster_up
    [[ $has == *,keratin-cluster,* ]] && keratin_cluster_up
    [[ $has == *,rabbitmq-quorum,* ]] && rabbit_cluster_up

    local out=$CLUSTER_BASE/cluster.md load_before
    load_before=$(cut -d' ' -f1-3 /proc/loadavg)
    say "running $cases on $systems, $rounds rounds of $seconds s"
    "$bench" compare-cluster --systems "$systems" --cases "$cases" --rounds "$rounds" \
        --seconds "$seconds" --backlog "$backlog" \
        --amqp-nodes "$(ctl nodes rabbitmq-quorum | paste -sd,)" \
        --nats-nodes "$(ctl nodes nats-r3 | paste -sd,)" \
        --keratin-nodes "$(ctl nodes keratin-cluster | paste -sd,)" --dir "$CLUSTER_BASE" \
        --ctl "bash $SELF ctl" --out "$out"

    if [ "${WRITE_DOCS:-1}" = 1 ]; then
        local section=$CLUSTER_BASE/section.md
        {
            echo "Recorded by \`MODE=cluster bash bench/compare.sh\` (ROUNDS=$rounds SECONDS_PER_RUN=$seconds"
            echo "CLUSTER_BACKLOG=$backlog) on $(date -u '+%Y-%m-%d %H:%M UTC'), commit ${COMMIT:-unknown}."
            echo "Machine: $(nproc) cores ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')),"
            echo "$(awk '/MemTotal/ {printf "%.0f GiB", $2 / 1048576}' /proc/meminfo), kernel $(uname -r), data on"
            echo "$(df -T "$bench_dir" | awk 'NR == 2 {print $2 " (" $1 ")"}'); the 3 nodes of each cluster, the load generator"
            echo "and other engineers' builds shared the cores (load average before: $load_before; after: $(cut -d' ' -f1-3 /proc/loadavg))."
            echo "Keratin: the release \`keratin serve\` of this commit (3 nodes, replicas 3); keratin-single is"
            echo "one node started by keratin-bench (\`compare-node\`: the same server on a counting Io)."
            echo "Peers: RabbitMQ $(dpkg-query -W -f '${Version}' rabbitmq-server 2>/dev/null || echo unknown) (Debian),"
            echo "$(nats-server --version 2>/dev/null || echo 'nats-server unknown') (Debian); clients lapin 2, async-nats 0.38."
            echo
            cat "$out"
        } >"$section"
        # Markers of the run with Keratin; the peers-only section before it keeps its own.
        local docs=$ROOT/docs/benchmarks.md begin='<!-- compare.sh cluster keratin: begin -->' end='<!-- compare.sh cluster keratin: end -->'
        if ! grep -qF "$begin" "$docs"; then
            printf '\n## Replicated: issue 14, the Keratin cluster against the peers\n\n%s\n%s\n' "$begin" "$end" >>"$docs"
        fi
        SECTION=$section BEGIN=$begin END=$end perl -0pi -e '
            open my $f, "<", $ENV{SECTION} or die "read $ENV{SECTION}: $!";
            local $/; my $s = <$f>;
            s/\Q$ENV{BEGIN}\E.*?\Q$ENV{END}\E/$ENV{BEGIN}\n$s$ENV{END}/s;
        ' "$docs"
        say "written into $docs"
    fi
}

case ${1:-} in
run) run ;;
ctl) shift && ctl "$@" ;;
up)
    # Bring the clusters up (Keratin's when KERATIN_BIN is set) and keep them until Ctrl-C (for trying the harness by hand).
    CLUSTER_BASE=$(mktemp -d "${BENCH_DIR:-/var/tmp}/keratin-cluster.XXXXXX")
    export CLUSTER_BASE
    trap 'stop_everything; rm -rf "$CLUSTER_BASE"' EXIT
    trap 'exit 130' INT TERM
    mkdir -p "$CLUSTER_BASE/rmq-home"
    head -c32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$CLUSTER_BASE/rmq-home/.erlang.cookie"
    chmod 400 "$CLUSTER_BASE/rmq-home/.erlang.cookie"
    nats_cluster_up
    if [ -n "${KERATIN_BIN:-}" ]; then keratin_cluster_up; fi
    rabbit_cluster_up
    say "up; CLUSTER_BASE=$CLUSTER_BASE; Ctrl-C (or kill $$) stops everything"
    while :; do sleep 1; done
    ;;
*) die "usage: bench/cluster.sh run | up | ctl VERB SYSTEM ARGS" ;;
esac
