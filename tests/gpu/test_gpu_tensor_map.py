"""The driver's own reading of the tensor-map rules that `TensorMapSpec.check` transcribes: every
map `check` accepts, the driver encodes; every map `check` refuses (the cases of
tests/support/tensor_map_cases.py), the driver refuses too. Marked `gpu` and `twins`:
cuTensorMapEncodeTiled needs the CUDA driver."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fagen.kernels.tensor_map import MAP_BYTES, Swizzle, TensorMapError, driver_encode
from tensor_map_cases import Q_MAP, REFUSED

pytestmark = [pytest.mark.gpu, pytest.mark.twins,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def address():
    torch.cuda.init()
    buffer = torch.empty(2, 1000, 8, 128, dtype=torch.bfloat16, device="cuda")
    yield buffer.data_ptr()


ACCEPTED = [Q_MAP, dataclasses.replace(Q_MAP, swizzle=Swizzle.NONE, box_dims=(128, 64, 1, 1)),
            dataclasses.replace(Q_MAP, swizzle=Swizzle.B64, box_dims=(32, 64, 1, 1)),
            dataclasses.replace(Q_MAP, swizzle=Swizzle.B32, box_dims=(16, 256, 1, 1), element_strides=(1, 2, 1, 1))]


@pytest.mark.parametrize("spec", ACCEPTED)
def test_the_driver_encodes_what_check_accepts(spec, address):
    spec.check(address)
    result, data = driver_encode(spec, address)
    assert data is not None and len(data) == MAP_BYTES, result


def _driver_can_take(change: dict) -> bool:
    """Cases whose arrays have one entry per dim (up to 5): the driver reads `rank` entries of each,
    so a shorter array would be read past its end; and no swizzle outside the enum (the bindings
    refuse it before the driver sees it)."""
    spec = dataclasses.replace(Q_MAP, **change)
    lengths = (len(spec.global_strides) + 1, len(spec.box_dims), len(spec.steps))
    return spec.rank <= 5 and all(n == spec.rank for n in lengths) and change.get("swizzle") != 7


@pytest.mark.parametrize("change, field", [case for case in REFUSED if _driver_can_take(case[0])])
def test_the_driver_refuses_what_check_refuses(change, field, address):
    spec = dataclasses.replace(Q_MAP, **change)
    with pytest.raises(TensorMapError, match=field):
        spec.check(address)
    result, data = driver_encode(spec, address)
    assert data is None, f"the driver accepted a map check refuses ({field}): {spec}"
