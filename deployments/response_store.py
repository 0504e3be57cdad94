"""The Serve app's response store (``/v1/responses`` with ``store: true``): one named Ray actor per app, which
every ingress replica reaches through a ``RayResponseStore`` (the engine's ``ResponseStore`` interface).

The actor, ``ResponseStoreActor`` (named ``serval_response_store:<app name>`` in the ``serval`` namespace), holds
an ``InMemoryResponseStore``: the bounds and the TTL are the in-process server's code, sized by the app's
``response_store`` options. It is detached, so it outlives every replica, the one that created it included:
a conversation goes on after the replica that answered its last turn died. Ray restarts it, empty, if its own
process dies. The first ``/v1/responses`` call that stores or reads a response creates it (an app that never
serves one has none); a redeployed app reuses it with its new options. Deleting an app leaves its actor
behind (``num_cpus`` 0, holding at most ``max_bytes``) until the cluster stops.
"""

from __future__ import annotations

import asyncio

import ray

from engine.entrypoints.openai.response_store import InMemoryResponseStore, ResponseStoreOptions, StoredResponse

ACTOR_NAME_PREFIX = "serval_response_store:"
ACTOR_NAMESPACE = "serval"  # one for every app's store, whatever namespace the replicas' job runs in


@ray.remote(num_cpus=0)
class ResponseStoreActor:
    """An ``InMemoryResponseStore`` in an actor of its own (see the module docstring)."""

    def __init__(self, options: ResponseStoreOptions) -> None:
        self.store = InMemoryResponseStore(options)

    def configure(self, options: ResponseStoreOptions) -> None:
        self.store.configure(options)

    async def put(self, stored: StoredResponse) -> None:
        await self.store.put(stored)

    async def get(self, response_id: str) -> StoredResponse | None:
        return await self.store.get(response_id)

    async def delete(self, response_id: str) -> bool:
        return await self.store.delete(response_id)

    def num_stored(self) -> int:
        return len(self.store)


class RayResponseStore:
    """The ``ResponseStore`` of the app ``app_name``: its ``ResponseStoreActor``, created or found on first use
    and set to ``options``."""

    def __init__(self, app_name: str, options: ResponseStoreOptions) -> None:
        self.actor_name = f"{ACTOR_NAME_PREFIX}{app_name}"
        self.options = options
        self._actor: asyncio.Task | None = None

    async def put(self, stored: StoredResponse) -> None:
        await (await self.actor()).put.remote(stored)

    async def get(self, response_id: str) -> StoredResponse | None:
        return await (await self.actor()).get.remote(response_id)

    async def delete(self, response_id: str) -> bool:
        return await (await self.actor()).delete.remote(response_id)

    async def actor(self):
        """The app's actor handle (found or created once: concurrent first calls share the lookup)."""
        if self._actor is None:
            self._actor = asyncio.ensure_future(asyncio.to_thread(self._get_or_create))
        try:
            return await asyncio.shield(self._actor)
        except Exception:
            self._actor = None  # the next call looks again
            raise

    def _get_or_create(self):
        actor = ResponseStoreActor.options(
            name=self.actor_name,
            namespace=ACTOR_NAMESPACE,
            lifetime="detached",
            get_if_exists=True,
            max_restarts=-1,
        ).remote(self.options)
        ray.get(actor.configure.remote(self.options))
        return actor
