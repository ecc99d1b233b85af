"""Captured activations: what a real training step hands the loss, saved to a file for tuning.

The tuner and the benchmark time the kernels on synthetic or stand-in data unless given the user's
own: ``cce-tune --data FILE`` and ``cce-bench --data FILE`` read a file written here.

- :func:`save_activations` writes ``e``, ``c``, ``targets`` (and ``bias``, the softcap) as a
  training step would pass them to :func:`~cce_autotune.linear_cross_entropy`. Positions whose
  target is ``ignore_index`` are dropped and a ``shift`` is applied first, so the file holds one row
  per predicted token: ``e`` (n, D), ``targets`` (n,), all on the CPU, in the dtypes given.
- :func:`capture` records the next call(s) of ``linear_cross_entropy`` in this process, including
  the calls the Hugging Face patch makes, without changing them: wrap one training step in it.
  Eager mode only (a compiled graph does not call back into Python). Recording never breaks the
  training call: a call that cannot be saved (every target ignored, float64, a failed write) is
  skipped with a warning, and a block that saved nothing says why when it ends (a Hugging Face
  model left in eval mode, not patched, or called without labels makes no such call).
- :func:`load_activations` reads and checks a file; :func:`rows_for` fits it to a token count.

The file is a ``torch.save`` dict (loaded with ``weights_only=True``) with a format tag and a
SHA-256 digest of its tensors, which the tuner records in the entries it tunes on the file.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from ..options import check_softcap
from ..paths import save_torch_atomic

__all__ = ["save_activations", "load_activations", "capture", "capture_activations", "Activations", "rows_for", "FORMAT"]

FORMAT = "cce-autotune-activations/1"
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Activations:
    """A loaded activation file: ``e`` (n, D), ``c`` (V, D), ``targets`` (n,) int64, optional
    ``bias`` (V,), the ``softcap`` (or None), and ``digest`` (SHA-256 of the tensors' bytes)."""

    e: torch.Tensor
    c: torch.Tensor
    targets: torch.Tensor
    bias: torch.Tensor | None
    softcap: float | None
    digest: str
    path: Path
    note: str = ""

    @property
    def n(self) -> int:
        return int(self.e.shape[0])

    @property
    def V(self) -> int:
        return int(self.c.shape[0])

    @property
    def D(self) -> int:
        return int(self.c.shape[1])

    def describe(self) -> dict:
        """What an entry tuned on this file records about it."""
        d = {"kind": "file", "name": self.path.name, "sha256": self.digest[:16], "rows": self.n}
        if self.softcap is not None:
            d["softcap"] = self.softcap
        if self.note:
            d["note"] = self.note
        return d


def _digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        if t is None:
            h.update(b"none")
            continue
        t = t.detach().contiguous().cpu()
        h.update(f"{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _rows(e: torch.Tensor, targets: torch.Tensor, shift: int, ignore_index: int):
    """(e rows, targets) of the predicted positions: shifted, flattened, ignored positions dropped."""
    if shift:
        e = e[..., : e.shape[-2] - shift, :]
        targets = targets[..., shift:]
    e = e.reshape(-1, e.shape[-1])
    targets = targets.reshape(-1).to(torch.int64)
    keep = targets != ignore_index
    return e[keep], targets[keep]


def save_activations(path, e: torch.Tensor, c: torch.Tensor, targets: torch.Tensor, bias=None, *,
                     softcap: float | None = None, ignore_index: int = -100, shift: int = 0,
                     note: str = "") -> Path:
    """Write what ``linear_cross_entropy(e, c, targets, bias, softcap=..., ignore_index=...,
    shift=...)`` sees to ``path`` (atomically: a failed write leaves any earlier file whole).
    Returns the path. ``note``: free text kept in the file (the model, the step)."""
    for name, t in (("e", e), ("c", c), ("targets", targets)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if c.dim() != 2 or e.dim() < 2 or e.shape[-1] != c.shape[1]:
        raise ValueError(f"e, c: expected e (..., D) and c (V, D), got {tuple(e.shape)} and {tuple(c.shape)}")
    if tuple(targets.shape) != tuple(e.shape[:-1]):
        raise ValueError(f"targets: shape {tuple(targets.shape)} does not match e's batch shape {tuple(e.shape[:-1])}")
    if e.dtype not in _DTYPES or c.dtype not in _DTYPES:
        raise TypeError(f"e, c: dtypes {e.dtype}, {c.dtype}: use float32, bfloat16 or float16")
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (c.shape[0],)):
        raise ValueError(f"bias: expected a tensor of shape ({c.shape[0]},)")
    softcap = check_softcap(softcap)
    with torch.no_grad():
        rows, t = _rows(e.detach(), targets.detach(), shift, ignore_index)
        if rows.shape[0] == 0:
            raise ValueError("targets: every position is ignore_index; nothing to save")
        V = c.shape[0]
        bad = (t < 0) | (t >= V)
        if bool(bad.any()):
            raise ValueError(f"targets: values outside [0, {V}) (other than ignore_index={ignore_index})")
        tensors = [rows.contiguous().cpu(), c.detach().contiguous().cpu(), t.cpu(),
                   None if bias is None else bias.detach().contiguous().cpu()]
    body = {
        "format": FORMAT, "e": tensors[0], "c": tensors[1], "targets": tensors[2], "bias": tensors[3],
        "softcap": softcap, "note": str(note), "sha256": _digest(tensors),
        "saved_on": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": str(torch.__version__),
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_torch_atomic(body, path)
    return path


def load_activations(path) -> Activations:
    """Read and check an activation file; errors name the file and what is wrong."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such file: {path}")
    try:
        body = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ValueError(f"{path}: not an activation file written by cce_autotune.save_activations ({exc})") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        found = body.get("format") if isinstance(body, dict) else type(body).__name__
        raise ValueError(f"{path}: not an activation file of format {FORMAT!r} (found {found!r})")
    e, c, t, bias = body.get("e"), body.get("c"), body.get("targets"), body.get("bias")
    for name, x in (("e", e), ("c", c), ("targets", t)):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{path}: field {name!r} is missing or not a tensor")
    if e.dim() != 2 or c.dim() != 2 or e.shape[1] != c.shape[1] or t.shape != (e.shape[0],):
        raise ValueError(f"{path}: inconsistent shapes e {tuple(e.shape)}, c {tuple(c.shape)}, targets {tuple(t.shape)}")
    if e.dtype not in _DTYPES or c.dtype not in _DTYPES or t.dtype != torch.int64:
        raise ValueError(f"{path}: unexpected dtypes e {e.dtype}, c {c.dtype}, targets {t.dtype}")
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (c.shape[0],)):
        raise ValueError(f"{path}: field 'bias' does not have shape ({c.shape[0]},)")
    if e.shape[0] == 0 or int(t.min()) < 0 or int(t.max()) >= c.shape[0]:
        raise ValueError(f"{path}: targets empty or outside [0, {c.shape[0]})")
    digest = _digest([e, c, t, bias])
    if digest != body.get("sha256"):
        raise ValueError(f"{path}: the tensors do not match the file's SHA-256 (the file is damaged or was edited)")
    try:  # (not covered by the digest: a file must not hand the tuner a cap no call could use)
        softcap = check_softcap(body.get("softcap"))
    except ValueError as exc:
        raise ValueError(f"{path}: field 'softcap': {str(exc).removeprefix('softcap: ')}") from None
    return Activations(e, c, t, bias, softcap, digest, path, str(body.get("note", "")))


def rows_for(acts: Activations, B: int, dtype: torch.dtype | None = None, device="cpu"):
    """(e, c, targets, bias) with ``B`` rows: the file's first ``B``, or its rows repeated in order
    when it holds fewer; cast to ``dtype`` (default: the file's) on ``device``."""
    if B <= 0:
        raise ValueError(f"B: must be positive, got {B}")
    idx = torch.arange(B) % acts.n
    dtype = dtype or acts.e.dtype
    e = acts.e[idx].to(device=device, dtype=dtype).contiguous()
    c = acts.c.to(device=device, dtype=dtype).contiguous()
    t = acts.targets[idx].to(device)
    bias = None if acts.bias is None else acts.bias.to(device=device, dtype=dtype)
    return e, c, t, bias


# -- capture ----------------------------------------------------------------------------------
_capture_lock = threading.Lock()
_active: list = []  # the open capture() recorders (checked by linear_cross_entropy: empty = no cost)


class _Recorder:
    """One open :func:`capture` block: the files it wrote (``saved``), the calls it saw, and why a
    patched model made none (``skips``), so that an empty block can say why."""

    def __init__(self, path: Path, calls: int, note: str):
        self.path, self.calls, self.note = path, calls, note
        self.saved: list[Path] = []
        self.seen = 0  # linear_cross_entropy calls made inside the block
        self.skips: dict[str, None] = {}  # (ordered set) why a patched model ran its own forward instead
        self._warned: set[str] = set()

    def __call__(self, e, c, targets, bias, softcap, ignore_index, shift) -> None:
        self.seen += 1
        if len(self.saved) >= self.calls:
            return
        if e.dtype == torch.float64:
            self.warn("float64", "a float64 call is not recorded: activation files hold float32, bfloat16 or "
                      "float16, what the kernels are tuned for; the next call in one of those is recorded instead")
            return
        with torch.no_grad():
            shifted = targets[..., shift:] if shift else targets
            if not bool((shifted != ignore_index).any()):
                self.warn("ignored", f"a call whose every target is ignore_index={ignore_index} is not recorded "
                          "(no row to save); the next call is recorded instead")
                return
        i = len(self.saved)
        path = self.path if self.calls == 1 else self.path.with_name(f"{self.path.stem}-{i}{self.path.suffix}")
        self.saved.append(save_activations(path, e, c, targets, bias, softcap=softcap, ignore_index=ignore_index,
                                           shift=shift, note=self.note))

    def warn(self, kind: str, message: str, stacklevel: int = 5) -> None:
        """Warn once per block and kind of skipped call (``stacklevel``: at linear_cross_entropy's caller)."""
        if kind not in self._warned:
            self._warned.add(kind)
            warnings.warn(f"cce_autotune capture({self.path}): {message}", stacklevel=stacklevel)

    def why_empty(self) -> str:
        """Why the block saved nothing, for the warning at its end."""
        head = f"cce_autotune capture({self.path}): nothing was written"
        if self.seen:
            return (f"{head}: none of the {self.seen} linear_cross_entropy call(s) inside the block could be "
                    "recorded (see the warnings before this one)")
        head += ": no linear_cross_entropy call was made inside the block"
        if self.skips:
            return f"{head}; the patched model ran its own forward because {'; '.join(self.skips)}"
        return (f"{head}. A Hugging Face model must be patched (cce_autotune.integrations.transformers.patch), "
                "in training mode (model.train(): from_pretrained leaves it in eval mode) and called with labels")


@contextlib.contextmanager
def capture(path, *, calls: int = 1, note: str = ""):
    """Save the inputs of the next ``calls`` calls of ``linear_cross_entropy`` made inside the block
    (``path``, or ``<stem>-<i><suffix>`` for several). Yields a recorder whose ``saved`` lists the
    files written. The calls themselves run unchanged: a call that cannot be recorded (every target
    ignored, float64, a failed write) is skipped with a warning and the next one is recorded
    instead, and a block that ends having written nothing warns with the reason.

        with cce_autotune.data.captured.capture("acts.pt"):
            loss = model(input_ids=x, labels=y).loss   # a patched Hugging Face model, or your own call
    """
    if isinstance(calls, bool) or not isinstance(calls, int) or calls < 1:
        raise ValueError(f"calls: expected a positive int, got {calls!r}")
    rec = _Recorder(Path(path), calls, note)
    with _capture_lock:
        _active.append(rec)
    try:
        yield rec
    finally:
        with _capture_lock:
            _active.remove(rec)
    if not rec.saved:  # (not reached when the block raised: its error says enough)
        warnings.warn(rec.why_empty(), stacklevel=3)


capture_activations = capture  # the name ``cce_autotune`` exports


def active() -> bool:
    """Whether a :func:`capture` block is open (the loss then records what it sees)."""
    return bool(_active)


def record(e, c, targets, bias, softcap, ignore_index, shift) -> None:
    """Called by ``linear_cross_entropy`` while a :func:`capture` block is open. A capture must never
    break the training step it watches: whatever goes wrong while saving is a warning."""
    for rec in list(_active):
        try:
            rec(e, c, targets, bias, softcap, ignore_index, shift)
        except Exception as exc:  # noqa: BLE001 - e.g. a full disk: the call goes on
            rec.warn("error", f"a call could not be recorded ({type(exc).__name__}: {exc}); the call itself "
                     "goes on", stacklevel=4)


def skipped(reason: str) -> None:
    """Called by the Hugging Face patch when, inside a :func:`capture` block, it runs the model's own
    forward (no ``linear_cross_entropy`` call to record): ``reason`` ends up in the empty block's
    warning."""
    for rec in list(_active):
        rec.skips[reason] = None
