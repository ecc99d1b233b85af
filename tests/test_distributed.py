"""DTensor arguments over torch.distributed (gloo, processes spawned by the test, on the CPU): a
classifier sharded over the vocabulary (Shard(0): the vocabulary-parallel loss) or replicated, hidden
states with their rows sharded, against one process on the whole classifier (fp32, 1e-5)."""

import datetime
import gc
import os
import sys
import tempfile
import traceback

import pytest
import torch

dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

B, T, D, V = 2, 9, 16, 37  # (V = 37: uneven shards over 2 and 4 ranks)

CASES = [
    dict(),
    dict(reduction="sum"),
    dict(reduction="none", ignore=True),
    dict(shift=1, ignore=True),
    dict(softcap=20.0, bias=True),
    dict(label_smoothing=0.1, bias=True),
    dict(z_loss=1e-3, return_lse=True),
    dict(token_weights=True, ignore=True),
    dict(e_sharded=True),
    dict(placement="replicate", bias=True),
]
KERNEL_CASES = [dict(impl="triton"), dict(impl="triton", filter_eps=None, softcap=20.0, bias=True)]


def _inputs(case):
    g = torch.Generator().manual_seed(0)
    e = torch.randn(B, T, D, generator=g) / D**0.25
    c = torch.randn(V, D, generator=g) / D**0.25
    bias = torch.randn(V, generator=g) * 0.1 if case.get("bias") else None
    t = torch.randint(0, V, (B, T), generator=g)
    if case.get("ignore"):
        t[0, :3] = -100
    w = torch.rand(B, T, generator=g) + 0.5 if case.get("token_weights") else None
    return e, c, bias, t, w


def _options(case):
    keys = ("reduction", "shift", "softcap", "label_smoothing", "z_loss", "return_lse", "impl", "filter_eps")
    out = {k: case[k] for k in keys if k in case}
    out.setdefault("impl", "torch")
    return out


def _run(e, c, bias, t, w, options):
    """(loss, lse or None) after a backward of loss (+ 0.1 * lse.sum() when returned)."""
    from cce_autotune import linear_cross_entropy

    out = linear_cross_entropy(e, c, t, bias, token_weights=w, **options)
    loss, lse = out if options.get("return_lse") else (out, None)
    total = loss.sum() + (0.1 * lse.sum() if lse is not None else 0.0)
    total.backward()
    return loss.detach(), lse.detach() if lse is not None else None


def _check(mesh, case):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    e, c, bias, t, w = _inputs(case)
    options = _options(case)
    ref_e, ref_c = e.clone().requires_grad_(), c.clone().requires_grad_()
    ref_b = bias.clone().requires_grad_() if bias is not None else None
    reference = dict(impl="torch", **{k: v for k, v in options.items() if k not in ("impl", "filter_eps")})
    want_loss, want_lse = _run(ref_e, ref_c, ref_b, t, w, reference)

    placement = [Replicate()] if case.get("placement") == "replicate" else [Shard(0)]
    c_d = distribute_tensor(c.clone(), mesh, placement).requires_grad_()
    b_d = distribute_tensor(bias.clone(), mesh, placement).requires_grad_() if bias is not None else None
    e_d = distribute_tensor(e.clone(), mesh, [Shard(0)]).requires_grad_() if case.get("e_sharded") else \
        e.clone().requires_grad_()
    import torch.distributed as dist

    reduces = []  # (dE's: the shards' agreement on their filter reduces a few numbers too)
    all_reduce = dist.all_reduce
    dist.all_reduce = lambda t, *a, **k: (reduces.extend([1] if t.shape == e.shape else []), all_reduce(t, *a, **k))[1]
    try:
        loss, lse = _run(e_d, c_d, b_d, t, w, options)
    finally:
        dist.all_reduce = all_reduce
    if placement != [Replicate()]:
        # dE is summed over the mesh by the backward's all_reduce, or, with e's rows sharded over the
        # mesh, by DTensor's reduce_scatter as it hands each rank its rows' gradient (no all_reduce).
        assert len(reduces) == (0 if case.get("e_sharded") else 1), reduces
        if case.get("e_sharded"):
            assert tuple(e_d.grad.placements) == (Shard(0),)
    close = dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss, want_loss, **close)
    if want_lse is not None:
        torch.testing.assert_close(lse, want_lse, **close)
    grad_e = e_d.grad.full_tensor() if case.get("e_sharded") else e_d.grad
    torch.testing.assert_close(grad_e, ref_e.grad, **close)
    torch.testing.assert_close(c_d.grad.full_tensor(), ref_c.grad, **close)
    assert tuple(c_d.grad.placements) == tuple(placement)
    if bias is not None:
        torch.testing.assert_close(b_d.grad.full_tensor(), ref_b.grad, **close)


def _check_compiled(mesh, case):
    # torch.compile(fullgraph=True) traces the DTensor arguments around the loss's operators: the
    # compiled call's loss and gradients are the eager one's.
    from torch.distributed.tensor import Shard, distribute_tensor

    from cce_autotune import linear_cross_entropy

    e, c, bias, t, w = _inputs(case)
    options = _options(case)

    def step(fn):
        c_d = distribute_tensor(c.clone(), mesh, [Shard(0)]).requires_grad_()
        b_d = distribute_tensor(bias.clone(), mesh, [Shard(0)]).requires_grad_() if bias is not None else None
        e_d = distribute_tensor(e.clone(), mesh, [Shard(0)]).requires_grad_() if case.get("e_sharded") else \
            e.clone().requires_grad_()
        out = fn(e_d, c_d, b_d, t, w)
        loss, lse = out if options.get("return_lse") else (out, None)
        (loss.sum() + (0.1 * lse.sum() if lse is not None else 0.0)).backward()
        grads = [x.grad.full_tensor() if hasattr(x.grad, "full_tensor") else x.grad for x in (e_d, c_d, b_d)
                 if x is not None]
        return [loss.detach()] + ([lse.detach()] if lse is not None else []) + grads

    def call(e_, c_, b_, t_, w_):
        return linear_cross_entropy(e_, c_, t_, b_, token_weights=w_, **options)

    want = step(call)
    got = step(torch.compile(call, fullgraph=True, backend="aot_eager"))
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


def _check_errors(mesh):
    import re

    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor

    from cce_autotune import linear_cross_entropy

    def refused(e_, c_, t_, bias=None, *, starts: str, holds: str = ""):
        with pytest.raises(ValueError, match="^" + re.escape(starts) + ".*" + re.escape(holds)):
            linear_cross_entropy(e_, c_, t_, bias, impl="torch")

    e, c, _, t, _ = _inputs({})
    refused(e, distribute_tensor(c.clone(), mesh, [Shard(1)]), t, starts="c: a DTensor placed", holds="Shard(dim=1)")
    c_d = distribute_tensor(c.clone(), mesh, [Shard(0)])
    refused(e, c_d, t, torch.zeros(V), starts="bias: must be a DTensor placed as the classifier")
    different_rows = "e, targets: the ranks of the classifier's mesh hold different rows"
    mine = t.clone()
    mine[0, 0] = (int(mine[0, 0]) + 1 + dist.get_rank()) % V  # each rank its own targets: not the TP layout
    refused(e, c_d, mine, starts=different_rows)
    other = e.clone()
    other[1] += dist.get_rank()  # the same targets, other rows
    refused(other, c_d, t, starts=different_rows)
    bad = t.clone()
    bad[1, 2] = V + 3
    refused(e, c_d, bad, starts="", holds=f"targets: value {V + 3} is outside [0, {V})")


def _check_filtered(mesh):
    # The shards' forwards record their tile maps and their backwards filter together: the accuracy
    # check sums each sampled row's dE and dropped terms over the shards, so every shard measures,
    # and chooses from, the whole call's error. All 64 rows are sampled here and the bound is taken
    # without its confidence margin, so the measured error is the error of the gradient that runs.
    import functools

    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor

    from cce_autotune import linear_cross_entropy
    from cce_autotune.configdb import dispatch
    from cce_autotune.planning import accuracy, costs, explain, filters
    from helpers import NO_CHUNK_HOST, make_inputs, rel_err
    from test_planner import MAPPED

    costs.BUILTIN["h200"] = {**costs.BUILTIN["h200"], "map_ms": 0.0, **NO_CHUNK_HOST,
                             "pause_share": float("inf"), "max_dropped": float("inf")}
    dispatch.costs_for = lambda gpu: costs.builtin(gpu)  # (no fixed costs: at this size they would pause)
    accuracy.check = functools.partial(accuracy.check, confidence=0.0)
    filters.MAX_ERROR = 0.5  # the first candidate passes, with an error worth measuring
    e, c, t, _ = make_inputs((64,), 512, 32, torch.float32, peaked=0.3, seed=5)
    kv = MAPPED.replace(backward=MAPPED.backward.replace(filter_eps=2.0**-4, strategy="chunked"))
    e64, c64 = e.double().requires_grad_(), c.double().requires_grad_()
    torch.nn.functional.cross_entropy(e64 @ c64.T, t).backward()
    c_d = distribute_tensor(c.clone(), mesh, [Shard(0)]).requires_grad_()
    with explain.recording() as made:
        for _ in range(2):  # the first call leaves the vocabulary's order, the second walks it and filters
            e_d = e.clone().requires_grad_()
            c_d.grad = None
            linear_cross_entropy(e_d, c_d, t, impl="triton", variants=kv, deterministic=True).backward()
    call = made[-1].call
    assert call.backward.use_map and call.run_eps is not None, call.backward.describe()
    err = rel_err(e_d.grad.double(), e64.grad)
    mine = [call.run_eps, err, call.checked]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    assert len({x[0] for x in everyone}) == 1, everyone  # the same filter on every shard
    assert err > 1e-4, err  # the filter dropped something
    measured = [m for m in call.checked if m[0] == call.run_eps]
    assert measured, call.checked
    assert abs(measured[0][1] - err) <= 0.02 * err, (measured, err)  # the check measured the whole call
    # A shard that cannot filter (here rank 1's, paused: its forward maps nothing) makes every shard
    # run exact, rather than leave the others waiting in a check it does not join.
    from cce_autotune import memory

    if dist.get_rank() == 1:
        memory.pause(c_d.to_local(), 1)
    with explain.recording() as made:
        linear_cross_entropy(e.clone().requires_grad_(), c_d, t, impl="triton", variants=kv, deterministic=True).backward()
    call = made[-1].call
    assert call.run_eps is None and not call.checked, call.backward.describe()
    if dist.get_rank() == 0:
        assert "another vocabulary shard of the call has no tile map" in call.backward.reason
    # A shard whose filtering cannot pay (here rank 1's, by its cost model) pauses and runs exact; the
    # others, which would have filtered, run exact too and pause with it.
    memory.clear()
    if dist.get_rank() == 1:
        costs.BUILTIN["h200"] = {**costs.BUILTIN["h200"], "pause_share": 0.0}
    auto = MAPPED.replace(backward=MAPPED.backward.replace(filter_eps=2.0**-4, strategy="auto"))
    c_d = distribute_tensor(c.clone(), mesh, [Shard(0)]).requires_grad_()
    with explain.recording() as made:
        for _ in range(2):
            e_d = e.clone().requires_grad_()
            linear_cross_entropy(e_d, c_d, t, impl="triton", variants=auto, deterministic=True).backward()
    call = made[-1].call
    assert call.run_eps is None and not call.backward.use_map and call.pause > 0, call.backward.describe()
    assert ("another vocabulary shard of the call pauses" if dist.get_rank() == 0 else "filtering cannot pay") \
        in call.backward.reason, call.backward.reason
    assert rel_err(e_d.grad.double(), e64.grad) < 1e-5  # exact


def _worker(rank, world, init_file, out_dir, jobs, interpret):
    """Run each ``(label, check, args)`` of ``jobs`` as ``check(mesh, *args)`` on a 1-D mesh of all the
    ranks; what fails is written to ``out_dir`` for the test (a rank's failures, with their labels)."""
    if interpret:
        os.environ["TRITON_INTERPRET"] = "1"
    import faulthandler

    faulthandler.enable(all_threads=True)  # (a rank that aborts in C++ prints its Python stacks to the test's stderr)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    # (a rank left waiting in a collective fails the test within minutes, not gloo's default half hour)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=240))
    failures = []
    try:
        mesh = init_device_mesh("cpu", (world,))
        for label, check, args in jobs:
            try:
                check(mesh, *args)
            except Exception:  # noqa: BLE001 - reported to the test, which fails naming the job
                failures.append(f"{label}: {traceback.format_exc()}")
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
            f.write("\n".join(failures))
        # Every rank done before any tears down, and nothing of Python's left holding the groups.
        dist.barrier()
        mesh = None
        gc.collect()
        dist.destroy_process_group()
    # Reached only when nothing escaped (an escaping exception ends the rank with a non-zero status):
    # the results are written and the groups destroyed, so the rank leaves without the interpreter's
    # teardown, where gloo's threads aborted a rank now and then (SIGABRT, "terminate called without
    # an active exception": 1 spawned test in about 70 on a 2-core machine, 2 of 6 fresh-clone CI runs
    # at one stop; the teardown race that pytorch/pytorch#179291 describes).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _spawn(world, jobs, interpret=False):
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(world, os.path.join(tmp, "init"), tmp, jobs, interpret), nprocs=world,
                           start_method="spawn")
        failures = [open(os.path.join(tmp, f"rank{r}.txt")).read() for r in range(world)]
    assert not any(failures), "\n".join(f"rank {r}: {x}" for r, x in enumerate(failures) if x)


def _cases(cases, errors=True):
    """Jobs for :func:`_spawn`: each case, and the errors' checks."""
    return [(str(case), _check, (case,)) for case in cases] + ([("errors", _check_errors, ())] if errors else [])


def test_two_ranks_match_one_process_for_every_loss_term():
    _spawn(2, _cases(CASES))


def test_the_vocabulary_parallel_loss_compiles_with_fullgraph():
    cases = [dict(e_sharded=True), dict(label_smoothing=0.1, bias=True, return_lse=True, z_loss=1e-3, token_weights=True)]
    _spawn(2, [(f"compiled {case}", _check_compiled, (case,)) for case in cases])


def test_four_ranks_with_uneven_shards():
    _spawn(4, _cases([dict(), dict(label_smoothing=0.1, bias=True, shift=1), dict(e_sharded=True, reduction="sum")]))


def test_the_kernels_run_each_shard_through_the_interpreter():
    _spawn(2, _cases(KERNEL_CASES, errors=False), interpret=True)


def test_the_shards_filter_together_on_the_whole_vocabularys_error():
    _spawn(2, [("filtered", _check_filtered, ())], interpret=True)


# -- FSDP2 and the Hugging Face patch ------------------------------------------------------------


def _fsdp_model(patched: bool, head_alone: bool, mesh=None, before_fsdp=None):
    import transformers
    from torch.distributed.fsdp import fully_shard

    from cce_autotune.integrations.transformers import patch

    config = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).float()
    if patched:
        patch(model, impl="torch")
    if before_fsdp is not None:
        before_fsdp(model)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    if head_alone:
        fully_shard(model.lm_head, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _check_fsdp_training(mesh, head_alone):
    # Each rank its own batch (data parallel); the same steps, patched and not, end at the same weights.
    rank = mesh.get_local_rank()
    # (AdamW turns a rounding-level difference in a near-zero gradient into a difference of up to a step
    # in that weight: 5e-6 in one k_proj element of 512 here with transformers 5.24 and torch 2.13. 1e-4,
    # 1 % of a step of lr 1e-2, still fails on any real gradient error, which moves the losses and most
    # weights by far more.)
    _assert_same_training([_train(_fsdp_model(patched, head_alone), 100 + rank) for patched in (False, True)], 1e-4)


def _train(model, seed):
    """(losses, full parameters) after 3 AdamW steps of ``model`` on batches drawn from ``seed``."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(3):
        ids = torch.randint(0, V, (2, 12), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return torch.stack(losses), {k: p.full_tensor().detach() for k, p in model.named_parameters()}


def _assert_same_training(results, atol):
    (ref_losses, ref_params), (losses, params) = results
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    for k, p in ref_params.items():
        torch.testing.assert_close(params[k], p, rtol=1e-5, atol=atol, msg=lambda m, k=k: f"{k}: {m}")


def _check_tensor_parallel_head(mesh):
    # A TP plan that shards lm_head column-wise (its weight Shard(0)): the patched model's loss and
    # gradients are one process's on the whole model (every rank holds the same batch).
    import transformers
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from cce_autotune.integrations.transformers import patch

    config = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(config).float().train()
    model = transformers.LlamaForCausalLM(config).float().train()
    model.load_state_dict(ref.state_dict())
    parallelize_module(model, mesh, {"lm_head": ColwiseParallel(use_local_output=False)})
    patch(model, impl="torch")
    ids = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(7))
    want = ref(input_ids=ids, labels=ids).loss
    want.backward()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    assert tuple(model.lm_head.weight.grad.placements)[0].is_shard(0)
    grads = {k: p.grad for k, p in ref.named_parameters()}
    for k, p in model.named_parameters():
        got = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        torch.testing.assert_close(got, grads[k], rtol=1e-5, atol=1e-6, msg=k)


def _check_fsdp_over_tensor_parallel(mesh, head_alone):
    # A 2-D mesh (data parallel x tensor parallel): lm_head sharded column-wise over "tp", FSDP2 over
    # "dp" (the layers, the root, and with head_alone the head on its own). FSDP gathers the "dp"
    # shards around the forward, so the loss sees lm_head's weight Shard(0) on the 1-D "tp" mesh: the
    # vocabulary-parallel loss. The patched model trains as the unpatched one under FSDP2 alone.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    world = mesh.size()
    mesh2 = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh2["dp"].get_local_rank()
    results = []
    for patched in (False, True):
        tp = (lambda m: parallelize_module(m, mesh2["tp"], {"lm_head": ColwiseParallel(use_local_output=False)})) \
            if patched else None
        model = _fsdp_model(patched, head_alone and patched, mesh=mesh2["dp"], before_fsdp=tp)
        hooks = (dict(model.lm_head._forward_pre_hooks), dict(model.lm_head._forward_hooks))
        results.append(_train(model, 100 + dp))
        if patched:
            assert model.lm_head.weight.device_mesh.ndim == 2, model.lm_head.weight.placements
        # (the TP hooks that the loss's call leaves out are back, in their order)
        assert (dict(model.lm_head._forward_pre_hooks), dict(model.lm_head._forward_hooks)) == hooks
    _assert_same_training(results, 1e-5)


def test_fsdp2_over_a_tensor_parallel_head_on_a_2d_mesh():
    pytest.importorskip("transformers")
    _spawn(4, [("FSDP2 x TP", _check_fsdp_over_tensor_parallel, (False,)),
               ("FSDP2 x TP, the head sharded on its own", _check_fsdp_over_tensor_parallel, (True,))])


def test_fsdp2_and_tensor_parallel_patched_models_match_the_unpatched_one():
    pytest.importorskip("transformers")
    _spawn(2, [("head sharded with the root", _check_fsdp_training, (False,)),
               ("head sharded on its own", _check_fsdp_training, (True,)),
               ("tensor-parallel lm_head", _check_tensor_parallel_head, ())])
