"""Start-up timings cached per machine, so a restarted model service does not time its passes again.

What a model service times at start-up (specd_engine/autotune.py: its forward passes per thread count,
weight layout and size; the Medusa heads' product; batched rounds; a feature drafter's steps) depends on
the machine, the software and the model, not on the moment. Timing it at every start made a verify killed
by kill -9 under `specd up` serve again 44–47 s later, 36 s of it measuring (2-core AMD EPYC VM, issue 47).
So the raw timings are written to one JSON file per service and key under cache_root()/runtime, the key
holding everything that changes them: the CPU model and usable cores, the GPU's name, the torch and
transformers versions, the model's name, config, dtype and device, the thread counts tried and the options
that decide what is timed, and the measurement's own sizes. A start whose key matches chooses its runtime
from the cached timings exactly as it would from fresh ones, and logs the file; `--remeasure`, or any
change in the key, times again. Timings cut short by the start-up budget (autotune.Budget) are used but
not written, so the next start measures in full. While serving, autotune.ServingTrials still settles the
choices the start-up timings left close, cached or not.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import tempfile
import time
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from specd_common.config import STARTUP_BUDGET_S
from specd_engine import autotune

log = logging.getLogger(__name__)

FORMAT = 1  # what a file holds; bump when that changes: a file of another format is measured over
RUNTIME_FOLDER = "runtime"


def cache_root() -> Path:
    """specd's on-disk cache: $SPECD_CACHE_DIR, else $XDG_CACHE_HOME/specd, else ~/.cache/specd."""
    if os.environ.get("SPECD_CACHE_DIR"):
        return Path(os.environ["SPECD_CACHE_DIR"])
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    return Path(xdg) / "specd" if os.path.isabs(xdg) else Path.home() / ".cache" / "specd"


def runtime_folder(chosen: str = "") -> Path:
    """Where start-up timings are cached: `chosen` when given, else cache_root()/runtime."""
    return Path(chosen).expanduser() if chosen else cache_root() / RUNTIME_FOLDER


def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's model name (/proc/cpuinfo's first "model name", or "Hardware"/"CPU part" on ARM), else
    what platform reports."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        text = ""
    named: dict = {}
    for line in text.splitlines():
        name, colon, value = line.partition(":")
        if colon:
            named.setdefault(name.strip(), value.strip())  # the first CPU's
    for name in ("model name", "Hardware", "CPU part"):
        if named.get(name):
            return named[name]
    return platform.processor() or platform.machine()


def digest(value: Any) -> str:
    """A short stable digest of a JSON-able value, a dataclass or a transformers config (to_dict)."""
    if is_dataclass(value) and not isinstance(value, type):
        value = asdict(value)
    elif hasattr(value, "to_dict"):
        value = value.to_dict()
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


# the engine's pass as timed: a change to specd_engine that changes what a pass costs bumps it, so
# timings cached under the old code are measured again instead of pricing rounds by a stale cost
ENGINE_REVISION = 4


def machine_key(device: str = "cpu") -> dict:
    """What about this machine and its software changes a timing: CPU model, usable cores (affinity,
    cgroup quota, OMP_NUM_THREADS), the GPU when the device is CUDA, torch and transformers versions,
    and the engine's own revision."""
    import torch
    import transformers

    key = {"cpu": cpu_model(), "arch": platform.machine(), "cores": autotune.available_cores(),
           "torch": torch.__version__, "transformers": transformers.__version__, "engine": ENGINE_REVISION}
    if device.startswith("cuda"):
        key["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return key


def model_key(name: str, model: Any) -> dict:
    """A model's identity as far as timings go: its name or path, its config (every shape), its dtype
    and device. The weights' values change no timing, so they are not read."""
    parameter = next(model.parameters())
    return {"model": name, "config": digest(model.config), "dtype": str(parameter.dtype), "device": str(parameter.device)}


def encode(timings: dict) -> list:
    """measure_interleaved's {(threads, ...): seconds} as JSON: [[[threads, ...], seconds], ...]."""
    return [[list(key), seconds] for key, seconds in timings.items()]


def decode(rows: list) -> dict:
    """encode's inverse; ValueError/TypeError on anything else."""
    timings = {}
    for key, seconds in rows:
        if not isinstance(key, list) or not all(isinstance(part, (int, str)) for part in key) or not isinstance(key[0], int):
            raise ValueError(f"bad timing key {key!r}")
        timings[tuple(key)] = float(seconds)
    return timings


def read(path: Path, key: dict) -> dict:
    """name → timings cached at `path` for exactly `key`; {} when there are none, with a warning when the
    file is unreadable, of another format or for another key (it is then measured over, never trusted)."""
    if not path.exists():
        return {}
    try:
        record = json.loads(path.read_text())
        if record.get("format") != FORMAT or record.get("key") != key:
            log.warning("start-up timings in %s are of another format or key: measuring again (and rewriting it)", path)
            return {}
        return {name: decode(rows) for name, rows in record["timings"].items()}
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as error:
        log.warning("start-up timings in %s are unreadable (%s): measuring again (and rewriting it)", path, error)
        return {}


def write(path: Path, record: dict) -> None:
    """Write atomically: a temporary file in the same folder, then os.replace, so a start killed while
    writing (or two services writing at once) leaves the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w") as file:
            json.dump(record, file, separators=(",", ":"))
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


class StartupTimings:
    """One service's start-up timings: `measure` (an autotune.Measure) answers from the cache file when
    its key matches, else times within the budget; `finish` writes what was timed in full and says how
    the runtime was chosen."""

    def __init__(self, service: str, key: dict, folder: Optional[Path] = None, remeasure: bool = False,
                 budget: Optional[autotune.Budget] = None):
        self.key = json.loads(json.dumps({"format": FORMAT, "service": service, **key}, default=str))  # as it reads back
        self.path = folder / f"{service}-{digest(self.key)}.json" if folder is not None else None
        self.budget = budget or autotune.Budget()
        self.cached = read(self.path, self.key) if self.path is not None and not remeasure else {}
        self.measured: dict = {}
        if self.cached:
            log.info("start-up timings: from the cache %s, not measured (--remeasure measures again)", self.path)

    @classmethod
    def open(cls, service: str, key: dict, cache_dir: Optional[str], remeasure: bool = False,
             budget_s: float = STARTUP_BUDGET_S) -> "StartupTimings":
        """cache_dir: None for no cache, '' for runtime_folder()'s default, else that folder."""
        folder = None if cache_dir is None else runtime_folder(cache_dir)
        return cls(service, key, folder, remeasure, autotune.Budget(budget_s))

    def measure(self, name: str, make_runs: Callable[[], dict], repeats: int) -> dict:
        """The cached timings of `name`, else measured now within what is left of the budget; {} when
        the budget was spent before it began (the caller keeps its defaults)."""
        if name in self.cached:
            return self.cached[name]
        if self.budget.spent():
            self.budget.cut.append(f"{name} not timed")
            return {}
        started = time.monotonic()
        timings = autotune.measure_interleaved(make_runs(), repeats, self.budget, name)
        self.measured[name] = timings
        log.info("start-up timing of %s: %.1f s (%.1f s since the first; budget %s)", name, time.monotonic() - started,
                 self.budget.elapsed(), f"{self.budget.seconds:.0f} s" if self.budget.seconds > 0 else "none")
        return timings

    @property
    def source(self) -> str:
        """How the timings were obtained, for RuntimeChoice.source: cached, measured or cut short."""
        if self.budget.cut:
            return "measured, cut short by the start-up budget"
        return "cached" if self.cached and not self.measured else "measured"

    def finish(self) -> Optional[Path]:
        """Write the timings when something was measured and nothing cut short (cached ones merged in);
        a budget cut is logged and not written. Returns the file written, if any. A cache that cannot
        be written is a warning: the service serves all the same."""
        if self.budget.cut:
            log.warning("start-up timings cut short by their %.0f s budget (%s): the runtime is chosen from the rounds "
                        "timed; not cached, so the next start measures again", self.budget.seconds, "; ".join(self.budget.cut))
            return None
        if self.path is None or not self.measured:
            return None
        timings = {name: encode(found) for name, found in {**self.cached, **self.measured}.items()}
        record = {"format": FORMAT, "key": self.key, "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                  "measuring_s": round(self.budget.elapsed(), 1), "timings": timings}
        try:
            write(self.path, record)
        except OSError as error:
            log.warning("start-up timings not cached in %s: %s", self.path, error)
            return None
        log.info("start-up timings cached in %s", self.path)
        return self.path
