#!/usr/bin/env python3
"""Python clients side by side (issue 17): Keratin's `keratin-client` against `aio-pika` on a
RabbitMQ quorum queue and `nats-py` on a NATS JetStream file stream, on the same machine, in one
run.

Cases, 1 KiB bodies, one connection per system:
- publish: confirmed publishes for SECONDS, CONCURRENCY publishes in flight (as many coroutines,
  each awaiting its publish's confirm before sending the next). Keratin confirms after the
  fsync that covers the message; RabbitMQ's quorum queue after the fsync of a majority (here one
  node); JetStream acknowledges after its write, without an fsync (NATS's default `sync`
  interval is 2 minutes): the peers' figures are the upper bound of what they promise.
- consume: a backlog of BACKLOG messages, consumed and acknowledged one by one (prefetch 1000;
  RabbitMQ `basic.ack` and JetStream `ack` are sent without waiting for an answer, as Keratin's).

Each (system, case, round) runs in a fresh Python process (`one` below), so one client's
garbage or event-loop state does not weigh on the next. The rounds interleave the systems and
reverse their order every other round; the table gives medians and the ratios Keratin / peer.

Usage: bench/compare.sh with MODE=python starts the brokers and runs this script; by hand:
    compare.py all --keratin 127.0.0.1:25680 [--keratin-user admin --keratin-password-file F]
                   --amqp amqp://guest:guest@127.0.0.1:25673/%2f --nats nats://127.0.0.1:24223
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import uuid

SYSTEMS = ("keratin", "rabbitmq-quorum", "nats")
CASES = ("publish", "consume")
BODY_BYTES = 1024
PREFETCH = 1000


# --- one measurement, in its own process ---------------------------------------------------------


async def publish_loop(publish_one, seconds: float, concurrency: int) -> int:
    """Confirmed publishes from `concurrency` coroutines until `seconds` have passed."""
    deadline = time.perf_counter() + seconds
    done = 0

    async def worker() -> None:
        nonlocal done
        while time.perf_counter() < deadline:
            await publish_one()
            done += 1

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done


async def fill(publish_one, count: int, concurrency: int) -> None:
    """`count` confirmed publishes, not timed: the backlog of the consume case."""
    left = count

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            await publish_one()

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def one_keratin(args, queue: str) -> dict:
    import keratin

    password = None
    if args.keratin_password_file:
        with open(args.keratin_password_file, encoding="utf-8") as f:
            password = f.read().strip()
    body = os.urandom(BODY_BYTES)
    client = await keratin.connect(
        args.keratin,
        user=args.keratin_user if password else None,
        password=password,
        publish_timeout=60.0,
    )
    async with client:
        await client.declare(queue)

        async def publish_one() -> None:
            await client.publish(queue, body)

        try:
            if args.case == "publish":
                start = time.perf_counter()
                n = await publish_loop(publish_one, args.seconds, args.concurrency)
                return {"count": n, "seconds": time.perf_counter() - start}
            await fill(publish_one, args.backlog, args.concurrency)
            start = time.perf_counter()
            n = 0
            async for delivery in client.consume(queue, prefetch=PREFETCH):
                await delivery.ack()
                n += 1
                if n == args.backlog:
                    break
            return {"count": n, "seconds": time.perf_counter() - start}
        finally:
            await client.delete(queue)


async def one_rabbitmq(args, queue: str) -> dict:
    import aio_pika

    body = os.urandom(BODY_BYTES)
    connection = await aio_pika.connect(args.amqp)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        q = await channel.declare_queue(
            queue, durable=True, arguments={"x-queue-type": "quorum"}
        )
        exchange = channel.default_exchange

        async def publish_one() -> None:
            await exchange.publish(
                aio_pika.Message(body, delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
                routing_key=queue,
            )

        try:
            if args.case == "publish":
                start = time.perf_counter()
                n = await publish_loop(publish_one, args.seconds, args.concurrency)
                return {"count": n, "seconds": time.perf_counter() - start}
            await fill(publish_one, args.backlog, args.concurrency)
            await channel.set_qos(prefetch_count=PREFETCH)
            start = time.perf_counter()
            n = 0
            async with q.iterator() as it:
                async for message in it:
                    await message.ack()
                    n += 1
                    if n == args.backlog:
                        break
            return {"count": n, "seconds": time.perf_counter() - start}
        finally:
            await q.delete(if_unused=False, if_empty=False)


async def one_nats(args, queue: str) -> dict:
    import nats
    from nats.js.api import RetentionPolicy, StorageType, StreamConfig

    body = os.urandom(BODY_BYTES)
    nc = await nats.connect(args.nats)
    try:
        js = nc.jetstream(timeout=60)
        subject = f"bench.{queue}"
        await js.add_stream(
            StreamConfig(
                name=queue,
                subjects=[subject],
                storage=StorageType.FILE,
                retention=RetentionPolicy.WORK_QUEUE,
            )
        )

        async def publish_one() -> None:
            await js.publish(subject, body)

        try:
            if args.case == "publish":
                start = time.perf_counter()
                n = await publish_loop(publish_one, args.seconds, args.concurrency)
                return {"count": n, "seconds": time.perf_counter() - start}
            await fill(publish_one, args.backlog, args.concurrency)
            sub = await js.pull_subscribe(subject, durable="bench")
            start = time.perf_counter()
            n = 0
            while n < args.backlog:
                for message in await sub.fetch(batch=min(PREFETCH, args.backlog - n), timeout=30):
                    await message.ack()
                    n += 1
            return {"count": n, "seconds": time.perf_counter() - start}
        finally:
            await js.delete_stream(queue)
    finally:
        await nc.close()


def one(args) -> None:
    queue = f"pybench_{uuid.uuid4().hex[:12]}"
    run = {"keratin": one_keratin, "rabbitmq-quorum": one_rabbitmq, "nats": one_nats}[args.system]
    result = asyncio.run(run(args, queue))
    result["rate"] = result["count"] / result["seconds"]
    print(json.dumps(result))


# --- the rounds and the table ---------------------------------------------------------------------


def measure(args, system: str, case: str) -> float:
    command = [
        sys.executable, os.path.abspath(__file__), "one",
        "--system", system, "--case", case,
        "--seconds", str(args.seconds), "--concurrency", str(args.concurrency),
        "--backlog", str(args.backlog),
        "--keratin", args.keratin, "--keratin-user", args.keratin_user,
        "--amqp", args.amqp, "--nats", args.nats,
    ]
    if args.keratin_password_file:
        command += ["--keratin-password-file", args.keratin_password_file]
    limit = args.seconds + args.backlog / 200 + 120
    out = subprocess.run(command, capture_output=True, text=True, timeout=limit)
    if out.returncode != 0:
        raise RuntimeError(f"{system} {case} failed:\n{out.stderr.strip()[-2000:]}")
    rate = json.loads(out.stdout.strip().splitlines()[-1])["rate"]
    print(f"compare.py: {case} {system}: {rate:,.0f} msg/s", file=sys.stderr, flush=True)
    return rate


def all_rounds(args) -> None:
    systems = [s for s in SYSTEMS if s in args.systems.split(",")]
    if "keratin" not in systems:
        raise SystemExit("compare.py: the run needs keratin among --systems")
    cases = [c for c in CASES if c in args.cases.split(",")]
    rates = {(c, s): [] for c in cases for s in systems}
    for r in range(args.rounds):
        order = systems if r % 2 == 0 else list(reversed(systems))
        for case in cases:
            for system in order:
                rates[(case, system)].append(measure(args, system, case))
    lines = [
        f"Python clients: keratin-client (this commit), aio-pika {version('aio-pika')} (RabbitMQ "
        f"quorum queue), nats-py {version('nats-py')} (JetStream file stream, work-queue "
        f"retention); Python {sys.version.split()[0]}. 1 KiB bodies; publish: "
        f"{args.concurrency} confirmed publishes in flight on one connection for {args.seconds} s; "
        f"consume: a backlog of {args.backlog}, prefetch {PREFETCH}, each message acked. "
        f"{args.rounds} rounds, systems interleaved (order reversed every other round); medians.",
        "",
        "| case | " + " | ".join(f"{s} (msg/s)" for s in systems) + " | "
        + " | ".join(f"keratin / {s}" for s in systems if s != "keratin")
        + " | goal | per-round ratios |",
        "|---" * (2 * len(systems) + 2) + "|",
    ]
    missed = []
    for case in cases:
        medians = {s: statistics.median(rates[(case, s)]) for s in systems}
        ratios, rounds = [], []
        for s in systems:
            if s == "keratin":
                continue
            ratio = medians["keratin"] / medians[s]
            ratios.append(f"{ratio:.2f}")
            per_round = [k / p for k, p in zip(rates[(case, "keratin")], rates[(case, s)])]
            rounds.append(f"{s}: " + " ".join(f"{x:.2f}" for x in per_round))
            if ratio < 1.0:
                missed.append(f"{case} keratin / {s} = {ratio:.2f} < 1")
        lines.append(
            f"| {case} | " + " | ".join(f"{medians[s]:,.0f}" for s in systems) + " | "
            + " | ".join(ratios) + " | >= 1 | " + "; ".join(rounds) + " |"
        )
    lines.append("")
    lines.append("Goals missed: " + ("; ".join(missed) if missed else "none") + ".")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)


def version(dist: str) -> str:
    try:
        from importlib.metadata import version as v

        return v(dist)
    except Exception:  # noqa: BLE001 - a missing package shows as unknown in the record
        return "unknown"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["all", "one"])
    p.add_argument("--system", choices=SYSTEMS)
    p.add_argument("--case", choices=CASES)
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--backlog", type=int, default=20000)
    p.add_argument("--keratin", default="127.0.0.1:25680")
    p.add_argument("--keratin-user", default="admin")
    p.add_argument("--keratin-password-file")
    p.add_argument("--amqp", default="amqp://guest:guest@127.0.0.1:25673/%2f")
    p.add_argument("--nats", default="nats://127.0.0.1:24223")
    p.add_argument("--out")
    args = p.parse_args()
    if args.what == "one":
        if not args.system or not args.case:
            raise SystemExit("compare.py one: needs --system and --case")
        one(args)
    else:
        all_rounds(args)


if __name__ == "__main__":
    main()
