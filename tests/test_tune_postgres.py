"""cce-tune's studies on a real PostgreSQL server: the distribution's server binaries, started by this
module on a free local port in a temporary folder and stopped at its end; several worker processes on
one shared study, a run killed and resumed, nothing lost (the fake backend: no GPU)."""

import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

optuna = pytest.importorskip("optuna")
psycopg2 = pytest.importorskip("psycopg2")

from optuna.trial import TrialState  # noqa: E402

from cce_autotune import tuner as tune  # noqa: E402
from conftest_tune import isolated  # noqa: E402,F401
from test_tune import SMALL, _measured, _trials, check_workers_share_one_study  # noqa: E402


def _bindir() -> str | None:
    """The folder of the server's initdb and pg_ctl: $CCE_AUTOTUNE_PG_BIN, pg_config's, or the newest
    /usr/lib/postgresql/*/bin."""
    found = [os.environ.get("CCE_AUTOTUNE_PG_BIN", "")]
    if shutil.which("pg_config"):
        found.append(subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True).stdout.strip())
    found += sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(p.split("/")[-2]), reverse=True)
    return next((d for d in found if d and os.path.exists(os.path.join(d, "initdb"))
                 and os.path.exists(os.path.join(d, "pg_ctl"))), None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def postgres():
    """The URL of a database ``studies`` on a fresh server (trust authentication, local only)."""
    bindir = _bindir()
    if bindir is None:
        pytest.skip("no PostgreSQL server binaries (initdb, pg_ctl) on this machine: apt-get install postgresql")
    # (a folder of its own in the temporary directory: pytest's are closed to the server's user)
    root = Path(tempfile.mkdtemp(prefix="cce_postgres_"))
    run_as = []
    if os.geteuid() == 0:  # the server refuses to run as root: as the distribution's postgres user
        import pwd

        try:
            user = pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("running as root without a postgres user to run the server as")
        os.chown(root, user.pw_uid, user.pw_gid)
        run_as = ["runuser", "-u", "postgres", "--"]
    data, port = root / "data", _free_port()
    pg = lambda tool, *args: subprocess.run([*run_as, os.path.join(bindir, tool), *args],  # noqa: E731
                                            capture_output=True, text=True, timeout=120)
    init = pg("initdb", "-D", str(data), "-A", "trust", "-U", "postgres", "--no-sync")
    assert init.returncode == 0, init.stderr[-2000:]
    options = f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=100"
    start = pg("pg_ctl", "-D", str(data), "-o", options, "-l", str(root / "log"), "-w", "start")
    assert start.returncode == 0, start.stderr[-2000:] + (root / "log").read_text()[-2000:]
    try:
        con = psycopg2.connect(host="127.0.0.1", port=port, user="postgres", dbname="postgres")
        con.autocommit = True
        con.cursor().execute("CREATE DATABASE studies")
        con.close()
        yield f"postgresql+psycopg2://postgres@127.0.0.1:{port}/studies"
    finally:
        pg("pg_ctl", "-D", str(data), "-m", "fast", "-w", "stop")
        shutil.rmtree(root, ignore_errors=True)


def test_workers_share_one_study_on_postgresql(isolated, postgres):
    check_workers_share_one_study(postgres, isolated["tmp"] / "timed.jsonl", 3, 12)


def test_a_killed_run_resumes_on_postgresql_and_loses_nothing(isolated, postgres):
    spec = tune.StudySpec("h200", "lse_forward", SMALL, n_trials=10)
    code = ("import sys; from cce_autotune import tuner as tune; "
            f"tune.run_workers(2, 'fake', {{'fail_compile': None, 'fail_resources': None, 'slow': [{{}}], "
            f"'slow_s': 0.5}}, {postgres!r}, [tune.StudySpec('h200', 'lse_forward', tune.TuningProblem(B=512, "
            "V=32000, D=256), n_trials=10)])")
    env = {**os.environ, "CCE_AUTOTUNE_CACHE_DIR": str(isolated["cache"])}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    done_before = []
    while time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.5)
        try:
            done_before = _measured(_trials(spec, postgres))
        except Exception:  # noqa: BLE001 - the study may not exist yet
            continue
        if len(done_before) >= 3:
            break
    assert proc.poll() is None, f"the run ended before it could be killed: {proc.stderr.read()[-2000:]}"
    os.killpg(proc.pid, signal.SIGKILL)  # the run and its workers, mid-trial
    proc.wait(timeout=60)
    kept = {t.number for t in _measured(_trials(spec, postgres))}
    assert len(kept) >= 3
    tune.run_workers(2, "fake", {"fail_compile": None, "fail_resources": None}, postgres, [spec])
    trials = _trials(spec, postgres)
    measured = _measured(trials)
    assert kept <= {t.number for t in measured}  # what the killed run measured is still there
    assert 10 <= len(measured) <= 11  # and counts against the budget: the resumed run only completes it
    # The killed workers' claimed trials are closed (a trial killed between its creation and its claim
    # holds nothing, counts for nothing, and a later run fails it by its age).
    assert not [t for t in trials if t.state == TrialState.RUNNING and t.user_attrs]
