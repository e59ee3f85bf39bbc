"""Device lanes: one worker thread per device, so the target and the draft can run at the same time.

Every backend call goes through its lane, which runs it on the lane's own thread and records a span
in the generation's timeline. A lane runs one job at a time, so a backend is never entered by two
threads at once; two lanes run concurrently (torch and MLX release the GIL inside their kernels).
The thread is also what device-affine runtimes (CUDA streams, MLX, Core ML) like: a device's work
always comes from the same thread."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

from hetero_sd.backends.base import DraftBackend, TargetBackend
from hetero_sd.errors import RuntimeClosedError

from .timeline import Timeline


class Lane:
    def __init__(self, name: str, device: str):
        self.name, self.device = name, device
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"hetero-sd-{name}")

    def submit(self, job: Callable, timeline: Timeline, label: str, request: int, step: int) -> Future:
        def timed():
            began = time.perf_counter()
            try:
                return job()
            finally:
                timeline.record(self.name, label, began, time.perf_counter(), request, step)
        return self.start(timed)

    def call(self, job: Callable):
        """Run a job on the lane's thread, unrecorded (set-up work such as allocating a request's caches)."""
        return self.start(job).result()

    def start(self, job: Callable) -> Future:
        try:
            return self.pool.submit(job)
        except RuntimeError:  # the executor was shut down: Runtime.close()
            raise RuntimeClosedError("this Runtime was closed", "load a new one (hetero_sd.load) to generate again") from None

    def close(self) -> None:
        self.pool.shutdown(wait=True)


@dataclass
class Lanes:
    """The two lanes as one generation sees them: its timeline, its request number, its step, and its
    backends (`bind`), whose `synchronize()` ends every job, so that a span on an asynchronous device
    (CUDA, MPS) ends when the device has finished, not when the work was queued."""

    target_lane: Lane
    draft_lane: Lane
    timeline: Timeline
    request: int = 0
    step: int = 0
    backends: dict = field(default_factory=dict)  # "target" / "draft" -> the backend whose jobs run there

    def __post_init__(self):
        self.timeline.devices.update(target=self.target_lane.device, draft=self.draft_lane.device)

    def bind(self, target: TargetBackend | None, draft: DraftBackend | None) -> None:
        self.backends = {"target": target, "draft": draft}

    def submit(self, lane: str, label: str, job: Callable) -> Future:
        which = self.target_lane if lane == "target" else self.draft_lane
        backend = self.backends.get(lane)
        return which.submit(job if backend is None else partial(synchronized, job, backend), self.timeline, label,
                            self.request, self.step)

    def target(self, label: str, job: Callable):
        return self.submit("target", label, job).result()

    def draft(self, label: str, job: Callable):
        return self.submit("draft", label, job).result()


def synchronized(job: Callable, backend):
    result = job()
    backend.synchronize()
    return result
