"""`kubectl logs -f` as both log endpoints serve it (the API server's in process, the node agent's):
what the log holds now, then what the container adds, until its Pod ends or goes."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from aiohttp import web


async def follow(
    request: web.Request, data: bytes, *, read: Callable[[], bytes], done: Callable[[], bool]
) -> web.StreamResponse:
    """Stream `data` (the first slice asked for), then whatever `read()` adds past it, polled every
    0.1 s until `done()` (read once more after it, so nothing written at the end is lost)."""
    response = web.StreamResponse(status=200, headers={"Content-Type": "text/plain"})
    await response.prepare(request)
    await response.write(data)
    sent = len(read()) if data else 0
    while True:
        finished = done()
        full = read()
        if len(full) > sent:
            await response.write(full[sent:])
            sent = len(full)
        if finished:
            break
        await asyncio.sleep(0.1)
    await response.write_eof()
    return response
