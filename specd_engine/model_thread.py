"""One thread runs every torch computation of a model service.

Why: with PyTorch's OpenMP backend, each thread that runs a multi-threaded torch op gets an OpenMP
team of its own. A model service used to run its passes on the batcher's worker (or on whichever
gRPC thread asked), the start-up measurements on the main thread, and the argmax over the logits,
the Medusa heads and the sampling softmax on the gRPC threads: several teams on the same cores.
Once a second team exists, every multi-threaded pass gets slower for the rest of the process
(2-core AMD EPYC VM, default target, 4-position pass at 2 threads, in-process: 59–60 ms while one
thread had run parallel work, 66–68 ms once a second thread had; `OMP_WAIT_POLICY=PASSIVE` 73 ms;
`GOMP_SPINCOUNT` no help). With one thread for all of it there is one team, and the cores run the
model instead of idle workers of other teams.

So a model service loads its model, measures it and serves it on `shared()`, the process's one
model thread, and keeps torch work off its other threads. The calling thread's contextvars (the
RPC's trace context among them) travel with each call, so spans opened on the model thread stay
children of the caller's. One rule: work on the model thread must never wait for another thread
that itself needs the model thread. ForwardBatcher's worker does (its batch runs here), so a caller
that batches (a draft servicer around a model drafter, say) must call from its own thread, not
hand the whole call over: that deadlocked the concurrent-streams test when tried.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import queue
import threading
from pathlib import Path
from concurrent.futures import Future
from typing import Any, Callable


class ModelThread:
    """A daemon thread that runs submitted calls one at a time, in order; `run` waits for the result."""

    def __init__(self, name: str = "specd-model"):
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=serve_calls, args=(self._calls,), name=name, daemon=True)
        self._thread.start()

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """fn(*args, **kwargs) on the model thread (directly when already on it); its result or its exception."""
        if threading.current_thread() is self._thread:
            return fn(*args, **kwargs)
        future: Future = Future()
        self._calls.put((future, contextvars.copy_context(), fn, args, kwargs))
        return future.result()

    def stop(self) -> None:
        """Let the thread end after the calls already queued (it does not wait for them)."""
        self._calls.put(None)

    @property
    def thread(self) -> threading.Thread:
        return self._thread


_shared: ModelThread | None = None
_shared_lock = threading.Lock()


def shared() -> ModelThread:
    """The process's model thread (started on first use; it lives as long as the process)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = ModelThread()
        return _shared


def serve_calls(calls: queue.SimpleQueue) -> None:
    """The thread's loop: run each queued call in its caller's context until `stop` queues None."""
    profiler = CallProfiler.from_environment()
    while (call := calls.get()) is not None:
        future, context, fn, args, kwargs = call
        try:
            with profiler.call():
                result = context.run(fn, *args, **kwargs)
            future.set_result(result)
        except BaseException as error:  # the caller re-raises it in its own thread
            future.set_exception(error)
        # hold nothing of a finished call while waiting for the next: its arguments (a session holding a
        # KV store slot, specd_engine/flat_pass.py) must go when their callers drop them
        call = future = context = fn = args = kwargs = result = None


class CallProfiler:
    """torch.profiler over a window of the model thread's calls, for a service on a device nobody can
    watch live (the GPU check's bench): with SPECD_PROFILE_DIR set, calls `skip` .. `skip + count`
    (SPECD_PROFILE_CALLS, default "100:300": past start-up, into steady decoding) are recorded and
    their operator table, sorted by host time, is written to DIR/profile-<pid>.txt. Every torch op
    of a service runs on this thread, so the table holds all of them: kernel launches, copies and
    synchronisations per pass are what make a small model's pass host-bound on a GPU."""

    def __init__(self, folder: str = "", skip: int = 0, count: int = 0):
        self.folder, self.skip, self.count = folder, skip, count
        self.calls = 0
        self._profile = None

    @classmethod
    def from_environment(cls) -> "CallProfiler":
        folder = os.environ.get("SPECD_PROFILE_DIR", "")
        skip, count = (int(part) for part in os.environ.get("SPECD_PROFILE_CALLS", "100:300").split(":"))
        return cls(folder, skip, count)

    @contextlib.contextmanager
    def call(self):
        if not self.folder or self.calls > self.skip + self.count:
            yield
            return
        if self.calls == self.skip:
            import torch.profiler

            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profile = torch.profiler.profile(activities=activities)
            self._profile.__enter__()
        try:
            yield
        finally:
            self.calls += 1
            if self._profile is not None and self.calls == self.skip + self.count:
                self._write()

    def _write(self) -> None:
        profile, self._profile = self._profile, None
        profile.__exit__(None, None, None)
        table = profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
        path = Path(self.folder) / f"profile-{os.getpid()}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{self.count} model-thread calls after {self.skip}\n{table}\n")
