"""Bad input, from Python: one table of malformed calls of every public function (attention,
attention_forward, attention_backward, attention_weights, the SDPA drop-in, varlen_attention,
and the kernel ops on packed sequences), a test per row. A row is a valid call with
some arguments replaced by bad values (``None`` in every position, exotic dtypes, shapes, devices,
non-finite scales and scales finite only in float64, nested and sparse tensors, bad key masks,
bad cumulative lengths), optionally with q requiring grad (the Autograd kernel checks first). Each
must raise exactly the documented ValueError (shapes, devices, scale), TypeError (dtypes, None)
or NotImplementedError (a tensor that is not dense) with a message that begins with the op's
name and contains the row's fragments: the offending argument and what was seen.

Calls that never reach the op's checks (a non-tensor argument; a sparse tensor under inference
mode, which skips the Autograd kernel) are refused by torch itself; the last tests pin that down,
as it is part of what a caller sees, and that our Python wrappers raise TypeError for them.
scripts/sanitize.sh runs this file under ASan and UBSan.
"""

import math
import re
import warnings
from dataclasses import dataclass
from typing import Any, Dict, Tuple

import pytest
import torch

import causal_attention
from causal_attention.ops import ScoreOptions

OPS = torch.ops.causal_attention

pytestmark = [
    pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype"),
    pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta"),
]


def randn(*shape, dtype=torch.float32, device="cpu"):
    return torch.randn(shape).to(dtype=dtype, device=device)


def z(*shape, dtype=torch.float32, device="cpu"):
    return torch.zeros(shape, dtype=dtype, device=device)


def mask(*shape, dtype=torch.bool, device="cpu"):
    return torch.ones(shape, dtype=dtype, device=device)


def cu(*values, dtype=torch.int32):
    return torch.tensor(values, dtype=dtype)


def grad(t):
    """t as a leaf that requires grad."""
    return t.detach().requires_grad_(True)


def nested(t):
    """A nested tensor of t's batch items (dim 0), the last one a row shorter in dim -2 (the
    last dim for a 2-D t): ragged, so it has no sizes."""
    items = list(t.unbind(0))
    items[-1] = items[-1][..., :-1, :] if items[-1].dim() >= 2 else items[-1][:-1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "The PyTorch API of nested tensors is in prototype"
        return torch.nested.nested_tensor(items)


def nested_last_dim(t):
    """A nested tensor of t's two batch items, the second one shorter in its last dim."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.nested.nested_tensor([t[0], t[1][..., :-1]])


def jagged(t):
    """A jagged nested tensor (torch.jagged, the layout torch develops) of t's batch items, the
    last one a row shorter in its first dim."""
    items = list(t.unbind(0))
    items[-1] = items[-1][:-1]
    return torch.nested.nested_tensor(items, layout=torch.jagged)


def sparse_csr(t):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Sparse CSR tensor support is in beta state"
        return t.to_sparse_csr()


# --- the valid calls and how each function is called --------------------------------------------

# The score options' defaults: the public ops draw dropout's seed from ``generator``,
# the kernel ops take it as ``dropout_seed``.
NO_OPTIONS = {**ScoreOptions()._asdict(), "generator": None, "dropout_seed": None}
OPTION_NAMES = ScoreOptions._fields


def _public_options(a):
    return {**{name: a[name] for name in OPTION_NAMES}, "generator": a["generator"]}


def _kernel_options(a):
    return {**{name: a[name] for name in OPTION_NAMES}, "dropout_seed": a["dropout_seed"]}



def valid_dense():
    """q (2, 4, 5, 8), k (2, 2, 6, 8), v (2, 2, 6, 3); out (2, 4, 5, 3), lse (2, 4, 5)."""
    return {
        "grad_out": randn(2, 4, 5, 3),
        "q": randn(2, 4, 5, 8),
        "k": randn(2, 2, 6, 8),
        "v": randn(2, 2, 6, 3),
        "out": randn(2, 4, 5, 3),
        "lse": randn(2, 4, 5),
        "key_mask": None,  # or (2, 6) bool
        "scale": None,
        **NO_OPTIONS,
    }


def valid_sdpa():
    """The dense call with as many keys as queries, as SDPA's is_causal requires."""
    return {**valid_dense(), "k": randn(2, 2, 5, 8), "v": randn(2, 2, 5, 3)}


def valid_packed():
    """q (6, 4, 8), k (7, 2, 8), v (7, 2, 3): sequences of 2 + 4 query rows and 3 + 4 keys;
    out (6, 4, 3), lse (4, 6)."""
    return {
        "grad_out": randn(6, 4, 3),
        "q": randn(6, 4, 8),
        "k": randn(7, 2, 8),
        "v": randn(7, 2, 3),
        "out": randn(6, 4, 3),
        "lse": randn(4, 6),
        "cu_seqlens_q": cu(0, 2, 6),
        "cu_seqlens_k": cu(0, 3, 7),
        "max_seqlen_q": 4,
        "max_seqlen_k": 4,
        "scale": None,
        **NO_OPTIONS,
    }


def _kernel_scale(a):
    """The kernel ops take a scale; the rows that give none call them with 0.5."""
    return 0.5 if a["scale"] is None else a["scale"]


def _lengths(a):
    return (a["cu_seqlens_q"], a["cu_seqlens_k"], a["max_seqlen_q"], a["max_seqlen_k"])


# function -> (its valid call, how it is called on a dict of arguments)
FUNCTIONS = {
    "attention": (
        valid_dense,
        lambda a: causal_attention.attention(
            a["q"], a["k"], a["v"], scale=a["scale"], key_mask=a["key_mask"], **_public_options(a)
        ),
    ),
    "attention_forward": (
        valid_dense,
        lambda a: causal_attention.attention_forward(
            a["q"], a["k"], a["v"], _kernel_scale(a), a["key_mask"], **_kernel_options(a)
        ),
    ),
    "attention_backward": (
        valid_dense,
        lambda a: causal_attention.attention_backward(
            a["grad_out"], a["q"], a["k"], a["v"], a["out"], a["lse"], _kernel_scale(a),
            a["key_mask"], **_kernel_options(a),
        ),
    ),
    "attention_weights": (
        valid_dense,
        lambda a: causal_attention.attention_weights(
            a["q"], a["k"], a["v"], scale=a["scale"], key_mask=a["key_mask"], **_public_options(a)
        ),
    ),
    "scaled_dot_product_attention": (
        valid_sdpa,
        lambda a: causal_attention.scaled_dot_product_attention(
            a["q"], a["k"], a["v"], is_causal=True, enable_gqa=True
        ),
    ),
    "varlen_attention": (
        valid_packed,
        lambda a: causal_attention.varlen_attention(
            a["q"], a["k"], a["v"], *_lengths(a), scale=a["scale"], **_public_options(a)
        ),
    ),
    "packed_attention_forward": (
        valid_packed,
        lambda a: causal_attention.attention_forward(
            a["q"], a["k"], a["v"], _kernel_scale(a), **_packed(a), **_kernel_options(a)
        ),
    ),
    "packed_attention_backward": (
        valid_packed,
        lambda a: causal_attention.attention_backward(
            a["grad_out"], a["q"], a["k"], a["v"], a["out"], a["lse"], _kernel_scale(a),
            **_packed(a), **_kernel_options(a),
        ),
    ),
}


def _packed(a: Dict[str, Any]) -> Dict[str, Any]:
    """The kernel ops' packed-sequence arguments of a packed call."""
    names = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")
    return dict(zip(names, _lengths(a)))


def op_name(function: str) -> str:
    """The op a function's errors name: the packed kernel calls are the kernel ops'."""
    return function.replace("packed_", "")
DENSE_OPS = ["attention", "attention_forward", "attention_backward"]
MASK_OPS = DENSE_OPS + ["attention_weights"]
VARLEN_OPS = ["varlen_attention", "packed_attention_forward", "packed_attention_backward"]


def call(function: str, bad: Dict[str, Any], requires_grad: bool = False):
    """``function`` on its valid call with the arguments in ``bad`` replaced; with
    ``requires_grad``, q requires grad (where it is a floating-point tensor)."""
    valid, invoke = FUNCTIONS[function]
    args = {**valid(), **bad}
    q = args["q"]
    if requires_grad and isinstance(q, torch.Tensor) and q.is_floating_point():
        args["q"] = grad(q)
    return invoke(args)


def backward_dummies(q, v):
    """grad_out, out and lse of attention_backward for this q and v, as far as they allow."""
    value_dim = v.shape[-1] if v.dim() else 1
    out = torch.zeros(q.shape[:-1] + (value_dim,), dtype=q.dtype, device=q.device)
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    lse = torch.zeros(q.shape[:-1], dtype=lse_dtype, device=q.device)
    return {"grad_out": out.clone(), "out": out, "lse": lse}


def packed_backward_dummies(q, v):
    """The same for a packed attention_backward: out (total_q, Hq, Dv), lse (Hq, total_q)."""
    rows = q.shape[0] if q.dim() else 0
    heads = q.shape[1] if q.dim() > 1 else 1
    value_dim = v.shape[-1] if v.dim() else 1
    out = torch.zeros((rows, heads, value_dim), dtype=q.dtype, device=q.device)
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    lse = torch.zeros((heads, rows), dtype=lse_dtype, device=q.device)
    return {"grad_out": out.clone(), "out": out, "lse": lse}


def through(function: str, bad: Dict[str, Any]) -> Dict[str, Any]:
    """``bad`` for ``function``: a backward gets grad_out, out and lse that fit the row's q and v
    (from the valid call where the row leaves them), so that only what the row spoils is bad."""
    if function not in ("attention_backward", "packed_attention_backward"):
        return bad
    if any(name in bad for name in ("grad_out", "out", "lse")):
        return bad
    base = FUNCTIONS[function][0]()
    q, v = bad.get("q", base["q"]), bad.get("v", base["v"])
    dummies = backward_dummies if function == "attention_backward" else packed_backward_dummies
    return {**dummies(q, v), **bad}


# --- the table ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Bad:
    """A row: ``function`` called with the arguments ``bad`` (name -> bad value) replaced must
    raise exactly ``error`` with every one of ``needles`` in its message."""

    function: str
    bad: Dict[str, Any]
    error: type
    needles: Tuple[str, ...]
    requires_grad: bool = False


ROWS: Dict[str, Bad] = {}


def row(case, function, error, needles, requires_grad=False, **bad):
    """Adds the row ``function:case``."""
    name = f"{function}:{case}" + ("-grad" if requires_grad else "")
    assert name not in ROWS, name
    ROWS[name] = Bad(function, bad, error, tuple(needles), requires_grad)


def rows_for(functions, case, error, needles, requires_grad=False, **bad):
    """The same bad arguments through each of ``functions``."""
    for function in functions:
        row(case, function, error, needles, requires_grad, **through(function, bad))


def in_dtype(dtype):
    """The valid call's q, k and v in ``dtype``."""
    a = valid_dense()
    return {name: a[name].to(dtype) for name in ("q", "k", "v")}


V, T, N = ValueError, TypeError, NotImplementedError
NESTED = "must be a dense tensor, got a nested tensor"

# None for a tensor: TypeError naming the argument.
row("q-None", "attention", T, ["q must be a tensor, got None"], q=None)
row("k-None", "attention", T, ["k must be a tensor, got None"], k=None)
row("v-None", "attention", T, ["v must be a tensor, got None"], v=None)
row("v-None", "attention", T, ["v must be a tensor"], True, v=None)
row("q-None", "attention_forward", T, ["attention_forward: q must be a tensor"], q=None)
row("k-None", "attention_forward", T, ["attention_forward: k must be a tensor"], k=None)
row("grad_out-None", "attention_backward", T, ["grad_out must be a tensor"], grad_out=None)
for name in ("q", "k", "v"):
    row(f"{name}-None", "attention_backward", T,
        [f"attention_backward: {name} must be a tensor"], **{name: None})
row("out-None", "attention_backward", T, ["out must be a tensor"], out=None)
row("lse-None", "attention_backward", T, ["lse must be a tensor"], lse=None)
row("q-None", "attention_weights", T, ["q must be a tensor"], q=None)
row("q-None", "scaled_dot_product_attention", T, ["query must be a Tensor, got NoneType"], q=None)

# Dtypes: TypeError naming the argument and the dtype.
row("q-int8", "attention", T, ["q.dtype=Char"], q=randn(2, 4, 5, 8, dtype=torch.int8))
row("k-bool", "attention", T, ["k.dtype=Bool"], k=randn(2, 2, 6, 8, dtype=torch.bool))
row("v-uint8", "attention_forward", T, ["v.dtype=Byte"], v=randn(2, 2, 6, 3, dtype=torch.uint8))
row("q-complex128", "attention", T, ["q.dtype=ComplexDouble"],
    q=randn(2, 4, 5, 8, dtype=torch.complex128))
row("k-float8_e4m3fnuz", "attention", T, ["k.dtype=Float8_e4m3fnuz"],
    k=randn(2, 2, 6, 8, dtype=torch.float8_e4m3fnuz))
row("q-float64-k-float32", "attention", T, ["same dtype", "q.dtype=Double", "k.dtype=Float"],
    True, q=randn(2, 4, 5, 8, dtype=torch.float64))
row("bf16-q-k-fp16-v", "attention", T, ["same dtype", "v.dtype=Half"],
    q=randn(2, 4, 5, 8, dtype=torch.bfloat16), k=randn(2, 2, 6, 8, dtype=torch.bfloat16),
    v=randn(2, 2, 6, 3, dtype=torch.float16))
row("grad_out-float16", "attention_backward", T, ["grad_out.dtype=Half"],
    grad_out=randn(2, 4, 5, 3, dtype=torch.float16))
row("out-float64", "attention_backward", T, ["out.dtype=Double"],
    out=randn(2, 4, 5, 3, dtype=torch.float64))
row("lse-bool", "attention_backward", T, ["lse must have dtype", "lse.dtype=Bool"],
    lse=randn(2, 4, 5, dtype=torch.bool))
row("v-int64", "attention_weights", T, ["v.dtype=Long"], v=randn(2, 2, 6, 3, dtype=torch.int64))

# Shapes: ValueError naming the argument and showing the shapes.
row("q-rank1-8", "attention", V, ["q must have at least 2", "q.shape=[8]"], q=randn(8))
row("k-rank0", "attention_forward", V, ["k must have at least 2", "k.shape=[]"], k=randn())
row("v-rank3-vs-4", "attention", V, ["number of dimensions", "v.shape"], v=randn(2, 6, 3))
row("6d-inner-batch", "attention", V, ["leading (batch)", "k.shape=[2, 1, 2, 2, 6, 8]"],
    q=randn(2, 1, 3, 4, 5, 8), k=randn(2, 1, 2, 2, 6, 8), v=randn(2, 1, 3, 2, 6, 3))
row("D-differs", "attention_forward", V, ["head dimension D", "k.shape"], k=randn(2, 2, 6, 7))
row("D-zero", "attention", V, ["must be positive", "q.shape=[2, 4, 5, 0]"],
    q=randn(2, 4, 5, 0), k=randn(2, 2, 6, 0), scale=0.5)
row("Lk-differs", "attention", V, ["Lk", "v.shape"], True, v=randn(2, 2, 9, 3))
row("Hq-5-Hkv-2", "attention", V, ["multiple", "q.shape=[2, 5, 5, 8]"], q=randn(2, 5, 5, 8))
row("Hkv-0", "attention_forward", V, ["multiple", "k.shape=[2, 0, 6, 8]"],
    k=randn(2, 0, 6, 8), v=randn(2, 0, 6, 3))
row("kv-heads-differ", "attention", V, ["same number of heads", "k.shape"], k=randn(2, 1, 6, 8))
row("grad_out-shape", "attention_backward", V, ["grad_out.shape=[2, 4, 5, 8]"],
    grad_out=randn(2, 4, 5, 8))
row("out-transposed", "attention_backward", V, ["out must have shape", "out.shape=[2, 5, 4, 3]"],
    out=randn(2, 5, 4, 3))
row("lse-Lq", "attention_backward", V, ["lse.shape=[2, 4, 6]"], lse=randn(2, 4, 6))
row("lse-flat", "attention_backward", V, ["lse.shape=[40]"], lse=randn(40))
row("Lk-differs", "attention_weights", V, ["Lk", "v.shape"], v=randn(2, 2, 7, 3))
# The SDPA drop-in raises what SDPA raises for it: RuntimeError (tests/python/integrations).
row("D-differs", "scaled_dot_product_attention", RuntimeError, ["head dimension D", "k.shape"],
    k=randn(2, 2, 5, 9))

# q, k and v wrong together, through attention, attention_forward and attention_backward.
QKV = {
    "q-rank1": ((z(4), z(3, 4), z(3, 4)), V, ["q must have at least 2 dimensions", "q.shape=[4]"]),
    "k-rank1": ((z(3, 4), z(4), z(3, 4)), V, ["k must have at least 2 dimensions", "k.shape=[4]"]),
    "v-rank0": ((z(3, 4), z(3, 4), z()), V, ["v must have at least 2 dimensions", "v.shape=[]"]),
    "ranks-differ": (
        (z(2, 3, 4), z(3, 4), z(3, 4)),
        V,
        ["same number of dimensions", "q.shape=[2, 3, 4]", "k.shape=[3, 4]", "v.shape=[3, 4]"],
    ),
    "batch-differs": (
        (z(2, 1, 3, 4), z(3, 1, 3, 4), z(3, 1, 3, 4)),
        V,
        ["leading (batch) dimensions", "q.shape=[2, 1, 3, 4]", "k.shape=[3, 1, 3, 4]"],
    ),
    "5d-inner-batch-differs": (
        (z(2, 3, 1, 3, 4), z(2, 3, 1, 3, 4), z(2, 2, 1, 3, 4)),
        V,
        ["leading (batch) dimensions", "v.shape=[2, 2, 1, 3, 4]"],
    ),
    "D-differs-4d": (
        (z(1, 2, 3, 4), z(1, 2, 3, 5), z(1, 2, 3, 4)),
        V,
        ["head dimension D", "q.shape=[1, 2, 3, 4]", "k.shape=[1, 2, 3, 5]"],
    ),
    "Lk-differs-4d": (
        (z(1, 2, 3, 4), z(1, 2, 5, 4), z(1, 2, 6, 4)),
        V,
        ["number of keys Lk", "k.shape=[1, 2, 5, 4]", "v.shape=[1, 2, 6, 4]"],
    ),
    "Hq-not-multiple-of-Hkv": (
        (z(1, 3, 3, 4), z(1, 2, 3, 4), z(1, 2, 3, 4)),
        V,
        ["multiple of the key/value heads", "q.shape=[1, 3, 3, 4]", "k.shape=[1, 2, 3, 4]"],
    ),
    "kv-heads-differ-4d": (
        (z(1, 4, 3, 4), z(1, 2, 3, 4), z(1, 1, 3, 4)),
        V,
        ["same number of heads", "k.shape=[1, 2, 3, 4]", "v.shape=[1, 1, 3, 4]"],
    ),
    "D-zero-4d": (
        (z(1, 2, 3, 0), z(1, 2, 3, 0), z(1, 2, 3, 4)),
        V,
        ["head dimension D", "must be positive", "q.shape=[1, 2, 3, 0]"],
    ),
    "dtypes-differ": (
        (z(3, 4), z(3, 4, dtype=torch.float64), z(3, 4)),
        T,
        ["same dtype", "q.dtype=Float", "k.dtype=Double", "v.dtype=Float"],
    ),
    "int32": (
        (z(3, 4, dtype=torch.int32),) * 3,
        T,
        ["q must be float64, float32, bfloat16 or float16", "q.dtype=Int"],
    ),
    "v-int64": ((z(3, 4), z(3, 4), z(3, 4, dtype=torch.int64)), T,
                ["v must be float64", "v.dtype=Long"]),
    "complex64": ((z(3, 4, dtype=torch.complex64),) * 3, T,
                  ["q must be float64", "q.dtype=ComplexFloat"]),
    "k-float8": ((z(3, 4), z(3, 4, dtype=torch.float8_e4m3fn), z(3, 4)), T,
                 ["k must be float64", "k.dtype=Float8_e4m3fn"]),
    "devices-differ": (
        (z(3, 4), z(3, 4, device="meta"), z(3, 4)),
        V,
        ["same device", "q.device=cpu", "k.device=meta", "v.device=cpu"],
    ),
}
for case, ((q, k, v), error, needles) in QKV.items():
    rows_for(DENSE_OPS, case, error, needles, q=q, k=k, v=v)

# Scales: ValueError, the value shown as C++ prints it (a NaN as "nan" or "-nan").
for case, scale, shown in [
    ("scale-inf", math.inf, "scale=inf"),
    ("scale--inf", -math.inf, "scale=-inf"),
    ("scale-nan", math.nan, "nan"),
]:
    rows_for(DENSE_OPS, case, V, ["scale must be finite", shown], scale=scale)
row("scale-1e309", "attention", V, ["scale must be finite", "inf"], scale=1e309)
row("scale--inf", "attention", V, ["scale must be finite", "-inf"], True, scale=-math.inf)

# Finite doubles that are inf in float32, where the kernels compute for all but float64 inputs
# (the scale is cast to it): every score and every row would be NaN.
FLOAT32_MAX = torch.finfo(torch.float32).max
# Halfway from FLT_MAX to 2**128: rounding to nearest even takes it to inf, as FLT_MAX's
# significand is odd; the double just below it still rounds to FLT_MAX.
FLOAT32_OVERFLOW = FLOAT32_MAX + 2.0**103
SHOWN_DTYPE = {
    torch.float64: "Double",
    torch.float32: "Float",
    torch.bfloat16: "BFloat16",
    torch.float16: "Half",
}
# id -> (scale, finite in float32)
SCALES_NEAR_FLOAT32_OVERFLOW = {
    "float32-max": (FLOAT32_MAX, True),
    "just-below-overflow": (math.nextafter(FLOAT32_OVERFLOW, 0.0), True),
    "overflow": (FLOAT32_OVERFLOW, False),
    "1e39": (1e39, False),
    "-1e39": (-1e39, False),
}
ACCEPTED_SCALES = []  # (function, dtype, scale): finite in the accumulation dtype
for case, (scale, finite_in_float32) in SCALES_NEAR_FLOAT32_OVERFLOW.items():
    for dtype, shown in SHOWN_DTYPE.items():
        qkv = {name: z(1, 2, 3, 4, dtype=dtype) for name in ("q", "k", "v")}
        for function in MASK_OPS:
            if dtype == torch.float64 or finite_in_float32:
                ACCEPTED_SCALES.append(pytest.param(function, dtype, scale,
                                                    id=f"{function}-{case}-{dtype}"))
                continue
            message = (
                f"causal_attention.{op_name(function)}: scale must be finite in float32, the "
                f"accumulation dtype of q.dtype={shown}, got scale={scale:g}"
            )
            rows_for([function], f"scale-{case}-{shown}", V, [message], scale=scale, **qkv)
row("scale-1e39", "attention", V,
    ["scale must be finite in float32, the accumulation dtype of q.dtype=Float", "1e+39"],
    scale=1e39)
row("scale--1e39", "attention", V, ["finite in float32", "scale=-1e+39"], True, scale=-1e39)
row("bfloat16-scale-1e39", "attention", V, ["q.dtype=BFloat16"], scale=1e39,
    **in_dtype(torch.bfloat16))
row("float16-scale-4e38", "attention_forward", V, ["finite in float32", "q.dtype=Half"],
    scale=4e38, **in_dtype(torch.float16))
row("scale-1e39", "attention_backward", V, ["attention_backward: scale must be finite in float32"],
    scale=1e39)
row("scale-1e39", "attention_weights", V, ["attention_weights: scale must be finite in float32"],
    scale=1e39)
row("float64-scale-1e309", "attention_forward", V, ["finite in float64", "q.dtype=Double"],
    scale=1e309, **in_dtype(torch.float64))

# Devices: ValueError naming the devices.
row("v-meta", "attention", V, ["same device", "v.device=meta"], v=randn(2, 2, 6, 3, device="meta"))
row("q-meta", "attention_forward", V, ["q.device=meta", "k.device=cpu"],
    q=randn(2, 4, 5, 8, device="meta"))
row("grad_out-meta", "attention_backward", V, ["must be on q's device cpu"],
    grad_out=randn(2, 4, 5, 3, device="meta"))
row("lse-meta", "attention_backward", V, ["must be on q's device cpu"],
    lse=randn(2, 4, 5, device="meta"))

# attention_backward's own arguments against q, k and v.
for case, bad, error, needles in [
    ("grad_out-Dv", {"grad_out": z(2, 4, 5, 8)}, V,
     ["grad_out must have shape", "[2, 4, 5, 3]", "grad_out.shape=[2, 4, 5, 8]"]),
    ("grad_out-rank", {"grad_out": z(4, 5, 3)}, V,
     ["grad_out must have shape", "grad_out.shape=[4, 5, 3]"]),
    ("out-Lq", {"out": z(2, 4, 6, 3)}, V,
     ["out must have shape", "[2, 4, 5, 3]", "out.shape=[2, 4, 6, 3]"]),
    ("lse-kv-heads", {"lse": z(2, 2, 5)}, V,
     ["lse must have shape", "[2, 4, 5]", "lse.shape=[2, 2, 5]"]),
    ("lse-keepdim", {"lse": z(2, 4, 5, 1)}, V, ["lse must have shape", "lse.shape=[2, 4, 5, 1]"]),
    ("grad_out-float64", {"grad_out": z(2, 4, 5, 3, dtype=torch.float64)}, T,
     ["grad_out and out must have q's dtype Float", "grad_out.dtype=Double"]),
    ("out-bfloat16", {"out": z(2, 4, 5, 3, dtype=torch.bfloat16)}, T,
     ["grad_out and out must have q's dtype Float", "out.dtype=BFloat16"]),
    ("lse-float64", {"lse": z(2, 4, 5, dtype=torch.float64)}, T,
     ["lse must have dtype Float", "lse.dtype=Double"]),
    ("grad_out-meta-all", {"grad_out": z(2, 4, 5, 3, device="meta")}, V,
     ["grad_out, out and lse must be on q's device cpu"]),
    ("lse-bfloat16-for-bfloat16", {
        **{name: z(1, 2, 5, 8, dtype=torch.bfloat16) for name in ("q", "k", "v", "grad_out")},
        "out": z(1, 2, 5, 8, dtype=torch.bfloat16),
        "lse": z(1, 2, 5, dtype=torch.bfloat16),
    }, T, ["lse must have dtype Float", "q.dtype=BFloat16", "lse.dtype=BFloat16"]),
]:
    row(case, "attention_backward", error, needles, **bad)

# Key masks: bool, (*batch, Lk) with q's leading dims, on q's device; through every function
# that takes one, with and without grad.
MASK_SHAPE = "key_mask must have shape (*batch, Lk)=[2, 6] (q's leading dims and k's keys)"
KEY_MASKS = {
    "key_mask-int32": (z(2, 6, dtype=torch.int32), T,
                       ["key_mask must be a bool tensor", "key_mask.dtype=Int"]),
    "key_mask-float32": (z(2, 6), T, ["key_mask must be a bool tensor", "key_mask.dtype=Float"]),
    "key_mask-uint8": (z(2, 6, dtype=torch.uint8), T, ["key_mask.dtype=Byte"]),
    "key_mask-Lk-short": (
        z(2, 5, dtype=torch.bool),
        V,
        [MASK_SHAPE, "key_mask.shape=[2, 5]", "q.shape=[2, 4, 5, 8]", "k.shape=[2, 2, 6, 8]"],
    ),
    "key_mask-no-batch": (z(6, dtype=torch.bool), V, [MASK_SHAPE, "key_mask.shape=[6]"]),
    "key_mask-batch-1-not-broadcast": (z(1, 6, dtype=torch.bool), V,
                                       [MASK_SHAPE, "key_mask.shape=[1, 6]"]),
    "key_mask-sdpa-style-4d": (z(2, 1, 1, 6, dtype=torch.bool), V,
                               [MASK_SHAPE, "key_mask.shape=[2, 1, 1, 6]"]),
    "key_mask-per-query-2d": (z(2, 5, 6, dtype=torch.bool), V,
                              [MASK_SHAPE, "key_mask.shape=[2, 5, 6]"]),
    "key_mask-meta": (z(2, 6, dtype=torch.bool, device="meta"), V,
                      ["key_mask must be on q's device cpu", "key_mask.device=meta"]),
}
for case, (key_mask, error, needles) in KEY_MASKS.items():
    for requires_grad in (False, True):
        for function in MASK_OPS:
            row(case, function, error, [f"causal_attention.{op_name(function)}: ", *needles],
                requires_grad, **through(function, {"key_mask": key_mask}))
row("key_mask-int64", "attention", T, ["key_mask.dtype=Long"],
    key_mask=mask(2, 6, dtype=torch.int64))
row("key_mask-float", "attention", T, ["key_mask must be a bool tensor", "key_mask.dtype=Float"],
    True, key_mask=mask(2, 6, dtype=torch.float32))
row("key_mask-Lk", "attention_forward", V, ["key_mask.shape=[2, 5]"], key_mask=mask(2, 5))
row("key_mask-heads", "attention_backward", V, ["attention_backward: key_mask must have shape"],
    key_mask=mask(2, 4, 6))
row("key_mask-meta-ones", "attention_weights", V, ["key_mask.device=meta"],
    key_mask=mask(2, 6, device="meta"))
row("key_mask-0d", "attention", V, ["key_mask.shape=[]"], key_mask=mask())
# The mask's shape follows q's leading dims, whatever their number.
for case, q_shape, mask_shape, expected in [
    ("key_mask-2d-q", (5, 8), (2, 6), "[6]"),
    ("key_mask-3d-q", (3, 5, 8), (1, 6), "[6]"),
    ("key_mask-5d-q", (2, 3, 1, 5, 8), (2, 6), "[2, 3, 6]"),
]:
    k = z(*q_shape[:-3], 1, 6, 8) if len(q_shape) >= 3 else z(6, 8)
    row(case, "attention", V,
        [f"key_mask must have shape (*batch, Lk)={expected}", f"key_mask.shape={list(mask_shape)}"],
        q=z(*q_shape), k=k, v=k, key_mask=z(*mask_shape, dtype=torch.bool))

# The score options, through every function that takes them (attention_weights and
# the packed ones included), with and without grad: q (2, 4, 5, 8) has Hq = 4 and batch (2,);
# the packed q (6, 4, 8) Hq = 4 and no batch dims.
OPTION_OPS = MASK_OPS + VARLEN_OPS
KERNEL_OPS = ["attention_forward", "attention_backward"] + VARLEN_OPS[1:]
SCORE_OPTIONS = {
    # window: two ints, each -1 (unbounded) or more.
    "window-three-ints": ({"window": (1, 2, 3)}, T, ["window"]),
    "window-one-int": ({"window": 3}, T, ["window"]),
    "window-float": ({"window": (1.5, 0)}, T, ["window"]),
    "window-left--2": ({"window": (-2, 0)}, V, ["window", "-2"]),
    "window-right--5": ({"window": (4, -5)}, V, ["window", "-5"]),
    # softcap: finite and positive.
    "softcap-0": ({"softcap": 0.0}, V, ["softcap", "0"]),
    "softcap--1.5": ({"softcap": -1.5}, V, ["softcap", "-1.5"]),
    "softcap-nan": ({"softcap": math.nan}, V, ["softcap", "nan"]),
    "softcap-inf": ({"softcap": math.inf}, V, ["softcap", "inf"]),
    # ... in the accumulation dtype, where the kernels compute: 1e39 is inf in float32 (every
    # output NaN), 1e-46 is 0 (the cap silently off).
    "softcap-inf-in-float32": ({"softcap": 1e39}, V, ["softcap must be finite and > 0 in float32",
                                                      "softcap=1e+39"]),
    "softcap-0-in-float32": ({"softcap": 1e-46}, V, ["softcap must be finite and > 0 in float32",
                                                     "softcap=1e-46"]),
    # Float options given as tensors that require grad: the schema would take their value and
    # drop their gradient.
    "softcap-tensor-grad": ({"softcap": torch.tensor(2.0, requires_grad=True)}, T,
                            ["softcap must be a float, got a tensor that requires grad"]),
    "dropout-tensor-grad": ({"dropout_p": torch.tensor(0.1, requires_grad=True)}, T,
                            ["dropout_p must be a float, got a tensor that requires grad"]),
    # sinks: (Hq,) in q's dtype or float32, on q's device.
    "sinks-short": ({"sinks": z(3)}, V, ["sinks", "sinks.shape=[3]"]),
    "sinks-per-batch": ({"sinks": z(2, 4)}, V, ["sinks", "sinks.shape=[2, 4]"]),
    "sinks-0d": ({"sinks": z()}, V, ["sinks", "sinks.shape=[]"]),
    "sinks-float64": ({"sinks": z(4, dtype=torch.float64)}, T, ["sinks", "sinks.dtype=Double"]),
    "sinks-float16": ({"sinks": z(4, dtype=torch.float16)}, T, ["sinks", "sinks.dtype=Half"]),
    "sinks-int64": ({"sinks": z(4, dtype=torch.int64)}, T, ["sinks", "sinks.dtype=Long"]),
    "sinks-meta": ({"sinks": z(4, device="meta")}, V, ["sinks", "sinks.device=meta"]),
    # alibi_slopes: float32 (Hq,) or (*batch, Hq), on q's device.
    "alibi-short": ({"alibi_slopes": z(3)}, V, ["alibi_slopes", "alibi_slopes.shape=[3]"]),
    "alibi-heads-1": ({"alibi_slopes": z(1)}, V, ["alibi_slopes", "alibi_slopes.shape=[1]"]),
    "alibi-float64": ({"alibi_slopes": z(4, dtype=torch.float64)}, T,
                      ["alibi_slopes", "alibi_slopes.dtype=Double"]),
    "alibi-bfloat16": ({"alibi_slopes": z(4, dtype=torch.bfloat16)}, T,
                       ["alibi_slopes", "alibi_slopes.dtype=BFloat16"]),
    "alibi-meta": ({"alibi_slopes": z(4, device="meta")}, V,
                   ["alibi_slopes", "alibi_slopes.device=meta"]),
    # dropout_p in [0, 1).
    "dropout-1": ({"dropout_p": 1.0}, V, ["dropout_p", "1"]),
    "dropout-1.5": ({"dropout_p": 1.5}, V, ["dropout_p", "1.5"]),
    "dropout--0.1": ({"dropout_p": -0.1}, V, ["dropout_p", "-0.1"]),
    "dropout-nan": ({"dropout_p": math.nan}, V, ["dropout_p", "nan"]),
}
for case, (bad, error, needles) in SCORE_OPTIONS.items():
    for requires_grad in (False, True):
        for function in OPTION_OPS:
            row(case, function, error, [f"causal_attention.{op_name(function)}: ", *needles],
                requires_grad, **through(function, bad))
# ALiBi's (*batch, Hq) slopes follow the dense q's leading dims.
for case, slopes, shown in [
    ("alibi-batch-3", z(3, 4), "alibi_slopes.shape=[3, 4]"),
    ("alibi-batch-keepdim", z(2, 4, 1), "alibi_slopes.shape=[2, 4, 1]"),
    ("alibi-heads-first", z(4, 2), "alibi_slopes.shape=[4, 2]"),
]:
    rows_for(MASK_OPS, case, V, ["alibi_slopes", shown], alibi_slopes=slopes)
# Packed q's slopes are (Hq,) or (N, Hq), one row per sequence (N = 2 here).
rows_for(VARLEN_OPS, "alibi-sequences-3", V, ["alibi_slopes", "alibi_slopes.shape=[3, 4]"],
         alibi_slopes=z(3, 4))
# The sinks' dtype is q's or float32: bfloat16 sinks with float32 q are neither.
rows_for(OPTION_OPS, "sinks-bfloat16-for-float32", T, ["sinks.dtype=BFloat16"],
         sinks=z(4, dtype=torch.bfloat16))
# The scale likewise.
rows_for(OPTION_OPS, "scale-tensor-grad", T,
         ["scale must be a float, got a tensor that requires grad"],
         scale=torch.tensor(0.5, requires_grad=True))
# The kernel ops take dropout's seed as a CPU tensor, required with dropout: a Meta seed in a
# CPU call would be read as undefined memory.
for function in KERNEL_OPS:
    named = f"causal_attention.{op_name(function)}: "
    row("dropout-without-seed", function, V, [named, "dropout_seed"],
        **through(function, {"dropout_p": 0.5}))
    row("dropout-meta-seed", function, V,
        [named, "dropout_seed must be a CPU tensor", "on meta"],
        **through(function, {"dropout_p": 0.5,
                             "dropout_seed": torch.empty(2, dtype=torch.int64, device="meta")}))

# Tensors that are not dense: NotImplementedError naming the argument, as torch's dispatcher
# raises for a layout without a kernel. (Before, a nested tensor failed with "NestedTensorImpl
# doesn't support sizes" or "Given dimension -2 is irregular", a sparse one past the op's checks
# with the dispatcher's "Could not run ... SparseCPU backend": none named the argument.)
row("q-nested", "attention", N, ["q " + NESTED], q=nested(randn(2, 4, 5, 8)))
row("k-nested", "attention", N, ["k " + NESTED], True, k=nested(randn(2, 2, 6, 8)))
row("v-jagged", "attention", N, ["v " + NESTED], v=jagged(randn(2, 2, 6, 3)))
row("key_mask-nested", "attention", N, ["key_mask " + NESTED], key_mask=nested(mask(2, 6)))
row("q-jagged", "attention_forward", N, ["forward: q " + NESTED], q=jagged(randn(2, 4, 5, 8)))
row("grad_out-nested", "attention_backward", N, ["grad_out " + NESTED],
    grad_out=nested(randn(2, 4, 5, 3)))
row("lse-nested", "attention_backward", N, ["lse " + NESTED], lse=nested(randn(2, 4, 5)))
row("q-nested", "attention_weights", N, ["weights: q " + NESTED], q=nested(randn(2, 4, 5, 8)))
row("q-sparse", "attention", N, ["q must be a dense (strided) tensor, got q.layout=Sparse"],
    q=randn(2, 4, 5, 8).to_sparse())
row("v-sparse_csr", "attention", N, ["v.layout=SparseCsr"], True, v=sparse_csr(randn(2, 2, 6, 3)))
row("k-mkldnn", "attention", N, ["k.layout=Mkldnn"], k=randn(2, 2, 6, 8).to_mkldnn())
row("key_mask-sparse", "attention", N, ["key_mask.layout=Sparse"], key_mask=mask(2, 6).to_sparse())
row("v-sparse", "attention_forward", N, ["v.layout=Sparse"], v=randn(2, 2, 6, 3).to_sparse())
row("out-sparse", "attention_backward", N, ["out.layout"], out=randn(2, 4, 5, 3).to_sparse())
# Each of attention_backward's tensors (and the key mask) in each layout that is not dense.
NOT_DENSE = {
    "nested": (nested_last_dim, NESTED),
    "jagged": (jagged, NESTED),
    "sparse_coo": (
        lambda t: t.to_sparse(), "must be a dense (strided) tensor, got {}.layout=Sparse"
    ),
    "sparse_csr": (sparse_csr, "must be a dense (strided) tensor, got {}.layout=SparseCsr"),
}
for kind, (convert, shown) in NOT_DENSE.items():
    for name in ("grad_out", "q", "k", "v", "out", "lse", "key_mask"):
        base = {**valid_dense(), "key_mask": mask(2, 6)}
        row(f"{name}-{kind}-all", "attention_backward", N,
            [f"causal_attention.attention_backward: {name} {shown.format(name)}"],
            **{"key_mask": base["key_mask"], name: convert(base[name])})

# Packed sequences: None in every position, dtypes, ranks, devices, lengths, scales.
row("q-None", "varlen_attention", T, ["varlen_attention: q must be a tensor"], q=None)
row("k-None", "varlen_attention", T, ["k must be a tensor"], k=None)
row("v-None", "varlen_attention", T, ["v must be a tensor"], True, v=None)
row("cu_seqlens_q-None", "varlen_attention", T, ["cu_seqlens_q must be"], cu_seqlens_q=None)
row("cu_seqlens_k-None", "varlen_attention", T, ["cu_seqlens_k must be"], cu_seqlens_k=None)
# The kernel ops take packed sequences as optional arguments: all four or none.
PARTLY_PACKED = "packed sequences need all of cu_seqlens_q, cu_seqlens_k, max_seqlen_q and"
row("cu_seqlens_k-None", "packed_attention_forward", V,
    [f"attention_forward: {PARTLY_PACKED}"], cu_seqlens_k=None)
row("grad_out-None", "packed_attention_backward", T, ["grad_out must be"], grad_out=None)
row("out-None", "packed_attention_backward", T, ["out must be a tensor"], out=None)
row("lse-None", "packed_attention_backward", T, ["lse must be a tensor"], lse=None)
row("cu_seqlens_q-None", "packed_attention_backward", V, [f"attention_backward: {PARTLY_PACKED}"],
    cu_seqlens_q=None)
row("cu-int64", "varlen_attention", T, ["cu_seqlens_q.dtype=Long"],
    cu_seqlens_q=cu(0, 2, 6, dtype=torch.int64))
row("cu-uint8", "varlen_attention", T, ["cu_seqlens_k must be int32", "cu_seqlens_k.dtype=Byte"],
    True, cu_seqlens_k=cu(0, 3, 7, dtype=torch.uint8))
row("cu-int16", "packed_attention_backward", T, ["cu_seqlens_k.dtype=Short"],
    cu_seqlens_k=cu(0, 3, 7, dtype=torch.int16))
row("q-int8", "varlen_attention", T, ["q.dtype=Char"], q=randn(6, 4, 8, dtype=torch.int8))
row("q-float64", "varlen_attention", T, ["same dtype"], True, q=randn(6, 4, 8, dtype=torch.float64))
row("q-rank2", "varlen_attention", V, ["q must have 3 dim", "q.shape=[6, 8]"], q=randn(6, 8))
row("k-rank0", "packed_attention_forward", V, ["k must have 3 dim", "k.shape=[]"], k=randn())
row("v-rank5", "packed_attention_backward", V, ["v must have 3", "v.shape=[1, 1, 7, 2, 3]"],
    v=randn(1, 1, 7, 2, 3))
row("cu-rank2", "varlen_attention", V, ["cu_seqlens_k.shape=[1, 3]"], cu_seqlens_k=cu([0, 3, 7]))
row("cu-lengths-differ", "varlen_attention", V, ["same length N + 1"], cu_seqlens_k=cu(0, 7))
row("cu-start", "varlen_attention", V, ["cu_seqlens_q[0]=2"], cu_seqlens_q=cu(2, 2, 6))
row("cu-decreasing", "varlen_attention", V,
    ["cu_seqlens_k must be non-decreasing", "cu_seqlens_k[1]=5 > cu_seqlens_k[2]=3"], True,
    cu_seqlens_k=cu(0, 5, 3), max_seqlen_k=7)
row("cu-last", "packed_attention_forward", V, ["last entry of cu_seqlens_q", "rows 6"],
    cu_seqlens_q=cu(0, 3, 7))
row("max-too-small", "packed_attention_backward", V, ["more than max_seqlen_k=1"], max_seqlen_k=1)
row("max-negative", "varlen_attention", V, ["max_seqlen_q=-4"], max_seqlen_q=-4)
row("scale-nan", "varlen_attention", V, ["scale must be finite"], scale=math.nan)
row("scale-1e39", "varlen_attention", V, ["finite in float32", "q.dtype=Float"], True, scale=1e39)
row("scale--1e39", "packed_attention_forward", V, ["finite in float32"], scale=-1e39)
row("scale-1e39", "packed_attention_backward", V, ["finite in float32"], scale=1e39)
row("q-nested", "varlen_attention", N, ["varlen_attention: q " + NESTED], q=nested(randn(6, 4, 8)))
row("k-jagged", "varlen_attention", N, ["k " + NESTED], True, k=jagged(randn(7, 2, 8)))
row("cu_seqlens_q-sparse", "varlen_attention", N, ["cu_seqlens_q.layout=Sparse"],
    cu_seqlens_q=cu(0, 2, 6).to_sparse())
row("lse-nested", "packed_attention_backward", N, ["lse " + NESTED], lse=nested(randn(4, 6)))
row("scale-inf", "packed_attention_forward", V, ["scale must be finite"], scale=math.inf)
row("scale--inf", "packed_attention_backward", V, ["scale must be"], scale=-math.inf)
row("k-meta", "varlen_attention", V, ["k.device=meta"], k=randn(7, 2, 8, device="meta"))
row("cu-meta", "varlen_attention", V, ["cu_seqlens_k.device=meta"],
    cu_seqlens_k=cu(0, 3, 7).to("meta"))
row("lse-dense", "packed_attention_backward", V, ["lse.shape=[6, 4]"], lse=randn(6, 4))
row("lse-float16", "packed_attention_backward", T, ["lse.dtype=Half"],
    lse=randn(4, 6, dtype=torch.float16))
row("grad_out-Dv", "packed_attention_backward", V, ["grad_out.shape=[6, 4, 8]"],
    grad_out=randn(6, 4, 8))
row("out-meta", "packed_attention_backward", V, ["must be on q's device cpu"],
    out=randn(6, 4, 3, device="meta"))

# The packed checks through every varlen function, with and without grad; each message names
# the op (varlen_attention, or the kernel op a packed kernel call is).
VARLEN = {
    "cu_q-int64": ({"cu_seqlens_q": cu(0, 2, 6).long()}, T,
                   ["cu_seqlens_q must be int32", "cu_seqlens_q.dtype=Long"]),
    "cu_k-float32": ({"cu_seqlens_k": cu(0, 3, 7).float()}, T,
                     ["cu_seqlens_k must be int32", "cu_seqlens_k.dtype=Float"]),
    "cu_q-2d": ({"cu_seqlens_q": cu(0, 2, 6)[None]}, V,
                ["cu_seqlens_q must be 1-D", "cu_seqlens_q.shape=[1, 3]"]),
    "cu_k-0d": ({"cu_seqlens_k": cu(7)[0]}, V,
                ["cu_seqlens_k must be 1-D", "cu_seqlens_k.shape=[]"]),
    "cu_q-no-entries": ({"cu_seqlens_q": cu(), "cu_seqlens_k": cu()}, V,
                        ["cu_seqlens_q must be 1-D with N + 1 >= 1 entries",
                         "cu_seqlens_q.shape=[0]"]),
    "cu-lengths-differ-all": ({"cu_seqlens_k": cu(0, 7)}, V, [
        "cu_seqlens_q and cu_seqlens_k must have the same length",
        "cu_seqlens_q.shape=[3]",
        "cu_seqlens_k.shape=[2]",
    ]),
    "cu_q-decreasing": ({"cu_seqlens_q": cu(0, 4, 2, 6), "cu_seqlens_k": cu(0, 3, 5, 7)}, V,
                        ["cu_seqlens_q must be non-decreasing",
                         "cu_seqlens_q[1]=4 > cu_seqlens_q[2]=2"]),
    "cu_k-decreasing": ({"cu_seqlens_k": cu(0, 3, -1)}, V,
                        ["cu_seqlens_k must be non-decreasing",
                         "cu_seqlens_k[1]=3 > cu_seqlens_k[2]=-1"]),
    "cu_q-not-from-0": ({"cu_seqlens_q": cu(1, 2, 6)}, V,
                        ["cu_seqlens_q must start at 0", "cu_seqlens_q[0]=1"]),
    "cu_k-not-from-0": ({"cu_seqlens_k": cu(-3, 3, 7)}, V,
                        ["cu_seqlens_k must start at 0", "cu_seqlens_k[0]=-3"]),
    "cu_q-last-short": ({"cu_seqlens_q": cu(0, 2, 5)}, V, [
        "last entry of cu_seqlens_q must be the number of packed rows 6", "cu_seqlens_q[2]=5"]),
    "cu_k-last-short": ({"cu_seqlens_k": cu(0, 3, 6)}, V, [
        "last entry of cu_seqlens_k must be the number of packed rows 7", "cu_seqlens_k[2]=6"]),
    "max_q-too-small": ({"max_seqlen_q": 3}, V, [
        "sequence 1 has length 4 (cu_seqlens_q[2] - cu_seqlens_q[1])", "max_seqlen_q=3"]),
    "max_k-too-small": ({"max_seqlen_k": 3}, V, [
        "sequence 1 has length 4 (cu_seqlens_k[2] - cu_seqlens_k[1])", "max_seqlen_k=3"]),
    "max_q-negative": ({"max_seqlen_q": -1}, V,
                       ["max_seqlen_q and max_seqlen_k must be non-negative", "max_seqlen_q=-1"]),
    "max_k-negative": ({"max_seqlen_k": -5}, V,
                       ["max_seqlen_q and max_seqlen_k must be non-negative", "max_seqlen_k=-5"]),
    "cu_q-meta": ({"cu_seqlens_q": cu(0, 2, 6).to("meta")}, V,
                  ["cu_seqlens_q must be on q's device cpu", "cu_seqlens_q.device=meta"]),
    "q-rank4": ({"q": z(1, 6, 4, 8)}, V,
                ["q must have 3 dimensions (total_q, Hq, D)", "q.shape=[1, 6, 4, 8]"]),
    "k-rank2": ({"k": z(7, 8)}, V,
                ["k must have 3 dimensions (total_k, Hkv, D)", "k.shape=[7, 8]"]),
    "v-rank4": ({"v": z(1, 7, 2, 3)}, V,
                ["v must have 3 dimensions (total_k, Hkv, Dv)", "v.shape=[1, 7, 2, 3]"]),
    "q-dense-4d-layout": ({"q": z(1, 4, 6, 8), "k": z(1, 2, 7, 8), "v": z(1, 2, 7, 3)}, V,
                          ["q must have 3 dimensions", "q.shape=[1, 4, 6, 8]"]),
    "k-float64": ({"k": z(7, 2, 8, dtype=torch.float64)}, T, ["same dtype", "k.dtype=Double"]),
    "q-int32": ({"q": z(6, 4, 8, dtype=torch.int32)}, T, ["q.dtype=Int"]),
    "v-meta": ({"v": z(7, 2, 3, device="meta")}, V, ["same device", "v.device=meta"]),
    # The shapes these messages show are checked by the rows after the table.
    "keys-differ": ({"v": z(5, 2, 3)}, V, ["same number of keys"]),
    "D-differs": ({"k": z(7, 2, 7)}, V, ["same head dimension D"]),
    "kv-heads-differ": ({"v": z(7, 1, 3)}, V, ["same number of heads"]),
    "Hq-not-multiple": ({"q": z(6, 3, 8)}, V, ["must be a multiple of the key/value"]),
}
VALUE_CASES = {"cu_q-decreasing", "cu_k-decreasing", "cu_q-not-from-0", "cu_k-not-from-0",
               "cu_q-last-short", "cu_k-last-short", "max_q-too-small", "max_k-too-small"}
for case, (bad, error, needles) in VARLEN.items():
    for requires_grad in (False, True):
        for function in VARLEN_OPS:
            # The values of cu_seqlens are data, read by the CPU kernels of the kernel ops
            # (varlen_attention's by attention_forward's).
            values = case in VALUE_CASES and function == "varlen_attention"
            named = "attention_forward" if values else op_name(function)
            row(case, function, error, [f"causal_attention.{named}: ", *needles],
                requires_grad, **through(function, bad))
for requires_grad in (False, True):
    row("cu_q-None", "varlen_attention", T, ["cu_seqlens_q must be a tensor"], requires_grad,
        cu_seqlens_q=None)
# The values of cu_seqlens are checked by the CPU kernels, under the name of the kernel op called
# (varlen_attention reaches them through attention_forward under autograd).
for function in VARLEN_OPS[1:]:
    row("cu_q-not-from-0-op-named", function, V,
        [f"causal_attention.{op_name(function)}: cu_seqlens_q must start at 0"],
        **through(function, {"cu_seqlens_q": cu(1, 2, 6)}))
# The checks between packed q, k and v show the shapes passed, not a dense view of them.
for case, bad, needles in [
    ("keys-differ-shapes", {"v": z(5, 2, 3)}, ["k.shape=[7, 2, 8]", "v.shape=[5, 2, 3]"]),
    ("D-differs-shapes", {"k": z(7, 2, 7)}, ["q.shape=[6, 4, 8]", "k.shape=[7, 2, 7]"]),
    ("kv-heads-differ-shapes", {"v": z(7, 1, 3)}, ["k.shape=[7, 2, 8]", "v.shape=[7, 1, 3]"]),
    ("Hq-not-multiple-shapes", {"q": z(6, 3, 8)}, ["q.shape=[6, 3, 8]", "k.shape=[7, 2, 8]"]),
    ("D-zero-shapes", {"q": z(6, 4, 0), "k": z(7, 2, 0)}, ["q.shape=[6, 4, 0]"]),
]:
    row(case, "varlen_attention", V, needles, **bad)
# A packed backward's own arguments: out (6, 4, 3) in q's dtype, lse (4, 6) float32.
OUT_SHAPE = "must have shape (total_q, Hq, Dv)=[6, 4, 3]"
for case, bad, error, needles in [
    ("grad_out-shape", {"grad_out": z(6, 4, 8)}, V,
     ["grad_out " + OUT_SHAPE, "grad_out.shape=[6, 4, 8]"]),
    ("out-dense-layout", {"out": z(4, 6, 3)}, V, ["out " + OUT_SHAPE, "out.shape=[4, 6, 3]"]),
    ("lse-dense-layout", {"lse": z(6, 4)}, V,
     ["lse must have shape (Hq, total_q)=[4, 6]", "lse.shape=[6, 4]"]),
    ("lse-float64", {"lse": z(4, 6, dtype=torch.float64)}, T,
     ["lse must have dtype Float", "lse.dtype=Double"]),
    ("out-bfloat16", {"out": z(6, 4, 3, dtype=torch.bfloat16)}, T,
     ["grad_out and out must have q's dtype Float", "out.dtype=BFloat16"]),
    ("lse-meta", {"lse": z(4, 6, device="meta")}, V,
     ["grad_out, out and lse must be on q's device cpu"]),
    ("grad_out-None-named", {"grad_out": None}, T, ["grad_out must be a tensor"]),
]:
    row(case, "packed_attention_backward", error,
        ["causal_attention.attention_backward: ", *needles], **bad)


def test_the_table_is_large():
    assert len(ROWS) >= 40


@pytest.mark.parametrize("bad", ROWS.values(), ids=ROWS.keys())
def test_bad_input_raises_its_documented_type_naming_the_argument(bad):
    with pytest.raises(Exception) as info:
        call(bad.function, bad.bad, bad.requires_grad)
    assert type(info.value) is bad.error, f"{type(info.value).__name__}: {info.value}"
    message = str(info.value)
    assert message.startswith("causal_attention."), message
    missing = [needle for needle in bad.needles if needle not in message]
    assert not missing, f"{missing} not in {message!r}"


# --- what the table spoils is fine ---------------------------------------------------------------


@pytest.mark.parametrize("requires_grad", [False, True], ids=["", "grad"])
@pytest.mark.parametrize("function", FUNCTIONS.keys())
def test_the_valid_call_the_table_spoils_succeeds(function, requires_grad):
    call(function, {}, requires_grad)


@pytest.mark.parametrize("key_mask", [mask(2, 6), z(2, 6, dtype=torch.bool)], ids=["ones", "zeros"])
@pytest.mark.parametrize("function", MASK_OPS)
def test_the_valid_call_succeeds_with_a_key_mask(function, key_mask):
    call(function, {"key_mask": key_mask}, requires_grad=True)


def _every_option(function, dtype):
    """Valid values of every score option for ``function``'s valid call with q in ``dtype``."""
    sinks_dtype = torch.float32 if dtype == torch.float32 else dtype
    options = {
        "window": (3, 1),
        "softcap": 5.0,
        "alibi_slopes": z(2, 4) if function in MASK_OPS else z(4),
        "sinks": z(4, dtype=sinks_dtype),
        "dropout_p": 0.25,
    }
    if function in KERNEL_OPS:
        options["dropout_seed"] = torch.tensor([1, 2], dtype=torch.int64)
    else:
        options["generator"] = torch.Generator().manual_seed(0)
    return options


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("requires_grad", [False, True], ids=["", "grad"])
@pytest.mark.parametrize("function", OPTION_OPS)
def test_the_valid_call_succeeds_with_every_option(function, requires_grad, dtype):
    """Including float32 sinks with bfloat16 q, and (*batch, Hq) ALiBi slopes."""
    valid = FUNCTIONS[function][0]()
    tensors = {
        name: valid[name].to(dtype)
        for name in ("q", "k", "v", "grad_out", "out")
    }
    bad = through(function, {**tensors, **_every_option(function, dtype)})
    call(function, bad, requires_grad)
    if dtype != torch.float32:
        call(function, {**bad, "sinks": z(4)}, requires_grad)


@pytest.mark.parametrize(
    "q_shape", [pytest.param(s, id=f"{len(s)}d-q") for s in [(5, 8), (3, 5, 8), (2, 3, 1, 5, 8)]]
)
def test_a_key_mask_of_q_leading_dims_is_accepted(q_shape):
    q = z(*q_shape)
    k = z(*q_shape[:-3], 1, 6, 8) if len(q_shape) >= 3 else z(6, 8)
    causal_attention.attention(q, k, k, key_mask=z(*(q_shape[:-3] + (6,)), dtype=torch.bool))


@pytest.mark.parametrize("function,dtype,scale", ACCEPTED_SCALES)
def test_scales_finite_in_the_accumulation_dtype_are_accepted(function, dtype, scale):
    qkv = {name: z(1, 2, 3, 4, dtype=dtype) for name in ("q", "k", "v")}
    result = call(function, through(function, {"scale": scale, **qkv}))
    first = result[0] if isinstance(result, (tuple, list)) else result
    assert first.isfinite().all()  # zero inputs: every score is 0 * scale


def test_a_softcap_finite_in_float64_is_accepted_for_float64_inputs():
    q = z(1, 2, 3, 4, dtype=torch.float64)
    out = causal_attention.attention(q, q, q, softcap=1e39)
    assert out.isfinite().all()


# dropout_keep_mask reads the seed whatever dropout_p is, so it checks it always, and refuses a
# probability outside [0, 1) (p = -0.5 would keep about half through a float-to-uint32 cast).
KEEP_MASK_SEED = torch.tensor([1, 2], dtype=torch.int64)
BAD_KEEP_MASKS = {
    "seed-empty-p-0": (torch.empty(0, dtype=torch.int64), 0.0, V,
                       "dropout_seed must be a CPU tensor of shape (2,)"),
    "seed-int32": (KEEP_MASK_SEED.int(), 0.5, T, "dropout_seed must be int64"),
    "p-negative": (KEEP_MASK_SEED, -0.5, V, "dropout_p must be in [0, 1), got dropout_p=-0.5"),
    "p-nan": (KEEP_MASK_SEED, math.nan, V, "dropout_p must be in [0, 1), got dropout_p=nan"),
    "p-1": (KEEP_MASK_SEED, 1.0, V, "dropout_p must be in [0, 1), got dropout_p=1"),
}


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("case", BAD_KEEP_MASKS.values(), ids=BAD_KEEP_MASKS.keys())
def test_dropout_keep_mask_refuses_a_bad_seed_or_probability(case, device):
    seed, p, error, needle = case
    with pytest.raises(error, match=re.escape("causal_attention.dropout_keep_mask: " + needle)):
        OPS.dropout_keep_mask(seed.to(device), [1, 1, 4, 8], p)


# --- refused by torch before the op's checks -----------------------------------------------

# torch's argument parser refuses a non-tensor for a Tensor argument, or a non-number for the
# scale, with RuntimeError naming the argument; the op never runs.
NOT_TENSORS = {
    "q-list": (lambda t: OPS.attention([[1.0]], t, t), "argument 'q'"),
    "k-numpy": (lambda t: OPS.attention(t, t.numpy(), t), "argument 'k'"),
    "v-str": (lambda t: OPS.attention_forward(t, t, "v", 0.5), "argument 'v'"),
    "scale-str": (lambda t: OPS.attention(t, t, t, scale="0.5"), "argument 'scale'"),
    "scale-None-forward": (lambda t: OPS.attention_forward(t, t, t, None), "argument 'scale'"),
    "scale-positional": (lambda t: OPS.attention(t, t, t, 0.5), "positional argument"),
}


@pytest.mark.parametrize("case", NOT_TENSORS.values(), ids=NOT_TENSORS.keys())
def test_non_tensor_arguments_are_refused_by_torch_naming_the_argument(case):
    invoke, needle = case
    with pytest.raises(RuntimeError, match=needle):
        invoke(randn(5, 8))


# Tensors of another layout reach the op's checks through its Autograd kernel (the table above).
# Inference mode skips that kernel, and the ops have no kernel for these layouts: the dispatcher
# refuses them, with the same NotImplementedError type, naming the op and the backend.
FOREIGN = {
    "sparse-coo": lambda t: t.to_sparse(),
    "sparse-csr": sparse_csr,
    "mkldnn": lambda t: t.to_mkldnn(),
    "nested": nested,
}


@pytest.mark.parametrize("convert", FOREIGN.values(), ids=FOREIGN.keys())
def test_tensors_of_another_layout_are_refused_by_the_dispatcher_in_inference_mode(convert):
    q = randn(2, 5, 8)
    with torch.inference_mode(), pytest.raises(
        NotImplementedError, match="Could not run 'causal_attention::attention'"
    ):
        OPS.attention(convert(q), q, q)


# Our wrappers of the same ops raise TypeError for what the parser refuses, as they do for every
# other argument of the wrong type, keeping its message (the argument, the type seen).
CU = cu(0, 5)
WRAPPERS_NOT_TENSORS = {
    "attn_mask-list": (lambda t: causal_attention.attention(t, t, t, attn_mask=[[0.0] * 5] * 5),
                       "'Optional[Tensor]' for argument 'attn_mask' but instead found type 'list'"),
    "varlen-attn_mask": (lambda t: causal_attention.varlen_attention(
        t[:, None], t[:, None], t[:, None], CU, CU, 5, 5, attn_mask=t),
        "Unknown keyword argument 'attn_mask'"),
    "paged-cache_seqlens-list": (lambda t: causal_attention.paged_attention(
        t[None, :1, None], t[None, :, None], t[None, :, None], cu(0)[None], [5]),
        "'Tensor' for argument 'cache_seqlens' but instead found type 'list'"),
    "weights-generator-int": (lambda t: causal_attention.attention_weights(t, t, t, generator=3),
                              "argument 'generator'"),
    "forward-scale-missing": (lambda t: causal_attention.ops.attention_forward(t, t, t),
                              "missing value for argument 'scale'"),
}


@pytest.mark.parametrize("case", WRAPPERS_NOT_TENSORS.values(), ids=WRAPPERS_NOT_TENSORS.keys())
def test_our_wrappers_raise_type_error_for_what_the_schema_parser_refuses(case):
    invoke, needle = case
    with pytest.raises(TypeError, match=re.escape(needle)):
        invoke(randn(5, 8))
