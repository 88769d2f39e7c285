"""The Celery worker's consuming connection: kombu's Redis transport, with channels that fail as a
lost connection once their connection has been closed.

On a lost broker connection, Celery 5.7's consumer calls `collect()`, which detaches the transport
from its connection, then `close()`: kombu's Redis channel, closed, rebuilds its connection pool from
the detached connection to give back its unacknowledged messages, raises AttributeError, and the
worker exits ("Unrecoverable error"). Here such a channel raises redis's ConnectionError instead,
which kombu and Celery handle as what it is: the worker reconnects, and the messages stay in the
broker's unacknowledged set, delivered again after the visibility timeout (as when Redis is still
down at the close). No Celery release holds without it: 5.6 lacks the close but lets a thread pool's
refused cancel of a late-acked task end the worker.

Wired in by celeryconfig's `worker_consumer`, for the consuming connection only (the one Celery
closes so): producers, beat and Flower keep kombu's transport and their `redis://` URLs.
"""

from __future__ import annotations

from typing import Any

from celery.worker.consumer import Consumer as CeleryConsumer
from kombu import Connection
from kombu.transport import redis as kombu_redis
from redis.exceptions import ConnectionError as RedisConnectionError

# How the consuming connection names its transport (what its "Connected to" line shows).
TRANSPORT = "k8s_dispatch.tasks.broker:Transport"


class ChannelClosed(RedisConnectionError):
    """A channel whose connection was closed was asked to reach Redis."""


class Channel(kombu_redis.Channel):
    def _connparams(self, asynchronous: bool = False) -> dict[str, Any]:
        """Raises:
        ChannelClosed: the channel's connection is closed, its transport detached from it.
        """
        transport = self.connection
        if transport is None or transport.client is None:
            raise ChannelClosed("the broker connection of this channel is closed")
        params: dict[str, Any] = super()._connparams(asynchronous=asynchronous)  # type: ignore[misc]
        return params


class Transport(kombu_redis.Transport):
    Channel = Channel


class Consumer(CeleryConsumer):
    def connection_for_read(self, heartbeat: float | None = None) -> Connection:
        """Celery's consuming connection, on our Transport where it would be kombu's Redis one."""
        connection = self.app.connection_for_read(heartbeat=heartbeat)
        if connection.get_transport_cls() is kombu_redis.Transport:
            connection = self.app.connection_for_read(heartbeat=heartbeat, transport=TRANSPORT)
        return self.ensure_connected(connection)
