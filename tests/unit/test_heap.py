import gc

from jpaged.engine import heap


def test_settled_keeps_what_exists_out_of_full_collections_then_gives_it_back():
    made = [[]]  # a container: one the collector tracks
    assert any(o is made for o in gc.get_objects())
    with heap.settled():
        assert gc.get_freeze_count() > 0
        assert not any(o is made for o in gc.get_objects())  # no generation walks it
        later = [[]]
        assert any(o is later for o in gc.get_objects())  # what comes after is collected
    assert gc.get_freeze_count() == 0
    assert any(o is made for o in gc.get_objects())


def test_importing_collects_nothing_then_freezes_what_it_made():
    frozen = gc.get_freeze_count()
    try:
        with heap.importing():
            assert not gc.isenabled()
            made = [[]]
        assert gc.isenabled()
        assert gc.get_freeze_count() > frozen
        assert not any(o is made for o in gc.get_objects())
    finally:
        gc.unfreeze()
