"""attention(..., attn_mask=): SDPA's boolean and additive masks, broadcast as SDPA broadcasts
them, forward and every gradient (the floating mask's own included) against SDPA given the same
mask by FlashAttention's twice-SDPA's-error rule and against the float64 math; combined with the
window (intersection), the key mask and every score option; rows left without a visible key are
zeros with lse = -inf; hidden keys cannot poison anything with inf or NaN; masks that change
nothing are the unmasked call bitwise; results are bitwise the same at any thread count; the
kernel ops, opcheck, torch.compile, torch.export and bad input."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import causal_attention
from attention_testing.inputs import Case, make_tensor
from attention_testing.parameters import dtype_params
from attention_testing.references import to64
from attention_testing.results import assert_bitwise_equal
from attention_testing.tolerances import twice_sdpa_error_failures
from causal_attention._masks import visible_keys

OPS = torch.ops.causal_attention

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def make_mask(shape, kind: str, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    """A mask of ``shape`` (..., Lq or 1, Lk or 1) of one kind:
    - "random": bool, each entry True with probability 0.7;
    - "documents": bool, block-diagonal over 5 documents of unequal lengths (a packed batch);
    - "bias": floating, normal entries (a learned relative-position bias);
    - "bias-inf": floating, normal entries with -inf at the False entries of "random";
    - "padding": bool, the last third of the keys hidden (left to the caller's shape)."""
    generator = torch.Generator().manual_seed(seed)
    lq, lk = (1,) + tuple(shape[-1:]) if len(shape) == 1 else shape[-2:]
    if kind == "random":
        return torch.rand(shape, generator=generator) < 0.7
    if kind == "documents":
        bounds = torch.tensor([0.0, 0.1, 0.35, 0.4, 0.8]) * max(lq, lk)
        doc_q = torch.bucketize(torch.arange(lq) + max(lk - lq, 0), bounds, right=True)
        doc_k = torch.bucketize(torch.arange(lk), bounds, right=True)
        return (doc_q[:, None] == doc_k[None, :]).expand(shape)
    if kind == "bias":
        return torch.randn(shape, generator=generator).to(dtype)
    if kind == "bias-inf":
        bias = torch.randn(shape, generator=generator).to(dtype)
        return bias.masked_fill(make_mask(shape, "random", seed=seed + 1).logical_not(), -math.inf)
    if kind == "padding":
        return (torch.arange(lk) < lk - lk // 3).expand(shape)
    raise ValueError(kind)


def mask_shape(case: Case, broadcast: str):
    """attn_mask shapes SDPA broadcasts against the scores (*batch, Hq, Lq, Lk)."""
    batch = tuple(case.batch) if case.heads else ()
    hq, lq, lk = case.hq if case.heads else None, case.lq, case.lk
    heads = (hq,) if hq is not None else ()
    return {
        "full": batch + heads + (lq, lk),
        "rows-keys": (lq, lk),
        "batch": batch + (1,) * len(heads) + (lq, lk),
        "heads": (1,) * len(batch) + heads + (lq, lk),
        "keys": batch + (1,) * len(heads) + (1, lk),
        "key-vector": (lk,),
    }[broadcast]


def visible_of(case: Case, mask: torch.Tensor, window) -> torch.Tensor:
    """Bool, broadcastable to the scores: the keys each row sees (the window's and the mask's)."""
    hidden_by_mask = ~mask if mask.dtype == torch.bool else mask == -math.inf
    return visible_keys(case.lq, case.lk, window=window) & ~hidden_by_mask


def sdpa_with(q, k, v, mask, window, grad_out, mask_requires_grad: bool):
    """SDPA given the same attention: the mask, the window as a bool mask (or the float mask
    with -inf outside it), GQA through enable_gqa; rows without a visible key get zero grad_out
    (and are compared as zeros, see the tests). Returns (out, dq, dk, dv[, dmask])."""
    case_lq, case_lk = q.shape[-2], k.shape[-2]
    window_visible = visible_keys(case_lq, case_lk, window=window)
    if mask.dtype == torch.bool:
        sdpa_mask = mask & window_visible
    else:
        sdpa_mask = mask.to(q.dtype).masked_fill(~window_visible, -math.inf)
    sees = (sdpa_mask if mask.dtype == torch.bool else sdpa_mask != -math.inf).any(-1, True)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    extra = []
    if mask_requires_grad:
        sdpa_mask = mask.detach().to(q.dtype).requires_grad_()
        extra = [sdpa_mask]
        sdpa_mask_used = sdpa_mask.masked_fill(~window_visible, -math.inf)
    else:
        sdpa_mask_used = sdpa_mask
    gqa = q.dim() >= 3 and q.shape[-3] != k.shape[-3]
    out = F.scaled_dot_product_attention(*leaves, attn_mask=sdpa_mask_used, enable_gqa=gqa)
    grads = torch.autograd.grad(out, leaves + extra, grad_out.masked_fill(~sees, 0))
    out = out.detach().masked_fill(~sees, 0)
    grads = (grads[0].masked_fill(~sees, 0),) + tuple(grads[1:])
    return (out,) + grads


def ours_with(q, k, v, mask, window, grad_out, mask_requires_grad: bool):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    extra = [mask.detach().requires_grad_()] if mask_requires_grad else []
    out = causal_attention.attention(*leaves, attn_mask=extra[0] if extra else mask, window=window)
    grads = torch.autograd.grad(out, leaves + extra, grad_out)
    return (out.detach(),) + grads


# (case, broadcast, kind, window). Together: decoding (Lq <= 32, key splits past 1024 keys), the
# tiled forward (Lq >= 1024), a KV cache (Lq < Lk), Lq > Lk, GQA and MQA, Dv != D, the one-pass
# (batch * Hkv >= 8 in float32/float64) and two-pass backward, 2-D to 5-D inputs, transposed and
# strided layouts; every broadcast; causal and full windows.
CASES = [
    pytest.param(Case(1, 300, 64, hq=4, hkv=1, batch=(3,)), "keys", "padding", (-1, 0),
                 id="decode-Lq1-mqa4-padding"),
    pytest.param(Case(16, 1300, 32, hq=4, hkv=2), "full", "random", (-1, 0),
                 id="decode-Lq16-Lk1300-split-random"),
    pytest.param(Case(9, 300, 17, dv=24, hq=2, hkv=1, batch=(2,), layout="strided"), "heads",
                 "bias", (-1, -1), id="decode-Lq9-D17-Dv24-strided-bias-full-window"),
    pytest.param(Case(1030, 1030, 16, hq=2, hkv=1), "rows-keys", "documents", (-1, 0),
                 id="L1030-tiles-documents"),
    pytest.param(Case(200, 200, 32, hq=2, hkv=1), "heads", "bias-inf", (-1, 0),
                 id="two-pass-gqa2-bias-inf"),
    pytest.param(Case(130, 130, 32, hq=4, hkv=4, batch=(2,)), "batch", "bias", (-1, 0),
                 id="one-pass-B2-H4-bias-batch"),
    pytest.param(Case(100, 160, 32, dv=48, hq=8, hkv=4, batch=(2,), layout="transposed"), "full",
                 "random", (-1, -1), id="one-pass-kvcache-transposed-random-full-window"),
    pytest.param(Case(129, 64, 8, hq=2, hkv=1, batch=(2,)), "full", "bias", (40, 0),
                 id="Lq129-Lk64-window40-bias"),
    pytest.param(Case(70, 70, 8, heads=False), "rows-keys", "random", (-1, 0), id="2d-random"),
    pytest.param(Case(40, 40, 8, hq=3, hkv=3, batch=()), "key-vector", "padding", (-1, -1),
                 id="3d-key-vector-full-window"),
    pytest.param(Case(33, 50, 8, dv=16, hq=2, hkv=1, batch=(2, 3)), "batch", "bias-inf", (-1, 0),
                 id="5d-Lq33-Lk50-bias-inf"),
    pytest.param(Case(33, 50, 8, hq=2, hkv=2, batch=(2, 3)), "keys", "random", (-1, 0),
                 id="5d-keys-random"),
]


def _failures(case, broadcast, kind, window, dtype, mask_requires_grad):
    mask = make_mask(mask_shape(case, broadcast), kind, dtype=dtype)
    inputs = case.inputs(dtype)
    grad_out = make_tensor(case.out_shape, dtype)
    ours = ours_with(*inputs, mask, window, grad_out, mask_requires_grad)
    same = sdpa_with(*inputs, mask, window, grad_out, mask_requires_grad)
    reference = sdpa_with(*(to64(t) for t in inputs), to64(mask) if mask.is_floating_point()
                          else mask, window, to64(grad_out), mask_requires_grad)
    names = ("out", "dq", "dk", "dv", "dattn_mask")[: len(ours)]
    assert ours[0].shape == case.out_shape and ours[0].dtype == dtype
    for name, got, like in zip(names[1:], ours[1:], inputs + (mask,)):
        assert got.shape == like.shape and got.dtype == like.dtype, name
    return twice_sdpa_error_failures(names, ours, same, reference)


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("case,broadcast,kind,window", CASES)
def test_matches_sdpa_within_twice_its_error(case, broadcast, kind, window, dtype):
    failures = _failures(case, broadcast, kind, window, dtype,
                         mask_requires_grad=kind.startswith("bias"))
    assert not failures, "; ".join(failures)


@pytest.mark.parametrize("broadcast", ["full", "batch", "heads", "keys", "rows-keys"])
def test_gradcheck_float64_through_the_mask(broadcast):
    case = Case(12, 12, 4, hq=2, hkv=1, batch=(2,))
    q, k, v = case.inputs(torch.float64, requires_grad=True)
    mask = make_mask(mask_shape(case, broadcast), "bias", dtype=torch.float64).requires_grad_()

    def call(q, k, v, mask):
        return causal_attention.attention(q, k, v, attn_mask=mask, softcap=5.0)

    assert torch.autograd.gradcheck(call, (q, k, v, mask))


@pytest.mark.parametrize("dtype", dtype_params([torch.float64, torch.float32, torch.bfloat16]))
@pytest.mark.parametrize(
    "options",
    [
        dict(softcap=3.0),
        dict(alibi_slopes=torch.tensor([0.5, 0.25])),
        dict(sinks=torch.tensor([0.3, -1.0])),
        dict(window=(7, 0), softcap=8.0),
        dict(key_mask="padding"),
        dict(dropout_p=0.2),
    ],
    ids=["softcap", "alibi", "sinks", "window-softcap", "key-mask", "dropout"],
)
@pytest.mark.parametrize("kind", ["random", "bias-inf"])
def test_combines_with_every_score_option_as_the_materialized_weights(options, kind, dtype):
    """Against attention_weights @ v in float64 (ATen's softmax over the materialized scores,
    the mask added after softcap and ALiBi, the same dropout mask), forward and gradients,
    the mask's included."""
    case = Case(70, 90, 16, hq=2, hkv=1, batch=(2,))
    mask = make_mask(mask_shape(case, "heads"), kind,
                     dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    options = dict(options)
    if options.get("key_mask") == "padding":
        options["key_mask"] = torch.arange(case.lk).expand(2, case.lk) < torch.tensor([[60], [90]])
    inputs = case.inputs(dtype)
    grad_out = make_tensor(case.out_shape, dtype)
    float_mask = mask.is_floating_point()

    def run(function, tensors, mask, **kwargs):
        leaves = [t.detach().requires_grad_() for t in tensors]
        m = mask.detach().requires_grad_() if float_mask else mask
        generator = torch.Generator().manual_seed(5)
        out = function(*leaves, m, generator=generator, **kwargs)
        grads = torch.autograd.grad(out, leaves + ([m] if float_mask else []), grad_out.to(out))
        return (out,) + grads

    def ours(q, k, v, m, **kwargs):
        return causal_attention.attention(q, k, v, attn_mask=m, **kwargs)

    def materialized(q, k, v, m, **kwargs):
        weights = causal_attention.attention_weights(q, k, v, attn_mask=m, **kwargs)
        return weights @ (v if q.shape[-3] == v.shape[-3] else v.repeat_interleave(2, -3))

    got = run(ours, inputs, mask, **options)
    # ALiBi slopes stay float32, as the op takes them for every dtype.
    options64 = {name: to64(value) if name == "sinks" else value
                 for name, value in options.items()}
    want = run(materialized, [to64(t) for t in inputs], to64(mask) if float_mask else mask,
               **options64)
    tolerance = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 3e-2}[dtype]
    for name, a, b in zip(("out", "dq", "dk", "dv", "dattn_mask"), got, want):
        error = (to64(a) - b).abs().max().item()
        assert error <= tolerance * (1 + b.abs().max().item()), f"{name}: {error}"


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize(
    "case",
    [Case(20, 20, 8, hq=2, hkv=1, batch=(2,)), Case(4, 600, 16, hq=4, hkv=2, batch=(2,)),
     Case(1030, 1030, 8)],
    ids=["L20", "decode", "tiles"],
)
@pytest.mark.parametrize("float_mask", [False, True], ids=["bool", "float-inf"])
def test_rows_without_visible_keys_are_zeros_with_lse_minus_inf(case, float_mask, dtype):
    shape = mask_shape(case, "full")
    mask = make_mask(shape, "random")
    mask[..., 1::3, :] = False  # every third row sees nothing
    if float_mask:
        mask = torch.zeros(shape, dtype=dtype).masked_fill(~mask, -math.inf)
    q, k, v = case.inputs(dtype, requires_grad=True)
    out = causal_attention.attention(q, k, v, attn_mask=mask)
    dq, = torch.autograd.grad(out, q, make_tensor(case.out_shape, dtype))
    empty = ~visible_of(case, mask, (-1, 0)).any(-1)
    assert empty[..., 1::3].all() and not empty.all()
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))
    assert torch.equal(dq[empty], torch.zeros_like(dq[empty]))
    assert torch.isfinite(out).all() and torch.isfinite(dq).all()
    _, lse = OPS.attention_forward(q, k, v, case.d ** -0.5, attn_mask=mask)
    assert (lse[empty] == -math.inf).all() and torch.isfinite(lse[~empty]).all()


@pytest.mark.parametrize(
    "case",
    [Case(300, 300, 16, hq=2, hkv=2), Case(8, 700, 16, hq=4, hkv=1), Case(1030, 1030, 8)],
    ids=["L300", "decode", "tiles"],
)
def test_values_and_keys_a_row_cannot_see_never_reach_it(case):
    """Inf and NaN in K and V of the first document reach only its rows: every other row's
    output and every other key's gradient are bitwise those of finite inputs."""
    mask = make_mask(mask_shape(case, "rows-keys"), "documents")
    first_doc = mask[..., -1, :].logical_not() & (torch.arange(case.lk) < case.lk // 10)
    q, k, v = case.inputs(torch.float32)
    poisoned_k, poisoned_v = k.clone(), v.clone()
    poisoned_k[..., first_doc, 0] = math.inf
    poisoned_v[..., first_doc, :] = math.nan
    grad_out = make_tensor(case.out_shape, torch.float32)
    clean = ours_with(q, k, v, mask, (-1, 0), grad_out, False)
    dirty = ours_with(q, poisoned_k, poisoned_v, mask, (-1, 0), grad_out, False)
    rows = ~(mask & first_doc).any(-1)  # rows that see none of the first document
    assert rows.any()
    assert_bitwise_equal(dirty[0][..., rows, :], clean[0][..., rows, :], "out")
    assert_bitwise_equal(dirty[1][..., rows, :], clean[1][..., rows, :], "dq")
    for index, name in ((2, "dk"), (3, "dv")):
        assert_bitwise_equal(dirty[index][..., ~first_doc, :], clean[index][..., ~first_doc, :],
                             name)


@pytest.mark.parametrize("dtype", dtype_params([torch.float32, torch.bfloat16]))
@pytest.mark.parametrize(
    "mask",
    [torch.ones(130, 130, dtype=torch.bool), torch.zeros(1, 130, 130), torch.zeros(130)],
    ids=["all-true", "zeros", "zero-keys"],
)
def test_a_mask_that_changes_nothing_is_the_unmasked_call_bitwise(mask, dtype):
    case = Case(130, 130, 32, hq=2, hkv=1, batch=(2,))
    inputs = case.inputs(dtype)
    grad_out = make_tensor(case.out_shape, dtype)
    plain = ours_with(*inputs, None, (-1, 0), grad_out, False)
    masked = ours_with(*inputs, mask.to(dtype) if mask.is_floating_point() else mask, (-1, 0),
                       grad_out, False)
    for name, a, b in zip(("out", "dq", "dk", "dv"), masked, plain):
        assert_bitwise_equal(a, b, name)


@pytest.mark.parametrize(
    "case,kind",
    [(Case(300, 300, 16, hq=4, hkv=2, batch=(2,)), "bias"),
     (Case(4, 1500, 16, hq=4, hkv=1, batch=(2,)), "random"),
     (Case(200, 200, 16, hq=2, hkv=1), "documents")],
    ids=["one-pass-bias", "decode-split", "two-pass-documents"],
)
def test_bitwise_the_same_at_any_thread_count(case, kind):
    mask = make_mask(mask_shape(case, "heads" if kind == "bias" else "rows-keys"), kind)
    inputs = case.inputs(torch.float32)
    grad_out = make_tensor(case.out_shape, torch.float32)
    results = []
    for threads in (1, 2, 1):
        torch.set_num_threads(threads)
        results.append(ours_with(*inputs, mask, (-1, 0), grad_out, mask.is_floating_point()))
    for other in results[1:]:
        for name, a, b in zip(("out", "dq", "dk", "dv", "dattn_mask"), other, results[0]):
            assert_bitwise_equal(a, b, name)


def test_kernel_ops_take_the_mask_last_and_attention_gradients_returns_its_gradient():
    case = Case(10, 12, 8, hq=2, hkv=1, batch=(2,))
    q, k, v = case.inputs(torch.float64)
    mask = make_mask(mask_shape(case, "heads"), "bias", dtype=torch.float64)
    grad_out = make_tensor(case.out_shape, torch.float64)
    out, lse = OPS.attention_forward(q, k, v, 0.5, None, [-1, 0], None, None, None, 0.0, None,
                                     None, None, None, None, mask)
    reference = causal_attention.attention(q, k, v, attn_mask=mask, scale=0.5)
    assert_bitwise_equal(out, reference, "out")
    dq, dk, dv, dsinks, dmask = OPS.attention_gradients(grad_out, q, k, v, out, lse, 0.5,
                                                        attn_mask=mask, attn_mask_grad=True)
    assert dmask.shape == mask.shape and dsinks.numel() == 0
    four = OPS.attention_backward(grad_out, q, k, v, out, lse, 0.5, attn_mask=mask)
    assert len(four) == 4
    for a, b in zip(four[:3], (dq, dk, dv)):
        assert_bitwise_equal(a, b)
    leaves = [t.detach().requires_grad_() for t in (q, k, v, mask)]
    out = causal_attention.attention(*leaves[:3], attn_mask=leaves[3], scale=0.5)
    grads = torch.autograd.grad(out, leaves, grad_out)
    for a, b in zip(grads, (dq, dk, dv, dmask)):
        assert_bitwise_equal(a, b)
    without = OPS.attention_gradients(grad_out, q, k, v, out.detach(), lse, 0.5, attn_mask=mask)
    assert without[4].numel() == 0


class _BackwardOps(TorchDispatchMode):
    """Records the causal_attention ops dispatched while it is active."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "causal_attention":
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_the_mask_s_gradient_is_computed_only_when_autograd_asks_for_it():
    """Autograd runs attention_backward unless the mask's gradient is asked for, and then
    attention_gradients; a bool mask has no gradient to ask for."""
    case = Case(10, 10, 8, hq=2, hkv=2)
    q, k, v = case.inputs(torch.float32, requires_grad=True)
    bias = make_mask(mask_shape(case, "heads"), "bias").requires_grad_()
    out = causal_attention.attention(q, k, v, attn_mask=bias)
    for wanted, op in (([q], "attention_backward"), ([q, bias], "attention_gradients")):
        with _BackwardOps() as recorded:
            grads = torch.autograd.grad(out.sum(), wanted, retain_graph=True)
        assert recorded.ops == [op] and all(g.abs().sum() > 0 for g in grads)
    out = causal_attention.attention(q, k, v, attn_mask=make_mask((10, 10), "random"))
    with _BackwardOps() as recorded:
        torch.autograd.grad(out.sum(), [q, k, v])
    assert recorded.ops == ["attention_backward"]


@pytest.mark.parametrize(
    "call,error,needles",
    [
        (dict(attn_mask=torch.zeros(10, 12, dtype=torch.int64)), TypeError,
         ["attn_mask must be bool (True where a query may attend a key)", "dtype=Long"]),
        (dict(attn_mask=torch.zeros(10, 12, dtype=torch.float64)), TypeError,
         ["float32 or q's dtype Float", "attn_mask.dtype=Double"]),
        (dict(attn_mask=torch.zeros(10, 13, dtype=torch.bool)), ValueError,
         ["attn_mask must be broadcastable to the scores (*batch, Hq, Lq, Lk)=[2, 2, 10, 12]",
          "attn_mask.shape=[10, 13]"]),
        (dict(attn_mask=torch.zeros(1, 2, 2, 10, 12, dtype=torch.bool)), ValueError,
         ["attn_mask must be broadcastable", "attn_mask.shape=[1, 2, 2, 10, 12]"]),
        (dict(attn_mask=torch.zeros(10, 12, dtype=torch.bool, device="meta")), ValueError,
         ["attn_mask must be on q's device cpu", "attn_mask.device=meta"]),
    ],
    ids=["int", "float64-for-float32", "keys", "rank", "device"],
)
def test_bad_masks_raise_typed_errors_naming_the_argument(call, error, needles):
    case = Case(10, 12, 8, hq=2, hkv=1, batch=(2,))
    q, k, v = case.inputs(torch.float32)
    for function in (causal_attention.attention, causal_attention.attention_weights):
        with pytest.raises(error) as raised:
            function(q, k, v, **call)
        for needle in needles:
            assert needle in str(raised.value)


def test_packed_calls_refuse_a_mask_and_a_bool_mask_has_no_gradient_to_ask_for():
    q = torch.randn(10, 2, 8)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match="attn_mask is for dense calls"):
        OPS.attention_forward(q, q, q, 0.5, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=6,
                              max_seqlen_k=6, attn_mask=torch.ones(6, 6, dtype=torch.bool))
    assert "attn_mask" not in str(causal_attention.varlen_attention.__signature__)
    case = Case(6, 6, 8, hq=2, hkv=2)
    q, k, v = case.inputs(torch.float32)
    out, lse = OPS.attention_forward(q, k, v, 0.5)
    with pytest.raises(ValueError, match="attn_mask_grad=True asks for the gradient of a floating"):
        OPS.attention_gradients(out, q, k, v, out, lse, 0.5,
                                attn_mask=torch.ones(6, 6, dtype=torch.bool), attn_mask_grad=True)


@pytest.mark.parametrize("kind", ["random", "bias"])
def test_opcheck(kind):
    case = Case(9, 11, 4, hq=4, hkv=2, batch=(2,))
    q, k, v = case.inputs(torch.float32, requires_grad=True)
    mask = make_mask(mask_shape(case, "heads"), kind)
    if mask.is_floating_point():
        mask.requires_grad_()
    for op, args, kwargs in (
        (OPS.attention.default, (q, k, v), dict(attn_mask=mask)),
        (OPS.attention_weights.default, (q, k, v), dict(attn_mask=mask)),
        (OPS.attention_forward.default, (q, k, v, 0.5), dict(attn_mask=mask)),
    ):
        report = torch.library.opcheck(op, args, kwargs)
        assert report and all(result == "SUCCESS" for result in report.values()), report
    out, lse = OPS.attention_forward(q, k, v, 0.5, attn_mask=mask)
    args = (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out.detach(), lse, 0.5)
    report = torch.library.opcheck(
        OPS.attention_gradients.default, args,
        dict(attn_mask=mask.detach(), attn_mask_grad=mask.is_floating_point()))
    assert report and all(result == "SUCCESS" for result in report.values()), report


def test_compiles_fullgraph_with_a_learned_bias():
    case = Case(24, 24, 8, hq=2, hkv=2, batch=(2,))
    inputs = case.inputs(torch.float32)
    bias = make_mask(mask_shape(case, "heads"), "bias")
    grad_out = make_tensor(case.out_shape, torch.float32)

    def step(q, k, v, bias):
        return causal_attention.attention(q, k, v, attn_mask=bias, window=(-1, -1))

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    results = []
    for function in (step, compiled):
        leaves = [t.detach().requires_grad_() for t in inputs + (bias,)]
        out = function(*leaves)
        results.append((out,) + torch.autograd.grad(out, leaves, grad_out))
    for name, a, b in zip(("out", "dq", "dk", "dv", "dbias"), *results):
        assert_bitwise_equal(a, b, name)


class _Biased(torch.nn.Module):
    def forward(self, q, k, v, bias):
        return causal_attention.attention(q, k, v, attn_mask=bias, window=(-1, -1))


def test_exports_and_runs_at_other_lengths():
    """torch.export keeps the op whole with its mask, at dynamic lengths."""
    from torch.export import Dim

    length = Dim("length", min=2, max=64)
    case = Case(10, 10, 8, hq=2, hkv=2)
    q, k, v = case.inputs(torch.float32)
    bias = make_mask((2, 10, 10), "bias")
    exported = torch.export.export(
        _Biased(), (q, k, v, bias),
        dynamic_shapes=({2: length}, {2: length}, {2: length}, {1: length, 2: length}),
    )
    assert OPS.attention.default in [node.target for node in exported.graph.nodes]
    for n in (10, 37):
        q, k, v = Case(n, n, 8, hq=2, hkv=2).inputs(torch.float32)
        bias = make_mask((2, n, n), "bias-inf", seed=n)
        assert_bitwise_equal(exported.module()(q, k, v, bias), _Biased()(q, k, v, bias))
