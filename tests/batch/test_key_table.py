"""The batch job's digest key table against Python's dict: same answers for setdefault, get, `in` and len
over keys of every kind (across its growth and probing), and a bounded size per key. No jax.
"""

import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from jaxinfer.batch.keys import KeyTable


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.text(max_size=12), st.integers(0, 2**31 - 1)), max_size=300), st.lists(st.text(max_size=12), max_size=50))
def test_key_table_answers_as_a_dict_does(pairs, probes):
    table, reference = KeyTable(), {}
    for key, value in pairs:
        assert table.setdefault(key, value) == reference.setdefault(key, value)
    assert len(table) == len(reference)
    for key in [k for k, _ in pairs] + probes:
        assert (key in table) == (key in reference)
        assert table.get(key, -7) == reference.get(key, -7)


def test_many_keys_grow_the_table_and_each_keeps_its_value():
    keys = [f'id:"r{i}"' for i in range(50_000)] + ["", "\ud800", "custom_id:\"é\"", "sha256:" + "0" * 32]
    table = KeyTable()
    for i, key in enumerate(keys):
        table.setdefault(key, i)
    assert len(table) == len(keys)
    assert all(table.get(key) == i for i, key in enumerate(keys))
    assert table.setdefault(keys[10], 99) == 10 and len(table) == len(keys)
    assert f'id:"r{len(keys)}"' not in table and 'id:"R1"' not in table


def test_a_key_costs_at_most_80_bytes_however_long_it_is():
    """20 bytes a slot, at least a quarter full (it doubles at half); a dict of the same keys costs more."""
    keys = [f'custom_id:"request-{i:08d}-{"x" * 40}"' for i in range(100_000)]
    table = KeyTable(keys)
    arrays = (table._low, table._high, table._values)
    table_bytes = sum(a.buffer_info()[1] * a.itemsize for a in arrays)
    assert table_bytes / len(keys) <= 80
    dict_bytes = sys.getsizeof(dict.fromkeys(keys)) + sum(sys.getsizeof(k) for k in keys)
    assert dict_bytes > 2 * table_bytes


def test_negative_values_are_refused():
    try:
        KeyTable().setdefault("a", -1)
    except ValueError as e:
        assert "-1" in str(e)
    else:
        raise AssertionError("a negative value was stored")
