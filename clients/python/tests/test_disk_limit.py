"""``429 disk`` from a real node whose storage is a small tmpfs (root: mount). The client
retries on the node's hint within its publish timeout, then raises ``LimitedError`` naming the
limit; consuming and acking keep working while publishes are refused, and once the backlog is
consumed the node takes publishes again. Every confirmed message is delivered."""

from __future__ import annotations

import asyncio
import os
import subprocess
import tempfile
import time
from typing import List

import keratin

from .conftest import Broker, privileged

#: Levels as fractions of the 64 MiB file system, sampled every 100 ms (as the Rust fill test,
#: crates/keratin/tests/limits.rs, `small_fs_config`).
FILL_ENV = {
    "KERATIN_STORAGE__SEGMENT_BYTES": "4194304",
    "KERATIN_LIMITS__SAMPLE_INTERVAL_MS": "100",
    "KERATIN_LIMITS__MAX_DELAY_MS": "50",
    "KERATIN_LIMITS__DISK__SOFT_FRACTION": "0.40",
    "KERATIN_LIMITS__DISK__SOFT_FLOOR_BYTES": "0",
    "KERATIN_LIMITS__DISK__HARD_FRACTION": "0.25",
    "KERATIN_LIMITS__DISK__HARD_FLOOR_BYTES": "0",
    "KERATIN_LIMITS__DISK__RESERVE_FRACTION": "0.10",
    "KERATIN_LIMITS__DISK__RESERVE_FLOOR_BYTES": "0",
    "KERATIN_LIMITS__DISK__CLEAR_MARGIN_FRACTION": "0.02",
}
BODY_BYTES = 16 * 1024


def test_a_filling_tmpfs_gives_limited_disk_and_publishing_resumes() -> None:
    privileged("test_a_filling_tmpfs_gives_limited_disk_and_publishing_resumes")
    with tempfile.TemporaryDirectory(prefix="keratin-py-fill-") as tmp:
        data = os.path.join(tmp, "data")
        os.makedirs(data)
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", data], check=True)
        try:
            node = Broker(FILL_ENV, [], data=data)
            try:
                asyncio.run(asyncio.wait_for(_fill_then_drain(node.address), 150))
            except BaseException:
                print(node.log())
                raise
            finally:
                node.stop()
        finally:
            subprocess.run(["umount", "-l", data], check=False)


async def _fill_then_drain(address: str) -> None:
    body = os.urandom(BODY_BYTES)
    confirmed: List[int] = []
    # A short publish timeout: the client's own retries on the node's hint end in a
    # LimitedError well within the test.
    async with await keratin.connect(address, publish_timeout=2.0) as client:
        await client.declare("fill")
        limited = None
        started = time.monotonic()
        while time.monotonic() - started < 90:
            try:
                await client.publish("fill", body, headers={"n": str(len(confirmed))})
            except keratin.LimitedError as e:
                limited = e
                break
            confirmed.append(len(confirmed))
        assert limited is not None, "no LimitedError after %d confirmed publishes in 90 s" % len(
            confirmed
        )
        assert limited.code == 429
        assert limited.reason == "disk", "the limit named is %r: %s" % (limited.reason, limited)
        assert limited.retry_after_ms is not None and limited.retry_after_ms > 0, limited
        # 64 MiB with hard at 25 % free: far more than 500 messages of 16 KiB fit first.
        assert len(confirmed) > 500, "limited after only %d messages" % len(confirmed)

        # Consuming and acking work while publishes are refused, in order, and free the space.
        got = 0
        async with client.consume("fill", prefetch=200) as consumer:
            async for delivery in consumer:
                assert delivery.headers.get("n") == str(got), delivery.headers
                await delivery.ack()
                got += 1
                if got == len(confirmed):
                    break
        assert got == len(confirmed), "every confirmed message delivered"

    # Publishing resumes by itself: the client retries on the node's hint while the levels
    # catch up with the freed space.
    async with await keratin.connect(address, publish_timeout=30.0) as client:
        await client.publish("fill", body)
        assert (await client.info("fill")).ready == 1
