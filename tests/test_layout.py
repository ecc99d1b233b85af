"""The package's shape: a strategy is one module plus one line of the table, imports point one way
(what executes a plan does not import the planner), lazy imports say why, and strategy names live in
the strategies' modules."""

import ast
import pathlib

import pytest
import torch

from cce_autotune import BackwardVariant, VariantError, linear_cross_entropy, strategies
from cce_autotune.strategies import chunked
from cce_autotune.strategies.base import Strategy
from helpers import grads_of, make_inputs, rel_err, torch_loss
from test_loss import SMALL

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "cce_autotune"


class Toy(Strategy):
    """A strategy written outside the package: the chunked strategy's kernel and launch, at twice its
    estimated cost (so that the planner takes it only when a variant asks for it)."""

    name = "toy"
    template = chunked.STRATEGY.template
    kernel_function = chunked.STRATEGY.kernel_function
    deterministic = True
    space_rules = (("toy_chunks", "chunk_v >= 1024", "the toy's chunks are wide"),)

    def option(self, ctx):
        opt = chunked.STRATEGY.option(ctx)
        return type(opt)(2 * opt.cost, opt.extra_bytes, opt.use_map, opt.sizes)

    def run(self, args, plan):
        return chunked.STRATEGY.run(args, plan)


@pytest.fixture
def toy():
    strategies.register(Toy())
    yield
    strategies.unregister("toy")


def test_a_new_strategy_is_its_module_and_one_registration(toy, device, planned):
    # The variant schema, the planner and the launch all find it through the table.
    BackwardVariant(strategy="toy").validate()
    kv = SMALL.replace(backward=SMALL.backward.replace(strategy="toy", filter_eps=None))
    e, c, t, _ = make_inputs((2, 23), 130, 40, torch.float32, device=device)
    _, (ge, gc) = grads_of(lambda e_, c_: linear_cross_entropy(e_, c_, t, shift=1, impl="triton", variants=kv), e, c)
    _, (re, rc) = grads_of(lambda e_, c_: torch_loss(e_, c_, t, shift=1), e.double(), c.double())
    assert planned[-1].call.backward.strategy == "toy" and "asks for it" in planned[-1].call.backward.reason
    assert rel_err(ge, re) < 1e-5 and rel_err(gc, rc) < 1e-5
    # Asked for nothing in particular, the planner prefers the cheaper chunked strategy it delegates to.
    auto = kv.replace(backward=kv.backward.replace(strategy="auto"))
    grads_of(lambda e_, c_: linear_cross_entropy(e_, c_, t, impl="triton", variants=auto, deterministic=True), e, c)
    assert planned[-1].call.backward.strategy == "chunked"
    assert "toy" in [a[0] for a in planned[-1].call.backward.alternatives]


def test_the_search_space_holds_a_new_strategys_rules(toy):
    pytest.importorskip("optuna")  # (the tuner's package; a GPU image may lack it)
    from cce_autotune.tuner.space import load_space

    assert any(c.name == "toy_chunks" for c in load_space("backward").constraints)


def test_an_unregistered_strategy_is_refused_by_name():
    with pytest.raises(VariantError, match="strategy='toy'"):
        BackwardVariant(strategy="toy").validate()
    with pytest.raises(ValueError, match="strategy 'toy'"):
        strategies.get("toy")
    with pytest.raises(ValueError, match="taken"):
        strategies.register(chunked.STRATEGY)


def _python_files():
    return sorted(PACKAGE.rglob("*.py"))


def _own_imports(tree):
    """(node, module) of every import of the package's own modules in ``tree``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level > 0 or (node.module or "").startswith("cce_autotune")):
            yield node, node.module or ""
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("cce_autotune"):
                    yield node, alias.name


def _targets(path, node):
    """The absolute names an import of ``path`` brings in (for ``from X import a``: X and X.a)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    package = path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1]
    base = list(package[: len(package) - node.level + 1]) if node.level else []
    module = ".".join(base + ([node.module] if node.module else []))
    return [module] + [f"{module}.{a.name}" for a in node.names]


def test_imports_inside_functions_say_why():
    # Lazy imports only where they keep a command instant; the first import of each such block (or the
    # comment just above it) says so.
    unexplained = []
    for path in _python_files():
        lines = path.read_text().splitlines()
        tree = ast.parse("\n".join(lines))
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node, _ in _own_imports(fn):
                block = node.lineno - 1
                while block > 0 and lines[block - 1].strip().startswith(("from ", "import ")):
                    block -= 1  # the first import of the block
                said = lines[block] + lines[node.lineno - 1] + (lines[block - 1] if block else "")
                if "(lazy" not in said:
                    unexplained.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert not unexplained, unexplained


@pytest.mark.parametrize("low, high", [("strategies", "planning"), ("strategies", "runtime"), ("strategies", "configdb"),
                                       ("planning", "runtime"), ("planning", "configdb"), ("configdb", "runtime"),
                                       ("runtime/execute.py", "planning")])
def test_imports_point_from_the_api_down_to_the_kernels(low, high):
    # The launchers never import the policy, the policy is handed its cost model (it does not read the
    # config database), nothing below the runtime imports it, and what executes a plan decides nothing.
    where = PACKAGE / low
    offenders = []
    for path in ([where] if where.is_file() else where.rglob("*.py")):
        for node, _ in _own_imports(ast.parse(path.read_text())):
            if any(t == f"cce_autotune.{high}" or t.startswith(f"cce_autotune.{high}.") for t in _targets(path, node)):
                offenders.append(f"{path.name}:{node.lineno}")
    assert not offenders, offenders


def test_strategy_names_are_written_only_in_their_modules():
    names = set(strategies.TABLE)
    found = []
    for path in _python_files():
        if path.parent.name == "strategies":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in names:
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.value!r}")
    assert not found, found


def test_the_launch_paths_hold_pytorch_itself_once_it_is_used(device):
    # The strategies name torch through a stand-in that binds the module itself on first use: the
    # launch paths pay no indirection per call.
    from cce_autotune.strategies import common, forward

    e, c, t, _ = make_inputs((8,), 40, 16, torch.float32, device=device)
    linear_cross_entropy(e, c, t, impl="triton", variants=SMALL)
    assert forward.torch is torch and common.torch is torch and chunked.torch is torch
