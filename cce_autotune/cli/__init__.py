"""``cce-tune``: tune kernels for this GPU, show the database, render a variant's source.

    cce-tune --gpu h200 --vocab 256000 [--hidden 2304,3584] [--heads V:D,...] [--data lm|real|FILE]
             [--tokens 4096,8192,16384] [--dtype bf16] [--no-calibrate]
             [--kernels all] [--trials N] [--budget-minutes M] [--out DIR] [--dry-run]
             [--max-grad-error 1e-2] [--storage URL] [--workers N] [--seed S]
    cce-tune show [--gpu h200] [--vocab V --hidden D --tokens B --dtype bf16 [--bias] [--softcap]]
    cce-tune render backward block_b=64 filter_eps=none [--dtype bf16] [--hidden D] [--bias] [--softcap]
    cce-tune report [--gpu h200] [--storage URL] [--out DIR] [--configs FILE]
    cce-tune merge FILE [FILE ...] --out OUT.yaml

Argument parsing only: the work is done by :mod:`cce_autotune.tuner`, :mod:`cce_autotune.configdb`,
:mod:`cce_autotune.planning`, :mod:`cce_autotune.codegen` and :mod:`.report`.

Each command imports the modules it needs when it runs (the imports inside the ``_cmd_*`` functions
below), so that ``cce-tune --help`` and the commands that read only YAML stay instant: the tuner
brings Optuna, the planner PyTorch.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from ..variant import KERNELS, VariantError

__all__ = ["main", "build_parsers", "ENV_BACKEND"]

ENV_BACKEND = "CCE_AUTOTUNE_BACKEND"  # "fake": run the whole loop on the CPU cost model (tests)
_COMMANDS = ("tune", "show", "render", "explain", "report", "merge")


class _UsageError(Exception):
    pass


def _int_list(name: str):
    def parse(text: str) -> list[int]:
        try:
            values = [int(x) for x in text.replace(" ", "").split(",") if x]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
        if not values or any(v <= 0 for v in values):
            raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
        return values

    return parse


def _positive(name: str, cast=int):
    """argparse type: a positive int (or float, with ``cast=float``); argparse names the option."""
    what = "an integer" if cast is int else "a number"

    def parse(text: str):
        try:
            v = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not v > 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
        return v

    return parse


def _dtype_list(text: str) -> list[str]:
    values = [x for x in text.replace(" ", "").split(",") if x]
    bad = [v for v in values if v not in ("bf16", "fp16", "fp32")]
    if not values or bad:
        raise argparse.ArgumentTypeError(f"--dtype: {text!r}: use bf16, fp16 or fp32 (comma-separated)")
    return values


def _kernel_list(text: str) -> list[str]:
    if text == "all":
        return list(KERNELS)
    values = [x for x in text.replace(" ", "").split(",") if x]
    bad = [v for v in values if v not in KERNELS]
    if not values or bad:
        raise argparse.ArgumentTypeError(f"--kernels: {', '.join(bad) or text!r} not among {', '.join(KERNELS)} (or all)")
    return values


def _head_list(text: str) -> list[tuple[int, int]]:
    heads = []
    for item in text.replace(" ", "").split(","):
        try:
            V, D = (int(x) for x in item.split(":"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected V:D pairs such as 128256:4096, got {item!r}") from None
        if V <= 0 or D <= 0:
            raise argparse.ArgumentTypeError(f"expected positive sizes, got {item!r}")
        heads.append((V, D))
    return heads


def _shape_args(p: argparse.ArgumentParser, required: bool) -> None:
    p.add_argument("--vocab", type=_int_list("--vocab"), required=required, metavar="V[,V...]",
                   help="vocabulary size(s)")
    p.add_argument("--hidden", type=_int_list("--hidden"), metavar="D[,D...]",
                   help="hidden size(s); default: the hidden sizes of known models with this vocabulary")
    p.add_argument("--tokens", type=_int_list("--tokens"), default=[4096, 8192, 16384], metavar="B[,B...]",
                   help="token counts, rounded to power-of-two buckets (default 4096,8192,16384)")
    p.add_argument("--dtype", type=_dtype_list, help="bf16, fp16 and/or fp32 (default bf16; tuning on --data FILE: the "
                   "file's)")
    p.add_argument("--bias", action="store_true", help="tune/look up the variant with a bias")
    p.add_argument("--softcap", action="store_true", help="tune/look up the variant with logit softcapping")


def build_parsers() -> dict[str, argparse.ArgumentParser]:
    tune = argparse.ArgumentParser(
        prog="cce-tune",
        description="Tune the Cut Cross-Entropy kernels for this GPU and shapes; winners go to <out>/<gpu>.yaml. "
        "Other commands: `cce-tune show --help`, `cce-tune explain --help`, `cce-tune render --help`, "
        "`cce-tune report --help`, `cce-tune merge --help`.",
    )
    tune.add_argument("--gpu", required=True, help="GPU slug or device name (must match the detected GPU), e.g. h200")
    _shape_args(tune, required=False)  # (--vocab, unless --data FILE gives it)
    tune.add_argument("--heads", type=_head_list, default=[], metavar="V:D[,V:D...]",
                      help="heads to tune as vocabulary:hidden pairs (with or instead of --vocab/--hidden), "
                      "e.g. 128256:4096,32768:4096")
    tune.add_argument("--kernels", type=_kernel_list, default=list(KERNELS),
                      help=f"comma-separated among {', '.join(KERNELS)}, or all (default)")
    tune.add_argument("--trials", type=_positive("--trials"), default=50, metavar="N",
                      help="measured trials per study (default 50); a study resumes up to this count")
    tune.add_argument("--budget-minutes", type=_positive("--budget-minutes", float), metavar="M",
                      help="wall-clock budget for the whole run, shared by the studies by weight (the backward "
                      "most); default: 8 GPU-minutes per head (V, D, dtype, flags) divided by --workers")
    tune.add_argument("--out", type=Path, metavar="DIR",
                      help="where <gpu>.yaml is written (default: the user cache's tuned_configs/)")
    tune.add_argument("--dry-run", action="store_true", help="print the plan and exit (needs no GPU)")
    tune.add_argument("--max-grad-error", type=_positive("--max-grad-error", float), default=1e-2,
                      help="correctness gate: relative L2 error of dE, dC (and dbias) vs the exact result (default 1e-2)")
    tune.add_argument("--max-value-error", type=_positive("--max-value-error", float), default=1e-3,
                      help="correctness gate for loss / lse / target logits (default 1e-3)")
    tune.add_argument("--storage", metavar="URL",
                      help="Optuna RDB storage URL shared by workers/machines (default: sqlite in the user cache)")
    tune.add_argument("--workers", type=_positive("--workers"), default=1, metavar="N",
                      help="worker processes, one per local GPU, sharing the studies (default 1)")
    tune.add_argument("--seed", type=int, default=0, help="sampler seed (default 0)")
    tune.add_argument("--data", default="lm", metavar="lm|real|FILE",
                      help="data the variants are checked and timed on: lm (LM-like, synthetic; default), real "
                      "(hidden states of a small GPT trained on the Python standard library, trained once per "
                      "shape and cached, as cce-bench --data real), or FILE: activations saved from your own "
                      "training step (cce_autotune.save_activations / capture_activations); its V and D are the "
                      "head tuned (--vocab/--hidden may be left out), its softcap and bias set --softcap/--bias")
    tune.add_argument("--calibrate", action=argparse.BooleanOptionalAction, default=True,
                      help="first measure the planner's cost coefficients on this GPU (15-40 s per head on an H200, "
                      "two heads at most) and save them in the results file's cost_model section (default: on)")
    tune.add_argument("--trial-time-limit", type=_positive("--trial-time-limit", float), default=120.0, metavar="S",
                      help="seconds one trial may take before it is recorded as failed (default 120)")
    tune.add_argument("--top-k", type=_positive("--top-k"), default=3, metavar="K",
                      help="best distinct variants re-timed interleaved before the winner is chosen (default 3)")
    tune.add_argument("--backend", choices=("gpu", "fake"), default=None, help=argparse.SUPPRESS)

    show = argparse.ArgumentParser(
        prog="cce-tune show",
        description="What the tuned-config database holds for a GPU, and (with --vocab/--hidden) which entry "
        "each kernel would use for a shape, and why.",
    )
    show.add_argument("--gpu", help="GPU slug or device name (default: $CCE_AUTOTUNE_GPU or the detected GPU)")
    _shape_args(show, required=False)

    render = argparse.ArgumentParser(
        prog="cce-tune render",
        description="Print the Triton source of a kernel variant, e.g. `cce-tune render backward block_b=64 "
        "filter_eps=none`. The backward's strategy (the knob strategy=chunked|sparse|fused) is auto by "
        "default: the planner chooses it per call (`cce-tune explain`); auto renders the chunked strategy's kernel.",
    )
    render.add_argument("kernel", choices=list(KERNELS))
    render.add_argument("knobs", nargs="*", metavar="knob=value", help="knobs to change from the built-in default")
    render.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    render.add_argument("--hidden", type=int, metavar="D", help="hidden size (decides the unmasked EVEN_D path)")
    render.add_argument("--bias", action="store_true")
    render.add_argument("--softcap", action="store_true")
    explain = argparse.ArgumentParser(
        prog="cce-tune explain",
        description="How the planner would run a call of this shape: the backward plan for each live share "
        "(the share of tiles the forward's tile map leaves live), whether filtering pauses for it, and the "
        "memory budget. Needs no GPU.",
    )
    explain.add_argument("--gpu", help="GPU slug or device name (default: $CCE_AUTOTUNE_GPU or the detected GPU)")
    _shape_args(explain, required=True)
    explain.add_argument("--live", type=_share_list, default=[0.05, 0.25, 0.5, 1.0], metavar="S,...",
                         help="live-tile shares to plan for, in (0, 1] (default 0.05,0.25,0.5,1)")
    explain.add_argument("--max-extra-memory", default="auto", metavar="SIZE",
                         help="the memory budget: auto (default), none, a byte count or e.g. 2GiB")
    explain.add_argument("--classifier", choices=("same", "fp32"), default="same",
                         help="fp32: the classifier is an fp32 master weight with 16-bit e (a mixed-precision "
                         "loop's lm_head under autocast): dC in fp32, and its copy in e's dtype counted")
    report = argparse.ArgumentParser(
        prog="cce-tune report",
        description="Report on a GPU's tuning studies: a PNG per study (trial history, best so far, failed / "
        "gated / ruled-out trials, the default's time; knob importances), and Markdown tables on stdout "
        "(also <out>/report.md) of the studies, the knob importances and the winners against the defaults. "
        "Plots need matplotlib: pip install 'cce-autotune[report]'.",
    )
    report.add_argument("--gpu", help="GPU slug or device name (default: $CCE_AUTOTUNE_GPU or the detected GPU)")
    report.add_argument("--storage", metavar="URL",
                        help="Optuna storage holding the studies (default: the sqlite file cce-tune uses)")
    report.add_argument("--out", type=Path, metavar="DIR",
                        help="where the PNGs and report.md go (default: ./cce-report-<gpu>)")
    report.add_argument("--configs", type=Path, metavar="FILE",
                        help="tuned-config file with the winners (default: <gpu>.yaml in the folders "
                        "`cce-tune show` lists, the first holding a key wins, as at run time)")
    merge = argparse.ArgumentParser(
        prog="cce-tune merge",
        description="Combine tuned-config files of one GPU into one: per key the entry tuned on the kernel's "
        "current template wins, then the entry tuned on data closer to a user's (captured activations, then "
        "real hidden states, then LM-like), then the faster (the rule of every save). Files of another GPU or schema "
        "version are refused (exit 2). The cost_model section is taken from the last file listed that has one.",
    )
    merge.add_argument("files", nargs="+", type=Path, metavar="FILE", help="tuned-config files (<gpu>.yaml)")
    merge.add_argument("--out", type=Path, required=True, metavar="OUT.yaml",
                       help="the merged file, written atomically; if it exists it is an input too, merged "
                       "first (or at its place when also listed as a FILE)")
    return {"tune": tune, "show": show, "render": render, "explain": explain, "report": report, "merge": merge}


def _share_list(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--live: {text!r} is not a comma list of numbers") from None
    if not values or any(not 0 < v <= 1 for v in values):
        raise argparse.ArgumentTypeError(f"--live: shares must lie in (0, 1], got {text!r}")
    return values


def _single(values: list[int], name: str) -> int:
    if len(values) != 1:
        raise _UsageError(f"{name}: expected one value, got {values}")
    return values[0]


# -- tune --------------------------------------------------------------------------------------
def _cmd_tune(args, out, err) -> int:
    from .. import tuner as tune  # (lazy: Optuna; see the module docstring)
    from ..configdb import dispatch
    from ..configdb import store as db
    from ..paths import cache_dir

    trials, workers, top_k = args.trials, args.workers, args.top_k
    gpu = dispatch.resolve_gpu(args.gpu)
    data = _tuning_data(args)
    plan = tune.make_plan(
        gpu, data["vocab"] or [], data["hidden"], args.tokens, data["dtype"], args.kernels,
        flag_sets=[(data["bias"], data["softcap"])], trials=trials,
        gate=tune.Gate(args.max_grad_error, args.max_value_error), budget_minutes=args.budget_minutes,
        data=args.data, data_id=data["data_id"], softcap=data["softcap_value"], workers=workers,
        heads=args.heads,
    )
    plan.notes.extend(data["notes"])
    backend_name = args.backend or os.environ.get(ENV_BACKEND) or "gpu"
    if gpu not in dispatch.alias_table().slugs:
        smem = dispatch.smem_limit_for(gpu)
        err.write(f"cce-tune: note: --gpu {args.gpu!r} (slug {gpu!r}) is no GPU the alias table knows; planning "
                  f"with the default shared memory per block ({smem // 1024} KiB). A real run checks the "
                  "detected GPU.\n")
    if args.dry_run:
        out.write(tune.describe_plan(plan, dispatch.smem_limit_for(gpu), workers) + "\n")
        return 0
    err.write(f"cce-tune: {len(plan.studies)} studies for {gpu}; starting the {backend_name} backend "
              "(PyTorch, the device) ...\n")
    err.flush()
    try:
        backend = tune.make_backend(backend_name)
    except tune.NoGPUError as exc:
        err.write(f"cce-tune: no GPU: {exc}. Tuning needs the GPU it tunes for; use --dry-run to see the plan.\n")
        return 2
    if workers > 1 and backend_name == "gpu":
        import torch

        if workers > torch.cuda.device_count():
            err.write(f"cce-tune: --workers {workers}: only {torch.cuda.device_count()} GPU(s) visible\n")
            return 2
    detected_name = backend.device_name()
    detected = dispatch.resolve_gpu(detected_name)
    if detected != gpu:
        err.write(f"cce-tune: --gpu {args.gpu} (slug {gpu!r}) does not match the detected GPU {detected_name!r} "
                  f"(slug {detected!r}); tune on the GPU you name, or pass --gpu {detected}\n")
        return 2
    out_dir = args.out or (cache_dir() / "tuned_configs")
    target = Path(out_dir) / f"{gpu}.yaml"
    storage = args.storage or tune.default_storage_url()
    # Both places are checked before the first study (which may take an hour on a GPU).
    problem = _check_out(target) or _check_storage(storage, workers)
    if problem:
        err.write(f"cce-tune: {problem}\n")
        return 2
    shown = tune.display_url(storage)  # (never the password: report.md and logs get attached to issues)
    out.write(tune.describe_plan(plan, backend.smem_limit(), workers) + "\n")
    out.write(f"studies: {shown}\nresults: {target}\n")
    out.flush()
    saved: list = []
    unsaved: list = []  # what a save failed to write (the run goes on: the studies keep the results)

    def save_costs(section) -> None:
        try:
            db.save_entries(target, [], gpu=gpu, cost_model=section)
        except (OSError, db.ConfigDBError) as exc:  # (a calibration the file's checks refuse is not written)
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            err.write(f"cce-tune: could not save the cost model to {target}: {why}\n")
            unsaved.append("the planner's cost model")
            return
        out.write(f"saved the planner's cost model -> {target}\n")
        out.flush()

    def save(entry) -> None:
        try:
            report = db.save_entries(target, [entry], gpu=gpu)
        except OSError as exc:  # e.g. a full disk: the study keeps its winner; the plan goes on
            err.write(f"cce-tune: could not save {entry.key.describe()} to {target}: {exc.strerror or exc}; "
                      "the study keeps the result: run the same command again to save it\n")
            unsaved.append(entry.key.describe())
            return
        saved.append(entry)
        out.write(f"saved {entry.key.describe()} -> {target}: {report}\n")
        out.flush()

    try:
        # Ctrl-C also sets a flag the tuner checks between trials: one swallowed inside a finalizer
        # (SQLAlchemy's) still stops the run, after the current trial.
        with tune.stop_on_interrupt():
            entries = tune.run_plan(
                plan, backend, storage, backend_name=backend_name, workers=workers, seed=args.seed,
                trial_time_limit=args.trial_time_limit, top_k=top_k, on_result=save, progress=err,
                calibrate=args.calibrate and "backward" in args.kernels, on_costs=save_costs,
            )
            tune.check_interrupt()  # (one pressed during the last study's re-timing)
    except KeyboardInterrupt:
        err.write("\ncce-tune: interrupted; run the same command again to resume\n")
        return 130
    except tune.DeviceLost as exc:
        err.write(f"\ncce-tune: {exc}\n")
        return 3
    except tune.STORAGE_ERRORS as exc:  # the studies database failed: full, damaged, read-only, gone
        err.write(f"\ncce-tune: the studies database {shown} failed: {tune.storage_failure(exc, storage)}; "
                  "free the space or fix the storage, then run the same command again to resume\n")
        return 3
    except tune.WorkersFailed as exc:  # (each worker printed its own error)
        err.write(f"\ncce-tune: {exc}; run the same command again to resume\n")
        return 3
    except OSError as exc:  # a full disk, a folder gone
        where = f": {exc.filename}" if getattr(exc, "filename", None) else ""
        err.write(f"\ncce-tune: {tune.hide_secrets(exc.strerror or exc, storage)}{where}; free the space or "
                  "fix the folder, then run the same command again to resume\n")
        return 3
    dispatch.clear_cache()
    won = f"done: {len(entries)} of {len(plan.studies)} studies produced a winner"
    if unsaved:
        out.write(f"{won}; {len(saved)} saved to {target}, {len(entries) - len(saved)} not\n")
        err.write(f"cce-tune: not saved to {target}: {', '.join(unsaved)}; the studies keep the results: make "
                  "the folder writable and run the same command again to save them\n")
        return 3
    out.write(won + "\n")
    return 0 if entries or not plan.studies else 1


def _tuning_data(args) -> dict:
    """The head(s) and flags to tune from the arguments, or from ``--data FILE`` (whose V, D, softcap
    and bias decide them; given --vocab/--hidden must agree)."""
    from ..tuner import DATA_KINDS  # (lazy: Optuna)

    found = dict(vocab=args.vocab, hidden=args.hidden, bias=args.bias, softcap=args.softcap, softcap_value=30.0,
                 data_id="", notes=[], dtype=args.dtype or ["bf16"])
    if args.data in DATA_KINDS:
        if not args.vocab and not args.heads:
            raise _UsageError("--vocab: required (or --heads V:D, or --data FILE, whose vocabulary is tuned)")
        return found
    from ..data import file_dtype, load_file, resolve_data  # (lazy: PyTorch)

    try:
        resolve_data(args.data, DATA_KINDS)
        acts = load_file(args.data)
    except ValueError as exc:
        raise _UsageError(str(exc) if str(exc).startswith("--data: ") else f"--data: {exc}") from None
    found["dtype"] = args.dtype or [file_dtype(args.data)]  # the captured call's dtype unless told
    for name, given, own in (("--vocab", args.vocab, acts.V), ("--hidden", args.hidden, acts.D)):
        if given and list(given) != [own]:
            raise _UsageError(f"{name}: {given} differs from {args.data}'s {own}; leave it out")
    found.update(vocab=[acts.V], hidden=[acts.D], bias=args.bias or acts.bias is not None,
                 softcap=args.softcap or acts.softcap is not None, data_id=acts.digest[:16])
    if acts.softcap is not None:
        found["softcap_value"] = acts.softcap
    found["notes"].append(f"--data {args.data}: {acts.n} captured rows, {found['dtype'][0]}, V={acts.V}, D={acts.D}"
                          + (f", softcap {acts.softcap:g}" if acts.softcap is not None else "")
                          + (", bias" if acts.bias is not None else "")
                          + f" (sha256 {acts.digest[:16]}); token buckets above {acts.n} repeat its rows")
    return found


def _check_out(target: Path) -> str | None:
    """Why the results file cannot be written (one line), or None: its folder is created and a file
    written and removed there, and an existing file must be writable."""
    flag = "results folder"
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=target.parent, prefix=".cce-tune-check-"):
            pass
        if target.exists() and not os.access(target, os.W_OK):
            return f"{flag} {target.parent}: {target.name} is not writable"
    except OSError as exc:
        return f"{flag} {target.parent}: cannot write results there: {exc.strerror or exc}"
    return None


def _check_storage(url: str, workers: int) -> str | None:
    """Why the studies database cannot be used (one line), or None (it is opened once here)."""
    from .. import tuner as tune  # (lazy: Optuna)

    if url.strip() in ("sqlite://", "sqlite:///:memory:"):
        return (f"--storage {url}: an in-memory database cannot be resumed or shared by --workers; "
                "give a file (sqlite:///path/studies.db) or a server URL")
    try:
        tune.make_storage(url)
    except Exception as exc:  # noqa: BLE001 - any failure to open the storage, as one line
        return (f"--storage {tune.display_url(url)}: cannot open the studies database: "
                f"{tune.storage_failure(exc, url)[:250]}")
    return None


# -- show --------------------------------------------------------------------------------------
# The GPU `show` and `explain` plan for without --gpu on a machine without one: the one whose cost
# model is the built-in fallback (cce_autotune.planning.costs) and whose configs ship with the package.
DEFAULT_GPU = "h200"


def _gpu_or_default(args, err, command: str) -> str:
    """The slug ``show`` / ``explain`` work for: --gpu, else $CCE_AUTOTUNE_GPU or the detected GPU; on
    a machine without a GPU, :data:`DEFAULT_GPU`, said in one line (not "cpu": no GPU has its plans)."""
    from ..configdb import dispatch  # (lazy: YAML only, instant)

    if args.gpu:
        return dispatch.resolve_gpu(args.gpu)
    gpu = dispatch.gpu_slug()
    if gpu == dispatch.CPU_SLUG and not os.environ.get(dispatch.ENV_GPU):
        what = "configs" if command == "show" else "shipped configs and cost model"
        err.write(f"cce-tune {command}: no GPU detected: {'showing' if command == 'show' else 'planning for'} "
                  f"--gpu {DEFAULT_GPU}'s {what} (pass --gpu to choose another)\n")
        return DEFAULT_GPU
    return gpu


def _cmd_show(args, out, err) -> int:
    from ..configdb import dispatch  # (lazy: YAML only, instant)
    from ..configdb import store as db

    gpu = _gpu_or_default(args, err, "show")
    out.write(f"GPU slug: {gpu}\n")
    found = False
    for d in dispatch.config_search_path():
        path = d / f"{gpu}.yaml"
        if not path.is_file():
            out.write(f"  {path}: (none)\n")
            continue
        found = True
        cfg = db.load_file(path, expect_gpu=gpu)
        out.write(f"  {path}: {len(cfg.entries)} entries\n")
        if cfg.cost_model:
            out.write("    planner cost model: " + ", ".join(f"{k}={v}" for k, v in cfg.cost_model.items()) + "\n")
        for e in cfg.entries:
            speed = f"{e.speedup:.2f}x default" if e.speedup else "default did not run"
            out.write(f"    {e.key.describe():<60} {e.median_ms:9.4g} ms  {speed}  ({e.tuned_on})\n")
    if not found:
        out.write(f"no tuned configs for {gpu!r}; built-in defaults are used\n")
    if args.vocab:
        V = _single(args.vocab, "--vocab")
        if not args.hidden:
            raise _UsageError("--hidden: needed with --vocab to explain a lookup")
        D = _single(args.hidden, "--hidden")
        for B in args.tokens:
            for dtype in args.dtype or ["bf16"]:
                out.write("\n" + str(dispatch.explain(gpu, dtype, B, V, D, args.bias, args.softcap)) + "\n")
    return 0


# -- explain -----------------------------------------------------------------------------------
def _cmd_explain(args, out, err) -> int:
    from .. import strategies  # (lazy: the planner and the strategies bring PyTorch)
    from ..configdb import dispatch
    from ..planning import budget as budgets
    from ..planning import planner
    from ..options import Options
    from ..plans import CallPlan, CallProblem, ForwardPlan, MiB
    from ..strategies.base import PlanContext, mm_ms

    gpu = _gpu_or_default(args, err, "explain")
    V, D = _single(args.vocab, "--vocab"), _single(args.hidden, "--hidden")
    try:
        budgets.parse_bytes(args.max_extra_memory, "--max-extra-memory")
    except ValueError as exc:
        raise _UsageError(str(exc)) from None
    costs = dispatch.costs_for(gpu)
    for B in args.tokens:
        for dtype in args.dtype or ["bf16"]:
            kv = dispatch.explain(gpu, dtype, B, V, D, args.bias, args.softcap).variants
            bw = kv.backward.replace(strategy="auto")
            elem = 4 if dtype == "fp32" else 2
            c_elem = 4 if args.classifier == "fp32" else elem  # (an fp32 classifier: dC and dbias in fp32 too)
            grads = elem * B * D + c_elem * V * D + (c_elem * V if args.bias else 0)
            p = CallProblem(n=B, n_all=B, V=V, D=D, elem=elem, grad_bytes=grads, sorted_vocab=True,
                            map_bytes=B * -(-V // 256), c_elem=c_elem,
                            cast_bytes=V * D * elem if c_elem != elem else 0)
            whole = planner.converts_whole(p, args.max_extra_memory)
            budget = planner.call_budget(p, args.max_extra_memory, converted=whole)
            shown = "unlimited" if budget is None else f"{budget / MiB:.0f} MiB"
            cast = ""
            if p.cast_bytes:
                cast = (f", fp32 classifier: its {p.cast_bytes / MiB:.0f} MiB copy in {dtype} made once"
                        f"{' (held, outside the budget shown)' if whole else ' - does not fit: converted a chunk at a time'}")
            out.write(f"GPU {gpu}, {dtype}, B={B}, V={V}, D={D}: memory budget {shown}{cast}; one matmul of the shape "
                      f"is about {mm_ms(p, costs):.2f} ms\n")
            first = planner.plan_backward(replace(p, sorted_vocab=False, map_bytes=0), bw, has_map=False,
                                          budget=budget, costs=costs, exact=True)
            first = planner.with_forward_tiles(first, kv)
            out.write(f"  first call: {first.describe()}\n")
            # (a "mean" loss: whether the fused plan may run depends on the classifier's conversion alone)
            fusable = planner.fused_allowed(Options(), CallPlan(impl="triton", forward=ForwardPlan(convert_classifier=whole)),
                                            wider_classifier=bool(p.cast_bytes))
            exact = planner.plan_fused(p, bw, paused=False, exact=True, allowed=fusable, budget=budget, costs=costs,
                                       forward=kv.lse_forward)
            out.write(f"  exact: {exact.describe() if exact is not None else 'as the first call'}\n")
            unfiltered = planner.unfiltered_cost(p, bw, budget, costs, fused_allowed=fusable)
            fused = planner.plan_fused(p, bw, paused=True, allowed=fusable, budget=budget, costs=costs,
                                       forward=kv.lse_forward)
            for live in args.live:
                # Each strategy's live blocks for a random spread of the live tiles.
                ctx = PlanContext(problem=p, variant=bw, costs=costs, budget=budget, use_map=True, live=live,
                                  live_blocks=1.0, n_live=0, fixed=0.0, exact=False)
                shares = {s.name: s.block_share(live, ctx) for s in strategies.all_strategies()}
                plan = planner.plan_backward(p, bw, has_map=True, live=live,
                                             live_blocks={k: v for k, v in shares.items() if v is not None},
                                             budget=budget, costs=costs)
                pause = costs.forward + plan.cost >= costs.pause_share * unfiltered
                out.write(f"  live {live:.0%}: {plan.describe()}\n")
                if pause:
                    then = fused.describe() if fused is not None else "the exact plan above"
                    out.write(f"    -> filtering cannot pay (forward + this plan {costs.forward + plan.cost:.2f} mm vs "
                              f"{unfiltered:.2f} mm unfiltered): the classifier's next {costs.pause_calls} calls run "
                              f"{then}\n")
    return 0


# -- report, merge -----------------------------------------------------------------------------
def _cmd_report(args, out, err) -> int:
    from ..configdb import dispatch  # (lazy: Optuna, matplotlib)
    from . import report

    gpu = dispatch.resolve_gpu(args.gpu) if args.gpu else dispatch.gpu_slug()
    return report.run(gpu, storage=args.storage, out_dir=args.out, configs=args.configs, out=out, err=err)


def _cmd_merge(args, out, err) -> int:
    from ..configdb import store as db  # (lazy: YAML only, instant)

    try:
        result = db.merge_files(args.files, args.out)
    except db.ConfigDBError as exc:
        err.write(f"cce-tune merge: refused: {exc}; nothing written\n")
        return 2
    except OSError as exc:
        err.write(f"cce-tune merge: cannot write {args.out}: {exc.strerror or exc}\n")
        return 1
    out.write(result.describe() + "\n")
    if args.out.stem != result.gpu:
        out.write(f"note: the runtime reads {result.gpu}.yaml; rename {args.out.name} to use it\n")
    out.write(f"wrote {args.out}: {len(result.entries)} entries\n")
    return 0


# -- render ------------------------------------------------------------------------------------
def _knob_value(text: str):
    low = text.lower()
    if low in ("none", "null"):
        return None
    if low in ("true", "false"):
        return low == "true"
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    if low.startswith("2**") or low.startswith("2^"):
        try:
            return 2.0 ** float(low[3:] if low.startswith("2**") else low[2:])
        except ValueError:
            pass
    return text


def _cmd_render(args, out, err) -> int:
    from .. import strategies  # (lazy: the strategies' modules bring PyTorch)
    from ..codegen import Flags, render_source
    from ..planning.planner import default_strategy
    from ..variant import KernelVariants

    knobs = {}
    for item in args.knobs:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise _UsageError(f"knob {item!r}: expected name=value, e.g. block_b=64")
        knobs[name] = _knob_value(value)
    cls = KERNELS[args.kernel]
    base = getattr(KernelVariants.defaults(elem_bytes=4 if args.dtype == "fp32" else 2), args.kernel)
    try:
        variant = cls.from_dict({**base.to_dict(), **knobs})
        variant.validate(elem_bytes=4 if args.dtype == "fp32" else 2, smem_limit=None)
    except (VariantError, TypeError) as exc:
        raise _UsageError(f"{args.kernel}: {exc}") from None
    if getattr(variant, "strategy", None) == "auto":  # decided per call by the planner: say so, render chunked
        err.write(f"cce-tune render: note: the backward's strategy is auto, chosen per call by the planner "
                  f"(`cce-tune explain` shows which); rendering the {default_strategy()} strategy's kernel: "
                  f"strategy=NAME renders another ({', '.join(strategies.names())})\n")
        variant = variant.replace(strategy=default_strategy())
    flags = Flags(
        has_bias=args.bias, has_softcap=args.softcap,
        even_d=bool(args.hidden and args.hidden % variant.block_d == 0),
        ieee_dot=args.dtype == "fp32",
    )
    out.write(render_source(variant, flags))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``cce-tune``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv and argv[0] in _COMMANDS else "tune"
    if argv and argv[0] in _COMMANDS:
        argv = argv[1:]
    parser = build_parsers()[command]
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
        return int(exc.code or 0)
    handler = {"tune": _cmd_tune, "show": _cmd_show, "render": _cmd_render, "explain": _cmd_explain,
               "report": _cmd_report, "merge": _cmd_merge}[command]
    try:
        return handler(args, sys.stdout, sys.stderr)
    except KeyboardInterrupt:  # (a run's own handler says how to resume)
        sys.stderr.write(f"\n{parser.prog}: interrupted\n")
        return 130
    except _UsageError as exc:
        parser.print_usage(sys.stderr)
        sys.stderr.write(f"{parser.prog}: error: {exc}\n")
        return 2
    except ValueError as exc:  # ConfigDBError, SpaceError, bad values: named, no traceback
        sys.stderr.write(f"{parser.prog}: error: {exc}\n")
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
