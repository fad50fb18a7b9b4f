"""The table of built-in variants (fagen.variants.builtins): each row's names are the ones the
rest of fagen uses, so that a row is all a built-in needs outside its device functions."""

import dataclasses

import pytest
import torch

from fagen.errors import InputError
from fagen.identities import VARIANT_IDENTITIES
from fagen.kernels.params import forward_params
from fagen.reference.problem import Problem
from fagen.spec import BUILTIN_MODS, Spec
from fagen.variants.builtins import BUILTINS, IN_PARAM_ORDER, CallShape, derived_values, window_pair


def test_one_row_per_spec_flag_in_name_order():
    assert tuple(row.flag for row in BUILTINS) == BUILTIN_MODS
    assert sorted(row.param_slot for row in BUILTINS) == list(range(len(BUILTINS)))


@pytest.mark.parametrize("row", BUILTINS, ids=lambda row: row.flag)
def test_a_row_names_what_exists(row):
    assert row.reference in {f.name for f in dataclasses.fields(Problem)}
    names = [identity.name for identity in VARIANT_IDENTITIES]
    for prefix in row.identities:
        assert any(name.startswith(prefix + ":") for name in names), prefix
    # and `fagen verify` proves some of them for a spec with the built-in alone
    alone = Spec(64, **{row.flag: True})
    assert not row.identities or any(identity.relied_on_by(alone) for identity in VARIANT_IDENTITIES
                                     if identity.name.startswith(row.identities[0] + ":"))


@pytest.mark.parametrize("row", BUILTINS, ids=lambda row: row.flag)
def test_a_rows_params_are_its_kernels(row):
    """The forward of a spec with the built-in alone takes the row's parameters, in order."""
    names = [p.name for p in forward_params(Spec(64, **{row.flag: True}))]
    start = names.index(row.params[0][0])
    assert names[start:start + len(row.params)] == [name for name, _, _ in row.params]


def test_params_keep_their_order_with_every_builtin():
    names = [p.name for p in forward_params(Spec(64, **{row.flag: True for row in BUILTINS}))]
    ours = [name for row in IN_PARAM_ORDER for name, _, _ in row.params]
    assert [n for n in names if n in ours] == ours
    assert ours[0] == "sinks" and ours[-1] == "alibi_stride_b"


def test_checks_and_derived_values():
    q = torch.zeros(2, 5, 3, 8)
    shape = CallShape(q, False, 2, 5, 3, 7)
    window, softcap, alibi, sinks = BUILTINS
    assert window.check((-1, -1), shape) is None
    assert window.check((2, -1), shape) == {"window_left": 2, "window_right": 12}
    assert window.check((2, 4), shape._replace(causal=True)) == {"window_left": 2, "window_right": 0}
    assert softcap.check(0.0, shape) is None
    slopes = torch.ones(2, 3)
    values = {**softcap.check(30.0, shape), **alibi.check(slopes, shape)}
    derived = derived_values(values, 0.5)
    assert derived["softcap_scale"] == 0.5 / 30.0 and derived["alibi_stride_b"] == 3
    assert derived_values(alibi.check(torch.ones(3), shape), 0.5) == {"alibi_stride_b": 0}
    with pytest.raises(InputError, match="sinks must have shape"):
        sinks.check(torch.ones(4), shape)


@pytest.mark.parametrize("bad", [(1,), (1.0, 2), (-2, 0), (True, 1), "ab"])
def test_window_pair_refuses_by_name(bad):
    with pytest.raises(InputError, match="window_size must be a pair"):
        window_pair(bad)
