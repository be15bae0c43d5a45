"""The --mesh parser on its own: no process group, property tests with hypothesis."""

import pytest
from hypothesis import given, strategies as st

from common.errors import UserError
from parallel.mesh import DIM_ORDER, MeshSpec, format_mesh, parse_mesh

sizes = st.integers(min_value=1, max_value=64)


@st.composite
def specs(draw):
    values = {name: draw(sizes) for name in DIM_ORDER}
    if draw(st.booleans()):
        values[draw(st.sampled_from(DIM_ORDER))] = -1
    return MeshSpec(ep=draw(st.integers(min_value=1, max_value=8)), **values)


@given(specs(), st.randoms())
def test_round_trip_in_any_order_and_spacing(spec, rnd):
    items = [f"{n}={s}" for n, s in zip(DIM_ORDER, spec.sizes)] + [f"ep={spec.ep}"]
    rnd.shuffle(items)
    text = " , ".join(items) if rnd.random() < 0.5 else ",".join(items)
    assert parse_mesh(text) == spec
    assert parse_mesh(format_mesh(spec)) == spec


@given(specs(), st.integers(min_value=1, max_value=64))
def test_minus_one_takes_the_rest(spec, rest):
    known = 1
    for s in spec.sizes:
        known *= 1 if s == -1 else s
    resolved = spec.resolve(known * rest if -1 in spec.sizes else known)
    assert -1 not in resolved.sizes
    assert resolved.world_size == (known * rest if -1 in spec.sizes else known)


@pytest.mark.parametrize("text,fragment", [
    ("", "empty"),
    ("dp", "cannot read"),
    ("dp=", "cannot read"),
    ("dp=4;tp=2", "cannot read"),
    ("dp=four", "cannot read"),
    ("dp=2.5", "cannot read"),
    ("ez=2", "unknown dimension 'ez'. Known dimensions are pp, hsdp, dp, cp, tp (outermost first), and ep"),
    ("dp=4,ep=-1", "ep borrows its ranks from dp, so it cannot take the rest"),
    ("dp=2,dp=2", "given twice"),
    ("dp=0", "not a valid size"),
    ("tp=-2", "not a valid size"),
    ("dp=-1,tp=-1", "more than one dimension is -1"),
    ("dp=4,,tp=2", "cannot read"),
])
def test_malformed_text_is_rejected_with_the_reason(text, fragment):
    with pytest.raises(UserError, match=None) as err:
        parse_mesh(text)
    assert fragment in str(err.value)


@given(st.text(alphabet="hsdpte=,-0123456789 ;.x", max_size=20))
def test_every_string_is_either_parsed_or_rejected_cleanly(text):
    try:
        spec = parse_mesh(text)
    except UserError:
        return
    assert parse_mesh(format_mesh(spec)) == spec


def test_world_size_mismatch_shows_both_numbers():
    with pytest.raises(UserError) as err:
        parse_mesh("dp=4,tp=2").resolve(6)
    assert "needs 8 ranks" in str(err.value) and "world size is 6" in str(err.value)


def test_minus_one_that_does_not_divide():
    with pytest.raises(UserError) as err:
        parse_mesh("dp=-1,tp=3").resolve(8)
    assert "does not divide 8" in str(err.value)
