"""`posttrain.runtime`: process settings of the long-lived processes."""

import gc
import weakref

from posttrain.runtime import freeze_setup_objects


class _Node:
    pass


def test_freeze_hides_setup_objects_but_later_cycles_are_collected():
    setup_cycle = _Node()
    setup_cycle.self = setup_cycle
    try:
        freeze_setup_objects()
        frozen = gc.get_freeze_count()
        assert frozen > 1000  # the modules, classes and functions imported so far
        assert not any(o is setup_cycle for o in gc.get_objects())  # out of the collector's sight
        later = _Node()
        later.self = later
        ref = weakref.ref(later)
        del later
        gc.collect()
        assert ref() is None  # a cycle made after setup is still collected
    finally:
        gc.unfreeze()
