"""Device lanes: one worker thread per device, so the target and the draft can run at the same time.

Every backend call goes through its lane, which runs it on the lane's own thread and records a span
in the generation's timeline. A lane runs one job at a time, so a backend is never entered by two
threads at once; two lanes run concurrently (torch and MLX release the GIL inside their kernels).
The thread is also what device-affine runtimes (CUDA streams, MLX, Core ML) like: a device's work
always comes from the same thread.

Torch CPU lanes ("cpu", "ane-sim") run the jobs a caller waits for in the caller's own thread instead.
Each thread that runs torch CPU work owns an OpenMP team; with the caller's team and a team per lane,
libgomp sees more threads than cores and throttles its spin-waits, and every parallel region then pays
futex wake-ups: a decode step of the default target took 47 ms on a lane thread against 26 ms in the
calling thread (2-core Xeon, benchmarks/README.md). Jobs that must overlap (the `overlap` and `pipeline`
schedules) still go to the lane's thread; a lock keeps one job at a time per lane either way, and a
waited-for job goes through the thread while earlier overlapped jobs are still queued there, so jobs keep
their order."""

from __future__ import annotations

import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

from hetero_sd.backends.base import DraftBackend, TargetBackend, thread_release
from hetero_sd.errors import RuntimeClosedError

from .timeline import Timeline


INLINE_DEVICES = ("cpu", "ane-sim")  # torch on this process's CPU: no device affinity to keep
# CUDA too: torch sets the device per call, and a step captured as a CUDA graph is one launch, so a handoff to
# the lane's thread and back (two futex wake-ups, tens of microseconds in a VM) would be a sizeable part of it


RELEASING: "weakref.WeakSet[Lane]" = weakref.WeakSet()  # open lanes whose thread must release its device's state


def close_at_exit() -> None:
    for lane in list(RELEASING):
        try:
            lane.close()
        except Exception:  # noqa: BLE001 - one lane's failure must not keep the others' threads from releasing
            pass


# At interpreter exit, before concurrent.futures ends the pools' threads (its own hook is registered this way when it
# is imported, and these run last-registered first): a lane's thread releases its device's per-thread state first
threading._register_atexit(close_at_exit)


class Lane:
    def __init__(self, name: str, device: str):
        self.name, self.device = name, device
        self.inline = device in INLINE_DEVICES or device.startswith("cuda")
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"hetero-sd-{name}")
        self.release = thread_release(device)  # the thread's last job (thread_release); None: nothing to release
        if self.release is not None:
            RELEASING.add(self)
            # a lane dropped unclosed: its thread releases before it ends too (queued ahead of its end)
            weakref.finalize(self, release_then_end, self.pool, self.release)
        self.busy = threading.Lock()  # one job at a time, in the lane's thread or a caller's
        self.queued = 0  # jobs handed to the thread and not finished
        self.count_lock = threading.Lock()
        self.closed = False
        self.ran = {"inline": 0, "thread": 0}  # where jobs ran (a test checks the rule above holds)

    def submit(self, job: Callable, timeline: Timeline, label: str, request: int, step: int,
               wait: bool = False) -> Future:
        """Run `job` on this lane and record its span. wait=True: the caller blocks on it at once, so
        an inline lane may run it in the calling thread (the future comes back done)."""
        def timed():
            began = time.perf_counter()
            try:
                return job()
            finally:
                timeline.record(self.name, label, began, time.perf_counter(), request, step)
        return self.run_here(timed) if wait and self.here() else self.start(timed)

    def call(self, job: Callable):
        """Run a job on the lane, unrecorded (set-up work such as allocating a request's caches)."""
        return (self.run_here(job) if self.here() else self.start(job)).result()

    def here(self) -> bool:
        with self.count_lock:
            return self.inline and not self.queued

    def run_here(self, job: Callable) -> Future:
        self.check_open()
        done: Future = Future()
        with self.busy:
            self.ran["inline"] += 1
            try:
                done.set_result(job())
            except BaseException as e:  # the caller's .result() re-raises it, as from the thread
                done.set_exception(e)
        return done

    def start(self, job: Callable) -> Future:
        def queued_job():
            try:
                with self.busy:
                    self.ran["thread"] += 1
                    return job()
            finally:
                with self.count_lock:
                    self.queued -= 1

        self.check_open()
        with self.count_lock:
            self.queued += 1
        try:
            return self.pool.submit(queued_job)
        except RuntimeError:  # the executor was shut down: Runtime.close()
            with self.count_lock:
                self.queued -= 1
            self.check_open(closed=True)

    def check_open(self, closed: bool = False) -> None:
        if closed or self.closed:
            raise RuntimeClosedError("this Runtime was closed", "load a new one (hetero_sd.load) to generate again")

    def close(self) -> None:
        """Stop the thread (after the jobs queued there), its device's per-thread state released first."""
        if not self.closed and self.release is not None:
            release_then_end(self.pool, self.release)
        self.closed = True
        self.pool.shutdown(wait=True)


def release_then_end(pool: ThreadPoolExecutor, release: Callable[[], None]) -> None:
    """Queue `release` as the pool's thread's last job, then its end; waits for neither (from the thread itself too)."""
    try:
        pool.submit(release)
    except RuntimeError:  # shut down already (at exit, by concurrent.futures): its thread has ended
        return
    pool.shutdown(wait=False)


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

    def submit(self, lane: str, label: str, job: Callable, wait: bool = False, sync: bool = True) -> Future:
        """sync=False: the job's span ends when its work is launched (a draft whose output the device itself
        passes on to the verify: waiting for it here would stall the host for nothing)."""
        which = self.target_lane if lane == "target" else self.draft_lane
        backend = self.backends.get(lane)
        return which.submit(job if backend is None or not sync else partial(synchronized, job, backend), self.timeline,
                            label, self.request, self.step, wait)

    def target(self, label: str, job: Callable):
        return self.submit("target", label, job, wait=True).result()

    def draft(self, label: str, job: Callable, sync: bool = True):
        return self.submit("draft", label, job, wait=True, sync=sync).result()


def synchronized(job: Callable, backend):
    result = job()
    backend.synchronize()
    return result
