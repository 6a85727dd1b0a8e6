"""Weight updates in the pool: every engine takes a version in one session.

Weight updates go to every engine at once, as one session (`begin_update` -> the transport's
calls -> `end_update`): pause (rollout.update_mode=abort: abort what runs first; keep: the
running requests are held), load (megarl/rollout/weights/), reset the prefix cache, set the
version, (keep, rollout.keep_kv=false: drop the held requests' KV, recomputed under the new
weights), resume: held requests go on under the new version. If any engine fails, the error
names it.

A push is one session: begin_update (schedulers in `holders` stop admitting, every engine
aborts what runs and pauses; restarted engines join here, so they load this version
before they serve), the transport's calls on `engines` (rollout/weights/), end_update (every
engine resumes, also after a failure: an engine is never left paused, and holders go on).

`UpdateSessions` is a part of `EnginePool` (pool.py), split out by concept: it works on the
pool's engines, its request book and the schedulers it holds (`holders`), on the pool's
event loop.
"""
from __future__ import annotations

import asyncio

from megarl.rollout.engines.engine import Engine


class UpdateSessions:
    """Versioned update sessions on every engine (a base of the pool)."""

    async def begin_update(self, admit: bool = True) -> list[Engine]:
        """Start a push; returns the engines that take it. `admit=False` (a staged push's swap:
        the new version was staged on the engines of the session only) leaves replacements
        waiting for the next push, which brings them the whole version."""
        for h in self.holders:
            await h.hold()
        try:
            joining, self.joining = (self.joining, []) if admit else ([], self.joining)
            if joining:
                self.engines += joining
                self.restarts += len(joining)

            self._in_update = list(self.engines)

            if self.update_mode == "abort":   # the pool's own abort: those requests return their partials
                self._aborted.update(self._where)

            async def stop(e: Engine):
                if self.update_mode == "abort":
                    await e.abort(None)
                await e.pause()
            await self._on_each(stop)
        except BaseException:
            await self.end_update()
            raise
        return list(self.engines)

    async def end_update(self) -> None:
        try:
            if self.update_mode == "keep" and not self.keep_kv and self._where:
                # held requests recompute their KV under the new weights when they resume
                for h in self.holders:
                    if hasattr(h, "kv_dropped"):
                        h.kv_dropped()
                await self._on_each(lambda e: e.clear_kv(), [e for e in self.engines if e.running])
            # an engine retired during the update is resumed too (best effort): never left paused
            gone = [e for e in self._in_update if e not in self.engines]
            await asyncio.gather(*(e.resume() for e in gone), return_exceptions=True)
            await self._on_each(lambda e: e.resume())
        finally:
            self._in_update = []
            for h in self.holders:
                h.release()

    async def pause_all(self) -> None:
        """Pause every engine, holding what runs (the partial-rollout round's end in keep mode)."""
        await self._on_each(lambda e: e.pause())

    async def resume_all(self) -> None:
        await self._on_each(lambda e: e.resume())

    async def reload_weights(self, path: str, version: int) -> None:
        """files transport: every engine loads the safetensors in `path` as `version`."""
        await self.begin_update()
        try:
            await self._on_each(lambda e: e.reload_weights(path, version))
        finally:
            await self.end_update()

    @property
    def updating(self) -> bool:
        """A weight update is in progress (between begin_update and end_update)."""
        return bool(self._in_update)
