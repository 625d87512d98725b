"""Replayed prompts' arrivals (Prompt.arrival_s, as LLM.generate(arrival_times=...) gives them) on the real clock: which are
due, and how long to sleep until the next. Host only: no jax."""

import heapq
import itertools
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxinfer.scheduling.request import Prompt


class Arrivals:
    """Replayed prompts (Prompt.arrival_s) not yet arrived, by due time; the stream admits each between
    steps once its time has come, and sleeps to the next one when nothing runs."""

    def __init__(self, start: float):
        self.start, self._heap, self._order = start, [], itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def hold(self, prompts: list["Prompt"]) -> list["Prompt"]:
        """Keep the prompts that arrive later; return those due now (no arrival time, or already past)."""
        now = time.perf_counter()
        for prompt in prompts:
            if prompt.arrival_s is not None:
                heapq.heappush(self._heap, (self.start + prompt.arrival_s, next(self._order), prompt))
        return [p for p in prompts if p.arrival_s is None] + self.due(now)

    def due(self, now: float | None = None) -> list["Prompt"]:
        now = time.perf_counter() if now is None else now
        ready = []
        while self._heap and self._heap[0][0] <= now:
            ready.append(heapq.heappop(self._heap)[2])
        return ready

    def wait(self) -> None:
        time.sleep(max(0.0, self._heap[0][0] - time.perf_counter()))

    def time_of(self, prompt: "Prompt") -> float | None:
        return None if prompt.arrival_s is None else self.start + prompt.arrival_s
