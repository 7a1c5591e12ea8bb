"""The bad-input battery, from Python: a table of malformed calls of every public function
(attention, attention_forward, attention_backward, attention_weights, the SDPA drop-in,
varlen_attention, varlen_attention_forward, varlen_attention_backward; with and without inputs
that require grad, with and without a key mask). Each must raise exactly the documented
ValueError, TypeError or NotImplementedError with a message naming the offending argument.
test_errors.py checks the messages of the common mistakes in detail; this table is about
breadth: None in every position, exotic dtypes, devices, non-finite scales (in the accumulation
dtype), nested and sparse tensors, bad cumulative lengths. Calls that never reach the op's checks
(a non-tensor argument; a sparse tensor under inference mode, which skips the Autograd kernel)
are refused by torch itself; the last tests pin that down, as it is part of what a caller sees.
scripts/sanitize.sh runs this file under ASan and UBSan.
"""

import math
import warnings
from dataclasses import dataclass, field
from typing import Callable, List

import pytest
import torch

import causal_attention

OPS = torch.ops.causal_attention


def randn(*shape, dtype=torch.float32, device="cpu"):
    return torch.randn(shape).to(dtype=dtype, device=device)


# A valid call: q (2, 4, 5, 8), k (2, 2, 6, 8), v (2, 2, 6, 3); out (2, 4, 5, 3), lse (2, 4, 5).
def valid():
    return {
        "grad_out": randn(2, 4, 5, 3),
        "q": randn(2, 4, 5, 8),
        "k": randn(2, 2, 6, 8),
        "v": randn(2, 2, 6, 3),
        "out": randn(2, 4, 5, 3),
        "lse": randn(2, 4, 5),
        "key_mask": None,  # or (2, 6) bool
    }


def attention(scale=None, requires_grad=False, **replace):
    """causal_attention.attention on the valid call with some of q, k, v, key_mask replaced."""

    def call():
        args = {**valid(), **replace}
        if requires_grad:
            args["q"] = args["q"].detach().requires_grad_(True)
        return causal_attention.attention(
            args["q"], args["k"], args["v"], scale=scale, key_mask=args["key_mask"]
        )

    return call


def forward(scale=0.5, **replace):
    def call():
        args = {**valid(), **replace}
        return causal_attention.attention_forward(
            args["q"], args["k"], args["v"], scale, args["key_mask"]
        )

    return call


def backward(scale=0.5, **replace):
    def call():
        a = {**valid(), **replace}
        return causal_attention.attention_backward(
            a["grad_out"], a["q"], a["k"], a["v"], a["out"], a["lse"], scale, a["key_mask"]
        )

    return call


def weights(scale=None, **replace):
    def call():
        args = {**valid(), **replace}
        return causal_attention.attention_weights(
            args["q"], args["k"], args["v"], scale=scale, key_mask=args["key_mask"]
        )

    return call


def mask(*shape, dtype=torch.bool, device="cpu"):
    return torch.ones(shape, dtype=dtype, device=device)


def cu(*values, dtype=torch.int32):
    return torch.tensor(values, dtype=dtype)


def nested(t):
    """A nested tensor of t's batch items (dim 0), the last one a row shorter in dim -2 (the
    last dim for a 2-D t): ragged, so it has no sizes."""
    items = list(t.unbind(0))
    items[-1] = items[-1][..., :-1, :] if items[-1].dim() >= 2 else items[-1][:-1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "The PyTorch API of nested tensors is in prototype"
        return torch.nested.nested_tensor(items)


def jagged(t):
    """The same, as a jagged nested tensor (torch.jagged, the layout torch develops)."""
    items = list(t.unbind(0))
    items[-1] = items[-1][:-1]
    return torch.nested.nested_tensor(items, layout=torch.jagged)


def sparse_csr(t):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Sparse CSR tensor support is in beta state"
        return t.to_sparse_csr()


def in_dtype(dtype, builder, **kwargs):
    """builder(q=..., k=..., v=...) on the valid call's q, k and v in `dtype`."""
    a = valid()
    return builder(**{name: a[name].to(dtype) for name in ("q", "k", "v")}, **kwargs)


# A valid packed call: q (6, 4, 8), k (7, 2, 8), v (7, 2, 3); sequences of 2 + 4 query rows and
# 3 + 4 keys; out (6, 4, 3), lse (4, 6).
def valid_packed():
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
    }


def _packed_args(a):
    return (a["cu_seqlens_q"], a["cu_seqlens_k"], a["max_seqlen_q"], a["max_seqlen_k"])


def varlen(scale=None, requires_grad=False, **replace):
    def call():
        a = {**valid_packed(), **replace}
        if requires_grad:
            a["q"] = a["q"].detach().requires_grad_(True)
        return causal_attention.varlen_attention(
            a["q"], a["k"], a["v"], *_packed_args(a), scale=scale
        )

    return call


def varlen_forward(scale=0.5, **replace):
    def call():
        a = {**valid_packed(), **replace}
        return causal_attention.varlen_attention_forward(
            a["q"], a["k"], a["v"], *_packed_args(a), scale
        )

    return call


def varlen_backward(scale=0.5, **replace):
    def call():
        a = {**valid_packed(), **replace}
        return causal_attention.varlen_attention_backward(
            a["grad_out"], a["q"], a["k"], a["v"], a["out"], a["lse"], *_packed_args(a), scale
        )

    return call


def sdpa(**replace):
    def call():
        args = {**valid(), "k": randn(2, 2, 5, 8), "v": randn(2, 2, 5, 3), **replace}
        return causal_attention.scaled_dot_product_attention(
            args["q"], args["k"], args["v"], is_causal=True, enable_gqa=True
        )

    return call


@dataclass
class Bad:
    call: Callable[[], object]
    error: type
    needles: List[str] = field(default_factory=list)  # argument names among them


V, T, N = ValueError, TypeError, NotImplementedError
NESTED = "must be a dense tensor, got a nested tensor"

BATTERY = {
    # None for a tensor: TypeError naming the argument.
    "attention-q-None": Bad(attention(q=None), T, ["q must be a tensor, got None"]),
    "attention-k-None": Bad(attention(k=None), T, ["k must be a tensor, got None"]),
    "attention-v-None": Bad(attention(v=None), T, ["v must be a tensor, got None"]),
    "attention-grad-v-None": Bad(attention(requires_grad=True, v=None), T, ["v must be a tensor"]),
    "forward-q-None": Bad(forward(q=None), T, ["attention_forward: q must be a tensor"]),
    "forward-k-None": Bad(forward(k=None), T, ["attention_forward: k must be a tensor"]),
    "backward-grad_out-None": Bad(backward(grad_out=None), T, ["grad_out must be a tensor"]),
    "backward-q-None": Bad(backward(q=None), T, ["attention_backward: q must be a tensor"]),
    "backward-k-None": Bad(backward(k=None), T, ["attention_backward: k must be a tensor"]),
    "backward-v-None": Bad(backward(v=None), T, ["attention_backward: v must be a tensor"]),
    "backward-out-None": Bad(backward(out=None), T, ["out must be a tensor"]),
    "backward-lse-None": Bad(backward(lse=None), T, ["lse must be a tensor"]),
    "weights-q-None": Bad(weights(q=None), T, ["q must be a tensor"]),
    # Dtypes: TypeError naming the argument and the dtype.
    "q-int8": Bad(attention(q=randn(2, 4, 5, 8, dtype=torch.int8)), T, ["q.dtype=Char"]),
    "k-bool": Bad(attention(k=randn(2, 2, 6, 8, dtype=torch.bool)), T, ["k.dtype=Bool"]),
    "v-uint8": Bad(forward(v=randn(2, 2, 6, 3, dtype=torch.uint8)), T, ["v.dtype=Byte"]),
    "q-complex128": Bad(
        attention(q=randn(2, 4, 5, 8, dtype=torch.complex128)), T, ["q.dtype=ComplexDouble"]
    ),
    "k-float8_e4m3fnuz": Bad(
        attention(k=randn(2, 2, 6, 8, dtype=torch.float8_e4m3fnuz)),
        T,
        ["k.dtype=Float8_e4m3fnuz"],
    ),
    "grad-q-float64-k-float32": Bad(
        attention(requires_grad=True, q=randn(2, 4, 5, 8, dtype=torch.float64)),
        T,
        ["same dtype", "q.dtype=Double", "k.dtype=Float"],
    ),
    "bf16-q-k-fp16-v": Bad(
        attention(
            q=randn(2, 4, 5, 8, dtype=torch.bfloat16),
            k=randn(2, 2, 6, 8, dtype=torch.bfloat16),
            v=randn(2, 2, 6, 3, dtype=torch.float16),
        ),
        T,
        ["same dtype", "v.dtype=Half"],
    ),
    "backward-grad_out-float16": Bad(
        backward(grad_out=randn(2, 4, 5, 3, dtype=torch.float16)), T, ["grad_out.dtype=Half"]
    ),
    "backward-out-float64": Bad(
        backward(out=randn(2, 4, 5, 3, dtype=torch.float64)), T, ["out.dtype=Double"]
    ),
    "backward-lse-bool": Bad(
        backward(lse=randn(2, 4, 5, dtype=torch.bool)), T, ["lse must have dtype", "lse.dtype=Bool"]
    ),
    "weights-v-int64": Bad(weights(v=randn(2, 2, 6, 3, dtype=torch.int64)), T, ["v.dtype=Long"]),
    # Shapes: ValueError naming the argument and showing the shapes.
    "q-rank1": Bad(attention(q=randn(8)), V, ["q must have at least 2", "q.shape=[8]"]),
    "k-rank0": Bad(forward(k=randn()), V, ["k must have at least 2", "k.shape=[]"]),
    "v-rank3-vs-4": Bad(attention(v=randn(2, 6, 3)), V, ["number of dimensions", "v.shape"]),
    "6d-inner-batch": Bad(
        attention(
            q=randn(2, 1, 3, 4, 5, 8), k=randn(2, 1, 2, 2, 6, 8), v=randn(2, 1, 3, 2, 6, 3)
        ),
        V,
        ["leading (batch)", "k.shape=[2, 1, 2, 2, 6, 8]"],
    ),
    "D-differs": Bad(forward(k=randn(2, 2, 6, 7)), V, ["head dimension D", "k.shape"]),
    "D-zero": Bad(
        attention(q=randn(2, 4, 5, 0), k=randn(2, 2, 6, 0), scale=0.5),
        V,
        ["must be positive", "q.shape=[2, 4, 5, 0]"],
    ),
    "Lk-differs": Bad(attention(requires_grad=True, v=randn(2, 2, 9, 3)), V, ["Lk", "v.shape"]),
    "Hq-5-Hkv-2": Bad(attention(q=randn(2, 5, 5, 8)), V, ["multiple", "q.shape=[2, 5, 5, 8]"]),
    "Hkv-0": Bad(
        forward(k=randn(2, 0, 6, 8), v=randn(2, 0, 6, 3)), V, ["multiple", "k.shape=[2, 0, 6, 8]"]
    ),
    "kv-heads-differ": Bad(attention(k=randn(2, 1, 6, 8)), V, ["same number of heads", "k.shape"]),
    "backward-grad_out-shape": Bad(
        backward(grad_out=randn(2, 4, 5, 8)), V, ["grad_out.shape=[2, 4, 5, 8]"]
    ),
    "backward-out-transposed": Bad(
        backward(out=randn(2, 5, 4, 3)), V, ["out must have shape", "out.shape=[2, 5, 4, 3]"]
    ),
    "backward-lse-Lq": Bad(backward(lse=randn(2, 4, 6)), V, ["lse.shape=[2, 4, 6]"]),
    "backward-lse-flat": Bad(backward(lse=randn(40)), V, ["lse.shape=[40]"]),
    "weights-Lk-differs": Bad(weights(v=randn(2, 2, 7, 3)), V, ["Lk", "v.shape"]),
    "sdpa-D-differs": Bad(sdpa(k=randn(2, 2, 5, 9)), V, ["head dimension D", "k.shape"]),
    "sdpa-q-None": Bad(sdpa(q=None), T, ["query must be a Tensor, got NoneType"]),
    # Scales: ValueError.
    "attention-scale-nan": Bad(attention(scale=math.nan), V, ["scale must be finite"]),
    "attention-scale-1e309": Bad(attention(scale=1e309), V, ["scale must be finite", "inf"]),
    "attention-grad-scale--inf": Bad(
        attention(requires_grad=True, scale=-math.inf), V, ["scale must be finite", "-inf"]
    ),
    "forward-scale-inf": Bad(forward(scale=math.inf), V, ["scale must be finite"]),
    "backward-scale-nan": Bad(backward(scale=math.nan), V, ["scale must be finite"]),
    # Finite doubles that are inf in float32, where the kernels compute for all but float64.
    "attention-scale-1e39": Bad(
        attention(scale=1e39),
        V,
        ["scale must be finite in float32, the accumulation dtype of q.dtype=Float", "1e+39"],
    ),
    "attention-grad-scale--1e39": Bad(
        attention(requires_grad=True, scale=-1e39), V, ["finite in float32", "scale=-1e+39"]
    ),
    "attention-bfloat16-scale-1e39": Bad(
        in_dtype(torch.bfloat16, attention, scale=1e39), V, ["q.dtype=BFloat16"]
    ),
    "forward-float16-scale-4e38": Bad(
        in_dtype(torch.float16, forward, scale=4e38), V, ["finite in float32", "q.dtype=Half"]
    ),
    "backward-scale-1e39": Bad(
        backward(scale=1e39), V, ["attention_backward: scale must be finite in float32"]
    ),
    "weights-scale-1e39": Bad(
        weights(scale=1e39), V, ["attention_weights: scale must be finite in float32"]
    ),
    "forward-float64-scale-1e309": Bad(
        in_dtype(torch.float64, forward, scale=1e309), V, ["finite in float64", "q.dtype=Double"]
    ),
    # Devices: ValueError naming the devices.
    "v-meta": Bad(
        attention(v=randn(2, 2, 6, 3, device="meta")), V, ["same device", "v.device=meta"]
    ),
    "q-meta": Bad(
        forward(q=randn(2, 4, 5, 8, device="meta")), V, ["q.device=meta", "k.device=cpu"]
    ),
    "backward-grad_out-meta": Bad(
        backward(grad_out=randn(2, 4, 5, 3, device="meta")), V, ["must be on q's device cpu"]
    ),
    "backward-lse-meta": Bad(
        backward(lse=randn(2, 4, 5, device="meta")), V, ["must be on q's device cpu"]
    ),
    # Key masks: bool, (*batch, Lk), on q's device.
    "attention-key_mask-int64": Bad(
        attention(key_mask=mask(2, 6, dtype=torch.int64)), T, ["key_mask.dtype=Long"]
    ),
    "attention-grad-key_mask-float": Bad(
        attention(requires_grad=True, key_mask=mask(2, 6, dtype=torch.float32)),
        T,
        ["key_mask must be a bool tensor", "key_mask.dtype=Float"],
    ),
    "forward-key_mask-Lk": Bad(forward(key_mask=mask(2, 5)), V, ["key_mask.shape=[2, 5]"]),
    "backward-key_mask-heads": Bad(
        backward(key_mask=mask(2, 4, 6)), V, ["attention_backward: key_mask must have shape"]
    ),
    "weights-key_mask-meta": Bad(
        weights(key_mask=mask(2, 6, device="meta")), V, ["key_mask.device=meta"]
    ),
    "attention-key_mask-0d": Bad(attention(key_mask=mask()), V, ["key_mask.shape=[]"]),
    # Nested and sparse tensors: NotImplementedError naming the argument, as torch's dispatcher
    # raises for a layout without a kernel.
    "attention-q-nested": Bad(attention(q=nested(randn(2, 4, 5, 8))), N, ["q " + NESTED]),
    "attention-grad-k-nested": Bad(
        attention(requires_grad=True, k=nested(randn(2, 2, 6, 8))), N, ["k " + NESTED]
    ),
    "attention-v-jagged": Bad(attention(v=jagged(randn(2, 2, 6, 3))), N, ["v " + NESTED]),
    "attention-key_mask-nested": Bad(
        attention(key_mask=nested(mask(2, 6))), N, ["key_mask " + NESTED]
    ),
    "forward-q-jagged": Bad(forward(q=jagged(randn(2, 4, 5, 8))), N, ["forward: q " + NESTED]),
    "backward-grad_out-nested": Bad(
        backward(grad_out=nested(randn(2, 4, 5, 3))), N, ["grad_out " + NESTED]
    ),
    "backward-lse-nested": Bad(backward(lse=nested(randn(2, 4, 5))), N, ["lse " + NESTED]),
    "weights-q-nested": Bad(weights(q=nested(randn(2, 4, 5, 8))), N, ["weights: q " + NESTED]),
    "attention-q-sparse": Bad(
        attention(q=randn(2, 4, 5, 8).to_sparse()),
        N,
        ["q must be a dense (strided) tensor, got q.layout=Sparse"],
    ),
    "attention-grad-v-sparse_csr": Bad(
        attention(requires_grad=True, v=sparse_csr(randn(2, 2, 6, 3))),
        N,
        ["v.layout=SparseCsr"],
    ),
    "attention-k-mkldnn": Bad(attention(k=randn(2, 2, 6, 8).to_mkldnn()), N, ["k.layout=Mkldnn"]),
    "attention-key_mask-sparse": Bad(
        attention(key_mask=mask(2, 6).to_sparse()), N, ["key_mask.layout=Sparse"]
    ),
    "forward-v-sparse": Bad(forward(v=randn(2, 2, 6, 3).to_sparse()), N, ["v.layout=Sparse"]),
    "backward-out-sparse": Bad(backward(out=randn(2, 4, 5, 3).to_sparse()), N, ["out.layout"]),
    # Packed sequences: None in every position, dtypes, ranks, devices, lengths, scales.
    "varlen-q-None": Bad(varlen(q=None), T, ["varlen_attention: q must be a tensor"]),
    "varlen-k-None": Bad(varlen(k=None), T, ["k must be a tensor"]),
    "varlen-v-None": Bad(varlen(requires_grad=True, v=None), T, ["v must be a tensor"]),
    "varlen-cu_seqlens_q-None": Bad(varlen(cu_seqlens_q=None), T, ["cu_seqlens_q must be"]),
    "varlen-cu_seqlens_k-None": Bad(varlen(cu_seqlens_k=None), T, ["cu_seqlens_k must be"]),
    "varlen_forward-cu_seqlens_k-None": Bad(
        varlen_forward(cu_seqlens_k=None), T, ["varlen_attention_forward: cu_seqlens_k must be"]
    ),
    "varlen_backward-grad_out-None": Bad(varlen_backward(grad_out=None), T, ["grad_out must be"]),
    "varlen_backward-out-None": Bad(varlen_backward(out=None), T, ["out must be a tensor"]),
    "varlen_backward-lse-None": Bad(varlen_backward(lse=None), T, ["lse must be a tensor"]),
    "varlen_backward-cu_seqlens_q-None": Bad(
        varlen_backward(cu_seqlens_q=None), T, ["cu_seqlens_q must be a tensor"]
    ),
    "varlen-cu-int64": Bad(
        varlen(cu_seqlens_q=cu(0, 2, 6, dtype=torch.int64)), T, ["cu_seqlens_q.dtype=Long"]
    ),
    "varlen-grad-cu-uint8": Bad(
        varlen(requires_grad=True, cu_seqlens_k=cu(0, 3, 7, dtype=torch.uint8)),
        T,
        ["cu_seqlens_k must be int32", "cu_seqlens_k.dtype=Byte"],
    ),
    "varlen_backward-cu-int16": Bad(
        varlen_backward(cu_seqlens_k=cu(0, 3, 7, dtype=torch.int16)),
        T,
        ["cu_seqlens_k.dtype=Short"],
    ),
    "varlen-q-int8": Bad(varlen(q=randn(6, 4, 8, dtype=torch.int8)), T, ["q.dtype=Char"]),
    "varlen-grad-q-float64": Bad(
        varlen(requires_grad=True, q=randn(6, 4, 8, dtype=torch.float64)), T, ["same dtype"]
    ),
    "varlen-q-rank2": Bad(varlen(q=randn(6, 8)), V, ["q must have 3 dim", "q.shape=[6, 8]"]),
    "varlen-k-rank0": Bad(varlen_forward(k=randn()), V, ["k must have 3 dim", "k.shape=[]"]),
    "varlen_backward-v-rank5": Bad(
        varlen_backward(v=randn(1, 1, 7, 2, 3)), V, ["v must have 3", "v.shape=[1, 1, 7, 2, 3]"]
    ),
    "varlen-cu-rank2": Bad(varlen(cu_seqlens_k=cu([0, 3, 7])), V, ["cu_seqlens_k.shape=[1, 3]"]),
    "varlen-cu-lengths-differ": Bad(varlen(cu_seqlens_k=cu(0, 7)), V, ["same length N + 1"]),
    "varlen-cu-start": Bad(varlen(cu_seqlens_q=cu(2, 2, 6)), V, ["cu_seqlens_q[0]=2"]),
    "varlen-grad-cu-decreasing": Bad(
        varlen(requires_grad=True, cu_seqlens_k=cu(0, 5, 3), max_seqlen_k=7),
        V,
        ["cu_seqlens_k must be non-decreasing", "cu_seqlens_k[1]=5 > cu_seqlens_k[2]=3"],
    ),
    "varlen_forward-cu-last": Bad(
        varlen_forward(cu_seqlens_q=cu(0, 3, 7)), V, ["last entry of cu_seqlens_q", "rows 6"]
    ),
    "varlen_backward-max-too-small": Bad(
        varlen_backward(max_seqlen_k=1), V, ["more than max_seqlen_k=1"]
    ),
    "varlen-max-negative": Bad(varlen(max_seqlen_q=-4), V, ["max_seqlen_q=-4"]),
    "varlen-scale-nan": Bad(varlen(scale=math.nan), V, ["scale must be finite"]),
    "varlen-grad-scale-1e39": Bad(
        varlen(requires_grad=True, scale=1e39), V, ["finite in float32", "q.dtype=Float"]
    ),
    "varlen_forward-scale--1e39": Bad(varlen_forward(scale=-1e39), V, ["finite in float32"]),
    "varlen_backward-scale-1e39": Bad(varlen_backward(scale=1e39), V, ["finite in float32"]),
    "varlen-q-nested": Bad(varlen(q=nested(randn(6, 4, 8))), N, ["varlen_attention: q " + NESTED]),
    "varlen-grad-k-jagged": Bad(
        varlen(requires_grad=True, k=jagged(randn(7, 2, 8))), N, ["k " + NESTED]
    ),
    "varlen-cu_seqlens_q-sparse": Bad(
        varlen(cu_seqlens_q=cu(0, 2, 6).to_sparse()), N, ["cu_seqlens_q.layout=Sparse"]
    ),
    "varlen_backward-lse-nested": Bad(
        varlen_backward(lse=nested(randn(4, 6))), N, ["lse " + NESTED]
    ),
    "varlen_forward-scale-inf": Bad(varlen_forward(scale=math.inf), V, ["scale must be finite"]),
    "varlen_backward-scale--inf": Bad(varlen_backward(scale=-math.inf), V, ["scale must be"]),
    "varlen-k-meta": Bad(varlen(k=randn(7, 2, 8, device="meta")), V, ["k.device=meta"]),
    "varlen-cu-meta": Bad(
        varlen(cu_seqlens_k=cu(0, 3, 7).to("meta")), V, ["cu_seqlens_k.device=meta"]
    ),
    "varlen_backward-lse-dense": Bad(varlen_backward(lse=randn(6, 4)), V, ["lse.shape=[6, 4]"]),
    "varlen_backward-lse-float16": Bad(
        varlen_backward(lse=randn(4, 6, dtype=torch.float16)), T, ["lse.dtype=Half"]
    ),
    "varlen_backward-grad_out-Dv": Bad(
        varlen_backward(grad_out=randn(6, 4, 8)), V, ["grad_out.shape=[6, 4, 8]"]
    ),
    "varlen_backward-out-meta": Bad(
        varlen_backward(out=randn(6, 4, 3, device="meta")), V, ["must be on q's device cpu"]
    ),
}


def test_battery_has_at_least_40_cases():
    assert len(BATTERY) >= 40


@pytest.mark.parametrize("case", BATTERY.values(), ids=BATTERY.keys())
def test_bad_call_raises_its_documented_type_naming_the_argument(case):
    with pytest.raises(Exception) as info:
        case.call()
    assert type(info.value) is case.error, f"{type(info.value).__name__}: {info.value}"
    message = str(info.value)
    assert message.startswith("causal_attention."), message
    missing = [needle for needle in case.needles if needle not in message]
    assert not missing, f"{missing} not in {message!r}"


@pytest.mark.parametrize(
    "function",
    [attention, forward, backward, weights, sdpa, varlen, varlen_forward, varlen_backward],
)
def test_the_valid_call_the_battery_spoils_succeeds(function):
    function()()


@pytest.mark.parametrize("function", [attention, forward, backward, weights])
def test_the_valid_call_succeeds_with_a_key_mask(function):
    function(key_mask=mask(2, 6))()


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
    call, needle = case
    with pytest.raises(RuntimeError, match=needle):
        call(randn(5, 8))


# Tensors of another layout reach the op's checks through its Autograd kernel (the battery
# above). Inference mode skips that kernel, and the ops have no kernel for these layouts: the
# dispatcher refuses them, with the same NotImplementedError type, naming the op and the backend.
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
