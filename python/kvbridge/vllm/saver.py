"""The connector's save thread: the worker copies a finished prompt's KV out of the paged cache
(the only work decode waits for) and hands the copy here; one background thread writes the
copies to the store through ``Bridge.save``, in order."""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import List, Optional, Tuple

from kvbridge import _core
from kvbridge.bridge import Bridge
from kvbridge.vllm.stats import Counters

logger = logging.getLogger("kvbridge.vllm")


class Saver:
    """Writes queued prompts' KV under `spec` through `bridge`, counting into `counters`
    (save_seconds, tokens_saved, saves_purged, save_errors). A save never raises to its caller:
    a failure is counted and logged (the request is unaffected)."""

    def __init__(self, bridge: Bridge, spec: _core.ModelSpec, counters: Counters):
        self._bridge = bridge
        self._spec = spec
        self._counters = counters
        self._queue: "queue.Queue[Optional[tuple]]" = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="kvbridge-save", daemon=True)
        self._thread.start()

    def submit(self, tokens: List[int], kv: tuple, namespace: str,
               origin: Tuple[str, str] = ("", "")) -> None:
        """Queues a save; origin: (source, adapter) fingerprints of KV that derives from a
        conversion, ("", "") for the model's own."""
        self._queue.put((tokens, kv, namespace, origin))

    def flush(self) -> None:
        """Waits until every submitted save has been written."""
        self._queue.join()

    def _loop(self) -> None:
        count = self._counters.count
        while True:
            item = self._queue.get()
            try:
                tokens, kv, namespace, (converted_from, adapter) = item
                t0 = time.perf_counter()
                # The Bridge refuses a dropped adapter's KV, and a drop waits for this put.
                saved = self._bridge.save(self._spec, tokens, kv, namespace,
                                          converted_from=converted_from, adapter=adapter)
                if adapter and saved == 0 and self._bridge.adapter_dropped(adapter):
                    count("saves_purged")
                count("save_seconds", time.perf_counter() - t0)
                count("tokens_saved", saved)
            except Exception as e:  # a save never affects the request
                count("save_errors")
                logger.warning("kvbridge: save failed: %s", e)
            finally:
                self._queue.task_done()


__all__ = ["Saver"]
