"""Launching the rendered ``@triton.jit`` kernels at less host cost than Triton's own launch path.

``kernel[grid](*args, **constants)`` through Triton binds and specializes the arguments, builds its
cache key, reads its settings and launch hooks, then calls the compiled kernel's launcher: about 44
us of host time for the chunked strategy's kernel on the H200's host, against 13 us for the launcher
alone. A call launches 10 to 35 kernels, so that is up to a millisecond and a half a call.

:class:`Launcher` keeps Triton's own binder (the same specialization of every argument: dtypes,
16-byte alignment, divisibility, the constants) and its compiled kernel, and skips the rest: the first
launch of each specialization goes through Triton (which compiles or finds the kernel and returns
it), later ones call that kernel's launcher with the same bound arguments. So a launch is the
kernel Triton would have launched. Triton's path is taken for every launch while a launch hook is set
(a profiler's), under the interpreter, and for good after anything in Triton's internals is not as
expected (an older or newer Triton): then nothing is lost but the saving. Settings read from the
environment at launch (``TRITON_DEBUG`` and the like) are read at a specialization's first launch.

A loop that launches one kernel many times with arguments that differ in a few places (the chunked
strategy's chunk offsets) launches through :meth:`Launcher.series`: after the series' first launch,
only the arguments that are not the very objects of its previous launch are specialized (Triton's
own ``native_specialize_impl``, which its binder calls for each argument); where each gives what it
gave before, the kernel and the previous launch's other arguments are reused without the binder
(about 15 us of a launch's 40 on the H200's host). The series holds its last launch's arguments
until the loop drops it.
"""

from __future__ import annotations

__all__ = ["Launcher", "Series", "direct_launches", "launch_hooked", "cdiv", "next_power_of_2"]

_state = {"direct": True}  # False once Triton's internals were not as expected (or a test turns it off)


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for the host's grids: ``triton.cdiv`` is a ``constexpr_function`` since Triton 3.5,
    about 1.5 us a call on the host (a call of the chunked strategy made 357 of them)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (0 for 0), as ``triton.next_power_of_2`` without its cost."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def direct_launches(on: bool | None = None) -> bool:
    """Whether launches after a specialization's first skip Triton's launch path; ``on`` sets it."""
    if on is not None:
        _state["direct"] = bool(on)
    return _state["direct"]


def _triton() -> tuple:
    """Triton's settings and driver (imported on the first launch)."""
    found = _state.get("triton")
    if found is None:
        from triton import knobs
        from triton.runtime.driver import driver

        found = _state["triton"] = (knobs, driver)
    return found


def _specialize():
    """Triton's per-argument specialization (``native_specialize_impl``), or None where this Triton
    has none (a series then binds every launch)."""
    if "specialize" not in _state:
        try:
            from triton._C.libtriton import native_specialize_impl
        except ImportError:
            native_specialize_impl = None
        _state["specialize"] = native_specialize_impl
    return _state["specialize"]


def _holds_hooks(hook) -> bool:
    """Whether a launch hook is set: a function, or a chain of them (Triton's ``HookChain``, empty by
    default) that holds one."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _hooked(knobs) -> bool:
    """Whether Triton's settings hold a launch hook, on entry or on exit."""
    return _holds_hooks(knobs.runtime.launch_enter_hook) or _holds_hooks(knobs.runtime.launch_exit_hook)


def launch_hooked() -> bool:
    """Whether Triton has a launch hook set (a profiler's): then every launch goes through Triton's own
    path, which calls it (True also where Triton's settings are not as expected)."""
    try:
        return _hooked(_triton()[0])
    except (ImportError, AttributeError):
        return True


class Launcher:
    """A ``@triton.jit`` function launched as ``kernel[grid](*args, **constants)``; other attributes
    are the function's (``.fn``, ``.src``). ``interpreted``: the function runs in Triton's
    interpreter (every launch goes through it)."""

    __slots__ = ("jit", "interpreted", "_compiled")

    def __init__(self, jit, interpreted: bool = False):
        self.jit = jit
        self.interpreted = interpreted
        self._compiled: dict = {}

    def __getattr__(self, name):
        if name in Launcher.__slots__:  # (not set yet: a copy being made)
            raise AttributeError(name)
        return getattr(self.jit, name)

    def __getitem__(self, grid):
        if self.interpreted or not _state["direct"]:
            return self.jit[grid]
        return lambda *args, **kw: self._launch(grid, args, kw)

    def series(self) -> "Series":
        """Launches of this kernel in one loop (see the module docstring): ``s = kernel.series()``,
        then ``s[grid](*args, **constants)`` as ``kernel[grid]``."""
        return Series(self)

    def _launch(self, grid, args, kw, series: "Series | None" = None):
        try:
            knobs, driver = _triton()
            hooked = _hooked(knobs)
            active = driver.active
            device = active.get_current_device()
            found = None if series is None or callable(grid) else series.reuse(args, kw, device)
            if found is None:
                bound, spec, options = self.jit.device_caches[device][-1](*args, **kw)  # Triton's binder
                key = (device, tuple(spec), tuple(options.items()))
                compiled = self._compiled.get(key)
                values = bound.values()
            else:
                compiled, values = found
        except (ImportError, AttributeError, KeyError, TypeError, ValueError, IndexError):
            _state["direct"] = False  # not the Triton this was written for: its own path from now on
            return self.jit[grid](*args, **kw)
        if compiled is None or hooked:
            kernel = self.jit[grid](*args, **kw)  # compiles, or finds, the kernel; launches it
            if compiled is None and all(hasattr(kernel, a) for a in ("run", "function", "packed_metadata")):
                self._compiled[key] = kernel
                if series is not None:
                    series.remember(args, kw, device, spec, values, kernel)
            return kernel
        g = grid(bound) if callable(grid) else grid
        n = len(g)
        try:
            run = compiled.run
            run(g[0], g[1] if n > 1 else 1, g[2] if n > 2 else 1, active.get_current_stream(device),
                compiled.function, compiled.packed_metadata, None, None, None, *values)
        except TypeError:  # the launcher takes other arguments: nothing was launched
            _state["direct"] = False
            return self.jit[grid](*args, **kw)
        if found is None and series is not None:
            series.remember(args, kw, device, spec, values, compiled)
        return compiled


class Series:
    """Launches of one kernel in one loop (:meth:`Launcher.series`): ``series[grid](*args, **kw)``.
    Between two launches, the arguments that are the same objects keep their specialization; the
    others are specialized one by one with Triton's own function and compared with what the binder
    gave the last bound launch. Any difference, a constant or option changed, or anything unlike the
    Triton this was written for: the launch is bound as :class:`Launcher` binds it."""

    __slots__ = ("launcher", "last")

    def __init__(self, launcher: Launcher):
        self.launcher = launcher
        self.last = None  # (args, kw, device, spec, the bound values past args, compiled, backend)

    def __getitem__(self, grid):
        k = self.launcher
        if k.interpreted or not _state["direct"]:
            return k[grid]  # (Triton's path, as the launcher's own)
        return lambda *args, **kw: k._launch(grid, args, kw, self)

    def remember(self, args, kw, device, spec, values, compiled) -> None:
        """A bound launch's arguments, the binder's specialization of them and the kernel it chose."""
        values = list(values)
        params = getattr(self.launcher.jit, "params", None)
        caches = self.launcher.jit.device_caches[device]
        if (_specialize() is None or params is None or len(spec) != len(params) or len(values) != len(params)
                or len(caches) < 2 or any(values[i] is not a for i, a in enumerate(args))):
            self.last = None  # (not the binder's layout this was written for: bind every launch)
            return
        self.last = (args, dict(kw), device, list(spec), values[len(args):], compiled, caches[-2])

    def reuse(self, args, kw, device):
        """``(compiled, values)`` for a launch whose specialization is the last bound one's, else None."""
        last = self.last
        if last is None:
            return None
        last_args, last_kw, last_device, spec, tail, compiled, backend = last
        if device != last_device or len(args) != len(last_args) or kw != last_kw:
            return None
        params = self.launcher.jit.params
        specialize = _state["specialize"]
        try:
            for i, a in enumerate(args):
                b = last_args[i]
                if a is b:
                    continue
                kp = params[i]
                if kp.is_constexpr or kp.annotation_type:
                    if type(a) is not type(b) or type(a) not in (int, bool, float) or a != b:
                        return None
                    continue
                s = specialize(backend, a, kp.is_const, not kp.do_not_specialize, not kp.do_not_specialize_on_alignment)
                if tuple(s) != tuple(spec[i]):
                    return None
        except (AttributeError, TypeError, ValueError, IndexError):
            # (not the Triton this was written for: series bind every launch from now on; the
            # launcher's own direct path is not affected)
            _state["specialize"] = None
            self.last = None
            return None
        self.last = (args, last_kw, device, spec, tail, compiled, backend)
        return compiled, [*args, *tail]
