"""``cce-tune report``: what a GPU's tuning studies did, drawn and tabulated.

For each study of the GPU in the Optuna storage (names ``cce:<gpu>:...``, see
:attr:`cce_autotune.tuner.StudySpec.name`):

- one PNG, ``<out>/<study>.png``: left, the history (each measured trial's median ms by trial number,
  the best so far, failed / gated / ruled-out trials marked along the bottom, the built-in default's
  time and the tuned-config winner's as horizontal lines when known); right, the knob importances;
- the knob importances (``optuna.importance.get_param_importances`` with PED-ANOVA, which needs no
  scikit-learn, on the COMPLETE trials), printed too.

Then Markdown tables, on stdout and in ``<out>/report.md``: the studies, the importances, and the
winners of the tuned-config database against the built-in defaults. Status lines go to stderr, so
stdout is the Markdown alone. Without matplotlib the tables still come, with a note on the plots.

Reads studies and draws; tuning is :mod:`cce_autotune.tuner`'s, the files :mod:`cce_autotune.configdb.store`'s.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from .. import tuner
from ..codegen import template_hash
from ..configdb import store as db
from ..configdb.dispatch import config_search_path

__all__ = ["StudyReport", "parse_study_name", "load_studies", "load_winners", "importances", "plot_study",
           "markdown", "run", "MIN_COMPLETE", "INSTALL_HINT"]

MIN_COMPLETE = 3  # complete trials needed before importances mean anything
INSTALL_HINT = "pip install 'cce-autotune[report]'"

_NAME = re.compile(
    r"^cce:(?P<gpu>[^:]+):(?P<kernel>[^:]+):(?P<dtype>[^:]+):B(?P<B>\d+):V(?P<V>\d+):D(?P<D>\d+):"
    r"bias(?P<bias>[01]):softcap(?P<softcap>[01]):tpl-(?P<tpl>[0-9a-f]+):gate-(?P<gate>[^:]+)(?P<rest>(?::[^:]*)*)$"
)
# PRUNED trials by their status: ruled out by the rules (free) / lost the correctness gate / the rest failed
_INFEASIBLE, _GATE = "infeasible", "gate"


@dataclass
class StudyReport:
    """One study, read back: its key and the trials' outcomes."""

    name: str
    key: db.EntryKey
    template: str  # the template hash prefix in the name
    gate: str  # "<max grad error>-<max value error>"
    data: str  # "lm" (no data- part in the name) or the data kind
    ok: list = field(default_factory=list)  # (trial number, median ms) of COMPLETE trials
    gated: list = field(default_factory=list)  # trial numbers
    failed: list = field(default_factory=list)  # (trial number, status)
    infeasible: list = field(default_factory=list)  # trial numbers
    skipped: int = 0  # FAIL trials: duplicates, over the budget, interrupted
    baseline: tuple | None = None  # (trial number, ms) of the built-in default's trial, when it passed
    default_ms: float | None = None
    default_from: str = ""
    winner_ms: float | None = None
    importances: dict | None = None
    importance_note: str = ""
    png: Path | None = None

    @property
    def measured(self) -> int:
        return len(self.ok) + len(self.gated) + len(self.failed)

    @property
    def best_ms(self) -> float | None:
        return min((v for _, v in self.ok), default=None)

    @property
    def current(self) -> bool:
        return template_hash(self.key.kernel).startswith(self.template)

    def label(self) -> str:
        return self.key.describe() + ("" if self.data == "lm" else f" data={self.data}")

    def file_name(self) -> str:
        rest = self.name.split(":", 2)[2]
        return re.sub(r"[^A-Za-z0-9._-]+", "_", rest.replace(":", "-")) + ".png"


def parse_study_name(name: str) -> dict | None:
    """The parts of a study name (gpu, kernel, dtype, B, V, D, bias, softcap, tpl, gate, data), or None."""
    m = _NAME.match(name)
    if not m:
        return None
    parts = m.groupdict()
    rest = [p for p in parts.pop("rest").split(":") if p]
    parts["data"] = next((p[5:] for p in rest if p.startswith("data-")), "lm")
    return parts


def _study_report(name: str, parts: dict, study) -> StudyReport:
    from optuna.trial import TrialState

    key = db.EntryKey(parts["kernel"], parts["dtype"], int(parts["B"]), int(parts["V"]), int(parts["D"]),
                      parts["bias"] == "1", parts["softcap"] == "1")
    r = StudyReport(name, key, parts["tpl"], parts["gate"], parts["data"])
    for t in study.get_trials(deepcopy=False):
        status = t.user_attrs.get("status")
        if t.state == TrialState.COMPLETE and t.value is not None:
            r.ok.append((t.number, float(t.value)))
            if t.user_attrs.get("proposed") == "baseline":
                r.baseline = (t.number, float(t.value))
        elif t.state == TrialState.PRUNED:
            if status == _INFEASIBLE:
                r.infeasible.append(t.number)
            elif status == _GATE:
                r.gated.append(t.number)
            else:
                r.failed.append((t.number, status or "failed"))
        elif t.state == TrialState.FAIL:
            r.skipped += 1
    r.importances, r.importance_note = importances(study)
    return r


def importances(study) -> tuple[dict | None, str]:
    """(knob -> importance, sorted, summing to 1) on the COMPLETE trials, or (None, why not)."""
    import optuna
    from optuna.trial import TrialState

    complete = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))]
    if len(complete) < MIN_COMPLETE:
        return None, f"skipped: {len(complete)} complete trial(s), importances need {MIN_COMPLETE}"
    varying = sorted({k for t in complete for k in t.params
                      if len({repr(u.params.get(k)) for u in complete}) > 1})
    if not varying:
        return None, "skipped: every knob took one value in the complete trials"
    if len({t.value for t in complete}) < 2:
        return None, "skipped: every complete trial took the same time"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            found = optuna.importance.get_param_importances(
                study, evaluator=optuna.importance.PedAnovaImportanceEvaluator(), params=varying)
        except Exception as exc:  # noqa: BLE001 - a study optuna cannot assess: say so, go on
            return None, f"not computed: {type(exc).__name__}: {exc}"
    note = f"PED-ANOVA on {len(complete)} complete trials"
    equal = [w for w in caught if "will be equal" in str(w.message)]
    if equal or not any(v > 0 for v in found.values()):
        note += " (too few to tell the knobs apart)"
    return dict(sorted(found.items(), key=lambda kv: -kv[1])), note


def load_studies(storage, gpu: str) -> tuple[list, list]:
    """(the :class:`StudyReport` of each study of ``gpu`` in ``storage``, names under its prefix that do
    not parse)."""
    import optuna

    prefix = f"cce:{gpu}:"
    reports, odd = [], []
    for name in sorted(optuna.study.get_all_study_names(storage)):
        if not name.startswith(prefix):
            continue
        parts = parse_study_name(name)
        if parts is None or parts["gpu"] != gpu:
            odd.append(name)
            continue
        reports.append(_study_report(name, parts, optuna.load_study(study_name=name, storage=storage)))
    reports.sort(key=lambda r: (r.key, r.data, r.template, r.gate))
    return reports, odd


def load_winners(gpu: str, configs: Path | None = None) -> tuple[list, list]:
    """(entries, files read): ``configs`` alone, or ``<gpu>.yaml`` in each folder of the search path,
    the first holding a key winning (as at run time)."""
    if configs is not None:
        return list(db.load_file(configs, expect_gpu=gpu).entries), [Path(configs)]
    by_key: dict = {}
    files = []
    for d in config_search_path():
        path = d / f"{gpu}.yaml"
        if path.is_file():
            files.append(path)
            for e in db.load_file(path, expect_gpu=gpu).entries:
                by_key.setdefault(e.key, e)
    return [by_key[k] for k in sorted(by_key)], files


def _data_id(record) -> str | None:
    """An entry's ``data`` record as it appears in study names: "lm", "real" or "file-<sha256>"."""
    if not record:
        return None
    return f"file-{record.get('sha256', '')}" if record.get("kind") == "file" else str(record.get("kind"))


def _data_label(record) -> str:
    if not record:
        return "-"
    if record.get("kind") == "file":
        return f"{record.get('name', 'file')} ({str(record.get('sha256', ''))[:8]})"
    return str(record.get("kind"))


def _match(report: StudyReport, entries: list) -> None:
    """The default's (and the winner's) time for the study's plot: the entry of the study's key, template
    and data, else the study's own trial of the built-in default."""
    for e in entries:
        data = _data_id(getattr(e, "data", None))
        if e.key == report.key and e.template_hash.startswith(report.template) and data in (None, report.data):
            report.winner_ms = e.median_ms
            if e.default_ms:
                report.default_ms, report.default_from = e.default_ms["median"], "re-timed with the winner"
            break
    if report.default_ms is None and report.baseline is not None:
        report.default_ms, report.default_from = report.baseline[1], f"trial {report.baseline[0]}"


# -- drawing ------------------------------------------------------------------------------------
def _figure_class():
    """matplotlib's Figure with the Agg canvas, or None when matplotlib is not installed."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    return lambda **kw: FigureCanvasAgg(Figure(**kw)).figure


def plot_study(report: StudyReport, path: Path, new_figure=None) -> Path:
    """Draw ``report`` to the PNG ``path`` (history left, importances right)."""
    new_figure = new_figure or _figure_class()
    if new_figure is None:
        raise ImportError(f"plots need matplotlib: {INSTALL_HINT}")
    fig = new_figure(figsize=(12, 4.6), layout="constrained")
    ax, bars = fig.subplots(1, 2, gridspec_kw={"width_ratios": [2.3, 1]})
    if report.ok:
        xs, ys = zip(*report.ok)
        ax.plot(xs, ys, "o", ms=4, color="tab:blue", label="measured trial (median ms)")
        best, running = [], float("inf")
        for y in ys:
            running = min(running, y)
            best.append(running)
        last = max([*xs, *report.gated, *(n for n, _ in report.failed), *report.infeasible])
        ax.step([*xs, last], [*best, best[-1]], where="post", color="tab:orange", lw=1.6, label="best so far")
    else:
        ax.text(0.5, 0.5, "no trial passed", transform=ax.transAxes, ha="center", va="center")
    bottom = ax.get_xaxis_transform()  # x in trial numbers, y in axes fractions: marks along the bottom
    if report.infeasible:
        ax.plot(report.infeasible, [0.02] * len(report.infeasible), "|", color="0.6", ms=8, transform=bottom,
                label=f"ruled out by the rules ({len(report.infeasible)})")
    if report.gated:
        ax.plot(report.gated, [0.06] * len(report.gated), "x", color="tab:red", ms=7, transform=bottom,
                label=f"failed the correctness gate ({len(report.gated)})")
    if report.failed:
        nums = [n for n, _ in report.failed]
        kinds = sorted({s for _, s in report.failed})
        ax.plot(nums, [0.10] * len(nums), "v", color="black", ms=6, transform=bottom,
                label=f"failed: {', '.join(kinds)} ({len(nums)})")
    if report.default_ms is not None:
        ax.axhline(report.default_ms, ls="--", color="tab:gray",
                   label=f"built-in default {report.default_ms:.4g} ms ({report.default_from})")
    if report.winner_ms is not None:
        ax.axhline(report.winner_ms, ls=":", color="tab:green", label=f"tuned-config winner {report.winner_ms:.4g} ms")
    ax.margins(y=0.18)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("trial number")
    ax.set_ylabel("median ms")
    ax.set_title(f"{report.label()}: {report.measured} measured trials, template "
                 f"{'current' if report.current else 'stale'}, gate {report.gate}", fontsize=10)
    ax.legend(fontsize=7, loc="upper right")
    if report.importances:
        names = list(report.importances)[::-1]
        bars.barh(names, [report.importances[n] for n in names], color="tab:purple")
        bars.set_xlabel(f"importance ({report.importance_note})", fontsize=8)
        bars.set_title("knob importances", fontsize=10)
    else:
        bars.set_axis_off()
        bars.text(0.5, 0.5, "knob importances\n" + report.importance_note.replace(": ", ":\n", 1), ha="center",
                  va="center", transform=bars.transAxes, fontsize=9)
    path = Path(path)
    fig.savefig(path, dpi=100)
    return path


# -- tables ---------------------------------------------------------------------------------------
def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.4g}"


def _table(head: list, rows: list) -> list:
    return (["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
            + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def winners_table(entries: list) -> list:
    """Markdown rows of the database's winners against the built-in defaults."""
    with_data = any(getattr(e, "data", None) is not None for e in entries)
    head = ["kernel", "dtype", "B", "V", "D", "bias", "softcap"] + (["data"] if with_data else []) + [
        "winner ms", "default ms", "speed-up", "trials", "template", "tuned_on"]
    rows = []
    for e in sorted(entries, key=lambda e: e.key):
        k = e.key
        speed = f"{e.speedup:.2f}x" if e.speedup else "default failed"
        rows.append([k.kernel, k.dtype, k.B, k.V, k.D, _yes(k.has_bias), _yes(k.has_softcap)]
                    + ([_data_label(getattr(e, "data", None))] if with_data else [])
                    + [_ms(e.median_ms), _ms(e.default_ms["median"] if e.default_ms else None), speed, e.trials,
                       "current" if e.template_hash == template_hash(k.kernel) else "stale", e.tuned_on])
    return _table(head, rows)


def markdown(gpu: str, storage_url: str, reports: list, entries: list, files: list, images: bool) -> str:
    """The report's Markdown; ``storage_url`` is shown without its password (the file gets attached)."""
    lines = [f"# cce-tune report: GPU {gpu}", "",
             f"Studies: `{tuner.display_url(storage_url)}` ({len(reports)} for {gpu}).",
             "Tuned configs: " + (", ".join(f"`{f}`" for f in files) or "none") + ".", "", "## Studies", ""]
    rows = []
    for r in reports:
        plot = (f"![plot]({r.png.name})" if images else f"`{r.png.name}`") if r.png else "-"
        rows.append([r.label(), "current" if r.current else "stale", r.gate, r.measured, len(r.ok), len(r.gated),
                     len(r.failed), len(r.infeasible), _ms(r.best_ms), _ms(r.default_ms), plot])
    lines += _table(["study", "template", "gate", "measured", "passed", "gated", "failed", "ruled out",
                     "best ms", "default ms", "plot"], rows)
    lines += ["", "## Knob importances", ""]
    for r in reports:
        if r.importances:
            top = ", ".join(f"{k} {v:.2f}" for k, v in r.importances.items())
            lines.append(f"- {r.label()} ({r.importance_note}): {top}")
        else:
            lines.append(f"- {r.label()}: {r.importance_note}")
    lines += ["", "## Winners against the built-in defaults", ""]
    lines += winners_table(entries) if entries else ["No tuned-config entries for this GPU."]
    return "\n".join(lines) + "\n"


# -- the command ----------------------------------------------------------------------------------
def _gpus_of(store) -> list:
    """The GPUs the cce-tune studies of ``store`` are for."""
    import optuna

    return sorted({n.split(":")[1] for n in optuna.study.get_all_study_names(store)
                   if n.startswith("cce:") and n.count(":") > 1})


def run(gpu: str, storage: str | None = None, out_dir: Path | None = None, configs: Path | None = None,
        out=None, err=None) -> int:
    """``cce-tune report``: 0 when studies were found (with or without plots), 1 when there are none or
    the studies database cannot be read (one line; the database is read, never created or changed)."""
    import sys

    out, err = out or sys.stdout, err or sys.stderr
    url = storage or tuner.default_storage_url()
    shown = tuner.display_url(url)  # (never the password: report.md gets attached to pull requests)
    if url.startswith("sqlite:///") and url[len("sqlite:///"):] not in ("", ":memory:") \
            and not Path(url[len("sqlite:///"):]).is_file():
        err.write(f"cce-tune report: no studies database at {url[len('sqlite:///'):]} (tune first, or pass "
                  "--storage URL)\n")
        return 1
    try:
        store = tuner.open_existing_storage(url)  # (creates no table in a damaged or foreign database)
    except ValueError as exc:
        err.write(f"cce-tune report: the studies database {shown}: {tuner.hide_secrets(exc, url)}\n")
        return 1
    except tuner.STORAGE_ERRORS as exc:  # damaged beyond its tables
        err.write(f"cce-tune report: the studies database {shown} failed: {tuner.storage_failure(exc, url)}\n")
        return 1
    except Exception as exc:  # noqa: BLE001 - the storage cannot be opened (a driver missing, ...): one line
        err.write(f"cce-tune report: --storage {shown}: cannot open the studies database: "
                  f"{tuner.storage_failure(exc, url)[:250]}\n")
        return 1
    try:
        reports, odd = load_studies(store, gpu)
        others = [] if reports else _gpus_of(store)
    except tuner.STORAGE_ERRORS as exc:  # damaged beyond its tables
        err.write(f"cce-tune report: the studies database {shown} failed: {tuner.storage_failure(exc, url)}\n")
        return 1
    for name in odd:
        err.write(f"cce-tune report: note: study {name!r} is not named as cce-tune names studies; left out\n")
    if not reports:
        err.write(f"cce-tune report: no studies for GPU {gpu!r} in {shown} (names starting 'cce:{gpu}:')"
                  + (f"; it holds studies for: {', '.join(others)}" if others else "; it holds no cce-tune study")
                  + "\n")
        return 1
    entries, files = load_winners(gpu, configs)
    for r in reports:
        _match(r, entries)
    out_dir = Path(out_dir) if out_dir is not None else Path(f"cce-report-{gpu}")
    out_dir.mkdir(parents=True, exist_ok=True)
    new_figure = _figure_class()
    if new_figure is None:
        err.write(f"cce-tune report: note: no plots: matplotlib is not installed ({INSTALL_HINT}); tables only\n")
    else:
        for r in reports:
            r.png = plot_study(r, out_dir / r.file_name(), new_figure)
    out.write(markdown(gpu, url, reports, entries, files, images=False))
    md = out_dir / "report.md"
    md.write_text(markdown(gpu, url, reports, entries, files, images=True), encoding="utf-8")
    n_png = sum(1 for r in reports if r.png)
    err.write(f"cce-tune report: wrote {md}" + (f" and {n_png} PNG(s) in {out_dir}" if n_png else "") + "\n")
    return 0
