"""Search spaces: the packaged YAML files load, name exactly the variant fields, and every point
their rules let through is a valid variant."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

pytest.importorskip("optuna", reason="the tuner needs Optuna (not in the GPU image)")  # noqa: E402

from cce_autotune.tuner.space import SearchSpace, SpaceContext, SpaceError, load_space
from cce_autotune.variant import KERNELS, KernelVariants, VariantError

H200 = 232448
CONTEXTS = [
    SpaceContext(B=8192, V=256128, D=2304, elem_bytes=2, smem_limit=H200),  # gemma2, bf16, H200
    SpaceContext(B=4096, V=32768, D=4096, elem_bytes=4, smem_limit=166912),  # fp32 on an A100
    SpaceContext(B=300, V=1000, D=100, elem_bytes=2, smem_limit=101376),  # odd sizes, small smem
]


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_knobs_are_exactly_the_variant_fields(kernel):
    space = load_space(kernel)
    assert set(space.knobs) == {f.name for f in dataclasses.fields(KERNELS[kernel])}
    assert all(len(v) >= 1 for v in space.knobs.values())


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_default_variant_is_a_point_of_the_space(kernel):
    space = load_space(kernel)
    default = getattr(KernelVariants(), kernel)
    assert space.contains(default)
    # ... and feasible for the shapes the project measures (bf16 on an H200)
    assert space.reject_reason(space.params_of(default), CONTEXTS[0]) is None


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("ctx", CONTEXTS, ids=["gemma2-h200-bf16", "mistral-a100-fp32", "odd-small-smem"])
def test_every_feasible_point_is_a_valid_variant(kernel, ctx):
    space = load_space(kernel)
    total, feasible = space.count(ctx)
    assert 0 < feasible < total  # the rules rule something out, and leave something in
    # Every point of the main context, a stride for the others; the backward's main context has over
    # three million points: a stride of 7 (prime to every knob's number of values, so that each
    # value of each knob still comes up in every combination of the others' strides).
    step = 1 if ctx is CONTEXTS[0] and kernel != "backward" else 7
    n = 0
    for params in itertools.islice(space.iter_feasible(ctx), 0, None, step):
        # the file's rules alone must imply variant.validate for this device and dtype
        space.variant(params).validate(ctx.elem_bytes, ctx.smem_limit)
        n += 1
    assert n == -(-feasible // step)


def test_count_matches_enumeration_and_brute_force():
    space = load_space("indexed_dot")
    ctx = CONTEXTS[2]
    names = list(space.knobs)
    brute = [dict(zip(names, combo)) for combo in itertools.product(*space.knobs.values())]
    kept = [p for p in brute if space.violated(p, ctx) is None]
    assert space.count(ctx) == (len(brute), len(kept))
    assert list(space.iter_feasible(ctx)) == kept


def test_rules_name_the_reason():
    space = load_space("backward")
    params = space.params_of(KernelVariants().backward)
    tiny = SpaceContext(B=8192, V=32000, D=4096, elem_bytes=2, smem_limit=48 * 1024)
    assert "shared_memory" in space.reject_reason(params, tiny)
    redundant = {**params, "filter_eps": None, "sort_vocab": True}
    assert "sort_needs_filter" in space.reject_reason(redundant, CONTEXTS[0])
    spill = {**params, "block_b": 128, "block_v": 256, "block_d": 16, "num_stages": 1, "num_warps": 4}
    assert "registers" in space.reject_reason(spill, CONTEXTS[0])
    # variant.validate itself draws the hard line at 256 accumulators per thread (here 512).
    with pytest.raises(VariantError, match="accumulators per thread"):
        space.variant({**spill, "block_b": 256}).validate()


def _write(tmp_path, text):
    p = tmp_path / "indexed_dot.yaml"
    p.write_text(text)
    return p


GOOD = """
kernel: indexed_dot
knobs:
  block_b: {pow2: [8, 32]}
  block_d: [64, 128]
  num_warps: {range: [1, 4]}
  num_stages: [2]
constraints:
  - {name: r, rule: "block_b * block_d // threads <= 128", why: spills}
"""


def test_knob_forms_expand(tmp_path):
    space = load_space("indexed_dot", _write(tmp_path, GOOD))
    assert space.knobs == {"block_b": (8, 16, 32), "block_d": (64, 128), "num_warps": (1, 2, 3, 4), "num_stages": (2,)}
    assert isinstance(space, SearchSpace)


@pytest.mark.parametrize(
    "change, message",
    [
        (("num_stages: [2]", "num_stages: [2]\n  num_ctas: [1]"), "unknown knob(s) ['num_ctas']"),
        (("  num_stages: [2]\n", ""), "knob(s) ['num_stages'] missing"),
        (("threads <= 128", "threads.__class__"), "Attribute"),
        (("threads <= 128", "open('x')"), "calls something other than"),
        (("threads <= 128", "threads <= BLOCK"), "unknown name 'BLOCK'"),
        (("{pow2: [8, 32]}", "{pow2: [8, 24]}"), "powers of two"),
        (("kernel: indexed_dot", "kernel: backward"), "expected 'indexed_dot'"),
        (("block_d: [64, 128]", "block_d: [64, 64]"), "lists a value twice"),
    ],
)
def test_malformed_space_names_file_and_problem(tmp_path, change, message):
    path = _write(tmp_path, GOOD.replace(*change))
    with pytest.raises(SpaceError) as err:
        load_space("indexed_dot", path)
    assert str(path) in str(err.value)
    assert message in str(err.value)
