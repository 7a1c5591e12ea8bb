"""torch.library.opcheck (schema, autograd registration, FakeTensor/Meta, AOT dispatch with
dynamic shapes) of the operators: attention, attention_forward and attention_backward, without
and with a key mask, and varlen_attention and the kernel ops on packed sequences (their
cu_seqlens and max_seqlen arguments); then with the score options (window, softcap, ALiBi,
sinks, and dropout through the kernel ops' dropout_seed); and paged_attention on 8-bit caches
with both scale layouts."""

import pytest
import torch

import causal_attention  # noqa: F401  (loads the ops)
from attention_testing.inputs import Case, ScoreOptions, make_key_mask
from attention_testing.packed import Packed

OPS = torch.ops.causal_attention

# (case, dtype, scale) samples for the public op.
ATTENTION_SAMPLES = [
    pytest.param(Case(8, 8, 4, hq=2, hkv=2), torch.float32, None, id="4d-f32"),
    pytest.param(Case(8, 8, 4, hq=4, hkv=2), torch.float32, None, id="gqa2"),
    pytest.param(Case(8, 8, 4, hq=4, hkv=1), torch.float64, 0.3, id="gqa4-f64-scale"),
    pytest.param(Case(3, 9, 4, hq=2, hkv=2), torch.float32, None, id="Lq3-Lk9"),
    pytest.param(Case(9, 3, 4, hq=2, hkv=1), torch.float32, None, id="Lq9-Lk3-gqa2"),
    pytest.param(Case(6, 6, 4, heads=False), torch.float32, None, id="2d"),
    pytest.param(Case(6, 6, 4, hq=3, hkv=3, batch=()), torch.float32, None, id="3d"),
    pytest.param(Case(5, 5, 4, dv=3, hq=2, hkv=1, batch=(2, 2)), torch.float32, None, id="5d-Dv3"),
    pytest.param(
        Case(7, 7, 4, hq=2, hkv=2, batch=(2,), layout="transposed"),
        torch.float32,
        None,
        id="transposed",
    ),
    pytest.param(Case(7, 5, 4, hq=2, hkv=2, layout="strided"), torch.float32, None, id="strided"),
    pytest.param(Case(8, 8, 4, hq=2, hkv=2), torch.bfloat16, None, id="bf16"),
    pytest.param(Case(8, 8, 4, hq=2, hkv=1), torch.float16, 0.5, id="f16-gqa2-scale"),
]

FEW_SAMPLES = [
    pytest.param(Case(8, 8, 4, hq=4, hkv=2), torch.float32, 0.5, id="gqa2"),
    pytest.param(Case(9, 3, 4, hq=2, hkv=2, layout="transposed"), torch.float32, 0.5, id="Lq9-Lk3"),
    pytest.param(Case(6, 6, 4, heads=False), torch.bfloat16, 0.5, id="2d-bf16"),
]


def _assert_all_pass(report):
    assert report, "opcheck ran no test"
    assert all(result == "SUCCESS" for result in report.values()), report


@pytest.mark.parametrize("requires_grad", [False, True], ids=["no-grad", "grad"])
@pytest.mark.parametrize("case,dtype,scale", ATTENTION_SAMPLES)
def test_opcheck_attention(case, dtype, scale, requires_grad):
    q, k, v = case.inputs(dtype, requires_grad=requires_grad)
    kwargs = {} if scale is None else {"scale": scale}
    _assert_all_pass(torch.library.opcheck(OPS.attention.default, (q, k, v), kwargs))


@pytest.mark.parametrize("requires_grad", [False, True], ids=["no-grad", "grad"])
@pytest.mark.parametrize("case,dtype,scale", FEW_SAMPLES)
def test_opcheck_attention_forward(case, dtype, scale, requires_grad):
    q, k, v = case.inputs(dtype, requires_grad=requires_grad)
    _assert_all_pass(torch.library.opcheck(OPS.attention_forward.default, (q, k, v, scale)))


@pytest.mark.parametrize("case,dtype,scale", FEW_SAMPLES)
def test_opcheck_attention_backward(case, dtype, scale):
    q, k, v = case.inputs(dtype)
    out, lse = OPS.attention_forward(q, k, v, scale)
    grad_out = torch.randn_like(out)
    args = (grad_out, q, k, v, out, lse, scale)
    _assert_all_pass(torch.library.opcheck(OPS.attention_backward.default, args))


# --- key masks ---------------------------------------------------------------------------------

# (case, dtype, scale, mask kind): holes with a whole hidden block, padding, a batch element that
# hides every key (rows without keys), and the (Lk,) mask of 2-D inputs.
KEY_MASK_SAMPLES = [
    pytest.param(
        Case(130, 130, 4, hq=2, hkv=2), torch.float64, 0.3, "holes", id="f64-hidden-block"
    ),
    pytest.param(
        Case(3, 9, 4, hq=2, hkv=1, batch=(2,)), torch.float32, None, "one-all-false", id="no-keys"
    ),
    pytest.param(
        Case(5, 7, 4, dv=3, hq=2, hkv=1, batch=(2, 2), layout="transposed"),
        torch.float16,
        0.5,
        "right-pad",
        id="5d-Dv3-f16-transposed",
    ),
    pytest.param(
        Case(8, 8, 4, hq=4, hkv=2, batch=(2,)), torch.float32, None, "left-pad", id="gqa2"
    ),
    pytest.param(Case(6, 6, 4, heads=False), torch.bfloat16, None, "holes", id="2d-bf16"),
]
# The kernel entries see the first three.
KEY_MASK_FEW = KEY_MASK_SAMPLES[:3]


@pytest.mark.parametrize("requires_grad", [False, True], ids=["no-grad", "grad"])
@pytest.mark.parametrize("case,dtype,scale,kind", KEY_MASK_SAMPLES)
def test_opcheck_attention_with_key_mask(case, dtype, scale, kind, requires_grad):
    q, k, v = case.inputs(dtype, requires_grad=requires_grad)
    kwargs = {"key_mask": make_key_mask(case.key_mask_shape, kind), "scale": scale}
    _assert_all_pass(torch.library.opcheck(OPS.attention.default, (q, k, v), kwargs))


@pytest.mark.parametrize("requires_grad", [False, True], ids=["no-grad", "grad"])
@pytest.mark.parametrize("case,dtype,scale,kind", KEY_MASK_FEW)
def test_opcheck_attention_forward_with_key_mask(case, dtype, scale, kind, requires_grad):
    q, k, v = case.inputs(dtype, requires_grad=requires_grad)
    args = (q, k, v, 0.5 if scale is None else scale, make_key_mask(case.key_mask_shape, kind))
    _assert_all_pass(torch.library.opcheck(OPS.attention_forward.default, args))


@pytest.mark.parametrize("case,dtype,scale,kind", KEY_MASK_FEW)
def test_opcheck_attention_backward_with_key_mask(case, dtype, scale, kind):
    q, k, v = case.inputs(dtype)
    scale = 0.5 if scale is None else scale
    key_mask = make_key_mask(case.key_mask_shape, kind)
    out, lse = OPS.attention_forward(q, k, v, scale, key_mask)
    args = (torch.randn_like(out), q, k, v, out, lse, scale, key_mask)
    _assert_all_pass(torch.library.opcheck(OPS.attention_backward.default, args))


# --- packed sequences --------------------------------------------------------------------------

# (packed, dtype, scale): an empty sequence and rows without keys, GQA with Dv != D, a chunk
# against its cache, and no sequences at all.
VARLEN_SAMPLES = [
    pytest.param(Packed((3, 0, 5), (3, 2, 2), 4, hq=2, hkv=2), torch.float32, None, id="mixed"),
    pytest.param(Packed((2, 7), (9, 7), 4, dv=3, hq=4, hkv=2), torch.float64, 0.3, id="gqa2-Dv3"),
    pytest.param(Packed((), (), 4, hq=2, hkv=1), torch.float32, None, id="no-sequences"),
    pytest.param(Packed((1, 70), (40, 70), 4, hq=2, hkv=1), torch.bfloat16, None, id="bf16-blocks"),
    pytest.param(Packed((4,), (4,), 4), torch.float16, 0.5, id="f16-one-sequence"),
]
# The kernel entries see the first three.
VARLEN_FEW = VARLEN_SAMPLES[:3]


@pytest.mark.parametrize("requires_grad", [False, True], ids=["no-grad", "grad"])
@pytest.mark.parametrize("packed,dtype,scale", VARLEN_SAMPLES)
def test_opcheck_varlen_attention(packed, dtype, scale, requires_grad):
    args = packed.inputs(dtype, requires_grad=requires_grad) + packed.lengths_args()
    _assert_all_pass(torch.library.opcheck(OPS.varlen_attention.default, args, {"scale": scale}))


@pytest.mark.parametrize("requires_grad", [False, True], ids=["no-grad", "grad"])
@pytest.mark.parametrize("packed,dtype,scale", VARLEN_FEW)
def test_opcheck_packed_attention_forward(packed, dtype, scale, requires_grad):
    scale = 0.5 if scale is None else scale
    args = packed.inputs(dtype, requires_grad=requires_grad) + (scale,)
    kwargs = _packed_kwargs(packed)
    _assert_all_pass(torch.library.opcheck(OPS.attention_forward.default, args, kwargs))


@pytest.mark.parametrize("packed,dtype,scale", VARLEN_FEW)
def test_opcheck_packed_attention_backward(packed, dtype, scale):
    scale = 0.5 if scale is None else scale
    q, k, v = packed.inputs(dtype)
    kwargs = _packed_kwargs(packed)
    out, lse = OPS.attention_forward(q, k, v, scale, **kwargs)
    args = (torch.randn_like(out), q, k, v, out, lse, scale)
    _assert_all_pass(torch.library.opcheck(OPS.attention_backward.default, args, kwargs))


def _packed_kwargs(packed: Packed) -> dict:
    """The kernel ops' packed-sequence arguments for ``packed``."""
    names = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")
    return dict(zip(names, packed.lengths_args()))


# --- score options (window, softcap, ALiBi, sinks, dropout) ------------------------------------

# (case, dtype, options): every option, alone and together, sinks in q's dtype and in float32
# (with bfloat16 q), slopes (Hq,) and (*batch, Hq), rows without keys (Lq > Lk). Each sample
# runs once, with inputs that require grad (the autograd registration is checked only then),
# opcheck being slow.
OPTION_SAMPLES = [
    pytest.param(
        Case(8, 8, 4, hq=4, hkv=2), torch.float32, ScoreOptions(window=(3, 1)), id="window"
    ),
    pytest.param(
        Case(9, 5, 4, hq=2, hkv=1), torch.float64, ScoreOptions(softcap=2.0), id="softcap-f64"
    ),
    pytest.param(
        Case(6, 7, 4, hq=2, hkv=2, batch=(2,), layout="transposed"),
        torch.float32,
        ScoreOptions(alibi="batch", sinks="q"),
        id="alibi-batch-sinks",
    ),
    pytest.param(
        Case(7, 7, 4, dv=3, hq=2, hkv=1, batch=(2,)),
        torch.bfloat16,
        ScoreOptions(window=(2, 0), softcap=3.0, alibi="heads", sinks="float32", key_mask="holes"),
        id="all-bf16-sinks-f32",
    ),
]
# The kernel entries: every option together, without and with dropout (its seed a tensor: the
# public ops' generator would draw another mask at each of opcheck's calls).
KERNEL_SAMPLES = [
    pytest.param(*OPTION_SAMPLES[3].values, 0.0, id="all-bf16"),
    pytest.param(*OPTION_SAMPLES[2].values, 0.3, id="alibi-batch-sinks-dropout"),
]
DROPOUT_SEED = torch.tensor([123, 4], dtype=torch.int64)


def _option_kwargs(case, dtype, options, requires_grad=False, dropout_p=0.0):
    """The op's keyword arguments; with dropout, the kernel ops' (dropout_p, dropout_seed)."""
    kwargs = options.for_case(case, dtype)
    if "sinks" in kwargs:
        kwargs["sinks"] = kwargs["sinks"].detach().requires_grad_(requires_grad)
    if dropout_p > 0:
        kwargs.update(dropout_p=dropout_p, dropout_seed=DROPOUT_SEED)
    return kwargs


@pytest.mark.parametrize("case,dtype,options", OPTION_SAMPLES)
def test_opcheck_attention_with_score_options(case, dtype, options):
    q, k, v = case.inputs(dtype, requires_grad=True)
    kwargs = _option_kwargs(case, dtype, options, requires_grad=True)
    _assert_all_pass(torch.library.opcheck(OPS.attention.default, (q, k, v), kwargs))


@pytest.mark.parametrize("case,dtype,options,dropout_p", KERNEL_SAMPLES)
def test_opcheck_attention_forward_with_score_options(case, dtype, options, dropout_p):
    q, k, v = case.inputs(dtype, requires_grad=True)
    kwargs = _option_kwargs(case, dtype, options, True, dropout_p)
    _assert_all_pass(torch.library.opcheck(OPS.attention_forward.default, (q, k, v, 0.5), kwargs))


@pytest.mark.parametrize("case,dtype,options,dropout_p", KERNEL_SAMPLES)
def test_opcheck_attention_backward_with_score_options(case, dtype, options, dropout_p):
    q, k, v = case.inputs(dtype)
    kwargs = _option_kwargs(case, dtype, options, dropout_p=dropout_p)
    out, lse = OPS.attention_forward(q, k, v, 0.5, **kwargs)
    args = (torch.randn_like(out), q, k, v, out, lse, 0.5)
    _assert_all_pass(torch.library.opcheck(OPS.attention_backward.default, args, kwargs))


def test_opcheck_attention_weights_with_score_options():
    case, dtype, options = OPTION_SAMPLES[3].values
    q, k, v = case.inputs(dtype, requires_grad=True)
    kwargs = _option_kwargs(case, dtype, options, requires_grad=True)
    # As test_attention_weights.py's opcheck: aot_dispatch is torch.export's (test_compile.py).
    torch.library.opcheck(
        OPS.attention_weights.default,
        (q, k, v),
        kwargs,
        test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
    )


# Rows without keys, an empty sequence, GQA and Dv != D, with every option but the key mask.
VARLEN_OPTION_PACKED = Packed((2, 0, 7), (9, 2, 5), 4, dv=3, hq=4, hkv=2)
VARLEN_OPTIONS = ScoreOptions(window=(3, 0), softcap=2.0, alibi="heads", sinks="float32")


def test_opcheck_varlen_attention_with_score_options():
    packed = VARLEN_OPTION_PACKED
    args = packed.inputs(torch.float64, requires_grad=True) + packed.lengths_args()
    kwargs = VARLEN_OPTIONS.kwargs(torch.float64, packed.hq)
    _assert_all_pass(torch.library.opcheck(OPS.varlen_attention.default, args, kwargs))


def test_opcheck_varlen_kernels_with_score_options_and_dropout():
    packed = VARLEN_OPTION_PACKED
    q, k, v = packed.inputs(torch.float32)
    kwargs = VARLEN_OPTIONS.kwargs(torch.float32, packed.hq)
    kwargs.update(sinks=kwargs["sinks"].detach(), dropout_p=0.3, dropout_seed=DROPOUT_SEED)
    kwargs.update(_packed_kwargs(packed))
    forward_args = (q, k, v, 0.5)
    _assert_all_pass(torch.library.opcheck(OPS.attention_forward.default, forward_args, kwargs))
    out, lse = OPS.attention_forward(*forward_args, **kwargs)
    args = (torch.randn_like(out), q, k, v, out, lse, 0.5)
    _assert_all_pass(torch.library.opcheck(OPS.attention_backward.default, args, kwargs))


# --- paged_attention on 8-bit caches -----------------------------------------------------------

EIGHT_BIT = [pytest.param(torch.float8_e4m3fn, id="e4m3fn"),
             pytest.param(torch.float8_e5m2, id="e5m2"), pytest.param(torch.int8, id="int8")]


def _eight_bit_paged_call(dtype, layout):
    """A decode row and a 3-row chunk (packed) against 8-bit pages of 4 rows in a pool of 6,
    bfloat16 q, GQA, with scales per tensor (0-d tensors) or per (page, slot, KV head)."""
    q = torch.randn(4, 4, 8, dtype=torch.bfloat16)
    k_cache, v_cache = ((torch.randn(6, 4, 2, 8) * 8).clamp(-100, 100).to(dtype)
                        for _ in range(2))
    table = torch.tensor([[0, 2], [5, 1]], dtype=torch.int32)
    lengths = torch.tensor([5, 8], dtype=torch.int32)
    if layout == "tensor":
        scales = {"k_scale": torch.tensor(0.05), "v_scale": torch.tensor(0.1)}
    else:
        scales = {"k_scale": torch.rand(6, 4, 2) / 10 + 0.01,
                  "v_scale": torch.rand(6, 4, 2) / 10 + 0.01}
    kwargs = dict(scales, cu_seqlens_q=torch.tensor([0, 1, 4], dtype=torch.int32),
                  max_seqlen_q=3, softcap=2.0, window=[6, 0])
    return (q, k_cache, v_cache, table, lengths), kwargs


@pytest.mark.parametrize("layout", ["tensor", "token"])
@pytest.mark.parametrize("dtype", EIGHT_BIT)
def test_opcheck_paged_attention_on_eight_bit_caches(dtype, layout):
    """Every opcheck test for int8. For the float8 dtypes test_schema cannot run: torch's
    SchemaCheckMode compares each input before and after the call with torch.allclose, which
    has no float8 kernel on the CPU; what it checks (no input mutated, as the schema declares)
    is checked here on the caches' bytes instead."""
    args, kwargs = _eight_bit_paged_call(dtype, layout)
    op = OPS.paged_attention.default
    tests = ("test_schema", "test_autograd_registration", "test_faketensor",
             "test_aot_dispatch_dynamic")
    if dtype != torch.int8:
        tests = tests[1:]
        before = [t.view(torch.uint8).clone() for t in args[1:3]]
        op(*args, **kwargs)
        assert all(torch.equal(t.view(torch.uint8), b) for t, b in zip(args[1:3], before))
        assert not any(a.is_write for a in op._schema.arguments if a.alias_info is not None)
    _assert_all_pass(torch.library.opcheck(op, args, kwargs, test_utils=tests))
