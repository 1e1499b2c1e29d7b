#!/usr/bin/env bash
# bench/compare.sh: Keratin side by side with RabbitMQ (classic and quorum queues), NATS
# JetStream and the raw disk, on this machine, in one run (issue 9).
#
# - Installs rabbitmq-server and nats-server from Debian when missing (apt-get; root).
# - Starts each broker on 127.0.0.1 from its binary, with its data in a temporary folder (not the
#   system service), runs `keratin-bench compare` (which starts Keratin itself, as a child
#   process in its default durable mode), and stops what it started, by PID, on exit.
# - Fill scenario (root): a 256 MiB tmpfs per broker, each broker restarted on its own with
#   comparable limits, unmounted at the end.
# - Prints one table of figures and ratios (Keratin / peer) and writes it into
#   docs/benchmarks.md, between the issue 9 markers, with date, commit and machine.
#
# MODE=idle runs the many-queues comparison of issue 13 instead (see "idle queues" below):
# per system, a fresh broker; QUEUES (10000) durable queues declared (declare rate); disk used
# (du of its data dir), resident memory and OS threads; the broker stopped and started again,
# and the time until every queue answers; for Keratin (the release `keratin` binary), confirmed
# publish of 4 producers spread over SPREAD (1000) queues vs 4 queues. KERATIN_QUEUES (QUEUES)
# caps Keratin's count alone (a build whose idle queues hold 64 MiB each cannot hold 10,000);
# IDLE_SYSTEMS (keratin,rabbitmq-classic,rabbitmq-quorum,nats), CONCURRENCY (16 declares in
# flight), RESTART_TIMEOUT_S (1200: how long a restarted broker gets until every queue
# answers). Written into docs/benchmarks.md between the issue 13 markers.
#
# MODE=cluster runs the replicated comparison of issue 14 instead: bench/cluster.sh starts a
# 3-node Keratin cluster (replicas 3), a 3-node RabbitMQ cluster (quorum queue) and a 3-node NATS
# cluster (R3 stream) on loopback, on ports of their own, and runs `keratin-bench
# compare-cluster` (confirmed publish, consume + ack, confirm latency at 5,000/s, leader failover
# by kill -9), with a single Keratin node in the same run. SECONDS_PER_RUN defaults to 3 there,
# CLUSTER_BACKLOG (50000), CLUSTER_SYSTEMS, CLUSTER_CASES: see bench/cluster.sh. Written into
# docs/benchmarks.md between the issue 14 cluster-with-Keratin markers.
#
# MODE=python runs the Python clients' comparison of issue 17 instead: the release `keratin serve`
# (the matrix's settings), RabbitMQ and nats-server as below, and bench/python/compare.py
# (keratin-client from clients/python against aio-pika on a quorum queue and nats-py on a
# JetStream stream; confirmed publish and consume + ack), installing the Python packages it needs
# from PyPI. PY_ROUNDS (3), PY_SECONDS (5), PY_BACKLOG (20000), PY_CONCURRENCY (256). Written
# into docs/benchmarks.md between the issue 17 markers.
#
# MODE=stream runs the streams benchmark of issue 18 instead: nats-server with JetStream as
# below (only it is installed, not RabbitMQ) and `keratin-bench stream` (which starts Keratin
# as a child process, with the matrix's disk levels): confirmed publish of a STREAM_GIB (1) GiB
# stream of 1 KiB messages, 1000 in flight, into a Keratin stream vs a JetStream stream with
# limits retention (file storage); the whole stream read from `first` by 1 and by 3 concurrent
# readers vs NATS ordered push consumers; the 1-reader read vs a raw `pread` of a file of the
# same size on BENCH_DIR; each read cold (page cache dropped before it; root) and warm;
# then Keratin's peak VmRSS while 10 readers read a STREAM_RSS_GIB (10; 0 skips it) GiB
# stream from spread positions, for at most STREAM_RSS_SECONDS (60). ROUNDS rounds (Keratin,
# NATS, raw in turn), medians. Written into docs/benchmarks.md between the issue 18 markers.
# Disk: up to STREAM_RSS_GIB + 2 × STREAM_GIB GiB on BENCH_DIR at once, removed at the end.
#
# Settings (environment): ROUNDS (2), SECONDS_PER_RUN (5), RSS_MESSAGES (1000000),
# BACKLOG (200000), CASES (publish,producers,consume,latency), RSS (1; 0 skips the memory
# case), FILL (1; 0 skips it),
# BENCH_DIR (/var/tmp: the file system under test), WRITE_DOCS (1; 0 only prints),
# CARGO_TARGET_DIR (where the release build goes).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
ROUNDS=${ROUNDS:-2}
# The cluster run's cases are shorter by default: 3 brokers each, on the same cores.
CLUSTER_SECONDS=${SECONDS_PER_RUN:-3}
SECONDS_PER_RUN=${SECONDS_PER_RUN:-5}
RSS_MESSAGES=${RSS_MESSAGES:-1000000}
BACKLOG=${BACKLOG:-200000}
CASES=${CASES:-publish,producers,consume,latency}
RSS=${RSS:-1}
FILL=${FILL:-1}
BENCH_DIR=${BENCH_DIR:-/var/tmp}
WRITE_DOCS=${WRITE_DOCS:-1}
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
MODE=${MODE:-matrix}
QUEUES=${QUEUES:-10000}
KERATIN_QUEUES=${KERATIN_QUEUES:-$QUEUES}
IDLE_SYSTEMS=${IDLE_SYSTEMS:-keratin,rabbitmq-classic,rabbitmq-quorum,nats}
CONCURRENCY=${CONCURRENCY:-16}
SPREAD=${SPREAD:-1000}
# Seconds after a restart until every queue must answer (RabbitMQ with 10,000 quorum queues did
# not come back in 19 minutes: cap the wait).
RESTART_TIMEOUT_S=${RESTART_TIMEOUT_S:-1200}
# Seconds a broker gets to stop on SIGTERM before it is killed (10,000 queues take a while).
STOP_WAIT_S=${STOP_WAIT_S:-30}
KERATIN_PORT=25680
AMQP_PORT=25673
NATS_PORT=24223
RABBIT_BIN=/usr/lib/rabbitmq/bin/rabbitmq-server
# Fill scenario: levels as fractions of the 256 MiB file system. RabbitMQ blocks publishers
# below disk_free_limit; NATS refuses once JetStream holds max_file_store; Keratin refuses at
# hard (free below 20 %) and keeps its reserve (5 %) for writes that free space.
FILL_MIB=256
FILL_HARD_FREE_BYTES=$((FILL_MIB * 1024 * 1024 / 5))
FILL_NATS_STORE_BYTES=$((FILL_MIB * 1024 * 1024 - FILL_HARD_FREE_BYTES))

say() { printf 'compare.sh: %s\n' "$*" >&2; }
die() { say "$*"; exit 1; }

# --- peers installed? ---------------------------------------------------------------------------
if [ "$MODE" = stream ]; then
    # Streams are compared with NATS JetStream alone: RabbitMQ is not needed.
    if ! command -v nats-server >/dev/null; then
        [ "$(id -u)" = 0 ] || die "nats-server is missing; run as root to install it (apt-get)"
        say "installing nats-server from Debian"
        export DEBIAN_FRONTEND=noninteractive
        apt-get install -y --no-install-recommends nats-server >/dev/null ||
            { apt-get update >/dev/null && apt-get install -y --no-install-recommends nats-server >/dev/null; } ||
            die "apt-get could not install nats-server"
    fi
elif [ ! -x "$RABBIT_BIN" ] || ! command -v nats-server >/dev/null; then
    [ "$(id -u)" = 0 ] || die "rabbitmq-server or nats-server is missing; run as root to install them (apt-get)"
    say "installing rabbitmq-server and nats-server from Debian"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y --no-install-recommends rabbitmq-server nats-server >/dev/null ||
        { apt-get update >/dev/null && apt-get install -y --no-install-recommends rabbitmq-server nats-server >/dev/null; } ||
        die "apt-get could not install rabbitmq-server and nats-server"
fi
[ "$MODE" = stream ] || [ -x "$RABBIT_BIN" ] || die "$RABBIT_BIN is missing after the install"

BUILD=(-p keratin-bench)
case $MODE in idle | cluster | python) BUILD+=(-p keratin) ;; esac
say "building ${BUILD[*]} (release)"
(cd "$ROOT" && CARGO_TARGET_DIR=$TARGET cargo build --release -q "${BUILD[@]}") ||
    die "the release build of ${BUILD[*]} failed"
BENCH=$TARGET/release/keratin-bench
KERATIN_BIN=$TARGET/release/keratin
# The commit the benchmark was built from, read now: edits made while it runs are not in it.
COMMIT=$(git -C "$ROOT" rev-parse --short HEAD)
git -C "$ROOT" diff --quiet HEAD -- crates || COMMIT="$COMMIT (with uncommitted changes)"

if [ "$MODE" = cluster ]; then
    # Its own nodes, ports, state and clean-up (bench/cluster.sh); nothing below applies.
    export BENCH COMMIT BENCH_DIR WRITE_DOCS ROUNDS KERATIN_BIN
    SECONDS_PER_RUN=$CLUSTER_SECONDS exec bash "$ROOT/bench/cluster.sh" run
fi

# --- what we start, and how it is stopped -----------------------------------------------------
WORK=$(mktemp -d "$BENCH_DIR/keratin-compare.XXXXXX")
STARTED=()
MOUNTS=()
EPMD_BEFORE=$(pgrep -x epmd || true)

descendants() {
    local pid=$1 child
    for child in $(cat /proc/"$pid"/task/*/children 2>/dev/null); do
        echo "$child"
        descendants "$child"
    done
}

stop_pid() {
    local pid=$1 family i
    family="$pid $(descendants "$pid")"
    kill -TERM "$pid" 2>/dev/null || return 0
    for i in $(seq 1 $((STOP_WAIT_S * 10))); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    for p in $family; do
        kill -KILL "$p" 2>/dev/null || true
    done
    wait "$pid" 2>/dev/null || true
}

cleanup() {
    local pid m
    for pid in "${STARTED[@]}"; do stop_pid "$pid"; done
    STARTED=()
    # epmd is started by RabbitMQ's Erlang VM and outlives it: stop it if it was not running before.
    if [ -z "$EPMD_BEFORE" ]; then
        for pid in $(pgrep -x epmd || true); do kill -TERM "$pid" 2>/dev/null || true; done
    fi
    for m in "${MOUNTS[@]}"; do umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || true; done
    MOUNTS=()
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

wait_port() {
    local port=$1 what=$2 i
    for i in $(seq 1 1200); do
        if (exec 3<>/dev/tcp/127.0.0.1/"$port") 2>/dev/null; then return 0; fi
        sleep 0.1
    done
    die "$what did not listen on 127.0.0.1:$port within 120 s (logs in $WORK)"
}

# start_rabbit DIR [DISK_FREE_LIMIT_BYTES]: RabbitMQ with its node data in DIR; sets RABBIT_PID.
start_rabbit() {
    local dir=$1 limit=${2:-50000000}
    mkdir -p "$dir/mnesia" "$WORK/rabbit-log" "$WORK/rabbit-home"
    cat >"$WORK/rabbitmq.conf" <<EOF
listeners.tcp.default = 127.0.0.1:$AMQP_PORT
loopback_users.guest = true
disk_free_limit.absolute = $limit
EOF
    : >"$WORK/enabled_plugins"
    HOME=$WORK/rabbit-home \
        RABBITMQ_NODENAME=kbench@localhost \
        RABBITMQ_NODE_IP_ADDRESS=127.0.0.1 \
        RABBITMQ_NODE_PORT=$AMQP_PORT \
        RABBITMQ_DIST_PORT=$((AMQP_PORT + 1)) \
        ERL_EPMD_ADDRESS=127.0.0.1 \
        RABBITMQ_MNESIA_BASE=$dir/mnesia \
        RABBITMQ_LOG_BASE=$WORK/rabbit-log \
        RABBITMQ_CONFIG_FILE=$WORK/rabbitmq.conf \
        RABBITMQ_ENABLED_PLUGINS_FILE=$WORK/enabled_plugins \
        "$RABBIT_BIN" >"$WORK/rabbit.out" 2>&1 &
    RABBIT_PID=$!
    STARTED+=("$RABBIT_PID")
    wait_port "$AMQP_PORT" RabbitMQ
}

# start_nats DIR [MAX_FILE_STORE_BYTES]: nats-server with JetStream's store in DIR; sets NATS_PID.
start_nats() {
    local dir=$1 max=${2:-}
    mkdir -p "$dir"
    {
        echo "listen: 127.0.0.1:$NATS_PORT"
        echo "jetstream {"
        echo "  store_dir: \"$dir\""
        [ -n "$max" ] && echo "  max_file_store: $max"
        echo "}"
    } >"$WORK/nats.conf"
    nats-server -c "$WORK/nats.conf" >"$WORK/nats.out" 2>&1 &
    NATS_PID=$!
    STARTED+=("$NATS_PID")
    wait_port "$NATS_PORT" nats-server
}

# start_keratin DIR [CONFIG]: the release `keratin serve` on DIR; sets KERATIN_PID.
start_keratin() {
    local dir=$1 config=${2:-$WORK/keratin-matrix.toml}
    mkdir -p "$dir"
    "$KERATIN_BIN" serve --data-dir "$dir" --config "$config" \
        --listen 127.0.0.1:$KERATIN_PORT --http 127.0.0.1:$((KERATIN_PORT + 1)) \
        >>"$WORK/keratin.out" 2>&1 &
    KERATIN_PID=$!
    STARTED+=("$KERATIN_PID")
    wait_port "$KERATIN_PORT" keratin
}

stop_all() {
    local pid
    for pid in "${STARTED[@]}"; do stop_pid "$pid"; done
    STARTED=()
}

# Keratin's disk levels are fractions of the file system with GiB floors: on a nearly full
# shared disk (this one had 8 % free) the defaults put the node at soft, which slows every
# publish by design. The matrix measures throughput, not push-back, so the levels are set low
# enough to stay at normal, as RabbitMQ's default disk_free_limit (50 MB) does; durability is
# unchanged (fdatasync before every confirm). The fill scenario below tests the levels.
# No logins (the matrix measures the data path; RabbitMQ runs with its guest login, NATS
# without any; keratin-bench auth measures logins).
cat >"$WORK/keratin-matrix.toml" <<EOF
[server]
auth = "none"

[limits.disk]
soft_fraction = 0.02
soft_floor_bytes = 1073741824
hard_fraction = 0.01
hard_floor_bytes = 536870912
reserve_fraction = 0.005
reserve_floor_bytes = 268435456
EOF

PEERS=(--amqp "amqp://guest:guest@127.0.0.1:$AMQP_PORT/%2f" --nats "nats://127.0.0.1:$NATS_PORT")

# --- idle queues (issue 13) ----------------------------------------------------------------------
record_header() {
    local cpu mem fs rabbit_version nats_version
    cpu=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')
    mem=$(awk '/MemTotal/ {printf "%.0f GiB", $2 / 1048576}' /proc/meminfo)
    fs=$(df -T "$BENCH_DIR" | awk 'NR == 2 {print $2 " (" $1 ")"}')
    rabbit_version=$(dpkg-query -W -f '${Version}' rabbitmq-server 2>/dev/null || echo unknown)
    nats_version=$(nats-server --version 2>/dev/null || echo unknown)
    echo "Recorded by \`bench/compare.sh\` on $(date -u '+%Y-%m-%d %H:%M UTC'), commit $COMMIT."
    echo "Machine: $(nproc) cores ($cpu), $mem, kernel $(uname -r), $BENCH_DIR on $fs."
    echo "Peers: RabbitMQ $rabbit_version (Debian), $nats_version (Debian); clients lapin 2, async-nats 0.38."
}

# write_docs BEGIN END TITLE FILE: FILE between the markers in docs/benchmarks.md.
write_docs() {
    local begin=$1 end=$2 title=$3 section=$4 docs=$ROOT/docs/benchmarks.md
    if ! grep -qF "$begin" "$docs"; then
        printf '\n## %s\n\n%s\n%s\n' "$title" "$begin" "$end" >>"$docs"
    fi
    SECTION=$section BEGIN=$begin END=$end perl -0pi -e '
        open my $f, "<", $ENV{SECTION} or die "read $ENV{SECTION}: $!";
        local $/; my $s = <$f>;
        s/\Q$ENV{BEGIN}\E.*?\Q$ENV{END}\E/$ENV{BEGIN}\n$s$ENV{END}/s;
    ' "$docs"
    say "written into $docs"
}

# start_system SYSTEM DIR: a broker of SYSTEM on DIR; sets SYS_PID.
start_system() {
    case $1 in
    keratin) start_keratin "$2" && SYS_PID=$KERATIN_PID ;;
    rabbitmq-*) start_rabbit "$2" && SYS_PID=$RABBIT_PID ;;
    nats) start_nats "$2" && SYS_PID=$NATS_PID ;;
    *) die "unknown system $1" ;;
    esac
}

if [ "$MODE" = python ]; then
    say "python: installing keratin-client (clients/python), aio-pika and nats-py"
    python3 -m pip install -q "$ROOT/clients/python" aio-pika nats-py ||
        die "pip could not install the Python clients"
    start_rabbit "$WORK/rabbit"
    start_nats "$WORK/nats"
    start_keratin "$WORK/keratin"
    python3 "$ROOT/bench/python/compare.py" all --keratin "127.0.0.1:$KERATIN_PORT" "${PEERS[@]}" \
        --rounds "${PY_ROUNDS:-3}" --seconds "${PY_SECONDS:-5}" --backlog "${PY_BACKLOG:-20000}" \
        --concurrency "${PY_CONCURRENCY:-256}" --out "$WORK/python-table.md"
    stop_all
    { record_header; echo; cat "$WORK/python-table.md"; } >"$WORK/python.md"
    sed -i 's/clients lapin 2, async-nats 0.38\./clients below./' "$WORK/python.md"
    cat "$WORK/python.md"
    [ "$WRITE_DOCS" = 1 ] && write_docs '<!-- compare.sh python: begin -->' '<!-- compare.sh python: end -->' \
        'Python clients side by side (issue 17)' "$WORK/python.md"
    exit 0
fi

if [ "$MODE" = stream ]; then
    [ "$(id -u)" = 0 ] || echo "!!! NOT ROOT: the page cache cannot be dropped; every stream read runs WARM" >&2
    start_nats "$WORK/nats"
    say "stream: ${STREAM_GIB:-1} GiB stream, $ROUNDS rounds; memory with a ${STREAM_RSS_GIB:-10} GiB stream"
    "$BENCH" stream --dir "$WORK" --keratin-config "$WORK/keratin-matrix.toml" \
        --nats "nats://127.0.0.1:$NATS_PORT" --rounds "$ROUNDS" \
        --stream-gib "${STREAM_GIB:-1}" --rss-gib "${STREAM_RSS_GIB:-10}" \
        --rss-seconds "${STREAM_RSS_SECONDS:-60}" --out "$WORK/stream-table.md"
    stop_all
    { record_header; echo; cat "$WORK/stream-table.md"; } >"$WORK/stream.md"
    sed -i 's/RabbitMQ [^ ]* (Debian), //; s/clients lapin 2, async-nats 0.38\./client async-nats 0.38./' "$WORK/stream.md"
    cat "$WORK/stream.md"
    [ "$WRITE_DOCS" = 1 ] && write_docs '<!-- compare.sh stream: begin -->' '<!-- compare.sh stream: end -->' \
        'Streams against NATS JetStream and the raw disk (issue 18)' "$WORK/stream.md"
    exit 0
fi

if [ "$MODE" = idle ]; then
    # Every broker keeps files open per queue or stream (NATS 2.9 stops creating file streams
    # near 10,000 with 20,000 descriptors: "error creating store for stream"). An operator with
    # 10,000 queues raises the limit; so does this run, for every broker alike (root).
    ulimit -n 262144 2>/dev/null || say "could not raise the open files limit: $(ulimit -n) (NATS needs about 2 per stream)"
    IDLE_PEERS=(--keratin "127.0.0.1:$KERATIN_PORT" "${PEERS[@]}")
    files=()
    for sys in ${IDLE_SYSTEMS//,/ }; do
        n=$QUEUES
        [ "$sys" = keratin ] && n=$KERATIN_QUEUES
        dir=$WORK/idle-$sys
        file=$WORK/idle-$sys.json
        say "idle: $sys, $n queues, fresh broker in $dir"
        start_system "$sys" "$dir"
        if ! "$BENCH" idle --phase declare --system "$sys" --queues "$n" --concurrency "$CONCURRENCY" \
            --pid "$SYS_PID" --data-dir "$dir" --file "$file" "${IDLE_PEERS[@]}"; then
            say "idle: $sys: the declares failed (above); no figures for it"
            stop_all
            rm -rf "$dir"
            continue
        fi
        say "idle: $sys: stopping, then starting again"
        stop_all
        since=$(date +%s%N)
        start_system "$sys" "$dir"
        "$BENCH" idle --phase restart --system "$sys" --concurrency "$CONCURRENCY" \
            --pid "$SYS_PID" --data-dir "$dir" --since-ns "$since" --restart-timeout "$RESTART_TIMEOUT_S" \
            --file "$file" "${IDLE_PEERS[@]}" \
            --spread "$SPREAD" --rounds "$ROUNDS" --seconds "$SECONDS_PER_RUN"
        stop_all
        rm -rf "$dir"
        files+=(--file "$file")
    done
    # IDLE_KEEP: a directory to keep each system's figures in (JSON; `keratin-bench idle
    # --phase report --file ...` prints the table again from them).
    if [ -n "${IDLE_KEEP:-}" ]; then mkdir -p "$IDLE_KEEP" && cp "$WORK"/idle-*.json "$IDLE_KEEP"/ || true; fi
    notes=()
    if [ "$KERATIN_QUEUES" != "$QUEUES" ]; then
        notes+=(--note "Keratin declared $KERATIN_QUEUES queues, the peers $QUEUES (KERATIN_QUEUES: capped so that the run fits on the disk); per-queue rows compare, totals and the restart time do not.")
    fi
    {
        record_header
        echo "Settings: $QUEUES queues per peer, $KERATIN_QUEUES for Keratin, $CONCURRENCY declares in flight, each"
        echo "on a connection of its own; durable queues (RabbitMQ classic and quorum, a fresh node each),"
        echo "JetStream file streams (work-queue retention); Keratin: the release \`keratin serve\` with default queue"
        echo "settings and the disk levels of the matrix; disk, memory and threads read 3 s after the last declare."
        echo "Restart: SIGTERM (killed after ${STOP_WAIT_S} s), start, until every queue answers a passive check"
        echo "(Keratin info, AMQP passive queue.declare, JetStream stream info). Spread: 4 producers, 1000 confirmed"
        echo "1 KiB publishes in flight each, $ROUNDS rounds of $SECONDS_PER_RUN s, 4 queues vs spread over $SPREAD."
        echo
        "$BENCH" idle --phase report "${files[@]}" "${notes[@]}"
    } >"$WORK/idle.md"
    cat "$WORK/idle.md"
    [ "$WRITE_DOCS" = 1 ] && write_docs '<!-- compare.sh idle: begin -->' '<!-- compare.sh idle: end -->' \
        'Many queues and per-message cost (issue 13)' "$WORK/idle.md"
    exit 0
fi

# --- the throughput, latency and memory matrix --------------------------------------------------
say "starting RabbitMQ and nats-server in $WORK"
start_rabbit "$WORK/rabbit"
start_nats "$WORK/nats"
say "running $CASES, $ROUNDS rounds of $SECONDS_PER_RUN s"
"$BENCH" compare --dir "$WORK" "${PEERS[@]}" \
    --keratin-config "$WORK/keratin-matrix.toml" \
    --rabbitmq-pid "$RABBIT_PID" --nats-pid "$NATS_PID" \
    --cases "$CASES" --rounds "$ROUNDS" --seconds "$SECONDS_PER_RUN" \
    --rss-messages "$RSS_MESSAGES" --backlog "$BACKLOG" --out "$WORK/matrix.md"
stop_all

# --- memory, on brokers fresh from their start -------------------------------------------------
# Each broker is restarted so that what earlier cases left in its heap does not count; the
# quorum queue gets a RabbitMQ of its own, as the classic queue's memory outlives its deletion.
if [ "$RSS" = 1 ]; then
    say "memory: $RSS_MESSAGES queued in each broker, fresh brokers"
    start_rabbit "$WORK/rabbit-rss"
    start_nats "$WORK/nats-rss"
    "$BENCH" compare --dir "$WORK" "${PEERS[@]}" --cases rss \
        --systems keratin,rabbitmq-classic,nats \
        --keratin-config "$WORK/keratin-matrix.toml" \
        --rabbitmq-pid "$RABBIT_PID" --nats-pid "$NATS_PID" \
        --rss-messages "$RSS_MESSAGES" --out "$WORK/rss.md"
    stop_all
    rm -rf "$WORK/rabbit-rss" "$WORK/nats-rss"
    start_rabbit "$WORK/rabbit-rss-quorum"
    "$BENCH" compare --dir "$WORK" "${PEERS[@]}" --cases rss --systems rabbitmq-quorum \
        --rabbitmq-pid "$RABBIT_PID" --rss-messages "$RSS_MESSAGES" --out "$WORK/rss-quorum.md"
    stop_all
    rm -rf "$WORK/rabbit-rss-quorum"
    sed -i '/^What a confirm means:/,/^$/d' "$WORK/rss.md" "$WORK/rss-quorum.md"
fi

# --- the fill scenario --------------------------------------------------------------------------
if [ "$FILL" = 1 ]; then
    if [ "$(id -u)" != 0 ]; then
        echo "!!! SKIPPING the fill scenario: it mounts tmpfs file systems and needs root" >&2
    else
        for b in keratin rabbit nats; do
            mkdir -p "$WORK/fill-$b"
            mount -t tmpfs -o size=${FILL_MIB}m tmpfs "$WORK/fill-$b"
            MOUNTS+=("$WORK/fill-$b")
        done
        cat >"$WORK/keratin-fill.toml" <<EOF
[storage]
segment_bytes = 4194304

[limits]
sample_interval_ms = 100

[limits.disk]
soft_fraction = 0.25
soft_floor_bytes = 0
hard_fraction = 0.20
hard_floor_bytes = 0
reserve_fraction = 0.05
reserve_floor_bytes = 0
clear_margin_fraction = 0.02
EOF
        say "fill: ${FILL_MIB} MiB tmpfs each; RabbitMQ disk_free_limit $FILL_HARD_FREE_BYTES B, NATS max_file_store $FILL_NATS_STORE_BYTES B, Keratin hard at 20 % free"
        start_rabbit "$WORK/fill-rabbit" "$FILL_HARD_FREE_BYTES"
        start_nats "$WORK/fill-nats" "$FILL_NATS_STORE_BYTES"
        "$BENCH" compare --dir "$WORK" "${PEERS[@]}" --cases fill \
            --keratin-dir "$WORK/fill-keratin/data" --keratin-config "$WORK/keratin-fill.toml" \
            --rabbitmq-pid "$RABBIT_PID" --nats-pid "$NATS_PID" \
            --rabbitmq-dir "$WORK/fill-rabbit" --nats-dir "$WORK/fill-nats" \
            --out "$WORK/fill.md"
        stop_all
        # The fill section is the fill table alone: the confirm lines are in the matrix's.
        sed -i '/^What a confirm means:/,/^$/d' "$WORK/fill.md"
    fi
fi

# --- the record ---------------------------------------------------------------------------------
cpu=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')
mem=$(awk '/MemTotal/ {printf "%.0f GiB", $2 / 1048576}' /proc/meminfo)
fs=$(df -T "$BENCH_DIR" | awk 'NR == 2 {print $2 " (" $1 ")"}')
rabbit_version=$(dpkg-query -W -f '${Version}' rabbitmq-server 2>/dev/null || echo unknown)
nats_version=$(nats-server --version 2>/dev/null || echo unknown)
{
    echo "Recorded by \`bench/compare.sh\` on $(date -u '+%Y-%m-%d %H:%M UTC'), commit $COMMIT."
    echo "Machine: $(nproc) cores ($cpu), $mem, kernel $(uname -r), $BENCH_DIR on $fs."
    echo "Peers: RabbitMQ $rabbit_version (Debian), $nats_version (Debian); clients lapin 2, async-nats 0.38."
    echo "Settings: 1 KiB bodies, $ROUNDS rounds of $SECONDS_PER_RUN s (systems interleaved, order reversed"
    echo "every other round; medians), backlog $BACKLOG, memory with $RSS_MESSAGES queued (fresh brokers)."
    echo "Keratin: default durable mode, disk levels lowered for the matrix (see the script), fill"
    echo "levels soft 25 % / hard 20 % / reserve 5 % free."
    echo
    cat "$WORK/matrix.md"
    for part in rss rss-quorum; do
        if [ -f "$WORK/$part.md" ]; then
            echo
            cat "$WORK/$part.md"
        fi
    done
    if [ -f "$WORK/fill.md" ]; then
        echo
        cat "$WORK/fill.md"
    fi
} >"$WORK/section.md"
cat "$WORK/section.md"

if [ "$WRITE_DOCS" = 1 ]; then
    docs=$ROOT/docs/benchmarks.md
    begin='<!-- compare.sh: begin -->'
    end='<!-- compare.sh: end -->'
    if ! grep -qF "$begin" "$docs"; then
        printf '\n## Side by side with RabbitMQ, NATS JetStream and the raw disk (issue 9)\n\n%s\n%s\n' \
            "$begin" "$end" >>"$docs"
    fi
    SECTION=$WORK/section.md BEGIN=$begin END=$end perl -0pi -e '
        open my $f, "<", $ENV{SECTION} or die "read $ENV{SECTION}: $!";
        local $/; my $s = <$f>;
        s/\Q$ENV{BEGIN}\E.*?\Q$ENV{END}\E/$ENV{BEGIN}\n$s$ENV{END}/s;
    ' "$docs"
    say "written into $docs"
fi
