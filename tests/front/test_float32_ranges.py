"""A number the device cannot hold is refused where it is set, naming the field: every check of a user's number
uses float32's range (the sampler computes in float32), and JSON keys that are digits only to Unicode are not
token ids. Host only: no jax."""

import pytest

from jaxinfer.scheduling.request import SamplingParams
from jaxinfer.validation import FLOAT32_MAX, FLOAT32_TINY, FieldError, check_logit_bias, check_number


@pytest.mark.parametrize("field, value", [
    ("repetition_penalty", 1e-300),  # float32 0: a division by zero on the device (it gave " of of of of", status ok)
    ("repetition_penalty", 1e39),  # float32 inf
    ("temperature", 1e-300),
    ("top_p", 1e-300),  # float32 0, outside (0, 1]
])
def test_a_sampling_value_outside_float32_is_refused_naming_its_field(field, value):
    with pytest.raises(FieldError, match=f"^{field} .*float32") as error:
        SamplingParams(**{field: value})
    assert error.value.field == field


def test_float32_s_range_is_the_boundary_of_every_number_check():
    """Hand-computed limits: float32's largest finite value and smallest normal one pass, just past them fail."""
    assert check_number("x", FLOAT32_MAX, low=0.0, high=float("inf")) == FLOAT32_MAX
    assert check_number("x", FLOAT32_TINY, low=0.0, high=1.0) == FLOAT32_TINY
    assert check_number("x", 0.0, low=0.0, high=1.0) == 0.0 and check_number("x", -2.0, low=-2.0, high=2.0) == -2.0
    for bad in (FLOAT32_MAX * 1.01, FLOAT32_TINY / 2, -FLOAT32_TINY / 2):
        with pytest.raises(FieldError, match="float32"):
            check_number("x", bad, low=-float("inf"), high=float("inf"))
    assert SamplingParams(repetition_penalty=1e-30).repetition_penalty == 1e-30  # small but normal: kept


@pytest.mark.parametrize("key", ["\u00b2", "\u0663", "\uff11"])  # superscript two, Arabic-Indic three, fullwidth one
def test_logit_bias_keys_that_are_digits_only_to_unicode_are_not_token_ids(key):
    with pytest.raises(FieldError, match="logit_bias must be an integer"):
        check_logit_bias({key: 5.0})
    assert check_logit_bias({"3": 5.0, " 12 ": -1}) == ((3, 5.0), (12, -1.0))
