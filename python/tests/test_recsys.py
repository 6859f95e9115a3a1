"""The recsys family through PyTorch: embedding bags (dense gradient or fused optimizer),
interaction, loss, dense optimizer, against nn.EmbeddingBag / torch.optim / plain torch math."""
import pytest

torch = pytest.importorskip("torch", reason="the operator tests need PyTorch")
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import fusekit  # noqa: E402
from fusekit import nn as fnn  # noqa: E402
from fusekit import ops  # noqa: E402


def make_bags(table_rows, batch, max_bag, device, seed, empty_every=5):
    """Per-table (indices, offsets) as nn.EmbeddingBag takes them: random bags of 0..max_bag rows
    (every empty_every-th bag empty), repeats within a bag allowed."""
    g = torch.Generator().manual_seed(seed)
    per_table = []
    for rows in table_rows:
        sizes = torch.randint(0, max_bag + 1, (batch,), generator=g)
        sizes[::empty_every] = 0
        idx = torch.randint(0, rows, (int(sizes.sum()),), generator=g)
        off = sizes.cumsum(0) - sizes  # each bag's start
        per_table.append((idx.to(device), off.to(device)))
    return per_table


def torch_bags(ebc, device):
    """nn.EmbeddingBag copies of ebc's tables."""
    bags = []
    for t, rows in enumerate(ebc.table_rows):
        b = nn.EmbeddingBag(rows, ebc.embedding_dim, mode=ebc.pooling, device=device)
        with torch.no_grad():
            b.weight.copy_(ebc.table(t))
        bags.append(b)
    return bags


CASES = [([7, 100, 33], 5, 3, 4), ([1], 1, 1, 8), ([50, 3, 9, 1000], 17, 6, 16), ([12, 12], 0, 2, 4)]


@pytest.mark.parametrize("table_rows,batch,max_bag,dim", CASES)
@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_embedding_bags_match_nn_embedding_bag_forward_and_gradient(table_rows, batch, max_bag, dim, pooling, device):
    torch.manual_seed(1)
    ebc = fnn.EmbeddingBagCollection(table_rows, dim, pooling=pooling, device=device)
    ref = torch_bags(ebc, device)
    per_table = make_bags(table_rows, batch, max_bag, device, 2)
    idx, off = fnn.EmbeddingBagCollection.collate(per_table)
    assert off.numel() == len(table_rows) * batch + 1
    out = ebc(idx, off)
    want = torch.stack([b(i, o) for b, (i, o) in zip(ref, per_table)], dim=1) if batch else out.new_empty(0, 0, 0)
    assert out.shape == (batch, len(table_rows), dim)
    torch.testing.assert_close(out, want.reshape(out.shape), rtol=1e-5, atol=1e-6)
    dy = torch.randn(out.shape, device=device)
    (out * dy).sum().backward()
    if batch:
        (want * dy).sum().backward()
    for t, b in enumerate(ref):
        expect = b.weight.grad if b.weight.grad is not None else torch.zeros_like(b.weight)
        torch.testing.assert_close(ebc.weight.grad[sum(table_rows[:t]):][:table_rows[t]], expect, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise_adagrad"])
def test_fused_optimizer_matches_the_optimizer_step_it_replaces(optimizer, device):
    torch.manual_seed(3)
    table_rows, dim, lr = [40, 7, 300], 8, 0.05
    ebc = fnn.EmbeddingBagCollection(table_rows, dim, optimizer=optimizer, lr=lr, eps=1e-8, device=device)
    ref = torch_bags(ebc, device)
    state = [torch.zeros(r, dim if optimizer == "adagrad" else 1, device=device) for r in table_rows]
    for step in range(3):
        per_table = make_bags(table_rows, 9, 4, device, 10 + step)
        idx, off = fnn.EmbeddingBagCollection.collate(per_table)
        dy = torch.randn(9, len(table_rows), dim, device=device)
        (ebc(idx, off) * dy).sum().backward()
        assert ebc.weight.grad is None  # the step happened inside the backward
        for t, (b, (i, o)) in enumerate(zip(ref, per_table)):
            b.weight.grad = None
            (b(i, o) * dy[:, t]).sum().backward()
            g = b.weight.grad
            with torch.no_grad():
                if optimizer == "sgd":
                    b.weight -= lr * g
                elif optimizer == "adagrad":
                    state[t] += g * g
                    b.weight -= lr * g / (state[t].sqrt() + 1e-8)
                else:  # touched rows only: an untouched row's mean g² is 0 and its update 0
                    state[t] += (g * g).mean(1, keepdim=True)
                    b.weight -= lr * g / (state[t].sqrt() + 1e-8)
    for t, b in enumerate(ref):
        torch.testing.assert_close(ebc.table(t), b.weight, rtol=1e-5, atol=1e-6)
    if optimizer == "adagrad":
        torch.testing.assert_close(ebc.optimizer_state, torch.cat(state), rtol=1e-5, atol=1e-6)


def test_fused_adagrad_matches_torch_optim_adagrad(device):
    torch.manual_seed(4)
    ebc = fnn.EmbeddingBagCollection([64], 4, optimizer="adagrad", lr=0.1, eps=1e-10, device=device)
    ref = torch_bags(ebc, device)[0]
    opt = torch.optim.Adagrad(ref.parameters(), lr=0.1, eps=1e-10)
    for step in range(3):
        ((i, o),) = make_bags([64], 6, 3, device, 20 + step)
        ebc(*fnn.EmbeddingBagCollection.collate([(i, o)])).square().sum().backward()
        opt.zero_grad()
        ref(i, o).square().sum().backward()
        opt.step()
    torch.testing.assert_close(ebc.table(0), ref.weight, rtol=1e-5, atol=1e-6)


def test_from_embedding_bags_copies_the_tables(device):
    bags = [nn.EmbeddingBag(n, 6, mode="mean", device=device) for n in (5, 11)]
    ebc = fnn.EmbeddingBagCollection.from_embedding_bags(bags)
    assert ebc.pooling == "mean" and ebc.table_rows == [5, 11]
    per_table = make_bags([5, 11], 4, 3, device, 5)
    torch.testing.assert_close(ebc(*fnn.EmbeddingBagCollection.collate(per_table)),
                               torch.stack([b(i, o) for b, (i, o) in zip(bags, per_table)], dim=1))
    with pytest.raises(fusekit.Error, match="argument 'bags'"):
        fnn.EmbeddingBagCollection.from_embedding_bags([nn.EmbeddingBag(3, 4), nn.EmbeddingBag(3, 5)])
    half = [nn.EmbeddingBag(n, 6, device=device, dtype=torch.bfloat16) for n in (5, 11)]
    ebc16 = fnn.EmbeddingBagCollection.from_embedding_bags(half)
    assert ebc16.weight.dtype == torch.bfloat16 and torch.equal(ebc16.table(1), half[1].weight)
    assert fnn.EmbeddingBagCollection.from_embedding_bags(half, dtype=torch.float32).weight.dtype == torch.float32


def test_bad_bags_raise_naming_the_argument(device):
    ebc = fnn.EmbeddingBagCollection([4, 6], 4, device=device)
    i64 = dict(dtype=torch.int64, device=device)
    good_off = torch.tensor([0, 1, 2, 3, 4], **i64)
    with pytest.raises(fusekit.Error, match="argument 'indices'"):
        ebc(torch.tensor([0, 4, 1, 2], **i64), good_off)  # 4 is past table 0's 4 rows
    with pytest.raises(fusekit.Error, match="argument 'indices'"):
        ebc(torch.tensor([0, 1, -1, 2], **i64), good_off)
    with pytest.raises(fusekit.Error, match="argument 'offsets'"):
        ebc(torch.tensor([0, 1, 1, 2], **i64), torch.tensor([0, 2, 1, 3, 4], **i64))  # decreasing
    with pytest.raises(fusekit.Error, match="argument 'offsets'"):
        ebc(torch.tensor([0, 1, 1, 2], **i64), torch.tensor([0, 1, 2, 3, 5], **i64))  # past the end
    with pytest.raises(fusekit.Error, match="argument 'offsets'"):
        ebc(torch.tensor([0, 1, 1, 2], **i64), torch.tensor([0, 1, 2, 4], **i64))  # not T * B + 1
    with pytest.raises(fusekit.Error, match="argument 'indices'"):
        ebc(torch.tensor([0, 1, 1, 2], dtype=torch.int32, device=device), good_off)
    with pytest.raises(fusekit.Error, match="optimizer"):
        fnn.EmbeddingBagCollection([4], 4, optimizer="adam")


def bf16_neighbours(x):
    """The bf16 values just below and just above each f32 value (equal where x is a bf16 value)."""
    lo = x.to(torch.bfloat16)
    lo = torch.where(lo.float() > x, torch.nextafter(lo, torch.full_like(lo, -float("inf"))), lo)
    hi = torch.where(lo.float() < x, torch.nextafter(lo, torch.full_like(lo, float("inf"))), lo)
    return lo.float(), hi.float()


@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_sixteen_bit_tables_pool_as_their_values(pooling, device):
    torch.manual_seed(3)
    rows, dim = [7, 100, 33], 16
    per_table = make_bags(rows, 9, 4, device, 5)
    idx, off = fnn.EmbeddingBagCollection.collate(per_table)
    for dtype in (torch.bfloat16, torch.float16):
        ebc = fnn.EmbeddingBagCollection(rows, dim, pooling=pooling, dtype=dtype, device=device)
        wide = fnn.EmbeddingBagCollection(rows, dim, pooling=pooling, device=device)
        with torch.no_grad():
            wide.weight.copy_(ebc.weight.float())
        out = ebc(idx, off)
        assert ebc.weight.dtype == dtype and out.dtype == torch.float32
        assert torch.equal(out, wide(idx, off))  # the same f32 values summed in the same order
        # Without a fused optimizer the dense gradient comes in the tables' dtype.
        dy = torch.randn(out.shape, device=device)
        (out * dy).sum().backward()
        (wide(idx, off) * dy).sum().backward()
        assert ebc.weight.grad.dtype == dtype
        assert torch.equal(ebc.weight.grad, wide.weight.grad.to(dtype))


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise_adagrad"])
def test_sixteen_bit_fused_update_rounds_to_a_neighbour_of_the_f32_update(optimizer, device):
    torch.manual_seed(4)
    rows, dim = [50, 20], 24
    ebc = fnn.EmbeddingBagCollection(rows, dim, optimizer=optimizer, lr=0.05, dtype=torch.bfloat16, device=device)
    wide = fnn.EmbeddingBagCollection(rows, dim, optimizer=optimizer, lr=0.05, device=device)
    with torch.no_grad():
        wide.weight.copy_(ebc.weight.float())
    before = ebc.weight.detach().float().clone()
    idx, off = fnn.EmbeddingBagCollection.collate(make_bags(rows, 12, 3, device, 8))
    dy = torch.randn(12, 2, dim, device=device)
    (ebc(idx, off) * dy).sum().backward()
    (wide(idx, off) * dy).sum().backward()
    assert ebc.weight.grad is None and ebc.weight.dtype == torch.bfloat16
    torch.testing.assert_close(ebc.optimizer_state, wide.optimizer_state)  # the state stays f32
    lo, hi = bf16_neighbours(wide.weight.detach())
    got = ebc.weight.detach().float()
    assert bool(((got == lo) | (got == hi)).all())
    touched = (wide.weight.detach() != before).any(1)
    assert touched.any() and torch.equal(got[~touched], before[~touched])
    # Not rounding to nearest every time: some values went the other way.
    nearest = wide.weight.detach().to(torch.bfloat16).float()
    assert bool((got[touched] != nearest[touched]).any())


def test_sixteen_bit_updates_follow_torch_manual_seed(device):
    def step(seed):
        torch.manual_seed(0)
        ebc = fnn.EmbeddingBagCollection([300], 16, optimizer="sgd", lr=1e-3, dtype=torch.bfloat16, device=device)
        idx, off = fnn.EmbeddingBagCollection.collate(make_bags([300], 40, 5, device, 9))
        torch.manual_seed(seed)
        ebc(idx, off).sum().backward()
        return ebc.weight.detach()

    assert torch.equal(step(1), step(1))
    assert not torch.equal(step(1), step(2))


def test_sixteen_bit_updates_below_half_a_step_move_on_average(device):
    # lr * g is a tenth of bf16's step at 1.0: rounding to nearest would never move the table;
    # stochastic rounding moves it by the update on average.
    ebc = fnn.EmbeddingBagCollection([1], 64, optimizer="sgd", lr=2 ** -8 / 10, dtype=torch.bfloat16, device=device)
    with torch.no_grad():
        ebc.weight.fill_(1.0)
    idx, off = torch.zeros(1, dtype=torch.int64, device=device), torch.tensor([0, 1], device=device)
    torch.manual_seed(5)
    for _ in range(50):
        ebc(idx, off).mul(-1.0).sum().backward()  # g = -1: each step adds lr
    moved = ebc.weight.detach().float().mean().item() - 1.0
    assert abs(moved - 50 * 2 ** -8 / 10) < 0.25 * 50 * 2 ** -8 / 10


@pytest.mark.parametrize("optimizer", [None, "rowwise_adagrad"])
def test_sixteen_bit_tables_in_a_model_under_autocast_and_compile(optimizer, device):
    # As a user runs them: inside a model, under autocast, loss.sum().backward(); compiled whole
    # (fullgraph) the step is the eager one, the rounding drawn from the same generator state.
    def train(compiled):
        torch.manual_seed(11)
        ebc = fnn.EmbeddingBagCollection([40, 25], 8, optimizer=optimizer, lr=0.05, dtype=torch.bfloat16,
                                         validate_indices=False, device=device)
        top = nn.Linear(16, 1, device=device)
        def step(idx, off):
            with torch.autocast(device_type=device, dtype=torch.bfloat16):
                return top(ebc(idx, off).flatten(1)).float()
        f = torch.compile(step, fullgraph=True, backend="aot_eager") if compiled else step
        for s in range(2):
            idx, off = fnn.EmbeddingBagCollection.collate(make_bags([40, 25], 6, 3, device, 40 + s))
            loss = f(idx, off)
            assert loss.shape == (6, 1)
            loss.sum().backward()
        grad = ebc.weight.grad
        assert (grad is None) == (optimizer is not None)
        assert grad is None or grad.dtype == torch.bfloat16
        return ebc.weight.detach().clone(), grad

    eager_w, eager_g = train(False)
    if optimizer is not None and tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) < (2, 15):
        pytest.skip("torch before 2.15 refuses the in-place update of a leaf in a compiled backward")
    compiled_w, compiled_g = train(True)
    assert torch.equal(compiled_w, eager_w)
    if eager_g is not None:
        torch.testing.assert_close(compiled_g, eager_g)


def test_sixteen_bit_update_needs_a_rounding_offset(device):
    i64 = dict(dtype=torch.int64, device=device)
    w = torch.zeros(10, 4, dtype=torch.bfloat16, device=device)
    idx, off = torch.tensor([0, 4], **i64), torch.tensor([0, 1, 2], **i64)
    _, keys, bags = ops.embedding_bag(w, idx, off, None, [4, 6], "sum", "seed", "sgd", 0.1, 0.0, None)
    dout = torch.ones(1, 2, 4, device=device)
    with pytest.raises(fusekit.Error, match="argument 'rounding_offset'"):
        ops.embedding_bag_update_(w, None, dout, keys, bags, off, [4, 6], "sgd", 0.1, 0.0, "sum")
    ops.embedding_bag_update_(w, None, dout, keys, bags, off, [4, 6], "sgd", 0.1, 0.0, "sum",
                              torch.zeros(1, **i64))
    lo, hi = bf16_neighbours(torch.full((2, 4), -0.1, device=device))
    assert bool(((w[[0, 8]].float() == lo) | (w[[0, 8]].float() == hi)).all())
    assert torch.equal(w[[1, 2, 3, 4, 5, 6, 7, 9]].float(), torch.zeros(8, 4, device=device))
    with pytest.raises(fusekit.Error, match="argument 'dtype'"):
        fnn.EmbeddingBagCollection([4], 4, dtype=torch.int32)


def reference_dot_interaction(z, self_interaction):
    """The DLRM reference's interact_features: [x, Zflat], Zflat the lower triangle of Z Zᵀ row by row."""
    zz = torch.bmm(z, z.transpose(1, 2))
    f = z.shape[1]
    li = [i for i in range(f) for j in range(i + (1 if self_interaction else 0))]
    lj = [j for i in range(f) for j in range(i + (1 if self_interaction else 0))]
    return torch.cat([z[:, 0], zz[:, li, lj]], dim=1)


@pytest.mark.parametrize("batch,features,dim", [(1, 2, 1), (7, 27, 16), (33, 5, 13), (0, 3, 4)])
@pytest.mark.parametrize("self_interaction", [False, True])
def test_dot_interaction_matches_the_dlrm_reference(batch, features, dim, self_interaction, device):
    g = torch.Generator().manual_seed(batch + features)
    z = torch.randn(batch, features, dim, generator=g).to(device).requires_grad_()
    r = fusekit.interaction(z, "dot", self_interaction)
    want = reference_dot_interaction(z, self_interaction)
    torch.testing.assert_close(r, want, rtol=1e-5, atol=1e-5)
    dr = torch.randn(r.shape, generator=g).to(device)
    got, = torch.autograd.grad(r, z, dr)
    exp, = torch.autograd.grad(want, z, dr)
    torch.testing.assert_close(got, exp, rtol=1e-5, atol=1e-5)


def test_interaction_module_and_cat(device):
    dense, sparse = torch.randn(4, 8, device=device), torch.randn(4, 3, 8, device=device)
    r = fnn.Interaction()(dense, sparse)
    torch.testing.assert_close(r, reference_dot_interaction(torch.cat([dense[:, None], sparse], 1), False))
    torch.testing.assert_close(fnn.Interaction("cat")(dense, sparse),
                               torch.cat([dense[:, None], sparse], 1).reshape(4, -1))
    with pytest.raises(fusekit.Error, match="argument 'z'"):
        fusekit.interaction(torch.randn(4, 8, 3, device=device).transpose(1, 2))  # not contiguous
    with pytest.raises(fusekit.Error, match="argument 'kind'"):
        fusekit.interaction(torch.randn(4, 3, 8, device=device), "sum")


@pytest.mark.parametrize("batch", [1, 7, 1000])
def test_sigmoid_bce_matches_binary_cross_entropy_with_logits(batch, device):
    g = torch.Generator().manual_seed(batch)
    x = (torch.randn(batch, generator=g) * 4).to(device).requires_grad_()
    y = torch.randint(0, 2, (batch,), generator=g).float().to(device)
    loss = fusekit.sigmoid_bce(x, y)
    want = F.binary_cross_entropy_with_logits(x, y)
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-7)
    got, = torch.autograd.grad(loss * 3, x)
    exp, = torch.autograd.grad(want * 3, x)
    torch.testing.assert_close(got, exp, rtol=1e-6, atol=1e-8)
    with pytest.raises(fusekit.Error, match="argument 'labels'"):
        fusekit.sigmoid_bce(x, y[:-1] if batch > 1 else y.double())


@pytest.mark.parametrize("adagrad", [False, True])
def test_dense_optimizer_update_matches_the_formula(adagrad, device):
    g = torch.Generator().manual_seed(9)
    p, grad = torch.randn(5, 7, generator=g).to(device), torch.randn(5, 7, generator=g).to(device)
    state = (torch.rand(5, 7, generator=g).to(device)) if adagrad else None
    want_p, want_s = p.clone(), None if state is None else state.clone()
    if adagrad:
        want_s += grad * grad
        want_p -= 0.1 * grad / (want_s.sqrt() + 1e-10)
    else:
        want_p -= 0.1 * grad
    fusekit.dense_optimizer_update_(p, grad, state, lr=0.1)
    torch.testing.assert_close(p, want_p)
    if adagrad:
        torch.testing.assert_close(state, want_s)


def test_opcheck_recsys_ops(device):
    i64 = dict(dtype=torch.int64, device=device)
    w = torch.randn(30, 4, device=device, requires_grad=True)
    idx, off = torch.tensor([1, 2, 3, 0, 14, 4], **i64), torch.tensor([0, 2, 3, 4, 5, 5, 6], **i64)
    rows = [10, 15, 5]
    torch.library.opcheck(ops.embedding_bag, (w, idx, off, None, rows, "sum", "seed", "dense_gradient", 0.0, 0.0, None))
    torch.library.opcheck(ops.embedding_bag, (w, idx, off, None, rows, "mean", "seed", "dense_gradient", 0.0, 0.0, None))
    _, keys, bags = ops.embedding_bag(w.detach(), idx, off, None, rows, "sum", "seed", "dense_gradient", 0.0, 0.0, None)
    dout = torch.randn(2, 3, 4, device=device)
    state = torch.zeros(30, device=device)
    torch.library.opcheck(ops.embedding_bag_update_, (w.detach().clone(), state, dout, keys, bags, off, rows,
                                                      "rowwise_adagrad", 0.1, 1e-8, "sum"))
    w16 = w.detach().to(torch.bfloat16)
    torch.library.opcheck(ops.embedding_bag, (w16, idx, off, None, rows, "sum", "seed", "sgd", 0.1, 0.0, None))
    torch.library.opcheck(ops.embedding_bag_update_, (w16.clone(), None, dout, keys, bags, off, rows, "sgd", 0.1, 0.0,
                                                      "sum", torch.zeros(1, **i64)))
    z = torch.randn(3, 4, 5, device=device, requires_grad=True)
    torch.library.opcheck(ops.interaction, (z, "dot", False))
    torch.library.opcheck(ops.interaction, (z, "cat", False))
    x, y = torch.randn(6, device=device, requires_grad=True), torch.rand(6, device=device).round()
    torch.library.opcheck(ops.sigmoid_bce, (x, y))
    torch.library.opcheck(ops.dense_optimizer_update_, (torch.randn(3, 2, device=device), torch.randn(3, 2, device=device),
                                                        torch.zeros(3, 2, device=device), True, 0.1, 1e-10))


def test_compiled_dlrm_sparse_side_has_no_graph_break(device):
    torch.manual_seed(6)

    class Sparse(nn.Module):
        def __init__(self):
            super().__init__()
            self.ebc = fnn.EmbeddingBagCollection([20, 30, 7], 8, validate_indices=False, device=device)
            self.bottom = nn.Linear(5, 8, device=device)
            self.inter = fnn.Interaction()

        def forward(self, dense, idx, off):
            return self.inter(torch.relu(self.bottom(dense)), self.ebc(idx, off)).sum(1)

    model = Sparse()
    idx, off = fnn.EmbeddingBagCollection.collate(make_bags([20, 30, 7], 6, 3, device, 7))
    dense = torch.randn(6, 5, device=device)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    y = compiled(dense, idx, off)
    torch.testing.assert_close(y, model(dense, idx, off))
    y.sum().backward()
    g = model.ebc.weight.grad.clone()
    model.zero_grad()
    model(dense, idx, off).sum().backward()
    torch.testing.assert_close(g, model.ebc.weight.grad)


@pytest.mark.skipif(tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) < (2, 15),
                    reason="torch 2.11's AOT autograd refuses an in-place update of a leaf requiring grad in a "
                           "compiled backward ('a leaf Variable that requires grad is being used in an in-place "
                           "operation'); 2.15 applies it")
def test_compiled_fused_optimizer_steps_as_eager_does(device):
    def train(compiled):
        torch.manual_seed(0)
        ebc = fnn.EmbeddingBagCollection([20, 30], 4, optimizer="adagrad", lr=0.1, validate_indices=False,
                                         device=device)
        f = torch.compile(ebc, fullgraph=True, backend="aot_eager") if compiled else ebc
        for step in range(3):
            f(*fnn.EmbeddingBagCollection.collate(make_bags([20, 30], 5, 3, device, 30 + step))).square().sum().backward()
        return ebc.weight.detach(), ebc.optimizer_state

    for have, want in zip(train(True), train(False)):
        assert torch.equal(have, want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_host_tensor_with_device_tables_is_an_error_naming_it():
    ebc = fnn.EmbeddingBagCollection([4, 6], 4, device="cuda")
    idx, off = torch.tensor([0, 1, 1, 2]), torch.tensor([0, 1, 2, 3, 4])
    with pytest.raises(fusekit.Error, match="argument 'indices'"):
        ebc(idx, off.cuda())
    with pytest.raises(fusekit.Error, match="argument 'offsets'"):
        ebc(idx.cuda(), off)
    with pytest.raises(fusekit.Error, match="argument 'labels'"):
        fusekit.sigmoid_bce(torch.zeros(3, device="cuda"), torch.zeros(3))
    with pytest.raises(fusekit.Error, match="argument 'grad'"):
        fusekit.dense_optimizer_update_(torch.zeros(3, device="cuda"), torch.zeros(3), lr=0.1)
