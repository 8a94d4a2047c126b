"""slimgrad.memory vs hand-computed counts, MemTracker, and itself (determinism, fake tensors)."""

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from slimgrad._library import custom_op
from slimgrad.memory import estimate, measure

N, D = 32, 64
ACT = N * D * 4  # one fp32 activation, 8192 B
W = D * D * 4  # one weight, 16384 B
B = D * 4  # one bias, 256 B


def test_linear_saves_its_input_not_its_weight():
    lin = nn.Linear(D, D)
    x = torch.randn(N, D)  # pre-existing, no grad: the weight is not needed for backward
    m = measure(lambda: lin(x).sum(), module=lin)
    assert m.saved_input_bytes == ACT
    assert m.floor_input_bytes == ACT  # a pre-existing matmul input: the floor's input part
    assert m.saved_param_bytes == 0
    assert m.saved_bytes == 0
    assert m.end_bytes == W + B  # the two parameter grads


def test_linear_input_created_in_step_counts_as_saved_and_floor():
    lin = nn.Linear(D, D)
    x = torch.randn(N, D)
    m = measure(lambda: lin(x * 1).sum(), module=lin)
    assert m.saved_bytes == ACT
    assert m.floor_bytes == ACT
    assert m.by_node == {"AddmmBackward0": ACT}


def test_relu_saves_only_its_output():
    x = torch.randn(N, D, requires_grad=True)
    m = measure(lambda: torch.relu(x * 2).sum())
    assert m.saved_bytes == ACT
    assert m.floor_bytes == m.floor_input_bytes == 0
    assert m.by_node == {"ReluBackward0": ACT}
    assert m.retained_bytes == ACT + 4  # the output and the loss


def test_mlp_peak_is_hand_computed():
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(D, D), nn.ReLU(), nn.Linear(D, D))
    x = torch.randn(N, D)
    m = measure(lambda: mlp(x).sum(), module=mlp)
    # saved: the ReLU output, kept by ReluBackward0 and by the second addmm, counted once
    assert m.saved_bytes == ACT
    assert m.floor_bytes == ACT
    assert m.by_module == {"1": ACT}
    # forward peak: r + h2 + loss
    assert m.forward_peak_bytes == 2 * ACT + 4
    # peak, in ReluBackward: loss + its ones grad (8) + r + dr + dW2 + db2 + dh1
    # (threshold_backward), then r and dr are freed and the first layer's dW1 + db1 arrive
    assert m.peak_bytes == 8 + ACT + W + B + W + B
    assert m.end_bytes == 2 * (W + B)
    assert m.peak_phase == "backward"


def test_views_and_inplace_add_nothing():
    x = torch.randn(N, D)

    def fwd():
        y = x * 1
        v = y.view(D, N)
        v.mul_(2)
        y.t_()
        return y[:3].sum()

    m = measure(fwd, backward=False)
    assert m.forward_peak_bytes == ACT + 4  # y, and the sum; views and in-place results share y


def test_untyped_storage_resize_is_followed():
    def fwd():
        t = torch.empty(1000)
        st = t.untyped_storage()
        st.resize_(0)
        st.resize_(3000 * 4)
        return t.sum()  # not differentiable: forward only

    m = measure(fwd, backward=False)
    # 4000 B, then 0, then 12000 B, plus the 4-byte sum
    assert m.forward_peak_bytes == 12000 + 4
    lives = [b for _, _, b in m.timeline]
    assert 0 in lives and 4000 in lives


def test_tensor_resize_and_out_are_followed():
    def fwd():
        t = torch.empty(1000)
        t.resize_(0)
        t.resize_(3000)
        o = torch.empty(0)
        torch.add(t, 1, out=o)  # o grows to 12000 B
        return o

    m = measure(fwd, backward=False)
    assert m.forward_peak_bytes == 24000


def test_grad_accumulation_into_existing_grads():
    mlp = nn.Sequential(nn.Linear(D, D), nn.ReLU(), nn.Linear(D, D))
    x = torch.randn(N, D)
    first = measure(lambda: mlp(x).sum(), module=mlp)
    second = measure(lambda: mlp(x).sum(), module=mlp)  # grads exist: accumulated in place
    assert second.end_bytes == 0
    assert second.saved_bytes == first.saved_bytes
    assert second.peak_bytes < first.peak_bytes


def test_custom_function_ctx_attributes_are_seen():
    class Keep(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            ctx.save_for_backward(a)
            ctx.side = [a[:10] * 3]  # a side buffer kept as an attribute: 40 B
            return a * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    x = torch.randn(N, D, requires_grad=True)
    m = measure(lambda: Keep.apply(x * 1).sum())
    assert m.saved_bytes == ACT + 10 * D * 4
    assert m.by_node == {"KeepBackward": ACT + 10 * D * 4}


class _Floor(torch.autograd.Function):
    _slimgrad_floor = True

    @staticmethod
    def forward(ctx, a):
        ctx.save_for_backward(a)
        return a.clone()

    @staticmethod
    def backward(ctx, g):
        return g


def test_floor_flag_on_slimgrad_functions_and_conv_embedding():
    x = torch.randn(N, D, requires_grad=True)
    assert measure(lambda: _Floor.apply(x * 1).sum()).floor_bytes == ACT
    conv = nn.Conv2d(3, 4, 3)
    img = torch.randn(2, 3, 9, 9)
    m = measure(lambda: conv(img * 1).sum(), module=conv)
    assert m.floor_bytes == img.nbytes == m.saved_bytes
    emb = nn.Embedding(10, 4)
    idx = torch.randint(0, 10, (5, 7))
    m = measure(lambda: emb(idx + 0).sum(), module=emb)
    assert m.floor_bytes == idx.nbytes


_SCRATCH = 64 * 1024


@custom_op("_test_scratch_double", mutates_args=())
def _scratch_double(x: torch.Tensor) -> torch.Tensor:
    scratch = torch.empty(_SCRATCH // 4)  # a temporary the op frees before returning
    scratch.fill_(1)
    return x * 2


def test_slimgrad_custom_op_temporaries_are_seen():
    x = torch.randn(N, D)
    m = measure(lambda: torch.ops.slimgrad._test_scratch_double(x), backward=False)
    assert m.forward_peak_bytes == _SCRATCH + ACT


def test_checkpointed_tensors_are_not_unpacked_by_the_walk():
    calls = []
    lin = nn.Linear(D, D)

    def body(a):
        calls.append(1)
        return torch.relu(lin(a))

    x = torch.randn(N, D, requires_grad=True)
    m = measure(lambda: checkpoint(body, x * 1, use_reentrant=False).sum(), module=lin)
    assert len(calls) == 2  # forward + the recompute in backward, none for measuring
    assert m.peak_bytes > 0


def test_non_scalar_output_needs_grad():
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(ValueError, match="slimgrad.memory.measure: backward needs a scalar"):
        measure(lambda: x * 2)
    m = measure(lambda: x * 2, grad=torch.ones(3))
    assert m.saved_bytes == 0
    with pytest.raises(TypeError, match="forward must return a tensor"):
        measure(lambda: 3)


class _TinyCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        x = torch.relu(self.bn(self.c1(x)))
        x = nn.functional.max_pool2d(self.c2(x), 2)
        return self.fc(x.mean((2, 3)))


class _TinyTransformer(nn.Module):
    def __init__(self, vocab=50, d=32, heads=4):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layer = nn.TransformerEncoderLayer(d, heads, 64, dropout=0.1, batch_first=True)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        return self.head(self.layer(self.emb(ids)))


def _cnn_case():
    model = _TinyCNN()
    x = torch.randn(4, 3, 12, 12)
    y = torch.randint(0, 5, (4,))
    return model, (x,), lambda: nn.functional.cross_entropy(model(x), y)


def _transformer_case():
    model = _TinyTransformer()
    ids = torch.randint(0, 50, (2, 9))
    return (
        model,
        (ids,),
        lambda: nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten()),
    )


@pytest.mark.parametrize("case", [_cnn_case, _transformer_case], ids=["cnn", "transformer"])
def test_peak_equals_memtracker(case):
    from torch.distributed._tools.mem_tracker import MemTracker

    torch.manual_seed(0)
    model, inputs, loss_fn = case()
    torch.manual_seed(1)
    ours = measure(loss_fn, module=model)
    model.zero_grad(set_to_none=True)
    mt = MemTracker()
    mt.track_external(model, *inputs)
    torch.manual_seed(1)
    with mt:
        start = mt.get_tracker_snapshot("current")
        start_total = sum(v["Total"] for v in start.values())
        loss_fn().backward()
    peak_total = sum(v["Total"] for v in mt.get_tracker_snapshot("peak").values())
    assert ours.peak_bytes == peak_total - start_total


@pytest.mark.parametrize("case", [_cnn_case, _transformer_case], ids=["cnn", "transformer"])
def test_two_runs_are_identical(case):
    torch.manual_seed(0)
    model, _, loss_fn = case()
    runs = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        runs.append(measure(loss_fn, module=model).to_dict(timeline=True))
    assert runs[0] == runs[1]


@pytest.mark.parametrize("case", [_cnn_case, _transformer_case], ids=["cnn", "transformer"])
def test_fake_estimate_equals_real(case):
    torch.manual_seed(0)
    model, _, loss_fn = case()
    torch.manual_seed(1)
    real = measure(loss_fn, module=model)

    def make():
        torch.manual_seed(0)
        fmodel, _, floss = case()
        return floss, fmodel

    fake = estimate(make)
    for field in ("peak_bytes", "saved_bytes", "floor_bytes", "retained_bytes", "end_bytes"):
        assert getattr(fake, field) == getattr(real, field), field


def test_module_attribution_reaches_past_inner_modules():
    class Blk(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(D, D)

        def forward(self, x):
            h = torch.tanh(x * 2)  # computed by Blk itself; kept by TanhBackward and by lin's addmm
            return self.lin(h) * 3

    model = nn.Sequential(Blk())
    x = torch.randn(N, D, requires_grad=True)
    m = measure(lambda: model(x).sum(), module=model)
    assert m.by_module == {"0": ACT}
    (h,) = [s for s in m.saved if s.kind == "step"]
    assert sorted(h.savers) == ["AddmmBackward0", "TanhBackward0"]


def test_meta_tensors_hold_no_bytes():
    # a meta tensor (a layout probe, shape arithmetic) allocates nothing: the step's peak is the
    # real tensors' only; fake tensors (estimate) still count
    x = torch.ones(4, requires_grad=True)

    def step():
        probe = torch.empty(100_000, device="meta")
        probe.add_(1)
        return (x * 2).sum()

    m = measure(step)
    assert m.peak_bytes == measure(lambda: (x * 2).sum()).peak_bytes < 1000
    est = estimate(lambda: lambda: (torch.ones(1000, requires_grad=True) * 2).sum())
    assert est.peak_bytes >= 4000


def test_tracker_finds_the_tensors_tree_flatten_finds():
    # the tracker's direct walk over an op's arguments and outputs (plain tuples, lists and dicts
    # walked, scalars skipped, anything else flattened by pytree) finds tree_flatten's tensors,
    # in its order
    from collections import OrderedDict, namedtuple

    from torch.utils._pytree import tree_flatten

    from slimgrad.memory import _tensors

    a, b, c, d = (torch.ones(i + 1) for i in range(4))
    pair = namedtuple("pair", "x y")
    for obj in (
        ((a, [b, 2, None], {"k": c, "s": torch.Size([2])}), {"out": d, "dtype": torch.float32}),
        [OrderedDict(z=b, y=a), pair(c, (d, 1.5)), torch.device("cpu"), "name"],
        (a,),
        (),
    ):
        want = [t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor)]
        got = _tensors(obj, [])
        assert len(got) == len(want) and all(g is w for g, w in zip(got, want, strict=True))


def test_the_trackers_reads_pass_no_torch_function_mode():
    # the tracker's own reads of an op's tensors (their storages, layouts) run with torch functions
    # off: a mode on the stack while the engine dispatches backward's ops from C++ (as estimate's
    # CUDA routing keeps one there: NOTE [Routing in backward] in slimgrad/memory.py) sees no
    # call the tracker made, and the figures are those of the step without the mode
    from slimgrad.memory import _backward_here

    calls = []

    class Watch(torch.overrides.TorchFunctionMode):
        inside = False

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if self.inside and not isinstance(func, torch._ops.OpOverload):
                # (the ops a dispatch mode passes on go through torch-function modes, the
                # tracker's as any; its own reads are what must not)
                calls.append(getattr(func, "__qualname__", str(func)))
            if func is torch.Tensor.backward:
                self.inside = True
                try:
                    with self:
                        _backward_here(*args, **kwargs)
                finally:
                    self.inside = False
                return None
            return func(*args, **kwargs)

    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8)

    def step():
        return lin(x).relu().square().sum()

    with Watch():
        step().backward()  # the calls the step itself makes in backward
    untracked, calls[:] = list(calls), []
    lin.zero_grad(set_to_none=True)
    plain = measure(step)
    lin.zero_grad(set_to_none=True)
    with Watch():
        watched = measure(step)
    assert calls == untracked
    assert watched.to_dict(timeline=True) == plain.to_dict(timeline=True)


def test_raw_saved_attributes_are_the_ones_dir_lists():
    # the saved-tensor walk reads each node type's ``_raw_saved_*`` names once and the node's own
    # attributes per node: the names ``dir(node)`` lists, in its order
    from slimgrad.memory import _raw_saved_attrs

    class Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            ctx.save_for_backward(a)
            ctx._raw_saved_extra, ctx.other = 1, a
            return a * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    x = torch.randn(3, 5, requires_grad=True)
    w = torch.randn(5, 2, requires_grad=True)
    y = (x @ w).relu().sum() + nn.functional.layer_norm(x, (5,)).sigmoid().mean()
    y = y + x[1:].exp().sum() + Fn.apply(x).sum()
    seen, stack, types = set(), [y.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        types.add(type(node).__name__)
        assert _raw_saved_attrs(node) == [a for a in dir(node) if a.startswith("_raw_saved_")]
        stack.extend(n for n, _ in node.next_functions)
    assert {"MmBackward0", "NativeLayerNormBackward0", "FnBackward"} <= types
