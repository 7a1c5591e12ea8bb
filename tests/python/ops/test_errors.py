"""Bad input raises the documented exception type (ValueError for shapes, devices and scale,
TypeError for dtypes) with a message naming the argument and showing what was seen."""

import math

import pytest
import torch

import causal_attention  # noqa: F401  (loads the ops)

OPS = torch.ops.causal_attention


def z(*shape, dtype=torch.float32, device="cpu"):
    return torch.zeros(shape, dtype=dtype, device=device)


# id -> (q, k, v builder, exception type, substrings the message must contain)
QKV_ERRORS = {
    "q-rank1": (
        lambda: (z(4), z(3, 4), z(3, 4)),
        ValueError,
        ["q must have at least 2 dimensions", "q.shape=[4]"],
    ),
    "k-rank1": (
        lambda: (z(3, 4), z(4), z(3, 4)),
        ValueError,
        ["k must have at least 2 dimensions", "k.shape=[4]"],
    ),
    "v-rank0": (
        lambda: (z(3, 4), z(3, 4), z()),
        ValueError,
        ["v must have at least 2 dimensions", "v.shape=[]"],
    ),
    "ranks-differ": (
        lambda: (z(2, 3, 4), z(3, 4), z(3, 4)),
        ValueError,
        ["same number of dimensions", "q.shape=[2, 3, 4]", "k.shape=[3, 4]", "v.shape=[3, 4]"],
    ),
    "batch-differs": (
        lambda: (z(2, 1, 3, 4), z(3, 1, 3, 4), z(3, 1, 3, 4)),
        ValueError,
        ["leading (batch) dimensions", "q.shape=[2, 1, 3, 4]", "k.shape=[3, 1, 3, 4]"],
    ),
    "5d-inner-batch-differs": (
        lambda: (z(2, 3, 1, 3, 4), z(2, 3, 1, 3, 4), z(2, 2, 1, 3, 4)),
        ValueError,
        ["leading (batch) dimensions", "v.shape=[2, 2, 1, 3, 4]"],
    ),
    "D-differs": (
        lambda: (z(1, 2, 3, 4), z(1, 2, 3, 5), z(1, 2, 3, 4)),
        ValueError,
        ["head dimension D", "q.shape=[1, 2, 3, 4]", "k.shape=[1, 2, 3, 5]"],
    ),
    "Lk-differs": (
        lambda: (z(1, 2, 3, 4), z(1, 2, 5, 4), z(1, 2, 6, 4)),
        ValueError,
        ["number of keys Lk", "k.shape=[1, 2, 5, 4]", "v.shape=[1, 2, 6, 4]"],
    ),
    "Hq-not-multiple-of-Hkv": (
        lambda: (z(1, 3, 3, 4), z(1, 2, 3, 4), z(1, 2, 3, 4)),
        ValueError,
        ["multiple of the key/value heads", "q.shape=[1, 3, 3, 4]", "k.shape=[1, 2, 3, 4]"],
    ),
    "kv-heads-differ": (
        lambda: (z(1, 4, 3, 4), z(1, 2, 3, 4), z(1, 1, 3, 4)),
        ValueError,
        ["same number of heads", "k.shape=[1, 2, 3, 4]", "v.shape=[1, 1, 3, 4]"],
    ),
    "D-zero": (
        lambda: (z(1, 2, 3, 0), z(1, 2, 3, 0), z(1, 2, 3, 4)),
        ValueError,
        ["head dimension D", "must be positive", "q.shape=[1, 2, 3, 0]"],
    ),
    "dtypes-differ": (
        lambda: (z(3, 4), z(3, 4, dtype=torch.float64), z(3, 4)),
        TypeError,
        ["same dtype", "q.dtype=Float", "k.dtype=Double", "v.dtype=Float"],
    ),
    "int32": (
        lambda: (z(3, 4, dtype=torch.int32),) * 3,
        TypeError,
        ["q must be float64, float32, bfloat16 or float16", "q.dtype=Int"],
    ),
    "v-int64": (
        lambda: (z(3, 4), z(3, 4), z(3, 4, dtype=torch.int64)),
        TypeError,
        ["v must be float64", "v.dtype=Long"],
    ),
    "complex64": (
        lambda: (z(3, 4, dtype=torch.complex64),) * 3,
        TypeError,
        ["q must be float64", "q.dtype=ComplexFloat"],
    ),
    "k-float8": (
        lambda: (z(3, 4), z(3, 4, dtype=torch.float8_e4m3fn), z(3, 4)),
        TypeError,
        ["k must be float64", "k.dtype=Float8_e4m3fn"],
    ),
    "devices-differ": (
        lambda: (z(3, 4), z(3, 4, device="meta"), z(3, 4)),
        ValueError,
        ["same device", "q.device=cpu", "k.device=meta", "v.device=cpu"],
    ),
}

# id -> (scale, how the message shows it; C++ may print a NaN as "nan" or "-nan")
BAD_SCALES = {
    "inf": (math.inf, "scale=inf"),
    "-inf": (-math.inf, "scale=-inf"),
    "nan": (math.nan, "nan"),
}


def _backward_dummies(q, k, v):
    """grad_out, out and lse shaped as the backward expects, as far as q and v allow."""
    value_dim = v.shape[-1] if v.dim() else 1
    out = torch.zeros(q.shape[:-1] + (value_dim,), dtype=q.dtype, device=q.device)
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    lse = torch.zeros(q.shape[:-1], dtype=lse_dtype, device=q.device)
    return out.clone(), out, lse


def _call(op_name, q, k, v, scale):
    if op_name == "attention":
        return OPS.attention(q, k, v, scale=scale)
    if op_name == "attention_forward":
        return OPS.attention_forward(q, k, v, 0.5 if scale is None else scale)
    grad_out, out, lse = _backward_dummies(q, k, v)
    return OPS.attention_backward(grad_out, q, k, v, out, lse, 0.5 if scale is None else scale)


def _assert_raises(exc_type, substrings, fn):
    with pytest.raises(exc_type) as info:
        fn()
    message = str(info.value)
    assert message.startswith("causal_attention."), message
    missing = [s for s in substrings if s not in message]
    assert not missing, f"{missing} not in {message!r}"


ALL_OPS = ["attention", "attention_forward", "attention_backward"]


@pytest.mark.parametrize("op_name", ALL_OPS)
@pytest.mark.parametrize("case", QKV_ERRORS.values(), ids=QKV_ERRORS.keys())
def test_bad_q_k_v(case, op_name):
    build, exc_type, substrings = case
    q, k, v = build()
    _assert_raises(exc_type, substrings, lambda: _call(op_name, q, k, v, None))


@pytest.mark.parametrize("op_name", ALL_OPS)
@pytest.mark.parametrize("case", BAD_SCALES.values(), ids=BAD_SCALES.keys())
def test_non_finite_scale(case, op_name):
    scale, shown = case
    q, k, v = z(1, 2, 3, 4), z(1, 2, 3, 4), z(1, 2, 3, 4)
    _assert_raises(
        ValueError, ["scale must be finite", shown], lambda: _call(op_name, q, k, v, scale)
    )


FLOAT32_MAX = torch.finfo(torch.float32).max
# Halfway from FLT_MAX to 2**128: rounding to nearest even takes it to inf, as FLT_MAX's
# significand is odd; the double just below it still rounds to FLT_MAX.
FLOAT32_OVERFLOW = FLOAT32_MAX + 2.0**103

# Scales that are finite doubles, against the dtype the kernels compute in: float32 for float32,
# bfloat16 and float16 inputs (the scale is cast to it), float64 for float64. Where the cast is
# inf, every score and every row would be NaN. id -> (scale, finite in float32)
SCALES_NEAR_FLOAT32_OVERFLOW = {
    "float32-max": (FLOAT32_MAX, True),
    "just-below-overflow": (math.nextafter(FLOAT32_OVERFLOW, 0.0), True),
    "overflow": (FLOAT32_OVERFLOW, False),
    "1e39": (1e39, False),
    "-1e39": (-1e39, False),
}
SHOWN_DTYPE = {
    torch.float64: "Double",
    torch.float32: "Float",
    torch.bfloat16: "BFloat16",
    torch.float16: "Half",
}


def _call_scaled(op_name, q, k, v, scale):
    if op_name == "attention_weights":
        return OPS.attention_weights(q, k, v, scale=scale)
    return _call(op_name, q, k, v, scale)


@pytest.mark.parametrize("dtype", SHOWN_DTYPE.keys(), ids=str)
@pytest.mark.parametrize("op_name", ALL_OPS + ["attention_weights"])
@pytest.mark.parametrize(
    "case", SCALES_NEAR_FLOAT32_OVERFLOW.values(), ids=SCALES_NEAR_FLOAT32_OVERFLOW.keys()
)
def test_scale_must_be_finite_in_the_accumulation_dtype(case, op_name, dtype):
    scale, finite_in_float32 = case
    q, k, v = (z(1, 2, 3, 4, dtype=dtype) for _ in range(3))
    if dtype == torch.float64 or finite_in_float32:
        result = _call_scaled(op_name, q, k, v, scale)
        first = result[0] if isinstance(result, (tuple, list)) else result
        assert first.isfinite().all()  # zero inputs: every score is 0 * scale
        return
    _assert_raises(
        ValueError,
        [
            f"causal_attention.{op_name}: scale must be finite in float32, the accumulation "
            f"dtype of q.dtype={SHOWN_DTYPE[dtype]}, got scale={scale:g}",
        ],
        lambda: _call_scaled(op_name, q, k, v, scale),
    )


# Valid q (1, 4, 5, 8), k (1, 2, 6, 8), v (1, 2, 6, 3): out (1, 4, 5, 3), lse (1, 4, 5) float32.
# id -> (replacement for grad_out/out/lse, exception type, substrings)
BACKWARD_ERRORS = {
    "grad_out-shape": (
        {"grad_out": z(1, 4, 5, 8)},
        ValueError,
        ["grad_out must have shape", "[1, 4, 5, 3]", "grad_out.shape=[1, 4, 5, 8]"],
    ),
    "grad_out-rank": (
        {"grad_out": z(4, 5, 3)},
        ValueError,
        ["grad_out must have shape", "grad_out.shape=[4, 5, 3]"],
    ),
    "out-shape": (
        {"out": z(1, 4, 6, 3)},
        ValueError,
        ["out must have shape", "[1, 4, 5, 3]", "out.shape=[1, 4, 6, 3]"],
    ),
    "lse-shape": (
        {"lse": z(1, 2, 5)},
        ValueError,
        ["lse must have shape", "[1, 4, 5]", "lse.shape=[1, 2, 5]"],
    ),
    "lse-keepdim": (
        {"lse": z(1, 4, 5, 1)},
        ValueError,
        ["lse must have shape", "lse.shape=[1, 4, 5, 1]"],
    ),
    "grad_out-dtype": (
        {"grad_out": z(1, 4, 5, 3, dtype=torch.float64)},
        TypeError,
        ["grad_out and out must have q's dtype Float", "grad_out.dtype=Double"],
    ),
    "out-dtype": (
        {"out": z(1, 4, 5, 3, dtype=torch.bfloat16)},
        TypeError,
        ["grad_out and out must have q's dtype Float", "out.dtype=BFloat16"],
    ),
    "lse-dtype": (
        {"lse": z(1, 4, 5, dtype=torch.float64)},
        TypeError,
        ["lse must have dtype Float", "lse.dtype=Double"],
    ),
    "grad_out-device": (
        {"grad_out": z(1, 4, 5, 3, device="meta")},
        ValueError,
        ["grad_out, out and lse must be on q's device cpu"],
    ),
}


@pytest.mark.parametrize("case", BACKWARD_ERRORS.values(), ids=BACKWARD_ERRORS.keys())
def test_bad_backward_inputs(case):
    replacement, exc_type, substrings = case
    q, k, v = z(1, 4, 5, 8), z(1, 2, 6, 8), z(1, 2, 6, 3)
    args = {"grad_out": z(1, 4, 5, 3), "out": z(1, 4, 5, 3), "lse": z(1, 4, 5)}
    OPS.attention_backward(args["grad_out"], q, k, v, args["out"], args["lse"], 0.5)  # valid
    args.update(replacement)
    _assert_raises(
        exc_type,
        substrings,
        lambda: OPS.attention_backward(args["grad_out"], q, k, v, args["out"], args["lse"], 0.5),
    )


# --- tensors that are not dense ----------------------------------------------------------------


def _nested(t):
    """A nested tensor of t's two batch items, the second one shorter in its last dim: ragged, so
    it has no sizes to report."""
    return torch.nested.nested_tensor([t[0], t[1][..., :-1]])


def _jagged(t):
    """The same as a jagged nested tensor (torch.jagged), ragged in its first dim after the
    batch."""
    return torch.nested.nested_tensor([t[0], t[1][:-1]], layout=torch.jagged)


# id -> (conversion, what the message says after the argument's name)
NOT_DENSE = {
    "nested": (_nested, "must be a dense tensor, got a nested tensor"),
    "jagged": (_jagged, "must be a dense tensor, got a nested tensor"),
    "sparse_coo": (
        lambda t: t.to_sparse(),
        "must be a dense (strided) tensor, got {}.layout=Sparse",
    ),
    "sparse_csr": (
        lambda t: t.to_sparse_csr(),
        "must be a dense (strided) tensor, got {}.layout=SparseCsr",
    ),
}
BACKWARD_ARGUMENTS = ["grad_out", "q", "k", "v", "out", "lse"]


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype")
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("argument", BACKWARD_ARGUMENTS + ["key_mask"])
@pytest.mark.parametrize("kind", NOT_DENSE.values(), ids=NOT_DENSE.keys())
def test_a_tensor_that_is_not_dense_is_refused_naming_it(kind, argument):
    # Before, a nested tensor failed with "NestedTensorImpl doesn't support sizes" (an internal
    # error) or "Given dimension -2 is irregular", a sparse one past the op's checks with the
    # dispatcher's "Could not run ... SparseCPU backend": none named the argument.
    convert, shown = kind
    args = {"grad_out": z(2, 4, 5, 3), "q": z(2, 4, 5, 8), "k": z(2, 2, 6, 8), "v": z(2, 2, 6, 3)}
    args.update(out=z(2, 4, 5, 3), lse=z(2, 4, 5), key_mask=torch.ones(2, 6, dtype=torch.bool))

    def call():
        tensors = (args[name] for name in BACKWARD_ARGUMENTS)
        return OPS.attention_backward(*tensors, 0.5, args["key_mask"])

    call()  # valid
    args[argument] = convert(args[argument])
    message = f"causal_attention.attention_backward: {argument} {shown.format(argument)}"
    _assert_raises(NotImplementedError, [message], call)


def test_lse_dtype_for_half_inputs_is_float32():
    q = k = v = z(1, 2, 5, 8, dtype=torch.bfloat16)
    grad_out = out = z(1, 2, 5, 8, dtype=torch.bfloat16)
    lse = z(1, 2, 5, dtype=torch.bfloat16)
    _assert_raises(
        TypeError,
        ["lse must have dtype Float", "q.dtype=BFloat16", "lse.dtype=BFloat16"],
        lambda: OPS.attention_backward(grad_out, q, k, v, out, lse, 0.5),
    )


# --- key masks ---------------------------------------------------------------------------------

# Valid q (2, 4, 5, 8), k (2, 2, 6, 8), v (2, 2, 6, 3): key_mask (2, 6).
# id -> (key_mask builder, exception type, substrings the message must contain)
MASK_SHAPE = "key_mask must have shape (*batch, Lk)=[2, 6] (q's leading dims and k's keys)"
KEY_MASK_ERRORS = {
    "int32": (
        lambda: z(2, 6, dtype=torch.int32),
        TypeError,
        ["key_mask must be a bool tensor", "key_mask.dtype=Int"],
    ),
    "float32": (
        lambda: z(2, 6),
        TypeError,
        ["key_mask must be a bool tensor", "key_mask.dtype=Float"],
    ),
    "uint8": (lambda: z(2, 6, dtype=torch.uint8), TypeError, ["key_mask.dtype=Byte"]),
    "Lk-short": (
        lambda: z(2, 5, dtype=torch.bool),
        ValueError,
        [MASK_SHAPE, "key_mask.shape=[2, 5]", "q.shape=[2, 4, 5, 8]", "k.shape=[2, 2, 6, 8]"],
    ),
    "no-batch": (lambda: z(6, dtype=torch.bool), ValueError, [MASK_SHAPE, "key_mask.shape=[6]"]),
    "batch-1-not-broadcast": (
        lambda: z(1, 6, dtype=torch.bool),
        ValueError,
        [MASK_SHAPE, "key_mask.shape=[1, 6]"],
    ),
    "sdpa-style-4d": (
        lambda: z(2, 1, 1, 6, dtype=torch.bool),
        ValueError,
        [MASK_SHAPE, "key_mask.shape=[2, 1, 1, 6]"],
    ),
    "per-query-2d-mask": (
        lambda: z(2, 5, 6, dtype=torch.bool),
        ValueError,
        [MASK_SHAPE, "key_mask.shape=[2, 5, 6]"],
    ),
    "meta": (
        lambda: z(2, 6, dtype=torch.bool, device="meta"),
        ValueError,
        ["key_mask must be on q's device cpu", "key_mask.device=meta"],
    ),
}

MASK_OPS = ["attention", "attention_forward", "attention_backward", "attention_weights"]


def _call_with_mask(op_name, q, k, v, key_mask):
    if op_name == "attention":
        return OPS.attention(q, k, v, key_mask=key_mask)
    if op_name == "attention_weights":
        return OPS.attention_weights(q, k, v, key_mask=key_mask)
    if op_name == "attention_forward":
        return OPS.attention_forward(q, k, v, 0.5, key_mask)
    grad_out, out, lse = _backward_dummies(q, k, v)
    return OPS.attention_backward(grad_out, q, k, v, out, lse, 0.5, key_mask)


@pytest.mark.parametrize("requires_grad", [False, True], ids=["", "grad"])
@pytest.mark.parametrize("op_name", MASK_OPS)
@pytest.mark.parametrize("case", KEY_MASK_ERRORS.values(), ids=KEY_MASK_ERRORS.keys())
def test_bad_key_mask(case, op_name, requires_grad):
    build, exc_type, substrings = case
    q = z(2, 4, 5, 8).requires_grad_(requires_grad)
    k, v = z(2, 2, 6, 8), z(2, 2, 6, 3)
    _call_with_mask(op_name, q, k, v, z(2, 6, dtype=torch.bool))  # valid
    _assert_raises(
        exc_type,
        [f"causal_attention.{op_name}: "] + substrings,
        lambda: _call_with_mask(op_name, q, k, v, build()),
    )


@pytest.mark.parametrize(
    "q_shape,mask_shape,expected",
    [
        pytest.param((5, 8), (2, 6), "[6]", id="2d-q"),
        pytest.param((3, 5, 8), (1, 6), "[6]", id="3d-q"),
        pytest.param((2, 3, 1, 5, 8), (2, 6), "[2, 3, 6]", id="5d-q"),
    ],
)
def test_key_mask_shape_follows_q_leading_dims(q_shape, mask_shape, expected):
    q = z(*q_shape)
    k = z(*q_shape[:-3], 1, 6, 8) if len(q_shape) >= 3 else z(6, 8)
    OPS.attention(q, k, k, key_mask=z(*(q_shape[:-3] + (6,)), dtype=torch.bool))  # valid
    _assert_raises(
        ValueError,
        [f"key_mask must have shape (*batch, Lk)={expected}", f"key_mask.shape={list(mask_shape)}"],
        lambda: OPS.attention(q, k, k, key_mask=z(*mask_shape, dtype=torch.bool)),
    )


# --- packed sequences --------------------------------------------------------------------------

# A valid call: q (6, 4, 8), k (7, 2, 8), v (7, 2, 3); sequences of 2 and 4 query rows, 3 and 4
# keys; out (6, 4, 3), lse (4, 6).
def _valid_packed():
    return {
        "q": z(6, 4, 8),
        "k": z(7, 2, 8),
        "v": z(7, 2, 3),
        "cu_seqlens_q": torch.tensor([0, 2, 6], dtype=torch.int32),
        "cu_seqlens_k": torch.tensor([0, 3, 7], dtype=torch.int32),
        "max_seqlen_q": 4,
        "max_seqlen_k": 4,
    }


def _cu(*values):
    return torch.tensor(values, dtype=torch.int32)


# id -> (replacements, exception type, substrings)
VARLEN_ERRORS = {
    "cu_q-int64": (
        {"cu_seqlens_q": _cu(0, 2, 6).long()},
        TypeError,
        ["cu_seqlens_q must be int32", "cu_seqlens_q.dtype=Long"],
    ),
    "cu_k-float32": (
        {"cu_seqlens_k": _cu(0, 3, 7).float()},
        TypeError,
        ["cu_seqlens_k must be int32", "cu_seqlens_k.dtype=Float"],
    ),
    "cu_q-None": ({"cu_seqlens_q": None}, TypeError, ["cu_seqlens_q must be a tensor"]),
    "cu_q-2d": (
        {"cu_seqlens_q": _cu(0, 2, 6)[None]},
        ValueError,
        ["cu_seqlens_q must be 1-D", "cu_seqlens_q.shape=[1, 3]"],
    ),
    "cu_k-0d": (
        {"cu_seqlens_k": _cu(7)[0]},
        ValueError,
        ["cu_seqlens_k must be 1-D", "cu_seqlens_k.shape=[]"],
    ),
    "cu_q-no-entries": (
        {"cu_seqlens_q": _cu(), "cu_seqlens_k": _cu()},
        ValueError,
        ["cu_seqlens_q must be 1-D with N + 1 >= 1 entries", "cu_seqlens_q.shape=[0]"],
    ),
    "cu-lengths-differ": (
        {"cu_seqlens_k": _cu(0, 7)},
        ValueError,
        [
            "cu_seqlens_q and cu_seqlens_k must have the same length",
            "cu_seqlens_q.shape=[3]",
            "cu_seqlens_k.shape=[2]",
        ],
    ),
    "cu_q-decreasing": (
        {"cu_seqlens_q": _cu(0, 4, 2, 6), "cu_seqlens_k": _cu(0, 3, 5, 7)},
        ValueError,
        ["cu_seqlens_q must be non-decreasing", "cu_seqlens_q[1]=4 > cu_seqlens_q[2]=2"],
    ),
    "cu_k-decreasing": (
        {"cu_seqlens_k": _cu(0, 3, -1)},
        ValueError,
        ["cu_seqlens_k must be non-decreasing", "cu_seqlens_k[1]=3 > cu_seqlens_k[2]=-1"],
    ),
    "cu_q-not-from-0": (
        {"cu_seqlens_q": _cu(1, 2, 6)},
        ValueError,
        ["cu_seqlens_q must start at 0", "cu_seqlens_q[0]=1"],
    ),
    "cu_k-not-from-0": (
        {"cu_seqlens_k": _cu(-3, 3, 7)},
        ValueError,
        ["cu_seqlens_k must start at 0", "cu_seqlens_k[0]=-3"],
    ),
    "cu_q-last-short": (
        {"cu_seqlens_q": _cu(0, 2, 5)},
        ValueError,
        ["last entry of cu_seqlens_q must be the number of packed rows 6", "cu_seqlens_q[2]=5"],
    ),
    "cu_k-last-short": (
        {"cu_seqlens_k": _cu(0, 3, 6)},
        ValueError,
        ["last entry of cu_seqlens_k must be the number of packed rows 7", "cu_seqlens_k[2]=6"],
    ),
    "max_q-too-small": (
        {"max_seqlen_q": 3},
        ValueError,
        ["sequence 1 has length 4 (cu_seqlens_q[2] - cu_seqlens_q[1])", "max_seqlen_q=3"],
    ),
    "max_k-too-small": (
        {"max_seqlen_k": 3},
        ValueError,
        ["sequence 1 has length 4 (cu_seqlens_k[2] - cu_seqlens_k[1])", "max_seqlen_k=3"],
    ),
    "max_q-negative": (
        {"max_seqlen_q": -1},
        ValueError,
        ["max_seqlen_q and max_seqlen_k must be non-negative", "max_seqlen_q=-1"],
    ),
    "max_k-negative": (
        {"max_seqlen_k": -5},
        ValueError,
        ["max_seqlen_q and max_seqlen_k must be non-negative", "max_seqlen_k=-5"],
    ),
    "cu_q-meta": (
        {"cu_seqlens_q": _cu(0, 2, 6).to("meta")},
        ValueError,
        ["cu_seqlens_q must be on q's device cpu", "cu_seqlens_q.device=meta"],
    ),
    "q-rank4": (
        {"q": z(1, 6, 4, 8)},
        ValueError,
        ["q must have 3 dimensions (total_q, Hq, D)", "q.shape=[1, 6, 4, 8]"],
    ),
    "k-rank2": (
        {"k": z(7, 8)},
        ValueError,
        ["k must have 3 dimensions (total_k, Hkv, D)", "k.shape=[7, 8]"],
    ),
    "v-rank4": (
        {"v": z(1, 7, 2, 3)},
        ValueError,
        ["v must have 3 dimensions (total_k, Hkv, Dv)", "v.shape=[1, 7, 2, 3]"],
    ),
    "q-dense-4d-layout": (
        {"q": z(1, 4, 6, 8), "k": z(1, 2, 7, 8), "v": z(1, 2, 7, 3)},
        ValueError,
        ["q must have 3 dimensions", "q.shape=[1, 4, 6, 8]"],
    ),
    "k-float64": (
        {"k": z(7, 2, 8, dtype=torch.float64)},
        TypeError,
        ["same dtype", "k.dtype=Double"],
    ),
    "q-int32": ({"q": z(6, 4, 8, dtype=torch.int32)}, TypeError, ["q.dtype=Int"]),
    "v-meta": ({"v": z(7, 2, 3, device="meta")}, ValueError, ["same device", "v.device=meta"]),
    # Shapes between the packed tensors: the phrases (test_packed_shape_errors_show_... below
    # checks the shapes the messages show).
    "keys-differ": ({"v": z(5, 2, 3)}, ValueError, ["same number of keys"]),
    "D-differs": ({"k": z(7, 2, 7)}, ValueError, ["same head dimension D"]),
    "kv-heads-differ": ({"v": z(7, 1, 3)}, ValueError, ["same number of heads"]),
    "Hq-not-multiple": ({"q": z(6, 3, 8)}, ValueError, ["must be a multiple of the key/value"]),
}

VARLEN_OPS = ["varlen_attention", "varlen_attention_forward", "varlen_attention_backward"]


def _call_varlen(op_name, a):
    args = (a["q"], a["k"], a["v"], a["cu_seqlens_q"], a["cu_seqlens_k"])
    maxes = (a["max_seqlen_q"], a["max_seqlen_k"])
    if op_name == "varlen_attention":
        return OPS.varlen_attention(*args, *maxes)
    if op_name == "varlen_attention_forward":
        return OPS.varlen_attention_forward(*args, *maxes, 0.5)
    q, v = a["q"], a["v"]
    rows = q.shape[0] if q.dim() else 0
    heads = q.shape[1] if q.dim() > 1 else 1
    value_dim = v.shape[-1] if v.dim() else 1
    out = torch.zeros((rows, heads, value_dim), dtype=q.dtype, device=q.device)
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    lse = torch.zeros((heads, rows), dtype=lse_dtype, device=q.device)
    grad_out = out.clone()
    return OPS.varlen_attention_backward(grad_out, q, a["k"], v, out, lse, *args[3:], *maxes, 0.5)


@pytest.mark.parametrize("requires_grad", [False, True], ids=["", "grad"])
@pytest.mark.parametrize("op_name", VARLEN_OPS)
@pytest.mark.parametrize("case", VARLEN_ERRORS.values(), ids=VARLEN_ERRORS.keys())
def test_bad_varlen_call(case, op_name, requires_grad):
    replacements, exc_type, substrings = case
    args = _valid_packed()
    args["q"].requires_grad_(requires_grad)
    _call_varlen(op_name, args)  # valid
    args.update(replacements)
    # Each message names the op; "causal_attention.varlen_attention" begins all three names
    # (test_varlen_value_errors_name_the_op_called checks the full one).
    _assert_raises(
        exc_type,
        ["causal_attention.varlen_attention"] + substrings,
        lambda: _call_varlen(op_name, args),
    )


# The values of cu_seqlens are checked by the CPU kernels, under the name of the kernel op
# called (varlen_attention reaches them through varlen_attention_forward under autograd).
@pytest.mark.parametrize("op_name", VARLEN_OPS[1:])
def test_varlen_value_errors_name_the_op_called(op_name):
    args = _valid_packed()
    args["cu_seqlens_q"] = _cu(1, 2, 6)
    _assert_raises(
        ValueError,
        [f"causal_attention.{op_name}: cu_seqlens_q must start at 0"],
        lambda: _call_varlen(op_name, args),
    )


# The checks between packed q, k and v show the shapes passed, not a dense view of them.
PACKED_SHAPE_ERRORS = {
    "keys-differ": ({"v": z(5, 2, 3)}, ["k.shape=[7, 2, 8]", "v.shape=[5, 2, 3]"]),
    "D-differs": ({"k": z(7, 2, 7)}, ["q.shape=[6, 4, 8]", "k.shape=[7, 2, 7]"]),
    "kv-heads-differ": ({"v": z(7, 1, 3)}, ["k.shape=[7, 2, 8]", "v.shape=[7, 1, 3]"]),
    "Hq-not-multiple": ({"q": z(6, 3, 8)}, ["q.shape=[6, 3, 8]", "k.shape=[7, 2, 8]"]),
    "D-zero": ({"q": z(6, 4, 0), "k": z(7, 2, 0)}, ["q.shape=[6, 4, 0]"]),
}


@pytest.mark.parametrize("case", PACKED_SHAPE_ERRORS.values(), ids=PACKED_SHAPE_ERRORS.keys())
def test_packed_shape_errors_show_the_shapes_passed(case):
    replacements, substrings = case
    args = {**_valid_packed(), **replacements}
    _assert_raises(ValueError, substrings, lambda: _call_varlen("varlen_attention", args))


# Valid call as above; out (6, 4, 3) in q's dtype, lse (4, 6) float32.
OUT_SHAPE = "grad_out and out must have shape (total_q, Hq, Dv)=[6, 4, 3]"
VARLEN_BACKWARD_ERRORS = {
    "grad_out-shape": (
        {"grad_out": z(6, 4, 8)},
        ValueError,
        [OUT_SHAPE, "grad_out.shape=[6, 4, 8]"],
    ),
    "out-dense-layout": (
        {"out": z(4, 6, 3)},
        ValueError,
        [OUT_SHAPE, "out.shape=[4, 6, 3]"],
    ),
    "lse-dense-layout": (
        {"lse": z(6, 4)},
        ValueError,
        ["lse must have shape (Hq, total_q)=[4, 6]", "lse.shape=[6, 4]"],
    ),
    "lse-float64": (
        {"lse": z(4, 6, dtype=torch.float64)},
        TypeError,
        ["lse must have dtype Float", "lse.dtype=Double"],
    ),
    "out-bfloat16": (
        {"out": z(6, 4, 3, dtype=torch.bfloat16)},
        TypeError,
        ["grad_out and out must have q's dtype Float", "out.dtype=BFloat16"],
    ),
    "lse-meta": (
        {"lse": z(4, 6, device="meta")},
        ValueError,
        ["grad_out, out and lse must be on q's device cpu"],
    ),
    "grad_out-None": ({"grad_out": None}, TypeError, ["grad_out must be a tensor"]),
}


@pytest.mark.parametrize("case", VARLEN_BACKWARD_ERRORS.values(), ids=VARLEN_BACKWARD_ERRORS.keys())
def test_bad_varlen_backward_inputs(case):
    replacement, exc_type, substrings = case
    a = _valid_packed()
    lengths = (a["cu_seqlens_q"], a["cu_seqlens_k"], a["max_seqlen_q"], a["max_seqlen_k"])
    args = {"grad_out": z(6, 4, 3), "out": z(6, 4, 3), "lse": z(4, 6)}

    def call():
        return OPS.varlen_attention_backward(
            args["grad_out"], a["q"], a["k"], a["v"], args["out"], args["lse"], *lengths, 0.5
        )

    call()  # valid
    args.update(replacement)
    _assert_raises(exc_type, ["causal_attention.varlen_attention_backward: "] + substrings, call)
