"""tests/support/schedule.py: the order the files run in (the heaviest first, a file's tests together
and in their order, files that share a resource next to each other), on stand-in items."""

from __future__ import annotations

from types import SimpleNamespace

from tests.support.schedule import estimate_s, file_of, heaviest_first


def _item(nodeid: str, *lanes: str, fixtures: tuple[str, ...] = ()):
    """What the ordering reads of a pytest item: its node id, its lane markers, its fixture names."""
    return SimpleNamespace(nodeid=nodeid, fixturenames=list(fixtures),
                           get_closest_marker=lambda name: name if name in lanes else None)


def _files(items) -> list[str]:
    out: list[str] = []
    for i in items:
        path = file_of(i)
        if not out or out[-1] != path:
            out.append(path)
    return out


def test_a_file_that_loads_a_model_goes_before_many_quick_tests_and_a_cluster_file():
    plain = [_item(f"a.py::t{n}") for n in range(300)]
    processes = [_item(f"b.py::t{n}", "process") for n in range(5)]
    model = [_item("c.py::t0", "model")]
    got = heaviest_first(plain + processes + model)
    assert _files(got) == ["c.py", "b.py", "a.py"]
    assert estimate_s(model) > estimate_s(processes) > estimate_s(plain)


def test_a_files_tests_stay_together_in_their_order():
    items = [_item("a.py::t2"), _item("b.py::t0", "model"), _item("a.py::t0", "process"), _item("a.py::t1"),
             _item("b.py::t1")]
    got = heaviest_first(items)
    assert [i.nodeid for i in got] == ["b.py::t0", "b.py::t1", "a.py::t2", "a.py::t0", "a.py::t1"]
    assert sorted(got, key=id) == sorted(items, key=id)  # nothing lost, nothing twice


def test_ties_keep_the_order_collected():
    items = [_item(f"{name}.py::t", "process") for name in "qwerty"]
    assert [i.nodeid for i in heaviest_first(items)] == [i.nodeid for i in items]


def test_files_that_share_a_cluster_run_next_to_each_other():
    shared = ("shared_cluster",)
    items = [_item("s1.py::t", "process", fixtures=shared), _item("m.py::t", "model"),
             _item("p.py::t", "process"), _item("s2.py::t", "process", fixtures=shared)]
    files = _files(heaviest_first(items))
    assert abs(files.index("s1.py") - files.index("s2.py")) == 1
    assert files.index("s1.py") < files.index("p.py")  # the two weigh as one file of both
