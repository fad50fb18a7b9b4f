"""Bad arguments, at every entry point: each error names the caller's own argument and is
catchable both as Python expects (ValueError for a bad value, TypeError for a wrong kind) and as
flash-attn raises (RuntimeError, its C++ checks), so code written for either keeps working.
Flags and windows take NumPy values as flash-attn's own tests pass them.
"""

import numpy as np
import pytest
import torch

import fagen
from fagen.errors import InputError, InputTypeError


def _qkv(b=1, n=8, h=2, d=64, dtype=torch.float16):
    return [torch.randn(b, n, h, d).to(dtype) for _ in range(3)]


def _varlen(dtype=torch.float16):
    q, k, v = (torch.randn(8, 2, 64).to(dtype) for _ in range(3))
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    return q, k, v, cu, cu, 5, 5


def _cache():
    q = torch.randn(2, 1, 4, 64).half()
    return q, torch.randn(2, 32, 2, 64).half(), torch.randn(2, 32, 2, 64).half()


def _parts():
    out = torch.randn(1, 4, 2, 64)
    return [out, out.clone()], [torch.randn(1, 2, 4), torch.randn(1, 2, 4)]


# (entry point, a call with a bad value, the argument its message names)
BAD_VALUES = [
    ("flash_attn_func", lambda: fagen.flash_attn_func(*_qkv()[:2], _qkv(n=9)[2]), "v"),
    ("flash_attn_varlen_func", lambda: fagen.flash_attn_varlen_func(*_varlen()[:3], torch.tensor([0, 3, 9],
                                                                    dtype=torch.int32), *_varlen()[4:]),
     "cu_seqlens_q"),
    ("flash_attn_with_kvcache", lambda: fagen.flash_attn_with_kvcache(*_cache(), cache_seqlens=40), "cache_seqlens"),
    ("merge_attention", lambda: fagen.merge_attention(_parts()[0], _parts()[1][:1]), "lses"),
    ("sdpa", lambda: fagen.sdpa(*(t.transpose(1, 2) for t in _qkv()), scale=-1.0), "scale"),
]
BAD_KINDS = [
    ("flash_attn_func", lambda: fagen.flash_attn_func(*_qkv(dtype=torch.float32)), "q"),
    ("flash_attn_varlen_func", lambda: fagen.flash_attn_varlen_func(*_varlen(torch.float32)), "q"),
    ("flash_attn_with_kvcache", lambda: fagen.flash_attn_with_kvcache(*_cache(), cache_seqlens=4, causal="yes"),
     "causal"),
    ("merge_attention", lambda: fagen.merge_attention([_parts()[0][0], "part"], _parts()[1]), "outs"),
    ("sdpa", lambda: fagen.sdpa(*(t.transpose(1, 2).float() for t in _qkv())), "query"),
]


@pytest.mark.parametrize("entry, call, argument", BAD_VALUES, ids=[c[0] for c in BAD_VALUES])
def test_bad_values_are_value_errors_and_runtime_errors(entry, call, argument):
    with pytest.raises(RuntimeError, match=argument) as caught:
        call()
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, InputError)


@pytest.mark.parametrize("entry, call, argument", BAD_KINDS, ids=[c[0] for c in BAD_KINDS])
def test_bad_kinds_are_type_errors_and_runtime_errors(entry, call, argument):
    with pytest.raises(RuntimeError, match=argument) as caught:
        call()
    assert isinstance(caught.value, TypeError) and isinstance(caught.value, InputTypeError)


def test_sparse_tensors_are_named_as_sparse_in_packed_and_decoding_calls():
    q, k, v, *rest = _varlen()
    with pytest.raises(TypeError, match="k must be a dense .* layout torch.sparse_coo"):
        fagen.flash_attn_varlen_func(q, k.to_sparse(), v, *rest)
    q, k_cache, v_cache = _cache()
    with pytest.raises(TypeError, match="v_cache must be a dense .* layout torch.sparse_coo"):
        fagen.flash_attn_with_kvcache(q, k_cache, v_cache.to_sparse(), cache_seqlens=4)


def test_numpy_flags_in_a_decoding_step_act_as_python_bools():
    q, k_cache, v_cache = _cache()
    plain = fagen.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=20, causal=True,
                                          return_softmax_lse=True)
    numpy = fagen.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=20, causal=np.bool_(True),
                                          return_softmax_lse=np.bool_(True))
    assert isinstance(numpy, tuple) and all(torch.equal(a, b) for a, b in zip(plain, numpy))


def test_a_numpy_window_in_flash_attn_func_is_the_same_window():
    q, k, v = _qkv(n=40)
    as_tuple = fagen.flash_attn_func(q, k, v, window_size=(5, 3))
    for window in (np.array([5, 3]), (np.int64(5), np.int32(3)), torch.tensor([5, 3])):
        assert torch.equal(fagen.flash_attn_func(q, k, v, window_size=window), as_tuple), repr(window)
