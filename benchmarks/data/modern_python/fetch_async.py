"""Fetch many URLs concurrently with asyncio, retries with backoff and a bounded number of connections."""
from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)


@dataclass(slots=True)
class FetchResult:
    url: str
    status: int
    body: bytes
    elapsed_s: float
    attempts: int


class TransientError(Exception):
    """A failure worth retrying (timeouts, 5xx answers)."""


async def with_retries(fn: Callable[[], Awaitable[T]], *, attempts: int = 4, base_delay: float = 0.2) -> tuple[T, int]:
    for attempt in range(1, attempts + 1):
        try:
            return await fn(), attempt
        except TransientError as e:
            if attempt == attempts:
                raise
            delay = base_delay * 2 ** (attempt - 1) * (1 + random.random())
            log.warning("attempt %d failed (%s); retrying in %.2fs", attempt, e, delay)
            await asyncio.sleep(delay)
    raise AssertionError("unreachable")


async def fetch_all(urls: list[str], get: Callable[[str], Awaitable[tuple[int, bytes]]],
                    max_concurrency: int = 8) -> list[FetchResult]:
    semaphore = asyncio.Semaphore(max_concurrency)

    async def one(url: str) -> FetchResult:
        async with semaphore:
            start = time.perf_counter()

            async def attempt() -> tuple[int, bytes]:
                status, body = await get(url)
                if status >= 500:
                    raise TransientError(f"{url}: HTTP {status}")
                return status, body

            (status, body), n = await with_retries(attempt)
            return FetchResult(url, status, body, time.perf_counter() - start, n)

    async with asyncio.TaskGroup() as tg:
        tasks = [tg.create_task(one(u)) for u in urls]
    return [t.result() for t in tasks]


async def fake_get(url: str) -> tuple[int, bytes]:
    await asyncio.sleep(random.uniform(0.01, 0.05))
    if random.random() < 0.2:
        return 503, b""
    return 200, f"<html>{url}</html>".encode()


async def main() -> None:
    urls = [f"https://example.com/page/{i}" for i in range(20)]
    results = await fetch_all(urls, fake_get, max_concurrency=4)
    ok = [r for r in results if r.status == 200]
    print(f"{len(ok)}/{len(results)} ok; mean {sum(r.elapsed_s for r in results) / len(results):.3f}s, "
          f"max attempts {max(r.attempts for r in results)}")


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    asyncio.run(main())
