"""bench/variant_args.py on the CPU: `--define NAME=JSON` registers an ad-hoc kernel-option variant (JSON lists as
the options' tuples) that `variant(NAME)` then applies, and refuses in one line what it cannot register."""

from __future__ import annotations

import pytest

from bench.variant_args import define_variants
from ft.kernels.options import DEFAULTS, VARIANTS, variant


@pytest.fixture
def clean_variants():
    before = dict(VARIANTS)
    yield
    VARIANTS.clear()
    VARIANTS.update(before)


def test_a_definition_is_a_variant_with_tuples(clean_variants):
    define_variants(['t64={"qsa.one_split_tile": [64, 4, 3]}',
                     'both={"qsa.one_pass": false, "qsa.one_split_tile": [16, 2, 2]}'])
    assert variant("t64").qsa.one_split_tile == (64, 4, 3) and variant("t64").qsa.one_pass == DEFAULTS.qsa.one_pass
    assert variant("both").qsa == type(DEFAULTS.qsa)(DEFAULTS.qsa.prefill_select_kernel, False, (16, 2, 2))


@pytest.mark.parametrize(("spec", "says"), [
    ('={"qsa.one_pass": false}', "is empty or a named variant already"),
    ('qsa-sparse-combine={"qsa.one_pass": true}', "is empty or a named variant already"),
    ('x={"qsa.nope": 1}', "no option 'qsa.nope'"),
    ("x=[1", "Expecting"),
])
def test_what_it_cannot_register_is_one_line(clean_variants, spec, says):
    before = dict(VARIANTS)
    with pytest.raises(SystemExit) as exc:
        define_variants([spec])
    assert says in str(exc.value) and "\n" not in str(exc.value)
    assert VARIANTS == before  # nothing half-registered
