"""Search spaces: ``search_spaces/<kernel>.yaml`` -> knob choices + constraints.

A :class:`SearchSpace` knows, for one kernel, the values each knob may take and the rules that rule
combinations out before a trial is spent on them (shared memory, register pressure, divisibility,
redundant knobs). The file format is documented in ``search_spaces/indexed_dot.yaml``. The backward's
space also holds the rules its strategies declare (:mod:`cce_autotune.strategies`): a knob that one
strategy alone reads is pinned to its default when another is asked for, and each strategy's own
rules hold when it is.

Rules are small Python expressions, checked once at load time against a whitelist of syntax and
names (no attribute access, no subscripts, no calls other than a few pure helpers) and then compiled,
so evaluating one costs about a microsecond. This module knows neither Optuna nor the kernels; the
tuner maps the choices to Optuna distributions.
"""

from __future__ import annotations

import ast
import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping

import yaml

from .. import strategies
from ..paths import resource_dir
from ..variant import KERNELS, VariantError, _Variant

__all__ = ["SpaceError", "SpaceContext", "Constraint", "SearchSpace", "load_space", "space_path"]


class SpaceError(ValueError):
    """A search-space file is malformed (the message names the file and the problem)."""


def _next_pow2(x: int) -> int:
    x = int(x)
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-int(a) // int(b))


_FUNCTIONS = {
    "min": min,
    "max": max,
    "abs": abs,
    "cdiv": _cdiv,
    "next_pow2": _next_pow2,
    "log2": math.log2,
}
_PROBLEM_NAMES = ("B", "V", "D", "elem_bytes", "smem_limit", "threads")
_ALLOWED_NODES = (
    ast.Expression, ast.BoolOp, ast.And, ast.Or, ast.UnaryOp, ast.Not, ast.USub, ast.UAdd,
    ast.BinOp, ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow,
    ast.Compare, ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.Is, ast.IsNot, ast.In, ast.NotIn,
    ast.IfExp, ast.Name, ast.Load, ast.Constant, ast.Call, ast.Tuple, ast.List,
)
# Stands for "no limit" (Triton interpreter, unknown device) inside rules.
_UNLIMITED = 1 << 62


@dataclass(frozen=True)
class SpaceContext:
    """What the rules may depend on besides the knobs: the problem shape and the device."""

    B: int
    V: int
    D: int
    elem_bytes: int = 2
    smem_limit: int | None = None  # None: unlimited (interpreter)

    def names(self) -> dict:
        return {
            "B": self.B, "V": self.V, "D": self.D, "elem_bytes": self.elem_bytes,
            "smem_limit": _UNLIMITED if self.smem_limit is None else self.smem_limit,
        }


@dataclass(frozen=True)
class Constraint:
    """One rule: a combination is kept when ``rule`` evaluates true."""

    name: str
    rule: str
    why: str
    names: frozenset  # knob names the rule reads
    code: Any = field(repr=False, compare=False)

    def holds(self, env: Mapping[str, Any]) -> bool:
        return bool(eval(self.code, {"__builtins__": {}, **_FUNCTIONS}, env))  # noqa: S307 - whitelisted AST


def _compile_rule(rule: str, knob_names: set, where: str) -> tuple[frozenset, Any]:
    try:
        tree = ast.parse(rule, mode="eval")
    except SyntaxError as exc:
        raise SpaceError(f"{where}: rule {rule!r} is not a valid expression ({exc.msg})") from None
    used = set()
    for node in ast.walk(tree):
        if not isinstance(node, _ALLOWED_NODES):
            raise SpaceError(f"{where}: rule {rule!r} uses {type(node).__name__}, which rules may not")
        if isinstance(node, ast.Call):
            if not isinstance(node.func, ast.Name) or node.func.id not in _FUNCTIONS or node.keywords:
                raise SpaceError(
                    f"{where}: rule {rule!r} calls something other than {sorted(_FUNCTIONS)} (positional arguments only)"
                )
        elif isinstance(node, ast.Name) and node.id not in _FUNCTIONS:
            if node.id not in knob_names and node.id not in _PROBLEM_NAMES:
                raise SpaceError(
                    f"{where}: rule {rule!r} reads unknown name {node.id!r}; knobs are {sorted(knob_names)}, "
                    f"problem names {list(_PROBLEM_NAMES)}"
                )
            used.add(node.id)
    code = compile(tree, f"<{where}>", "eval")
    return frozenset(used & knob_names | ({"num_warps"} if "threads" in used else set())), code


def _expand(name: str, spec: Any, where: str) -> tuple:
    if isinstance(spec, list):
        values = spec
    elif isinstance(spec, dict) and len(spec) == 1 and "pow2" in spec:
        lo, hi = _pair(spec["pow2"], name, where, "pow2")
        if lo < 1 or lo & (lo - 1) or hi & (hi - 1):
            raise SpaceError(f"{where}: knob {name!r}: pow2 bounds must be powers of two, got [{lo}, {hi}]")
        values = [1 << k for k in range(lo.bit_length() - 1, hi.bit_length())]
    elif isinstance(spec, dict) and len(spec) == 1 and "range" in spec:
        r = spec["range"]
        if not isinstance(r, list) or len(r) not in (2, 3) or not all(isinstance(x, int) and not isinstance(x, bool) for x in r):
            raise SpaceError(f"{where}: knob {name!r}: range must be [lo, hi] or [lo, hi, step] of integers")
        step = r[2] if len(r) == 3 else 1
        if step < 1:
            raise SpaceError(f"{where}: knob {name!r}: range step must be >= 1")
        values = list(range(r[0], r[1] + 1, step))
    else:
        raise SpaceError(
            f"{where}: knob {name!r}: expected a list of values, {{pow2: [lo, hi]}} or {{range: [lo, hi]}}, got {spec!r}"
        )
    if not values:
        raise SpaceError(f"{where}: knob {name!r} has no values")
    if len(set(map(repr, values))) != len(values):
        raise SpaceError(f"{where}: knob {name!r} lists a value twice: {values}")
    for v in values:
        if not (v is None or isinstance(v, (bool, int, float, str))):
            raise SpaceError(f"{where}: knob {name!r}: value {v!r} is not a number, string, boolean or null")
    return tuple(values)


def _pair(value: Any, name: str, where: str, what: str) -> tuple[int, int]:
    if (
        not isinstance(value, list) or len(value) != 2
        or not all(isinstance(x, int) and not isinstance(x, bool) for x in value) or value[0] > value[1]
    ):
        raise SpaceError(f"{where}: knob {name!r}: {what} must be [lo, hi] with integers lo <= hi, got {value!r}")
    return value[0], value[1]


@dataclass(frozen=True)
class SearchSpace:
    """The knobs of one kernel (name -> tuple of choices, in file order) and its rules."""

    kernel: str
    knobs: dict  # name -> tuple of values
    constraints: tuple  # of Constraint
    path: Path | None = None
    seeds: tuple = ()  # partial knob dicts the tuner measures first (over the built-in default)

    @property
    def variant_class(self) -> type[_Variant]:
        return KERNELS[self.kernel]

    def variant(self, params: Mapping[str, Any]) -> _Variant:
        return self.variant_class(**params)

    def params_of(self, variant: _Variant) -> dict:
        """The knob values of ``variant``, in the space's order."""
        d = dataclasses.asdict(variant)
        return {k: d[k] for k in self.knobs}

    def contains(self, variant: _Variant) -> bool:
        """True when every knob value of ``variant`` is one of the space's choices."""
        return all(any(_same(v, c) for c in self.knobs[k]) for k, v in self.params_of(variant).items())

    def violated(self, params: Mapping[str, Any], ctx: SpaceContext) -> Constraint | None:
        """The first rule ``params`` break in ``ctx``, or None when it is feasible."""
        env = {**ctx.names(), **params, "threads": 32 * params["num_warps"]}
        for c in self.constraints:
            if not c.holds(env):
                return c
        return None

    def reject_reason(self, params: Mapping[str, Any], ctx: SpaceContext) -> str | None:
        """Why ``params`` cannot be a trial (a rule of the file, or ``variant.validate``); None if it can."""
        c = self.violated(params, ctx)
        if c is not None:
            return f"constraint {c.name!r} ({c.rule}): {c.why}"
        try:
            self.variant(params).validate(ctx.elem_bytes, ctx.smem_limit)
        except (VariantError, TypeError) as exc:
            return f"variant.validate: {exc}"
        return None

    # -- enumeration ------------------------------------------------------------------------------
    def _plan(self):
        """For each depth i, the rules whose knobs are all among the first i+1 knobs (and not fewer)."""
        order = list(self.knobs)
        at_depth: list[list[Constraint]] = [[] for _ in order]
        for c in self.constraints:
            depth = max((order.index(n) for n in c.names), default=0)
            at_depth[depth].append(c)
        return order, at_depth

    def iter_feasible(self, ctx: SpaceContext) -> Iterator[dict]:
        """Every combination that passes the file's rules in ``ctx`` (depth-first, pruning early)."""
        order, at_depth = self._plan()
        env: dict[str, Any] = dict(ctx.names())

        def rec(i: int) -> Iterator[dict]:
            if i == len(order):
                yield {k: env[k] for k in order}
                return
            name = order[i]
            for value in self.knobs[name]:
                env[name] = value
                if name == "num_warps":
                    env["threads"] = 32 * value
                if all(c.holds(env) for c in at_depth[i]):
                    yield from rec(i + 1)
            env.pop(name, None)

        yield from rec(0)

    def count(self, ctx: SpaceContext) -> tuple[int, int]:
        """(combinations in the space, combinations that pass the rules in ``ctx``)."""
        order, at_depth = self._plan()
        total = math.prod(len(v) for v in self.knobs.values())
        last_rule = max((i for i, cs in enumerate(at_depth) if cs), default=-1)
        tail = math.prod(len(self.knobs[n]) for n in order[last_rule + 1:])
        env: dict[str, Any] = dict(ctx.names())
        # The count below depth i depends only on the values already set that the deeper rules
        # read: memoised on those, the count is exact without visiting every point (the backward's
        # 69 M points in a fraction of a second instead of a minute).
        deeper: set = set()
        keys: list[list[str]] = [[] for _ in order]
        for i in reversed(range(len(order))):
            for c in at_depth[i]:
                deeper |= set(c.names)
            keys[i] = [n for n in order[:i] + ["threads"] if n in deeper]
        memo: dict = {}

        def rec(i: int) -> int:
            if i > last_rule:
                return tail
            key = (i, tuple(env.get(n) for n in keys[i]))
            hit = memo.get(key)
            if hit is not None:
                return hit
            name = order[i]
            n = 0
            for value in self.knobs[name]:
                env[name] = value
                if name == "num_warps":
                    env["threads"] = 32 * value
                if all(c.holds(env) for c in at_depth[i]):
                    n += rec(i + 1)
            env.pop(name, None)
            if name == "num_warps":
                env.pop("threads", None)
            memo[key] = n
            return n

        return total, rec(0)


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b or (a is None and b is None) or (
        isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool)
        and not isinstance(b, bool) and a == b
    )


def _strategy_rules(knobs: dict) -> list:
    """The backward's rules that the strategies declare (``Strategy.knobs`` and ``Strategy.space_rules``),
    in the file's format."""
    defaults = dataclasses.asdict(KERNELS["backward"]())
    rules = []
    readers: dict = {}  # knob -> the strategies that read it
    for s in strategies.all_strategies():
        for k in s.knobs:
            readers.setdefault(k, []).append(s.name)
    for k, names in readers.items():
        if k in knobs:
            rules.append({"name": f"{k}_only_with_{'_or_'.join(names)}",
                          "rule": f"strategy in ({', '.join(map(repr, names))}, 'auto') or {k} == {defaults[k]!r}",
                          "why": f"{k} is read by the {' and '.join(names)} strateg{'ies' if len(names) > 1 else 'y'} "
                                 "only (which auto may choose); pinning it stops trials being spent on identical "
                                 "kernels"})
    for s in strategies.all_strategies():
        for name, rule, why in s.space_rules:
            rules.append({"name": name, "rule": f"strategy != {s.name!r} or ({rule})", "why": why})
    return rules


def space_path(kernel: str) -> Path:
    return resource_dir("search_spaces") / f"{kernel}.yaml"


def load_space(kernel: str, path: str | Path | None = None) -> SearchSpace:
    """Read and check the search space of ``kernel`` (default: the packaged ``search_spaces/<kernel>.yaml``)."""
    if kernel not in KERNELS:
        raise SpaceError(f"kernel {kernel!r}: must be one of {sorted(KERNELS)}")
    path = Path(path) if path is not None else space_path(kernel)
    where = str(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise SpaceError(f"{where}: cannot read ({exc.strerror})") from None
    except yaml.YAMLError as exc:
        raise SpaceError(f"{where}: not valid YAML ({exc})") from None
    if not isinstance(data, dict):
        raise SpaceError(f"{where}: expected a mapping with keys kernel, knobs, constraints")
    unknown = sorted(set(data) - {"kernel", "knobs", "constraints", "seeds"})
    if unknown:
        raise SpaceError(f"{where}: unknown top-level key(s) {unknown}")
    if data.get("kernel") != kernel:
        raise SpaceError(f"{where}: kernel is {data.get('kernel')!r}, expected {kernel!r}")
    knobs_raw = data.get("knobs")
    if not isinstance(knobs_raw, dict):
        raise SpaceError(f"{where}: 'knobs' must be a mapping of knob name -> values")
    fields = [f.name for f in dataclasses.fields(KERNELS[kernel])]
    unknown = sorted(set(knobs_raw) - set(fields))
    missing = [f for f in fields if f not in knobs_raw]
    if unknown:
        raise SpaceError(f"{where}: unknown knob(s) {unknown}; the {kernel} variant's fields are {fields}")
    if missing:
        raise SpaceError(f"{where}: knob(s) {missing} missing; list every field of the {kernel} variant (one value pins it)")
    knobs = {name: _expand(name, spec, where) for name, spec in knobs_raw.items()}
    rules_raw = data.get("constraints") or []
    if not isinstance(rules_raw, list):
        raise SpaceError(f"{where}: 'constraints' must be a list of {{name, rule, why}}")
    if kernel == "backward":
        rules_raw = list(rules_raw) + _strategy_rules(knobs)
    constraints = []
    seen = set()
    for i, item in enumerate(rules_raw):
        cw = f"{where}: constraints[{i}]"
        if not isinstance(item, dict) or set(item) != {"name", "rule", "why"}:
            raise SpaceError(f"{cw}: expected exactly the keys name, rule, why")
        if not all(isinstance(item[k], str) and item[k] for k in ("name", "rule", "why")):
            raise SpaceError(f"{cw}: name, rule and why must be non-empty strings")
        if item["name"] in seen:
            raise SpaceError(f"{cw}: constraint name {item['name']!r} used twice")
        seen.add(item["name"])
        names, code = _compile_rule(item["rule"], set(knobs), f"{where}: constraint {item['name']!r}")
        constraints.append(Constraint(item["name"], item["rule"], item["why"], names, code))
    seeds_raw = data.get("seeds") or []
    if not isinstance(seeds_raw, list):
        raise SpaceError(f"{where}: 'seeds' must be a list of knob mappings")
    seeds = []
    for i, item in enumerate(seeds_raw):
        sw = f"{where}: seeds[{i}]"
        if not isinstance(item, dict) or not item:
            raise SpaceError(f"{sw}: expected a non-empty mapping of knob -> value")
        for name, value in item.items():
            if name not in knobs:
                raise SpaceError(f"{sw}: unknown knob {name!r}")
            if not any(_same(value, c) for c in knobs[name]):
                raise SpaceError(f"{sw}: {name}={value!r} is not one of the knob's choices {list(knobs[name])}")
        seeds.append(dict(item))
    return SearchSpace(kernel=kernel, knobs=knobs, constraints=tuple(constraints), path=path, seeds=tuple(seeds))
