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


def test_lse_dtype_for_half_inputs_is_float32():
    q = k = v = z(1, 2, 5, 8, dtype=torch.bfloat16)
    grad_out = out = z(1, 2, 5, 8, dtype=torch.bfloat16)
    lse = z(1, 2, 5, dtype=torch.bfloat16)
    _assert_raises(
        TypeError,
        ["lse must have dtype Float", "q.dtype=BFloat16", "lse.dtype=BFloat16"],
        lambda: OPS.attention_backward(grad_out, q, k, v, out, lse, 0.5),
    )
