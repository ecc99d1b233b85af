"""One study: measuring a variant (check -> gate -> time), the Optuna storage, the trial loop of a
worker (:func:`run_study`) and the final interleaved re-timing (:func:`finalize`)."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import math
import os
import random
import signal
import socket
import sqlite3
import statistics
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import optuna
import sqlalchemy
import sqlalchemy.exc
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState

from .. import __version__, codegen
from ..configdb import dispatch
from ..configdb.store import Entry
from ..paths import cache_dir
from ..variant import _Variant
from .backends import Backend, DeviceLost, TrialTimeout, classify_failure
from .problem import StudySpec, _defaults, variants_for
from .space import SearchSpace, SpaceContext, load_space

optuna.logging.set_verbosity(optuna.logging.WARNING)


# -- measuring one variant ----------------------------------------------------------------------
@contextlib.contextmanager
def _time_limit(seconds: float | None):
    """Raise :class:`TrialTimeout` in the block after ``seconds`` (main thread on POSIX; else the
    caller checks the elapsed time afterwards)."""
    usable = (
        seconds and seconds > 0 and hasattr(signal, "setitimer")
        and threading.current_thread() is threading.main_thread()
    )
    if not usable:
        yield
        return

    def on_alarm(signum, frame):
        raise TrialTimeout(f"exceeded the per-trial time limit of {seconds:g} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@dataclass
class Outcome:
    """The result of measuring one variant."""

    status: str  # ok | gate | compile_error | out_of_resources | runtime_error | timeout | invalid
    reason: str = ""
    errors: dict = field(default_factory=dict)
    timing: dict = field(default_factory=dict)
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def measure(backend: Backend, spec: StudySpec, variant: _Variant, time_limit: float | None = None) -> Outcome:
    """check -> gate -> time one variant of ``spec.kernel``; failures become an :class:`Outcome`."""
    kv = variants_for(spec.kernel, variant, spec.problem)
    t0 = time.monotonic()
    try:
        with _time_limit(time_limit):
            errors = backend.check(spec.kernel, kv, spec.problem)
            why = spec.gate.failure(errors)
            if why:
                return Outcome("gate", why, errors=errors, wall_s=time.monotonic() - t0)
            timing = backend.time(spec.kernel, kv, spec.problem)
    except Exception as exc:  # noqa: BLE001 - classified below, the rest re-raised
        status = classify_failure(exc)
        if status is None:
            raise
        return Outcome(status, f"{type(exc).__name__}: {exc}"[:1000], wall_s=time.monotonic() - t0)
    wall = time.monotonic() - t0
    if time_limit and wall > time_limit:
        return Outcome("timeout", f"took {wall:.1f} s, over the per-trial time limit of {time_limit:g} s", errors, wall_s=wall)
    return Outcome("ok", errors=errors, timing=timing, wall_s=wall)


# -- storage and studies ------------------------------------------------------------------------
def default_storage_url() -> str:
    return f"sqlite:///{cache_dir() / 'studies.db'}"


# Attempts at creating a storage whose tables another process creates at the same moment.
STORAGE_ATTEMPTS = 6


def make_storage(url: str | None = None) -> optuna.storages.BaseStorage:
    """Optuna RDB storage for ``url`` (default: the SQLite file in the user cache).

    Several processes may open one fresh database at once (``--workers``, or machines sharing a
    ``--storage``): the one that loses the race to create Optuna's tables gets an IntegrityError
    (or "table ... already exists", "database is locked"); it waits a moment and opens the now
    existing database again. (SQLite refuses a change of journal mode with "database is locked" at
    once, without waiting for the lock, while another process holds it: sqlite3's own error.)"""
    url = url or default_storage_url()
    for attempt in range(STORAGE_ATTEMPTS):
        try:
            return _open_storage(url)
        except (sqlalchemy.exc.IntegrityError, sqlalchemy.exc.OperationalError, sqlite3.OperationalError) as exc:
            racing = isinstance(exc, sqlalchemy.exc.IntegrityError) or any(
                m in str(exc).lower() for m in ("locked", "already exists"))
            if attempt == STORAGE_ATTEMPTS - 1 or not racing:
                raise
            time.sleep(0.2 * (attempt + 1) * (1 + random.random()))
    raise AssertionError("unreachable")  # pragma: no cover


def _open_storage(url: str) -> optuna.storages.BaseStorage:
    if not url.startswith("sqlite:///"):
        return optuna.storages.RDBStorage(url)
    # SQLite: wait for other workers' locks instead of failing, and use write-ahead logging with
    # synchronous=NORMAL (no fsync per commit: ~10x faster trials; a crash of the process loses nothing).
    path = url[len("sqlite:///"):]
    if path and path != ":memory:":
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        con = sqlite3.connect(path, timeout=120)
        try:
            con.execute("PRAGMA journal_mode=WAL")
        finally:
            con.close()
    storage = optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": {"timeout": 120}})

    def on_connect(dbapi_connection, _record):
        dbapi_connection.execute("PRAGMA synchronous=NORMAL")

    sqlalchemy.event.listen(storage.engine, "connect", on_connect)
    storage.engine.dispose()  # connections opened while creating the tables reconnect with the pragma
    return storage


def _storage(storage) -> optuna.storages.BaseStorage:
    return storage if isinstance(storage, optuna.storages.BaseStorage) else make_storage(storage)


# -- the studies database, shown, failing, read without changing it ------------------------------
# What a failing studies database raises: Optuna wraps SQLAlchemy's errors of a commit in its own
# StorageInternalError; reads raise SQLAlchemy's (which wrap the driver's, e.g. sqlite3's).
STORAGE_ERRORS = (optuna.exceptions.StorageInternalError, sqlalchemy.exc.SQLAlchemyError, sqlite3.Error)


class StorageFailed(optuna.exceptions.StorageInternalError):
    """The studies database failed in a worker process: the reason, one line without the password."""


def display_url(url) -> str:
    """``url`` as it may be shown (stdout, error lines, ``report.md``): its password masked as
    SQLAlchemy masks it (``postgresql://user:***@host/db``). A string SQLAlchemy cannot parse is shown
    as it is only when it holds no ``@``; else what lies between its scheme and its last ``@`` is masked."""
    text = str(url)
    try:
        parsed = sqlalchemy.engine.make_url(text)
    except Exception:  # noqa: BLE001 - not a URL: shown as is, unless it may hold credentials
        if "@" not in text:
            return text
        scheme, sep, _ = text.partition("://")
        return (scheme + sep if sep else "") + "***@" + text.rsplit("@", 1)[1]
    if parsed.password is None:
        return text  # (as given: render_as_string may re-quote a path)
    return parsed.render_as_string(hide_password=True)


def hide_secrets(text: str, url) -> str:
    """``text`` (an error message) with ``url`` as :func:`display_url` shows it and its password nowhere."""
    text, raw = str(text), str(url)
    if raw:
        text = text.replace(raw, display_url(raw))
    try:
        password = sqlalchemy.engine.make_url(raw).password
    except Exception:  # noqa: BLE001
        password = None
    if password and len(str(password)) >= 4:  # (alone in a message; a shorter one would mask letters everywhere)
        from urllib.parse import quote_plus

        for form in {str(password), quote_plus(str(password))}:
            text = text.replace(form, "***")
    return text


def storage_failure(exc: BaseException, url) -> str:
    """Why the studies database at ``url`` failed, in one line without its password: the driver's
    error where there is one (Optuna's StorageInternalError and SQLAlchemy's errors wrap it)."""
    if isinstance(exc, StorageFailed):  # (already said by the worker)
        return hide_secrets(str(exc), url)
    chain, e = [], exc
    while e is not None and not any(e is c for c in chain):
        chain.append(e)
        e = e.__cause__ or e.__context__
    pick = None
    for e in chain:  # the outermost error that names the driver's reason
        if isinstance(e, sqlalchemy.exc.DBAPIError) and e.orig is not None:
            pick = e.orig
            break
        if isinstance(e, sqlite3.Error):
            pick = e
            break
    if pick is None:
        pick = next((e for e in chain if str(e).strip() and not isinstance(e, optuna.exceptions.StorageInternalError)),
                    exc)
    message = str(pick).strip()
    first = message.splitlines()[0] if message else ""
    return hide_secrets(f"{type(pick).__name__}: {first}"[:300] if first else type(pick).__name__, url)


def _optuna_tables() -> set:
    """The tables of an Optuna RDB storage (those RDBStorage creates when they are missing)."""
    try:
        from optuna.storages._rdb import models

        return set(models.BaseModel.metadata.tables)
    except Exception:  # noqa: BLE001 - (a private module): the tables every Optuna version has
        return {"studies", "study_directions", "study_user_attributes", "study_system_attributes", "trials",
                "trial_params", "trial_values", "trial_user_attributes", "trial_system_attributes",
                "trial_intermediate_values", "version_info"}


def _read_only(url: str) -> tuple[str, dict]:
    """(URL, engine keyword arguments) that read ``url`` and cannot change it where the driver allows:
    a SQLite file is opened read-only, so that neither a table nor the file itself is created."""
    parsed = sqlalchemy.engine.make_url(url)
    if parsed.get_backend_name() == "sqlite" and parsed.database not in (None, "", ":memory:"):
        uri = Path(parsed.database).resolve().as_uri() + "?mode=ro"
        return url, {"creator": lambda: sqlite3.connect(uri, uri=True, timeout=120, check_same_thread=False)}
    return url, {}


def check_existing_storage(url: str) -> str | None:
    """Why ``url`` holds no readable Optuna studies database (one line, without its password), or
    None. Reads only: Optuna's RDBStorage would create the missing tables of a damaged or foreign
    database, and a report must change nothing."""
    try:
        target, kwargs = _read_only(url)
        engine = sqlalchemy.create_engine(target, **kwargs)
        try:
            with engine.connect() as con:
                tables = set(sqlalchemy.inspect(con).get_table_names())
        finally:
            engine.dispose()
    except (*STORAGE_ERRORS, OSError, ImportError) as exc:  # (ImportError: the URL's driver is not installed)
        return f"cannot read it: {storage_failure(exc, url)}"
    missing = sorted(_optuna_tables() - tables)
    if not tables:
        return "it holds no table: not a studies database"
    if missing:
        return (f"not a complete Optuna studies database: table(s) {', '.join(missing)} missing (damaged, "
                "or written by another program); nothing was changed")
    return None


def open_existing_storage(url: str) -> optuna.storages.BaseStorage:
    """The Optuna storage at ``url``, for reading, when it holds a complete studies database (read-only
    where the driver allows, no table created); ValueError (one line) when not, having changed
    nothing (see :func:`check_existing_storage`)."""
    problem = check_existing_storage(url)
    if problem:
        raise ValueError(problem)
    target, kwargs = _read_only(url)
    try:
        return optuna.storages.RDBStorage(target, engine_kwargs=kwargs, skip_table_creation=True)
    except TypeError:  # an Optuna without skip_table_creation (< 4.x): the tables were checked above
        return optuna.storages.RDBStorage(target, engine_kwargs=kwargs)


# -- Ctrl-C ---------------------------------------------------------------------------------------
# Ctrl-C raises KeyboardInterrupt wherever the main thread is, and one raised inside a finalizer (a
# SQLAlchemy connection's, a weakref callback) is printed and swallowed: the run would go on. While a
# run is guarded, the SIGINT handler also sets a flag, checked at the safe points (before a trial,
# before a study's final re-timing, between re-timing rounds, while waiting for workers).
_interrupt = {"requested": False}


def interrupt_requested() -> bool:
    """Ctrl-C was pressed during the guarded run (:func:`stop_on_interrupt`), swallowed or not."""
    return _interrupt["requested"]


def check_interrupt() -> None:
    """A safe point: raise KeyboardInterrupt if Ctrl-C was pressed (even if its exception was swallowed)."""
    if _interrupt["requested"]:
        raise KeyboardInterrupt("interrupted (Ctrl-C)")


def _on_sigint(signum, frame):
    _interrupt["requested"] = True
    raise KeyboardInterrupt


@contextlib.contextmanager
def stop_on_interrupt():
    """Guard a run: Ctrl-C raises KeyboardInterrupt as usual and sets a flag that the safe points
    check (:func:`check_interrupt`), so that an interrupt swallowed inside a finalizer still stops the
    run after the current trial. The flag is cleared on entry and on exit (a later unguarded run is
    not stopped by it); the old handler is restored on exit. Only in the main thread (the one that
    gets signals), and not where SIGINT is ignored (a job started with ``nohup`` or ``&`` from a
    script): such a run stays immune to Ctrl-C, as its launcher asked."""
    _interrupt["requested"] = False
    if threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        try:
            yield
        finally:
            _interrupt["requested"] = False
        return
    old = signal.signal(signal.SIGINT, _on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old if old is not None else signal.default_int_handler)
        _interrupt["requested"] = False


def _distributions(space: SearchSpace) -> dict:
    return {name: CategoricalDistribution(list(values)) for name, values in space.knobs.items()}


def open_study(spec: StudySpec, storage, seed: int = 0, worker: int = 0) -> optuna.Study:
    """Create or load (same name) the study of ``spec``; the sampler is seeded from ``seed``, the
    worker index and the number of trials already stored (so a resumed run does not replay)."""
    storage = _storage(storage)
    probe = optuna.create_study(study_name=spec.name, storage=storage, direction="minimize", load_if_exists=True)
    n_existing = len(probe.get_trials(deepcopy=False))
    sampler = optuna.samplers.TPESampler(
        seed=(seed * 1_000_003 + worker * 7_919 + n_existing) % 2**32,
        n_startup_trials=max(5, min(10, spec.n_trials // 4)),
    )
    study = optuna.load_study(study_name=spec.name, storage=storage, sampler=sampler)
    if not study.user_attrs:
        study.set_user_attr("key", spec.key.to_dict())
        study.set_user_attr("gpu", spec.gpu)
        study.set_user_attr("gate", dataclasses.asdict(spec.gate))
        study.set_user_attr("template_hash", codegen.template_hash(spec.kernel))
    return study


def tuned_before(spec: StudySpec) -> list:
    """The variant of the tuned-config entry this study would replace (its key, on any template): after
    a template changes, the winner of the last search is measured first, so that a short search
    keeps what a long one found."""
    return [entry.variant for entry in dispatch.stored_entries(spec.gpu) if entry.key == spec.key]


def warm_starts(spec: StudySpec, specs: Sequence[StudySpec], storage) -> list:
    """What a study measures first after the default: the entry it would replace, then the winners of
    the same head at neighbouring token buckets."""
    found = tuned_before(spec)
    return found + [v for v in sibling_best(spec, specs, storage) if v not in found]


def sibling_best(spec: StudySpec, specs: Sequence[StudySpec], storage, limit: int = 2) -> list:
    """The best measured variant of each study of ``specs`` that tunes the same kernel on the same head
    (V, D, dtype, flags, data) at another token bucket, nearest bucket first (at most ``limit``):
    what a study measures first after the default (a winner at 4096 tokens is often one at 8192)."""
    p = spec.problem
    same = [s for s in specs if s.kernel == spec.kernel and s.problem.B != p.B
            and dataclasses.replace(s.problem, B=p.B) == p]
    same.sort(key=lambda s: abs(math.log2(s.problem.B / p.B)))
    space = load_space(spec.kernel)
    found = []
    for s in same:
        try:
            study = optuna.load_study(study_name=s.name, storage=_storage(storage))
        except KeyError:
            continue
        done = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE and _measured(t)]
        if done:
            v = space.variant(min(done, key=lambda t: t.value).params)
            if v not in found:
                found.append(v)
        if len(found) >= limit:
            break
    return found


def _worker_dead(worker) -> bool:
    """True when ``worker`` ("host:pid:wN", a trial's claimant) ran on this host and its process is
    gone (kill -9, an OOM kill, a Ctrl-C'd worker child): its RUNNING trial will never finish. A
    worker on another host is judged by the trial's age instead."""
    try:
        host, pid, _ = str(worker).rsplit(":", 2)
        pid = int(pid)
    except ValueError:
        return False
    if host != socket.gethostname() or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's live process
        return False
    return _zombie(pid)


def _zombie(pid: int) -> bool:
    """Whether process ``pid`` has exited but not been reaped (a killed run's orphaned worker, where
    nothing reaps orphans, as in many containers): it still answers a signal 0. Linux's /proc only."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state in (b"Z", b"X")


def _measured(t) -> bool:
    return bool(t.user_attrs.get("measured"))


@dataclass
class StudyStats:
    """What one worker's run of a study did, and the study's state afterwards."""

    name: str
    measured: int = 0  # trials this run measured
    total_measured: int = 0  # in the study, all runs and workers
    complete: int = 0
    failed: dict = field(default_factory=dict)  # status -> count (in the study)
    infeasible: int = 0
    duplicates: int = 0
    best_ms: float | None = None
    stopped: str = ""


def _summary(study: optuna.Study, stats: StudyStats) -> StudyStats:
    trials = study.get_trials(deepcopy=False)
    stats.total_measured = sum(1 for t in trials if _measured(t) and t.state in (TrialState.COMPLETE, TrialState.PRUNED))
    complete = [t for t in trials if t.state == TrialState.COMPLETE and _measured(t)]
    stats.complete = len(complete)
    stats.best_ms = min((t.value for t in complete), default=None)
    failed: dict = {}
    for t in trials:
        if t.state == TrialState.PRUNED and _measured(t):
            s = t.user_attrs.get("status", "?")
            failed[s] = failed.get(s, 0) + 1
    stats.failed = failed
    stats.infeasible = sum(1 for t in trials if t.user_attrs.get("status") == "infeasible")
    stats.duplicates = sum(1 for t in trials if t.user_attrs.get("status") == "duplicate")
    return stats


class _Progress:
    """One stderr line: trials done / budget, best so far, failures (rewritten in place on a tty)."""

    def __init__(self, label: str, total: int, stream=None):
        self.label = label
        self.total = total
        self.stream = stream
        self.tty = bool(stream is not None and getattr(stream, "isatty", lambda: False)())
        self.t0 = time.monotonic()
        self.last_printed = -1

    def update(self, stats: StudyStats, final: bool = False) -> None:
        if self.stream is None:
            return
        best = f"{stats.best_ms:.4g} ms" if stats.best_ms is not None else "-"
        failed = sum(stats.failed.values())
        line = (f"[{self.label}] {stats.total_measured}/{self.total} trials, best {best}, {failed} failed, "
                f"{stats.infeasible} ruled out, {time.monotonic() - self.t0:.0f} s")
        if final and stats.stopped:
            line += f" ({stats.stopped})"
        if self.tty:
            self.stream.write("\r" + line + ("\n" if final else ""))
        elif final or stats.measured % 10 == 0:
            if not (final and stats.measured == self.last_printed):
                self.stream.write(line + "\n")
            self.last_printed = stats.measured
        self.stream.flush()


def _ask_fixed(study: optuna.Study, dists: dict, params: Mapping[str, Any]) -> optuna.Trial:
    """A new trial whose knobs are ``params`` (recorded in the study like any sampled trial)."""
    base = study.sampler
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        study.sampler = optuna.samplers.PartialFixedSampler(dict(params), base)
    try:
        return study.ask(dists)
    finally:
        study.sampler = base


def _params_key(space: SearchSpace, params: Mapping[str, Any]) -> tuple:
    return tuple(params.get(k) for k in space.knobs)


def _alternative(space: SearchSpace, params: Mapping[str, Any], ctx: SpaceContext, taken: set,
                 rng: random.Random, tries: int = 200) -> dict | None:
    """A feasible point not in ``taken``: a one-step neighbour of ``params`` if one is free, else a
    random point; None when ``tries`` random points found nothing (the space is about exhausted)."""
    moves = []
    for name, values in space.knobs.items():
        i = values.index(params[name])
        moves += [(name, values[j]) for j in (i - 1, i + 1) if 0 <= j < len(values)]
    rng.shuffle(moves)
    candidates = ({**params, name: value} for name, value in moves)
    randoms = ({k: rng.choice(v) for k, v in space.knobs.items()} for _ in range(tries))
    for cand in (*candidates, *randoms):
        if _params_key(space, cand) not in taken and space.reject_reason(cand, ctx) is None:
            return cand
    return None


def run_study(spec: StudySpec, backend: Backend, storage=None, *, seed: int = 0, worker: int = 0,
              timeout_s: float | None = None, trial_time_limit: float | None = 120.0,
              max_idle: int = 300, progress=None, warm_start: Sequence = ()) -> StudyStats:
    """Run trials of ``spec`` until the study holds ``spec.n_trials`` measured trials (shared with any
    other worker on the same storage), ``timeout_s`` passes, or ``max_idle`` samples in a row were
    ruled out or already measured (the feasible space is exhausted). ``warm_start``: variants worth
    measuring first (the winners of the same kernel at a neighbouring token bucket)."""
    check_interrupt()
    storage = _storage(storage)
    study = open_study(spec, storage, seed, worker)
    space = load_space(spec.kernel)
    ctx = spec.problem.space_context(backend.smem_limit())
    dists = _distributions(space)
    stale_after = 3 * (trial_time_limit or 600) + 300
    me = f"{socket.gethostname()}:{os.getpid()}:w{worker}"

    # Points this worker measures next with fixed knobs (not Optuna's enqueue_trial: with SQLite two
    # workers can pop the same waiting trial). Worker 0 starts a fresh study with the default.
    pending: list[tuple[dict, str]] = []
    default = getattr(_defaults(spec.problem), spec.kernel)
    if (worker == 0 and not any(t.user_attrs.get("proposed") == "baseline" for t in study.get_trials(deepcopy=False))
            and space.contains(default) and space.reject_reason(space.params_of(default), ctx) is None):
        pending.append((space.params_of(default), "baseline"))
    # Then the winners of neighbouring studies, once per study.
    if worker == 0 and not any(t.user_attrs.get("proposed") == "warm start" for t in study.get_trials(deepcopy=False)):
        for v in warm_start:
            if space.contains(v) and v != default:
                params = space.params_of(v)
                if space.reject_reason(params, ctx) is None:
                    pending.append((params, "warm start"))
    # Then the space's seeds (known-good points, merged over the default), once per study.
    if worker == 0 and not any(str(t.user_attrs.get("proposed", "")).startswith("seed") for t in study.get_trials(deepcopy=False)):
        for i, partial in enumerate(space.seeds):
            params = {**space.params_of(default), **partial} if space.contains(default) else None
            if params is not None and space.reject_reason(params, ctx) is None:
                pending.append((params, f"seed {i}"))

    stats = StudyStats(spec.name)
    bar = _Progress(spec.label(), spec.n_trials, progress)
    backend.prepare(spec.problem)  # (the data: not on the study's clock)
    deadline = time.monotonic() + timeout_s if timeout_s else None
    rng = random.Random(f"{seed}:{worker}:{spec.name}")
    idle = 0
    while True:
        check_interrupt()  # (a safe point: a Ctrl-C swallowed during the last trial stops the run here)
        if deadline is not None and time.monotonic() > deadline:
            stats.stopped = "time budget reached"
            break
        trials = study.get_trials(deepcopy=False)
        now = datetime.datetime.now()
        for t in trials:  # trials of a worker that died: failed, so their slot is free again
            if t.state == TrialState.RUNNING and t.user_attrs.get("worker") != me and (
                    _worker_dead(t.user_attrs.get("worker"))
                    or (t.datetime_start and (now - t.datetime_start).total_seconds() > stale_after)):
                try:
                    study.tell(t.number, state=TrialState.FAIL, skip_if_finished=True)
                except optuna.exceptions.UpdateFinishedTrialError:
                    pass  # another worker closed it between our read and our write (a server database's race)
        claimed = sum(1 for t in trials if _measured(t) and t.state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING))
        if claimed >= spec.n_trials:
            stats.stopped = "trial budget reached"
            break
        if idle >= max_idle:
            stats.stopped = f"{max_idle} samples in a row ruled out or already measured: space exhausted"
            break
        if pending:
            fixed, why = pending.pop(0)
            trial = _ask_fixed(study, dists, fixed)
            trial.set_user_attr("proposed", why)
        else:
            trial = study.ask(dists)
        params = dict(trial.params)
        trial.set_user_attr("worker", me)
        reason = space.reject_reason(params, ctx)
        if reason:
            trial.set_user_attr("status", "infeasible")
            trial.set_user_attr("reason", reason)
            study.tell(trial, state=TrialState.PRUNED)
            idle += 1
            continue
        # Claim the point: mark it measured, then look at the study again. Another claim of the same
        # knobs (running or done) makes this one a duplicate; of two racing claims at least one sees
        # the other, so a point is never measured twice. Claims with a lower number than this one
        # come first for the trial budget.
        trial.set_user_attr("measured", True)
        fresh = study.get_trials(deepcopy=False)
        live = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING)
        twin = next((t for t in fresh if t.number != trial.number and _measured(t) and t.state in live
                     and t.params == params), None)
        if twin is not None:
            # TPE re-proposes points it likes once a small space is mostly explored: record the
            # repeat for free and queue an unmeasured neighbour instead (one knob one step away).
            trial.set_user_attr("measured", False)
            trial.set_user_attr("status", "duplicate")
            trial.set_user_attr("reason", f"same knobs as trial {twin.number}")
            study.tell(trial, state=TrialState.FAIL)
            taken = {_params_key(space, t.params) for t in fresh if _measured(t)}
            alt = _alternative(space, params, ctx, taken, rng)
            if alt is not None:
                pending.append((alt, f"neighbour of trial {twin.number}"))
            idle += 1 if alt is None else 0
            continue
        ahead = sum(1 for t in fresh if t.number < trial.number and _measured(t) and t.state in live)
        if ahead >= spec.n_trials:
            trial.set_user_attr("measured", False)
            trial.set_user_attr("status", "over_budget")
            study.tell(trial, state=TrialState.FAIL)
            stats.stopped = "trial budget reached"
            break
        idle = 0
        variant = space.variant(params)
        try:
            outcome = measure(backend, spec, variant, trial_time_limit)
        except BaseException as exc:  # interrupted (Ctrl-C) or an unexpected error: free the slot, re-raise
            trial.set_user_attr("measured", False)
            trial.set_user_attr("status", "interrupted")
            trial.set_user_attr("reason", f"{type(exc).__name__}: {exc}"[:1000])
            study.tell(trial, state=TrialState.FAIL)
            raise
        trial.set_user_attr("status", outcome.status)
        trial.set_user_attr("wall_s", round(outcome.wall_s, 3))
        if outcome.errors:
            trial.set_user_attr("errors", {k: float(v) for k, v in outcome.errors.items()})
        if outcome.ok:
            trial.set_user_attr("p20_ms", outcome.timing["p20_ms"])
            trial.set_user_attr("p80_ms", outcome.timing["p80_ms"])
            study.tell(trial, outcome.timing["median_ms"])
        else:
            trial.set_user_attr("reason", outcome.reason)
            study.tell(trial, state=TrialState.PRUNED)
            if outcome.status == "cuda_fatal":
                raise DeviceLost(f"trial {trial.number} of {spec.label()} broke the CUDA context "
                                 f"({outcome.reason}); it is recorded as failed: run the same command again to resume")
        stats.measured += 1
        if progress is not None:
            bar.update(_summary(study, stats))
    _summary(study, stats)
    bar.update(stats, final=True)
    return stats


def _retime(backend: Backend, spec: StudySpec, pool: list, rounds: int, time_limit: float | None) -> dict:
    """Interleaved re-timing: every round times each variant once, starting one later each round."""
    runs: dict = {v: [] for v in pool}
    dead: set = set()
    for r in range(rounds):
        check_interrupt()
        order = pool[r % len(pool):] + pool[: r % len(pool)]
        for v in order:
            if v in dead:
                continue
            try:
                with _time_limit(time_limit):
                    runs[v].append(backend.time(spec.kernel, variants_for(spec.kernel, v, spec.problem), spec.problem))
            except Exception as exc:  # noqa: BLE001
                if classify_failure(exc) is None:
                    raise
                dead.add(v)
    return {
        v: {k: statistics.median(t[f"{k}_ms"] for t in ts) for k in ("median", "p20", "p80")}
        for v, ts in runs.items() if ts and v not in dead
    }


def finalize(spec: StudySpec, backend: Backend, storage=None, *, top_k: int = 3, rounds: int = 3,
             time_limit: float | None = 120.0, log: Callable[[str], Any] | None = None) -> Entry | None:
    """Re-time the ``top_k`` best distinct variants of the study interleaved with the built-in default
    and return the winner as a database entry (None when no trial passed). ``log`` gets a line when
    the default itself fails the gate (then the winner may well be slower than the default)."""
    import torch
    import triton

    check_interrupt()
    study = optuna.load_study(study_name=spec.name, storage=_storage(storage))
    trials = study.get_trials(deepcopy=False)
    done = sorted((t for t in trials if t.state == TrialState.COMPLETE and _measured(t)), key=lambda t: t.value)
    space = load_space(spec.kernel)
    candidates: list = []
    for t in done:
        v = space.variant(t.params)
        if v not in candidates:
            candidates.append(v)
        if len(candidates) == top_k:
            break
    if not candidates:
        return None
    default = getattr(_defaults(spec.problem), spec.kernel)
    if default not in candidates:
        # The default competes too (it may lie outside the space, e.g. a swizzle group the rules
        # fold away): a tuned entry is never slower than what users get without one.
        baseline = measure(backend, spec, default, time_limit)
        if baseline.ok:
            candidates.append(default)
        elif log is not None:
            log(f"[{spec.label()}] the built-in default is not a candidate: {baseline.status} ({baseline.reason})")
    pool = candidates + ([default] if default not in candidates else [])
    timings = _retime(backend, spec, pool, rounds, time_limit)
    ranked = sorted((v for v in candidates if v in timings), key=lambda v: timings[v]["median"])
    if not ranked:
        return None
    winner = ranked[0]
    return Entry(
        key=spec.key,
        variant=winner,
        timing_ms=timings[winner],
        default_ms=timings.get(default),
        template_hash=codegen.template_hash(spec.kernel),
        tuned_on=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        versions={"torch": str(torch.__version__), "triton": str(triton.__version__), "cce_autotune": str(__version__)},
        device_name=backend.device_name(),
        trials=sum(1 for t in trials if _measured(t) and t.state in (TrialState.COMPLETE, TrialState.PRUNED)),
        data=spec.data_record(),
    )
