"""Requests to generations: a bounded admission queue, a pool of worker threads that run the runtime's
`stream` iterators, and the events each worker hands back to the request's coroutine.

The runtime serves concurrent generations interleaved (each with its own caches; the device lanes run one
job at a time), so `workers` bounds the generations in flight (and the caches they hold), and `queue`
more requests may wait for a worker; past that a request is refused at once with a 429. A request whose
client went away, or that hit a stop string, is cancelled: its worker stops at the next step and closes
the iterator, which gives the caches back."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from fastapi.responses import StreamingResponse

from . import errors
from .errors import ApiError
from .metrics import Metrics
from .stops import StopText


@dataclass
class Outcome:
    """The end of a generation, as the worker saw it."""

    reason: str  # "stop", "length", "cancelled" or "error"
    stats: object = None
    tokens: int = 0  # generated tokens consumed (up to the stop string, when one ended it)
    error: BaseException | None = None
    stop_sequence: str | None = None  # the stop string that ended it, if one did


@dataclass(eq=False)  # hashed by identity (the engine keeps a set of them)
class Job:
    events: object  # the runtime's stream iterator (not started: it takes its caches at the first step)
    stops: list[str]
    loop: asyncio.AbstractEventLoop
    admitted: float = field(default_factory=time.perf_counter)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    ttft_s: float | None = None

    def put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is gone (shutdown): nobody is listening
            pass

    def cancel(self) -> None:
        self.cancelled.set()

    async def items(self):
        """("text", str) pieces, then one ("end", Outcome)."""
        try:
            while True:
                item = await self.queue.get()
                yield item
                if item[0] == "end":
                    return
        finally:  # the consumer stopped early (client gone, or its task cancelled): stop the worker too
            self.cancel()


class Engine:
    def __init__(self, runtime, metrics: Metrics, workers: int = 4, queue: int = 16):
        self.rt, self.metrics = runtime, metrics
        self.capacity = workers + queue
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="hetero-sd-serve")
        self.lock = threading.Lock()
        self.jobs: set[Job] = set()
        self.running = 0
        self.closing = False

    def admit(self, prompt_ids: list[int], options: dict, stops: list[str], loop, stop_at_eos: bool = True) -> Job:
        """Check and start a generation; raises ApiError (429 when full) or the runtime's own errors."""
        with self.lock:
            if self.closing:
                raise ApiError(503, "the server is shutting down", None, "shutting_down")
            if len(self.jobs) >= self.capacity:
                raise ApiError(429, f"the server is busy: {len(self.jobs)} requests in flight or queued "
                                    f"(at most {self.capacity}); retry later", None, "queue_full")
            job = Job(None, stops, loop)
            self.jobs.add(job)
        try:  # every argument is checked here, before any model work (and before any response is sent)
            job.events = self.rt.stream(prompt_ids, stop_at_eos=stop_at_eos, **options)
        except BaseException:
            self.release(job)
            raise
        self.gauges()
        self.pool.submit(self.run, job)
        return job

    def release(self, job: Job) -> None:
        with self.lock:
            self.jobs.discard(job)
        self.gauges()

    def gauges(self) -> None:
        m = self.metrics
        with self.lock:
            m.running.labels(**m.labels).set(self.running)
            m.waiting.labels(**m.labels).set(len(self.jobs) - self.running)

    def run(self, job: Job) -> None:
        """In a worker thread: step the generation, hand text to the request, stop when asked to."""
        with self.lock:
            self.running += 1
        self.gauges()
        text, outcome, stats, tokens = StopText(job.stops), None, None, 0
        try:
            if job.cancelled.is_set():  # cancelled while queued: no model work at all
                outcome = Outcome("cancelled")
            else:
                for event in job.events:
                    stats, tokens = event.stats, tokens + len(event.token_ids)
                    job.ttft_s = job.ttft_s or time.perf_counter() - job.admitted
                    piece = text.feed(event.text)
                    if piece:
                        job.put(("text", piece))
                    if text.stopped:
                        outcome = Outcome("stop", stop_sequence=text.matched)
                        break
                    if job.cancelled.is_set():
                        outcome = Outcome("cancelled")
                        break
                else:
                    tail = text.flush()
                    if tail:
                        job.put(("text", tail))
                    outcome = Outcome(stats.finish_reason or "length" if stats else "length")
        except Exception as e:  # a device failure, or the runtime closed under us at shutdown
            outcome = Outcome("error", error=e)
        finally:
            job.events.close()  # gives the caches back (a generator's finally runs now)
            outcome = outcome or Outcome("cancelled")
            outcome.stats, outcome.tokens = stats, tokens
            if stats is not None:
                self.metrics.finished(stats, outcome.reason, job.ttft_s, time.perf_counter() - job.admitted)
            with self.lock:
                self.running -= 1
            self.release(job)
            job.put(("end", outcome))

    def cancel_all(self) -> None:
        with self.lock:
            jobs = list(self.jobs)
        for job in jobs:
            job.cancel()

    def close(self, cancel: bool) -> None:
        """Refuse new requests; cancel the ones in flight (or let them finish), and wait for the workers."""
        with self.lock:
            self.closing = True
            jobs = list(self.jobs)
        if cancel:
            for job in jobs:
                job.cancel()
        self.pool.shutdown(wait=True)


class SSE(StreamingResponse):
    """An event stream whose generation is cancelled however the response ends (client gone included)."""

    def __init__(self, content, job: Job):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.job = job

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancel()


def failure(outcome: Outcome) -> ApiError:
    """The API error of a generation that failed or was cancelled."""
    if outcome.reason == "cancelled":
        return ApiError(503, "the generation was cancelled (the server is shutting down)", None, "cancelled")
    e = outcome.error
    if isinstance(e, errors.HeteroSDError):
        return errors.from_hetero(e)
    return ApiError(500, f"the generation failed: {type(e).__name__}: {e}", None, "generation_failed")


async def collected(job: Job, request) -> tuple[str, Outcome]:
    """A non-streamed reply: its whole text and its outcome. A client that goes away meanwhile cancels it."""
    pieces, outcome = [], None
    watcher = asyncio.create_task(watch_disconnect(request, job))
    try:
        async for kind, value in job.items():
            if kind == "text":
                pieces.append(value)
            else:
                outcome = value
    finally:
        watcher.cancel()
    return "".join(pieces), outcome


async def watch_disconnect(request, job: Job) -> None:
    while not job.cancelled.is_set():
        await asyncio.sleep(0.25)
        if await request.is_disconnected():
            job.cancel()
            return
