"""Models on demand, the decisions (slotserve/on_demand.py, issue 34 item 1): load what is asked for,
wait, unload the least recently used idle model, never a busy one, refuse what cannot fit, unload
what stays idle -- each on made-up broker statuses, no process."""

from __future__ import annotations

import pytest

from protocol.enums import ModelState
from protocol.messages import DemandState, ModelStatus, Status
from slotserve.on_demand import Load, OnDemand, Refuse, Unload, estimate_bytes

MIB = 2**20
GIB = 2**30


def status(**models) -> Status:
    """A broker status: ``name=(queued, running, workers[, loading])`` per model."""
    out = {}
    for name, v in models.items():
        queued, running, workers, *loading = v
        out[name] = ModelStatus(queued, running, workers, min(running, workers), workers, *loading)
    return Status("b", 1.0, out, (), 1, {})


def core(max_loaded=1, idle=300.0, **needs) -> OnDemand:
    return OnDemand({n: v for n, v in (needs or {"a": GIB, "b": GIB}).items()}, max_loaded, idle)


def test_a_request_for_an_unloaded_model_loads_it():
    c = core()
    assert c.decide(status(a=(0, 0, 0), b=(0, 0, 0)), 0.0, 8 * GIB) == []
    assert c.decide(status(a=(2, 0, 0), b=(0, 0, 0)), 1.0, 8 * GIB) == [Load("a")]
    assert c.state("a") == "loading"
    # started, not registered yet: not loaded again
    assert c.decide(status(a=(2, 0, 0), b=(0, 0, 0)), 2.0, 8 * GIB, starting=frozenset({"a"})) == []
    assert c.decide(status(a=(0, 2, 1), b=(0, 0, 0)), 3.0, 7 * GIB) == [] and c.state("a") == "loaded"


def test_at_the_limit_the_least_recently_used_idle_model_makes_room_then_the_wanted_one_loads():
    c = core(max_loaded=2, a=GIB, b=GIB, c=GIB)
    c.decide(status(a=(0, 1, 1), b=(0, 1, 1), c=(0, 0, 0)), 0.0, 8 * GIB)  # both busy at t=0
    c.decide(status(a=(0, 1, 1), b=(0, 0, 1), c=(0, 0, 0)), 5.0, 8 * GIB)  # b idle since 0, a used at 5
    c.decide(status(a=(0, 0, 1), b=(0, 0, 1), c=(0, 0, 0)), 6.0, 8 * GIB)
    acts = c.decide(status(a=(0, 0, 1), b=(0, 0, 1), c=(3, 0, 0)), 7.0, 8 * GIB)
    assert acts == [Unload("b", "room for 'c' (max_loaded 2, least recently used)")]
    # b is stopping: c still waits (its memory and place are b's until b is gone)
    assert c.decide(status(a=(0, 0, 1), b=(0, 0, 1), c=(3, 0, 0)), 7.5, 8 * GIB, stopping=frozenset({"b"})) == []
    assert c.decide(status(a=(0, 0, 1), b=(0, 0, 0), c=(3, 0, 0)), 8.0, 8 * GIB) == [Load("c")]


def test_a_busy_model_is_never_unloaded_the_wanted_one_waits():
    c = core(max_loaded=1)
    c.decide(status(a=(0, 1, 1), b=(0, 0, 0)), 0.0, 8 * GIB)
    for t in range(1, 400, 7):  # a keeps working; b's requests wait in the broker's queue (no turns by default)
        assert c.decide(status(a=(1, 1, 1), b=(2, 0, 0)), float(t), 8 * GIB) == []
    assert c.decide(status(a=(0, 0, 1), b=(2, 0, 0)), 401.0, 8 * GIB) == [
        Unload("a", "room for 'b' (max_loaded 1, least recently used)")]


def test_with_turns_steady_traffic_for_a_busy_model_cannot_starve_another_past_turn_s():
    c = OnDemand({"a": GIB, "b": GIB}, 1, 300.0, turn_s=30.0)
    c.decide(status(a=(1, 0, 0), b=(0, 0, 0)), 0.0, 8 * GIB)
    c.decide(status(a=(0, 2, 1), b=(0, 0, 0)), 1.0, 8 * GIB)  # a loaded at 1
    for t in range(2, 32):  # a never idle; b waits from 2
        assert c.decide(status(a=(1, 2, 1), b=(1, 0, 0)), float(t), 8 * GIB) == []
    assert c.decide(status(a=(1, 2, 1), b=(1, 0, 0)), 32.0, 8 * GIB) == [
        Unload("a", "requests for 'b' waited 30 s (turn_s) for it")]
    # a's requests go back to the queue and wait behind b's: b loads first, then a waits its turn
    assert c.decide(status(a=(3, 0, 1), b=(1, 0, 0)), 32.5, 8 * GIB, stopping=frozenset({"a"})) == []
    assert c.decide(status(a=(3, 0, 0), b=(1, 0, 0)), 33.0, 8 * GIB) == [Load("b")]
    c.decide(status(a=(3, 0, 0), b=(0, 1, 1)), 34.0, 8 * GIB)  # b loaded at 34
    for t in range(35, 64):  # b busy, a waiting since 32.5: b has not had its turn yet
        assert c.decide(status(a=(3, 0, 0), b=(1, 1, 1)), float(t), 8 * GIB) == []
    assert c.decide(status(a=(3, 0, 0), b=(1, 1, 1)), 64.0, 8 * GIB) == [
        Unload("b", "requests for 'a' waited 30 s (turn_s) for it")]


def test_a_model_whose_load_fails_is_not_reloaded_in_a_loop():
    c = core(max_loaded=1)
    assert c.decide(status(a=(1, 0, 0), b=(0, 0, 0)), 0.0, 8 * GIB) == [Load("a")]
    c.failed("a", 2.0)  # its worker exited before registering: 1 s before the next try
    assert c.decide(status(a=(1, 0, 0), b=(0, 0, 0)), 2.5, 8 * GIB) == []
    assert c.decide(status(a=(1, 0, 0), b=(0, 0, 0)), 3.0, 8 * GIB) == [Load("a")]
    c.failed("a", 4.0)  # again: 2 s
    assert c.decide(status(a=(1, 0, 0), b=(0, 0, 0)), 5.9, 8 * GIB) == []
    assert c.decide(status(a=(1, 0, 0), b=(0, 0, 0)), 6.0, 8 * GIB) == [Load("a")]
    for _ in range(10):
        c.failed("a", 7.0)
    assert c.decide(status(a=(1, 0, 0), b=(0, 0, 0)), 7.0 + 59.0, 8 * GIB) == []  # at most a minute
    assert c.decide(status(a=(1, 0, 0), b=(0, 0, 0)), 7.0 + 60.0, 8 * GIB) == [Load("a")]
    c.decide(status(a=(0, 1, 1), b=(0, 0, 0)), 70.0, 8 * GIB)  # it registered: the count starts over
    c.failed("a", 80.0)
    assert c.decide(status(a=(1, 0, 0), b=(0, 0, 0)), 81.0, 8 * GIB) == [Load("a")]
    # a load order for a model that fails is dropped with the failure: no request, no reload
    c2 = core(max_loaded=1)
    c2.want("b", 0.0)
    assert c2.decide(status(a=(0, 0, 0), b=(0, 0, 0)), 0.0, 8 * GIB) == [Load("b")]
    c2.failed("b", 1.0)
    assert c2.decide(status(a=(0, 0, 0), b=(0, 0, 0)), 100.0, 8 * GIB) == []


def test_alternating_demand_with_room_for_one_takes_turns_oldest_demand_first():
    c = core(max_loaded=1, a=GIB, b=GIB, c=GIB)
    c.decide(status(a=(0, 0, 0), b=(1, 0, 0), c=(0, 0, 0)), 0.0, 8 * GIB)  # b first: loads
    acts = c.decide(status(a=(1, 0, 0), b=(0, 0, 1), c=(1, 0, 0)), 1.0, 8 * GIB)
    assert acts == [Unload("b", "room for 'a' (max_loaded 1, least recently used)")]
    assert c.decide(status(a=(1, 0, 0), b=(0, 0, 0), c=(1, 0, 0)), 2.0, 8 * GIB) == [Load("a")]  # a waited longer


def test_memory_not_the_count_can_make_room_and_what_never_fits_is_refused_once():
    c = core(max_loaded=3, a=3 * GIB, b=3 * GIB, big=9 * GIB)
    c.decide(status(a=(0, 1, 1), b=(0, 1, 1), big=(0, 0, 0)), 0.0, 2 * GIB)
    acts = c.decide(status(a=(0, 0, 1), b=(0, 1, 1), big=(1, 0, 0)), 1.0, 2 * GIB)
    assert [type(a) for a in acts] == [Refuse] and "9,216 MiB" in acts[0].why  # 2 free + 3 (a idle) < 9
    assert c.decide(status(a=(0, 0, 1), b=(0, 1, 1), big=(1, 0, 0)), 2.0, 2 * GIB) == []  # said once
    c2 = core(max_loaded=3, a=3 * GIB, b=3 * GIB, c=4 * GIB)
    c2.decide(status(a=(0, 1, 1), b=(0, 1, 1), c=(0, 0, 0)), 0.0, 2 * GIB)
    acts = c2.decide(status(a=(0, 0, 1), b=(0, 1, 1), c=(1, 0, 0)), 1.0, 2 * GIB)
    assert acts == [Unload("a", "room for 'c' (max_loaded 3, least recently used)")]  # 2 + 3 >= 4



def test_a_refused_model_says_loading_from_the_pass_that_makes_room_for_it():
    """Two load orders raced with memory for one (1.5 GiB, 1 GiB each): ``b`` is refused while ``a``
    loads (``a`` is not idle yet), then ``a``, loaded and idle, is unloaded to make room for ``b``. From
    that pass ``b``'s load is under way: ``loading``, as every model waiting for room is. Before, its
    refusal stayed until it loaded: ``unloaded``, ``failed``, "it needs about 1,024 MiB and the machine
    has 512 MiB available, 0 MiB more with every idle model unloaded", while ``a`` was unloaded for it."""
    c = core(max_loaded=3, a=GIB, b=GIB)
    c.want("a", 0.0)
    c.want("b", 0.0)
    acts = c.decide(status(a=(0, 0, 0), b=(0, 0, 0)), 0.0, 3 * GIB // 2)
    assert [type(x) for x in acts] == [Load, Refuse]
    assert c.published()["b"].failed
    assert c.decide(status(a=(0, 0, 1), b=(0, 0, 0)), 1.0, GIB // 2) == [
        Unload("a", "room for 'b' (max_loaded 3, least recently used)")]
    assert c.published()["b"] == DemandState(ModelState.LOADING)
    assert c.decide(status(a=(0, 0, 1), b=(0, 0, 0)), 1.2, GIB // 2, stopping=frozenset({"a"})) == []
    assert c.published()["b"] == DemandState(ModelState.LOADING)
    assert c.decide(status(a=(0, 0, 0), b=(0, 0, 0)), 1.4, 3 * GIB // 2) == [Load("b")]

def test_a_model_idle_for_idle_unload_s_is_unloaded_and_zero_keeps_it():
    for idle, expect in ((60.0, [Unload("a", "idle for 60 s (idle_unload_s 60)")]), (0.0, [])):
        c = core(max_loaded=2, idle=idle)
        c.decide(status(a=(0, 1, 1), b=(0, 0, 0)), 0.0, 8 * GIB)
        assert c.decide(status(a=(0, 0, 1), b=(0, 0, 0)), 59.0, 8 * GIB) == []
        assert c.decide(status(a=(0, 0, 1), b=(0, 0, 0)), 60.0, 8 * GIB) == expect


def test_want_loads_without_a_request_and_counts_as_use():
    c = core(max_loaded=1, idle=10.0)
    c.want("b", 0.0)
    assert c.decide(status(a=(0, 0, 0), b=(0, 0, 0)), 0.0, 8 * GIB) == [Load("b")]
    assert c.decide(status(a=(0, 0, 0), b=(0, 0, 1)), 1.0, 8 * GIB) == []  # loaded: the order is done
    with pytest.raises(KeyError):
        c.want("nope", 1.0)


def test_a_model_loaded_by_an_order_is_then_as_any_loaded_model_not_pinned():
    """POST /models/load loads a model; once loaded it is idle as any other (llama.cpp's router): the
    idle timer runs from its load, and another model's request makes room from it at once, rather
    than waiting on a model nobody uses (and seeing it loaded again each time that one goes idle)."""
    c = core(max_loaded=1, idle=10.0)
    c.want("b", 0.0)
    assert c.decide(status(a=(0, 0, 0), b=(0, 0, 0)), 0.0, 8 * GIB) == [Load("b")]
    c.decide(status(a=(0, 0, 0), b=(0, 0, 1)), 5.0, 8 * GIB)  # registered at 5
    assert c.decide(status(a=(1, 0, 0), b=(0, 0, 1)), 6.0, 8 * GIB) == [
        Unload("b", "room for 'a' (max_loaded 1, least recently used)")]
    assert c.decide(status(a=(0, 1, 1), b=(0, 0, 0)), 8.0, 8 * GIB) == []  # a served; b stays unloaded
    c2 = core(max_loaded=1, idle=10.0)
    c2.want("b", 0.0)
    c2.decide(status(a=(0, 0, 0), b=(0, 0, 0)), 0.0, 8 * GIB)
    c2.decide(status(a=(0, 0, 0), b=(0, 0, 1)), 5.0, 8 * GIB)
    assert c2.decide(status(a=(0, 0, 0), b=(0, 0, 1)), 14.9, 8 * GIB) == []
    assert [type(x) for x in c2.decide(status(a=(0, 0, 0), b=(0, 0, 1)), 15.0, 8 * GIB)] == [Unload]
    c2.decide(status(a=(0, 0, 0), b=(0, 0, 0)), 16.0, 8 * GIB)
    c2.decide(status(a=(0, 0, 1), b=(0, 0, 0)), 17.0, 8 * GIB)  # a loaded by a request
    c2.want("a", 18.0)  # an order for a model loaded already: a use, not a pin
    assert [type(x) for x in c2.decide(status(a=(0, 0, 1), b=(0, 0, 0)), 28.0, 8 * GIB)] == [Unload]


@pytest.mark.parametrize("kwargs, says", [(dict(models={}), "at least one"), (dict(models={"a": -1}), ">= 0"),
                                          (dict(models={"a": 1}, max_loaded=0), "max_loaded"),
                                          (dict(models={"a": 1}, idle_unload_s=-1.0), "idle_unload_s"),
                                          (dict(models={"a": 1}, turn_s=0.0), "turn_s")])
def test_bad_settings_are_value_errors(kwargs, says):
    with pytest.raises(ValueError, match=says):
        OnDemand(**kwargs)


def test_the_estimate_counts_the_files_and_the_overhead(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"x" * 4 * MIB)
    assert estimate_bytes(str(tmp_path / "m.gguf"), overhead_bytes=0) == 5 * MIB
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "a.safetensors").write_bytes(b"x" * 8 * MIB)
    (tmp_path / "dir" / "config.json").write_bytes(b"{}")
    assert estimate_bytes(str(tmp_path / "dir"), overhead_bytes=MIB) == int((8 * MIB + 2) * 1.25) + MIB
    assert estimate_bytes("simulated", overhead_bytes=7) == 7


# ---------------------------------------------------------------------- `slotserve up` with several models


def test_models_dir_lists_gguf_files_and_model_folders(tmp_path):
    import click

    from slotserve.cli import _models_in

    (tmp_path / "b.gguf").write_bytes(b"GGUF")
    (tmp_path / "a-folder").mkdir()
    (tmp_path / "a-folder" / "config.json").write_text("{}")
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "empty").mkdir()
    assert _models_in(str(tmp_path)) == (str(tmp_path / "a-folder"), str(tmp_path / "b.gguf"))
    with pytest.raises(click.UsageError, match="no .gguf file"):
        _models_in(str(tmp_path / "empty"))


@pytest.mark.parametrize("extra, says", [(["--served-model-name", "x"], "apply to one model"),
                                         (["--workers", "2"], "apply to one model"),
                                         (["--tokenizer", "t"], "--tokenizer applies to one model"),
                                         (["--reasoning-parser", "qwen3"], "give --http-port too")])
def test_up_with_several_models_refuses_what_applies_to_one(tmp_path, extra, says):
    from click.testing import CliRunner

    from slotserve.cli import main

    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    result = CliRunner().invoke(main, ["up", "--model", "simulated", "--model", str(tmp_path / "m.gguf"), *extra])
    assert result.exit_code == 2 and says in result.output, result.output


@pytest.mark.parametrize("args, env, says", [
    (["--max-loaded-models", "2"], {}, "--max-loaded-models applies to several models"),
    (["--idle-unload-s", "5"], {}, "--idle-unload-s applies to several models"),
    (["--max-loaded-models", "1", "--idle-unload-s", "0"], {}, "--max-loaded-models and --idle-unload-s apply"),
    ([], {"SLOTSERVE_UP_MAX_LOADED_MODELS": "2"}, "--max-loaded-models applies to several models"),
])
def test_up_with_one_model_refuses_what_applies_to_several(args, env, says):
    """--max-loaded-models and --idle-unload-s with one model were ignored in silence (its workers
    started and ran as long as the cluster); a usage error now, as the options of one model with
    several are (the test above)."""
    from click.testing import CliRunner

    from slotserve.cli import main

    result = CliRunner().invoke(main, ["up", "--model", "simulated", *args], env=env)
    assert result.exit_code == 2 and says in result.output and "--models-dir" in result.output, result.output


def test_up_with_one_model_named_twice_says_so_when_refusing_what_applies_to_several(monkeypatch, tmp_path):
    """``--model m.gguf --model ./m.gguf`` is one model (docs/cluster.md: one path named twice), so
    --idle-unload-s is refused as with one; the refusal said "give --model more than once", which the
    command line did: it now says the values name one model."""
    from click.testing import CliRunner

    from slotserve.cli import main

    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["up", "--model", "m.gguf", "--model", "./m.gguf", "--idle-unload-s", "5"])
    assert result.exit_code == 2, result.output
    said = " ".join(result.output.split())
    assert "the --model values given name one model (m.gguf), whose workers run" in said, result.output
    assert "--models-dir" in said and "give --model more than once" not in said, result.output


def test_release_unloads_once_idle_never_while_busy():
    c = core(max_loaded=2, idle=0.0)
    c.decide(status(a=(0, 1, 1), b=(0, 0, 0)), 0.0, 8 * GIB)
    c.release("a")
    assert c.decide(status(a=(1, 1, 1), b=(0, 0, 0)), 1.0, 8 * GIB) == []  # busy: it stays
    assert c.decide(status(a=(0, 0, 1), b=(0, 0, 0)), 2.0, 8 * GIB) == [Unload("a", "asked to (POST /models/unload)")]
    assert c.decide(status(a=(0, 0, 0), b=(0, 0, 0)), 3.0, 8 * GIB) == []  # gone; not unloaded twice
    c.release("b")  # not loaded: nothing to do, and a later request loads it as usual
    assert c.decide(status(a=(0, 0, 0), b=(0, 0, 0)), 4.0, 8 * GIB) == []
    assert c.decide(status(a=(0, 0, 0), b=(1, 0, 0)), 5.0, 8 * GIB) == [Load("b")]
    assert c.decide(status(a=(0, 0, 0), b=(0, 0, 1)), 6.0, 8 * GIB) == []  # loaded and idle: kept (idle 0)



def test_an_unload_of_a_model_waiting_for_room_is_kept_until_it_is_loaded_and_idle():
    """POST /models/unload of a model whose requests wait for room (``loading``: another model is busy) was
    dropped at the next pass, as one of a model with nothing under way, where the same order given once its
    worker had started was kept: it loaded for its requests and then stayed loaded (``--idle-unload-s 0``:
    for good), while every surface had said ``unloading`` at the order and the order had answered
    ``{"success": true}`` (a break-it pass: tiny-a waiting for tiny-b, its unload given, then tiny-a
    loaded for good). Now the order is kept: ``unloading`` while it loads and serves its requests, and
    unloaded once idle."""
    c = core(max_loaded=1, idle=0.0)
    c.decide(status(a=(0, 1, 1), b=(0, 0, 0)), 0.0, 8 * GIB)  # a busy
    assert c.decide(status(a=(0, 1, 1), b=(2, 0, 0)), 1.0, 8 * GIB) == []  # b waits for room
    assert c.published()["b"] == DemandState(ModelState.LOADING)
    c.release("b")
    assert c.decide(status(a=(0, 1, 1), b=(2, 0, 0)), 2.0, 8 * GIB) == []
    assert c.published()["b"] == DemandState(ModelState.UNLOADING)  # (as the broker said at the order)
    assert c.decide(status(a=(0, 0, 1), b=(2, 0, 0)), 3.0, 8 * GIB) == [
        Unload("a", "room for 'b' (max_loaded 1, least recently used)")]
    assert c.decide(status(a=(0, 0, 0), b=(2, 0, 0)), 4.0, 8 * GIB) == [Load("b")]
    assert c.decide(status(a=(0, 0, 0), b=(0, 2, 1)), 5.0, 8 * GIB) == []  # serving its requests: it stays
    assert c.published()["b"] == DemandState(ModelState.UNLOADING)
    assert c.decide(status(a=(0, 0, 0), b=(0, 0, 1)), 6.0, 8 * GIB) == [Unload("b", "asked to (POST /models/unload)")]


def test_the_last_order_wins_a_load_after_an_unload_keeps_the_model():
    c = core(max_loaded=2, idle=0.0)
    c.decide(status(a=(0, 1, 1), b=(0, 0, 0)), 0.0, 8 * GIB)
    c.release("a")  # busy: it would go once idle...
    c.want("a", 0.5)  # ...but the next order asks to keep it loaded
    assert c.decide(status(a=(1, 1, 1), b=(0, 0, 0)), 1.0, 8 * GIB) == []
    assert c.decide(status(a=(0, 0, 1), b=(0, 0, 0)), 2.0, 8 * GIB) == []  # idle: kept (idle 0)
    assert c.state("a") == "loaded"

# ---------------------------------------------------------------------- POST /models/load and /models/unload


def control_app(orders, on_demand=("model-a", "model-b")):
    """``/models/load`` and ``/models/unload`` whose orders to the broker go to ``orders(op, model)``,
    with the models on demand ``on_demand``; the broker's status (for the names that are none of
    theirs) lists model-a, model-b and ``always``, a model served always."""
    from starlette.applications import Starlette
    from starlette.routing import Route

    from gateway.model_control import ModelControl
    from tests.support.gateway import GivenStatusLink, model_status

    class OrderingLink(GivenStatusLink):
        async def order(self, action, model):
            orders(action, model)
            return self.status

    link = OrderingLink(on_demand)
    link.show({"model-a": model_status(), "model-b": model_status(1), "always": model_status(1)})
    control = ModelControl(link, 1024)
    return Starlette(routes=[Route("/models/load", control.load, methods=["POST"]),
                             Route("/models/unload", control.unload, methods=["POST"])]), link


def test_the_endpoints_hand_their_order_to_the_broker_and_refuse_what_is_not_theirs():
    from starlette.testclient import TestClient

    got = []
    app, link = control_app(lambda op, model: got.append((op, model)))
    with TestClient(app) as http:
        assert http.post("/models/load", json={"model": "model-b"}).json() == {"success": True}
        assert http.post("/models/unload", json={"model": "model-a"}).json() == {"success": True}
        for op in ("load", "unload"):  # a name no model has: the /v1 routes' very 404 (their builder's)
            r = http.post(f"/models/{op}", json={"model": "Model-A"})
            assert r.status_code == 404 and r.json()["error"] == link.model_not_found("Model-A", link.status).body()[
                "error"], r.text
            assert "(models: always, model-a (unloaded), model-b)" in r.json()["error"]["message"]
            assert r.json()["error"]["message"].endswith("did you mean `model-a`?")
            r = http.post(f"/models/{op}", json={"model": "always"})  # served, but not on demand
            assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
            assert r.json()["error"]["message"] == (f"model `always` is not loaded on demand: its workers run as long "
                                                    f"as the cluster does; /models/{op} applies to the models on "
                                                    "demand (model-a, model-b)")
        for body in ({}, {"model": 3}, {"model": ""}):
            r = http.post("/models/load", json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == "model"
        r = http.post("/models/load", json=["model-a"])
        assert r.status_code == 400 and r.json()["error"]["message"] == \
            'the body must be a JSON object ({"model": ...}), got an array'
        for op in ("load", "unload"):  # an unknown field: refused by name, as every route's body (was taken silently)
            r = http.post(f"/models/{op}", json={"model": "model-b", "force": True})
            assert r.status_code == 400 and r.json()["error"] == {
                "message": "Unrecognized request argument supplied: force", "type": "invalid_request_error",
                "param": "force", "code": "unknown_parameter"}, r.text
        r = http.post("/models/load", content=b"{", headers={"content-type": "application/json"})
        assert r.status_code == 400
    assert got == [("load", "model-b"), ("unload", "model-a")]
    with TestClient(control_app(got.append, on_demand=())[0]) as http:
        r = http.post("/models/load", json={"model": "model-a"})
        assert r.status_code == 400 and "slotserve up" in r.json()["error"]["message"]


class _FakeProcess:
    """A worker process as DemandSupervisor sees it; ``frozen``: SIGTERM does not end it (SIGSTOPped)."""

    def __init__(self, frozen: bool = False) -> None:
        self.alive, self.frozen, self.signals, self.exitcode = True, frozen, [], None

    def is_alive(self) -> bool:
        return self.alive

    def terminate(self) -> None:
        self.signals.append("TERM")
        self.alive = self.frozen

    def kill(self) -> None:
        self.signals.append("KILL")
        self.alive = False

    def join(self, timeout=None) -> None:
        pass


def test_a_worker_that_does_not_stop_when_told_is_killed_and_a_frozen_one_is_not_a_failed_load(monkeypatch):
    """The supervisor's side (slotserve/demand_supervisor.py), on a fake broker: an unloaded model's
    worker that outlives STOP_KILL_S after its SIGTERM (frozen: it never exits) is killed, so that its
    memory and place come back; a running worker killed as frozen (kill_frozen) is forgotten and its
    model loads again at once when its requests want it, with no back-off."""
    import types

    from slotserve import demand_supervisor
    from slotserve.demand_supervisor import STOP_KILL_S, DemandSupervisor
    from worker import host_memory
    from worker.config import WorkerConfig

    monkeypatch.setattr(demand_supervisor, "estimate_bytes", lambda model: GIB)
    monkeypatch.setattr(host_memory, "total_bytes", lambda: 64 * GIB)
    monkeypatch.setattr(host_memory, "available_bytes", lambda: 32 * GIB)
    lines = {"a": (1, 0, 0), "b": (0, 0, 0)}
    broker = types.SimpleNamespace(status=lambda timeout_s: status(**lines), close=lambda: None)
    spawned = []
    spawn = lambda model, config: spawned.append((model, _FakeProcess(frozen=True))) or spawned[-1][1]  # noqa: E731
    configs = tuple(WorkerConfig(model="simulated", served_model_names=(n,)) for n in ("a", "b"))
    sup = DemandSupervisor(configs, 1, 300.0, spawn=spawn, connect=lambda: broker)
    assert sup.run_pass(0.0) == [Load("a")]
    lines.update(a=(0, 1, 1))  # registered, busy
    sup.run_pass(1.0)
    # frozen, found by the launcher and killed: forgotten, and a queued request loads it again at once
    first = sup.running["a"]
    sup.kill_frozen("a")
    assert first.signals == ["KILL"] and "a" not in sup.running
    lines.update(a=(1, 0, 0))
    assert sup.run_pass(2.0) == [Load("a")] and sup.running["a"] is not first
    # b is wanted: a (idle) is unloaded, SIGTERM, but it is frozen and does not exit
    lines.update(a=(0, 0, 1))
    sup.run_pass(2.5)  # registered, idle
    lines.update(b=(1, 0, 0))
    assert [type(x) for x in sup.run_pass(3.0)] == [Unload]
    stuck = sup.stopping["a"]
    assert stuck.signals == ["TERM"] and stuck.is_alive()
    _passes(sup, 3.2, 3.0 + STOP_KILL_S)
    assert stuck.signals == ["TERM"]  # still within its time to stop
    _passes(sup, 3.2 + STOP_KILL_S, 4.0 + STOP_KILL_S)
    assert stuck.signals == ["TERM", "KILL"] and not stuck.is_alive()
    sup.run_pass(5.0 + STOP_KILL_S)
    assert "a" not in sup.stopping


def _on_demand_names_of(monkeypatch, tmp_path, *args) -> tuple:
    """``slotserve up ARGS`` up to its cluster: (exit code, output, each model on demand's served names)."""
    from click.testing import CliRunner

    from slotserve import launcher
    from slotserve.cli import main

    seen = []

    class _Cluster:  # (records the config; starts nothing)
        def __init__(self, cfg) -> None:
            seen.append(tuple(w.served_names for w in cfg.on_demand))
            raise RuntimeError("not started: a test")

    monkeypatch.setattr(launcher, "LocalCluster", _Cluster)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["up", *args])
    return result.exit_code, result.output, seen[0] if seen else None


def test_up_serves_a_model_named_twice_by_one_path_once(monkeypatch, tmp_path):
    """``m.gguf``, ``./m.gguf`` and its absolute path are one model (was: 'each model on demand once:
    got ['simulated', 'm', 'm']', exit 2)."""
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    code, out, names = _on_demand_names_of(monkeypatch, tmp_path, "--model", "simulated", "--model", "m.gguf",
                                           "--model", "./m.gguf", "--model", str(tmp_path / "m.gguf"))
    assert names == (("simulated",), ("m", "m.gguf")), out


def test_up_serves_a_model_folder_on_demand_by_its_folder_name(monkeypatch, tmp_path):
    """As docs/cluster.md and --models-dir's help say (was: by its whole path, '/.../models/tiny')."""
    (tmp_path / "models" / "tiny").mkdir(parents=True)
    (tmp_path / "models" / "tiny" / "config.json").write_text("{}")
    (tmp_path / "models" / "b.gguf").write_bytes(b"GGUF")
    code, out, names = _on_demand_names_of(monkeypatch, tmp_path, "--models-dir", "models")
    assert names == (("b", "models/b.gguf"), ("tiny", "models/tiny")), out
    code, out, names = _on_demand_names_of(monkeypatch, tmp_path, "--model", "simulated", "--model", "models/tiny/")
    assert names == (("simulated",), ("tiny", "models/tiny/")), out


@pytest.mark.parametrize("second", ["other/m.gguf", "other/m"])
def test_up_refuses_two_models_that_would_be_served_by_one_name(monkeypatch, tmp_path, second):
    """Two files with one stem, or a file and a folder of that name, with several models (where
    --served-model-name does not apply): a usage error naming both (was 'each model on demand once:
    got ['m', 'm']')."""
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    (tmp_path / "other" / "m").mkdir(parents=True)
    (tmp_path / "other" / "m" / "config.json").write_text("{}")
    (tmp_path / "other" / "m.gguf").write_bytes(b"GGUF")
    code, out, names = _on_demand_names_of(monkeypatch, tmp_path, "--model", "m.gguf", "--model", second)
    assert code == 2 and names is None
    assert f"the models m.gguf and {second} would both be served as 'm'" in out and "rename one" in out, out


def _core_of_a_and_b(monkeypatch):
    """A real broker core with models a and b on demand (heartbeats 0.1 s, a loader's window 0.5 s;
    1 GiB each, room for both), the clock ``[now]`` its supervisor's passes set, and a link whose status
    is the core's then: ``(broker, clock, link)``."""
    import types

    from broker.config import BrokerConfig
    from broker.core import BrokerCore
    from slotserve import demand_supervisor
    from worker import host_memory

    monkeypatch.setattr(demand_supervisor, "estimate_bytes", lambda model: GIB)
    monkeypatch.setattr(host_memory, "total_bytes", lambda: 64 * GIB)
    monkeypatch.setattr(host_memory, "available_bytes", lambda: 32 * GIB)
    broker = BrokerCore(BrokerConfig(heartbeat_interval_s=0.1, worker_liveness_s=0.5, on_demand_models=("a", "b")),
                        "broker", 0.0)
    clock = [0.0]
    return broker, clock, types.SimpleNamespace(status=lambda timeout_s: broker.status(clock[0]), close=lambda: None)


def _one_request_for_a(broker, clock: list, sup) -> list:
    """Request ``r`` for model a at 0 s, then 30 s of a supervisor pass and a broker tick each 0.1 s:
    ``(time, Finished)`` of each request that ended."""
    from protocol.messages import Results, Submit
    from tests.support.messages import envelope

    broker.on_frontend(b"client", Submit("a", [envelope("r", [1], 5)]), 0.0)
    ended = []
    for step in range(300):
        clock[0] = now = step / 10
        ended += [(now, f) for s in broker.tick(now) if isinstance(s.message, Results) for f in s.message.finished]
        sup.run_pass(now)
    return ended


def test_a_model_whose_every_load_dies_silently_ends_its_requests_after_backed_off_loads(monkeypatch):
    """The supervisor (slotserve/demand_supervisor.py) over a real broker core (injected clocks): each
    worker it starts for model ``a`` announces its load and is then killed silently (SIGKILL, the OOM
    killer: no goodbye). It starts no other while the broker still lists the dead one loading (until its
    liveness window ends), then waits out its back-off (1 s, 2 s, ...); the broker counts each dropped
    loader as a failed attempt of the waiting request, which ends ``worker_failed`` at the third
    (``max_attempts``), and with nothing waiting no load follows (before: the request waited forever and
    the model was loaded again after each back-off, in a loop)."""
    from protocol.enums import ErrorCode
    from protocol.messages import Loading
    from slotserve.demand_supervisor import DemandSupervisor
    from worker.config import WorkerConfig

    broker, clock, link = _core_of_a_and_b(monkeypatch)
    loads = []

    def spawn(model: str, config) -> _FakeProcess:
        loads.append(clock[0])
        broker.on_backend(b"w%d" % len(loads), Loading(model, f"w{len(loads)}"), clock[0])
        p = _FakeProcess()
        p.alive, p.exitcode = False, -9  # killed during its load
        return p

    configs = tuple(WorkerConfig(model="simulated", served_model_names=(n,)) for n in ("a", "b"))
    sup = DemandSupervisor(configs, 1, 300.0, spawn=spawn, connect=lambda: link)
    ended = _one_request_for_a(broker, clock, sup)
    assert loads == [0.0, 1.1, 3.2]  # each after the dead loader's window (0.5 s) and its back-off (1 s, 2 s)
    ((when, f),) = ended
    assert when == 3.8 and f.request_id == "r" and f.code is ErrorCode.WORKER_FAILED
    assert "fell silent while loading it: it died or was killed (out of memory?)" in f.message
    assert sup.core.state("a") == "unloaded" and broker.status(30.0).models["a"].queued == 0


def _supervised(monkeypatch, lines: dict, idle_s: float = 300.0, frozen: bool = True):
    """A DemandSupervisor of models a and b (1 GiB each, room for one) over a fake broker whose
    status is ``lines`` (model -> (queued, running, workers)); its workers are _FakeProcesses."""
    import types

    from slotserve import demand_supervisor
    from slotserve.demand_supervisor import DemandSupervisor
    from worker import host_memory
    from worker.config import WorkerConfig

    monkeypatch.setattr(demand_supervisor, "estimate_bytes", lambda model: GIB)
    monkeypatch.setattr(host_memory, "total_bytes", lambda: 64 * GIB)
    monkeypatch.setattr(host_memory, "available_bytes", lambda: 32 * GIB)
    broker = types.SimpleNamespace(status=lambda timeout_s: status(**lines), close=lambda: None)
    configs = tuple(WorkerConfig(model="simulated", served_model_names=(n,)) for n in ("a", "b"))
    return DemandSupervisor(configs, 1, idle_s, spawn=lambda model, config: _FakeProcess(frozen=frozen),
                            connect=lambda: broker)


def _passes(sup, start: float, end: float, step: float = 0.2, *, first: bool = False) -> list:
    """Passes every ``step`` s from ``start`` to ``end`` (the supervise loop's, unstalled), or
    (``first``) to the first that acts: ``(now, action)`` for each action taken."""
    out, n = [], 0
    while (now := round(start + n * step, 6)) <= end and not (first and out):
        out += [(now, a) for a in sup.run_pass(now)]
        n += 1
    return out


def test_a_stall_of_the_supervisor_kills_no_worker_told_to_stop_and_unloads_no_idle_model(monkeypatch):
    """The supervisor's own timers do not count a stall of its loop (the whole ``slotserve up``
    SIGSTOPped, a suspended laptop: its workers were frozen too and had no time to exit, nobody could
    use a model): after one longer than STOP_KILL_S, a worker told to stop is not killed at the first
    pass (it gets the rest of its STOP_KILL_S), and after one longer than idle_unload_s an idle model is
    not unloaded (it is once idle that long besides the stall). Before: killed, and unloaded, at once."""
    from slotserve.demand_supervisor import STOP_KILL_S

    lines = {"a": (1, 0, 0), "b": (0, 0, 0)}
    sup = _supervised(monkeypatch, lines, idle_s=60.0)
    assert _passes(sup, 0.0, 0.0) == [(0.0, Load("a"))]
    lines.update(a=(0, 1, 1))  # registered, busy until 1.0, then idle
    _passes(sup, 0.2, 1.0)
    lines.update(a=(0, 0, 1))
    assert _passes(sup, 1.2, 10.0) == []
    assert sup.run_pass(10.0 + 120.0) == []  # stalled 120 s, idle 9 s before: not unloaded
    ((when, unload),) = _passes(sup, 130.2, 200.0, first=True)
    assert type(unload) is Unload and unload.model == "a" and when - 120.0 - 1.0 == pytest.approx(60.0, abs=0.3)
    # a frozen worker told to stop (SIGTERM waits for SIGCONT), then the supervisor stalls too
    stuck = sup.stopping["a"]
    assert stuck.signals == ["TERM"]
    _passes(sup, when + 0.2, when + 10.0)
    t = when + 10.0 + 2 * STOP_KILL_S
    sup.run_pass(t)
    assert stuck.signals == ["TERM"]  # not killed on waking: 10 s of its 30 s have passed
    _passes(sup, t + 0.2, t + STOP_KILL_S - 10.0 - 0.4)
    assert stuck.signals == ["TERM"]
    _passes(sup, t + STOP_KILL_S - 10.0 - 0.2, t + STOP_KILL_S - 10.0 + 0.4)
    assert stuck.signals == ["TERM", "KILL"]


def test_a_stall_of_the_supervisor_does_not_count_as_time_waited_for_a_turn(monkeypatch):
    """With turns (``turn_s``), a busy model is unloaded for another that waited ``turn_s`` for it;
    a stall of the supervisor is no wait (nobody was served meanwhile): the busy model keeps its
    place at the first pass after one, and is unloaded once the other waited turn_s besides it."""
    lines = {"a": (1, 0, 0), "b": (0, 0, 0)}
    sup = _supervised(monkeypatch, lines)
    sup.core.turn_s = 30.0
    _passes(sup, 0.0, 0.0)
    lines.update(a=(1, 1, 1), b=(1, 0, 0))  # a loaded and busy, b waits from 0.2
    assert _passes(sup, 0.2, 20.0) == []
    assert sup.run_pass(20.0 + 100.0) == []  # stalled 100 s
    ((when, unload),) = _passes(sup, 120.2, 160.0, first=True)
    assert unload == Unload("a", "requests for 'b' waited 30 s (turn_s) for it")
    assert when - 100.0 == pytest.approx(30.2, abs=0.3)


def test_a_second_stall_after_a_window_on_time_is_not_counted_either(monkeypatch):
    """``slotserve up`` suspended twice (a laptop each night): an idle model's timer is not restarted
    by anything while it stays idle, so excused once (as a liveness judge's silent peer) it counted
    the second stall as idle time and was unloaded on waking (idle 49 s awake of its 60). A stall that
    follows at least the supervisor's window (its shortest timer, 30 s) of passes on time is a freeze
    again and excused again; a supervisor stalled at every pass still unloads (below)."""
    lines = {"a": (1, 0, 0), "b": (0, 0, 0)}
    sup = _supervised(monkeypatch, lines, idle_s=60.0)
    _passes(sup, 0.0, 0.0)
    lines.update(a=(0, 1, 1))  # registered, busy until 1.0, then idle
    _passes(sup, 0.2, 1.0)
    lines.update(a=(0, 0, 1))
    assert _passes(sup, 1.2, 10.0) == []
    assert sup.run_pass(10.0 + 120.0) == []  # stalled 120 s, idle 9 s before
    assert _passes(sup, 130.2, 170.0) == []  # 40 s on time: idle 49 s
    assert sup.run_pass(170.0 + 120.0) == []  # stalled 120 s again: not unloaded (before: at once)
    ((when, unload),) = _passes(sup, 290.2, 400.0, first=True)
    assert unload.model == "a" and when - 240.0 - 1.0 == pytest.approx(60.0, abs=0.3)


def test_a_supervisor_stalled_at_every_pass_still_unloads_an_idle_model(monkeypatch):
    """Slow, not frozen (every pass later than the stall threshold): the idle model's timer gets
    one stall excused, then counts (unloaded at the first pass 60 s after its excused stall)."""
    lines = {"a": (1, 0, 0), "b": (0, 0, 0)}
    sup = _supervised(monkeypatch, lines, idle_s=60.0)
    _passes(sup, 0.0, 0.0)
    lines.update(a=(0, 1, 1))
    _passes(sup, 0.2, 1.0)
    lines.update(a=(0, 0, 1))
    assert sup._stalls.threshold_s == pytest.approx(15.0)
    unloads = [(t, a) for t in (1.0 + 20.0 * k for k in range(1, 10)) for a in sup.run_pass(t)]
    assert unloads == [(81.0, Unload("a", "idle for 60 s (idle_unload_s 60)"))]


def test_a_model_whose_every_worker_dies_before_it_announces_its_load_ends_its_requests(monkeypatch):
    """As above, but each worker is killed before it could even announce its load (SIGKILL or a
    crash while the process starts: the broker never heard of it). The supervisor, which saw its
    process end without the broker ever listing it, announces the load for it and falls silent
    (``announce``), so the broker counts it as any dead loader: the waiting request ends
    ``worker_failed`` at the third such load (``max_attempts``), and no load follows (before: it
    waited forever, the model loaded again after each back-off, at most a minute apart)."""
    from protocol.enums import ErrorCode
    from protocol.messages import Loading
    from slotserve.demand_supervisor import DemandSupervisor
    from worker.config import WorkerConfig

    broker, clock, link = _core_of_a_and_b(monkeypatch)
    loads, announced = [], []

    def spawn(model: str, config) -> _FakeProcess:
        loads.append(clock[0])
        p = _FakeProcess()
        p.alive, p.exitcode, p.pid = False, -9, 100 + len(loads)  # killed before it said a word
        return p

    def announce(model: str, config, worker_name: str) -> None:
        announced.append((clock[0], worker_name))
        broker.on_backend(b"ghost%d" % len(announced), Loading(model, worker_name), clock[0])

    configs = tuple(WorkerConfig(model="simulated", served_model_names=(n,), name=f"w-{n}") for n in ("a", "b"))
    sup = DemandSupervisor(configs, 1, 300.0, spawn=spawn, connect=lambda: link, announce=announce)
    ended = _one_request_for_a(broker, clock, sup)
    assert loads == [0.0, 1.1, 3.2]  # each after its announced loader's window (0.5 s) and its back-off (1 s, 2 s)
    assert [t for t, _ in announced] == [0.1, 1.2, 3.3]
    assert announced[0][1] == "w-a, exited with code -9 before it announced its load"
    ((when, f),) = ended
    assert when == 3.9 and f.request_id == "r" and f.code is ErrorCode.WORKER_FAILED
    assert ("the worker loading model 'a' (w-a, exited with code -9 before it announced its load) fell silent "
            "while loading it: it died or was killed (out of memory?)") in f.message
    assert sup.core.state("a") == "unloaded" and broker.status(30.0).models["a"].queued == 0


def test_a_worker_the_broker_listed_loading_is_not_announced_again(monkeypatch):
    """A worker that announced its load itself, then died, is the broker's to count (its own
    silence): the supervisor announces nothing for it."""
    lines = {"a": (1, 0, 0, 0), "b": (0, 0, 0)}
    announced = []
    sup = _supervised(monkeypatch, lines, frozen=False)
    sup._announce = lambda model, config, name: announced.append(model)
    assert sup.run_pass(0.0) == [Load("a")]
    lines.update(a=(1, 0, 0, 1))  # the broker lists it loading
    sup.run_pass(0.2)
    sup.running["a"].alive = False
    sup.run_pass(0.4)
    assert "a" not in sup.running and announced == []


def test_after_a_broker_restart_a_worker_only_the_old_broker_heard_of_is_announced_when_it_dies(monkeypatch):
    """What the supervisor believes the broker has heard is the broker's it asked: a worker that
    announced its load to a broker that then restarted, and died before it reached the new one, is
    announced to the new one, which counts it at once as a failed load of the request resubmitted there
    (before: taken as heard, it was never counted there, and the request ended one load later)."""
    from broker.core import BrokerCore
    from protocol.enums import ErrorCode
    from protocol.messages import Loading, Results, Submit
    from slotserve.demand_supervisor import DemandSupervisor
    from tests.support.messages import envelope
    from worker.config import WorkerConfig

    old, clock, link = _core_of_a_and_b(monkeypatch)
    brokers, procs, announced = [old], [], []

    def spawn(model: str, config) -> _FakeProcess:
        procs.append(p := _FakeProcess())
        p.pid = 100 + len(procs)
        return p

    def announce(model: str, config, worker_name: str) -> None:
        announced.append((clock[0], worker_name))
        brokers[-1].on_backend(b"ghost%d" % len(announced), Loading(model, worker_name), clock[0])

    link.status = lambda timeout_s: brokers[-1].status(clock[0])
    configs = tuple(WorkerConfig(model="simulated", served_model_names=(n,), name=f"w-{n}") for n in ("a", "b"))
    sup = DemandSupervisor(configs, 1, 300.0, spawn=spawn, connect=lambda: link, announce=announce)
    old.on_frontend(b"client", Submit("a", [envelope("r", [1], 5)]), 0.0)
    assert sup.run_pass(0.0) == [Load("a")]
    old.on_backend(b"w1", Loading("a", "w1"), 0.05)  # the worker announces its load
    sup.run_pass(0.1)  # (the broker lists it loading)
    new = BrokerCore(old.config, "broker-2", 0.2)  # the broker restarts; the client resubmits r there
    brokers.append(new)
    new.on_frontend(b"client", Submit("a", [envelope("r", [1], 5)]), 0.2)
    procs[0].alive, procs[0].exitcode = False, -9  # killed before it reached the new broker
    ended = []
    for step in range(3, 300):
        clock[0] = now = step / 10
        ended += [(now, f) for s in new.tick(now) if isinstance(s.message, Results) for f in s.message.finished]
        sup.run_pass(now)
        for p in procs[1:]:  # every later worker dies before it announces its load
            p.alive, p.exitcode = False, -9
    assert announced[0] == (0.3, "w-a, exited with code -9 before it announced its load")  # (before: none)
    assert [t for t, _ in announced] == [0.3, 1.4, 3.5]  # (before: 1.4, 3.5, 7.6)
    ((when, f),) = ended
    assert len(procs) == 3 and when == 4.1  # the third load, as without the restart (before: a fourth, 8.2 s)
    assert f.request_id == "r" and f.code is ErrorCode.WORKER_FAILED


def test_a_dead_load_is_announced_to_a_real_broker_as_a_loader_that_then_falls_silent():
    """:func:`worker.link.announce_dead_load` over real sockets (a broker's socket loop in a thread):
    the broker lists the loader under its model and aliases, then drops it once silent past its window."""
    import threading

    from broker import BrokerConfig
    from broker.server import BrokerServer
    from client import Client
    from tests.support.cluster import ANY_PORT
    from tests.support.waits import wait_until
    from worker.config import WorkerConfig
    from worker.link import announce_dead_load

    server = BrokerServer(BrokerConfig(frontend=ANY_PORT, backend=ANY_PORT, heartbeat_interval_s=0.05,
                                       worker_liveness_s=0.2, on_demand_models=("a",)))
    stop = threading.Event()
    loop = threading.Thread(target=server.serve, args=(stop,), daemon=True)
    loop.start()
    client = None
    try:
        client = Client(server.frontend, connect_timeout_s=10)
        announce_dead_load(WorkerConfig(broker=server.backend, served_model_names=("a", "alias")), "ghost")
        st = wait_until(lambda: (s := client.status(timeout_s=10)).loading_workers and s, 10, "the loader listed")
        assert st.loading_workers == {"ghost": "a"} and st.aliases == {"alias": "a"}
        wait_until(lambda: not client.status(timeout_s=10).loading_workers, 10, "the silent loader dropped")
    finally:
        if client is not None:
            client.close()
        stop.set()
        loop.join(10)
        server.close()


# ---------------------------------------------------------------------- the states everyone is told


def test_published_states_say_a_load_or_an_unload_from_the_order_until_it_is_done():
    """OnDemand.published(), what the supervisor tells the broker after each pass: ``loading`` from an
    order (or a request) until the worker registered -- waiting for room too --, ``unloading`` from
    an unload until the worker is gone -- while it finishes its requests too --, and a failed load
    ``unloaded`` with ``failed``: its worker's exit code, or why it cannot fit (never ``loading``)."""
    c = core(max_loaded=1, idle=0.0)

    def states() -> dict:
        return {n: s.state.value for n, s in c.published().items()}

    assert states() == {"a": "unloaded", "b": "unloaded"}
    c.want("a", 0.0)
    assert states()["a"] == "loading"  # the order taken: loading before the pass that starts it
    assert c.decide(status(a=(0, 0, 0), b=(0, 0, 0)), 0.0, 8 * GIB) == [Load("a")] and states()["a"] == "loading"
    c.decide(status(a=(0, 0, 1), b=(0, 0, 0)), 1.0, 8 * GIB)
    assert states() == {"a": "loaded", "b": "unloaded"}
    c.decide(status(a=(0, 1, 1), b=(1, 0, 0)), 2.0, 8 * GIB)  # b's request waits for room (a is busy)
    assert states() == {"a": "loaded", "b": "loading"}
    c.release("a")  # busy: it goes once idle, and says so from now
    assert states()["a"] == "unloading"
    assert c.decide(status(a=(0, 1, 1), b=(1, 0, 0)), 3.0, 8 * GIB) == [] and states()["a"] == "unloading"
    assert [type(x) for x in c.decide(status(a=(0, 0, 1), b=(1, 0, 0)), 4.0, 8 * GIB)] == [Unload]
    assert states() == {"a": "unloading", "b": "loading"}
    c.decide(status(a=(0, 0, 1), b=(1, 0, 0)), 4.2, 8 * GIB, stopping=frozenset({"a"}))  # its worker stopping
    assert states() == {"a": "unloading", "b": "loading"}
    assert c.decide(status(a=(0, 0, 0), b=(1, 0, 0)), 4.4, 8 * GIB) == [Load("b")]
    assert states() == {"a": "unloaded", "b": "loading"}
    # b's worker exits before it registers: its request waits (the broker counts the attempt): loading
    # again after the back-off; once nothing waits, unloaded and failed, with the exit code
    c.failed("b", 5.0, exit_code=1)
    assert states()["b"] == "loading"
    c.decide(status(a=(0, 0, 0), b=(0, 0, 0)), 5.2, 8 * GIB)
    assert c.published()["b"] == DemandState(ModelState.UNLOADED, True, 1,
                                             "its worker exited with code 1 before it registered")
    # what cannot fit now: unloaded and failed, why, no exit code, while its requests wait for room
    big = core(max_loaded=2, a=GIB, big=9 * GIB)
    assert [type(x) for x in big.decide(status(a=(0, 0, 0), big=(1, 0, 0)), 0.0, 2 * GIB)] == [Refuse]
    got = big.published()["big"]
    assert got.state is ModelState.UNLOADED and got.failed and got.exit_code is None and "9,216 MiB" in got.reason


def _supervised_over_a_broker_core(monkeypatch):
    """A DemandSupervisor of a and b (room for both) over a real broker core, its ``demand`` sent to the
    core, spawning fake processes: ``(broker, clock, sup, procs)`` (``procs``: those spawned, in order)."""
    from slotserve.demand_supervisor import DemandSupervisor
    from worker.config import WorkerConfig

    procs = []

    def spawn(model: str, config) -> _FakeProcess:
        procs.append(p := _FakeProcess())
        return p

    broker, clock, link = _core_of_a_and_b(monkeypatch)
    link.tell_demand = lambda msg: broker.on_frontend(b"supervisor", msg, clock[0])
    configs = tuple(WorkerConfig(model="simulated", served_model_names=(n,)) for n in ("a", "b"))
    return broker, clock, DemandSupervisor(configs, 2, 300.0, spawn=spawn, connect=lambda: link), procs


def test_every_status_says_loading_from_a_load_order_until_loaded_and_unloading_until_gone(monkeypatch):
    """POST /models/load's order over a real broker core: the status that answers it says ``loading``
    (before: ``unloaded`` until the worker's process, started at the supervisor's next pass, announced
    its load, 0.5-3 s on), as does every status until the worker registered; an unload says
    ``unloading`` until its worker said goodbye and exited. The supervisor takes each order once."""
    from protocol.enums import ModelAction
    from protocol.messages import Bye, Loading, ModelOrder, Register
    from tests.support.cores import INFO

    broker, clock, sup, procs = _supervised_over_a_broker_core(monkeypatch)
    sup.run_pass(0.0)
    (answer,) = broker.on_frontend(b"gateway", ModelOrder("a", ModelAction.LOAD), 0.05)
    seen = [answer.message.on_demand["a"].state.value]
    for step in range(1, 16):
        clock[0] = now = step / 10
        if step == 5:
            broker.on_backend(b"w1", Loading("a", "w1"), now)  # its process started: it announces its load
        if step == 10:
            broker.on_backend(b"w1", Register("a", 2, 2, INFO, "w1"), now)
        seen.append(broker.status(now).on_demand["a"].state.value)
        sup.run_pass(now)
        seen.append(broker.status(now).on_demand["a"].state.value)
    assert seen == ["loading"] * 19 + ["loaded"] * 12 and len(procs) == 1  # (one order: one worker)
    (answer,) = broker.on_frontend(b"gateway", ModelOrder("a", ModelAction.UNLOAD), 1.55)
    seen = [answer.message.on_demand["a"].state.value]
    for step in range(16, 25):
        clock[0] = now = step / 10
        seen.append(broker.status(now).on_demand["a"].state.value)
        sup.run_pass(now)
        if procs[0].signals == ["TERM"] and broker.workers.for_model("a"):
            broker.on_backend(b"w1", Bye("stopping"), now)  # told to stop (SIGTERM): its goodbye, then it exits
        seen.append(broker.status(now).on_demand["a"].state.value)
    assert procs[0].signals == ["TERM"] and seen == ["unloading"] * 4 + ["unloaded"] * 15


def test_a_load_that_fails_ends_unloaded_and_failed_with_the_workers_words_not_loading(monkeypatch):
    """A model whose worker says why it cannot load and exits: ``loading`` from the order, then
    ``unloaded`` with ``failed``, its exit code and its words, from the pass that saw it exit."""
    from protocol.enums import ModelAction, ModelState
    from protocol.messages import Bye, Loading, ModelOrder

    broker, clock, sup, procs = _supervised_over_a_broker_core(monkeypatch)
    sup.run_pass(0.0)
    (answer,) = broker.on_frontend(b"gateway", ModelOrder("b", ModelAction.LOAD), 0.05)
    assert answer.message.on_demand["b"].state is ModelState.LOADING
    clock[0] = 0.2
    sup.run_pass(0.2)
    broker.on_backend(b"w1", Loading("b", "w1"), 0.3)
    clock[0] = 0.3
    sup.run_pass(0.3)
    assert broker.status(0.3).on_demand["b"].state is ModelState.LOADING
    broker.on_backend(b"w1", Bye("cannot load model 'b': not a GGUF file", load_failed=True), 0.4)
    procs[0].alive, procs[0].exitcode = False, 1
    assert broker.status(0.4).on_demand["b"].state is ModelState.LOADING  # (its exit not seen yet)
    clock[0] = 0.4
    sup.run_pass(0.4)
    got = broker.status(0.4).on_demand["b"]
    assert got.state is ModelState.UNLOADED and got.failed and got.exit_code == 1
    assert "not a GGUF file" in got.reason
    for step in range(5, 100):  # and so it stays: nothing wants it (no reload in a loop)
        clock[0] = step / 10
        sup.run_pass(step / 10)
    assert broker.status(9.9).on_demand["b"] == got and len(procs) == 1


def test_the_supervisor_takes_each_order_once_and_tells_the_broker_what_it_took(monkeypatch):
    """The orders of the broker's status not taken yet, by their seq: one still listed (the broker has
    not heard the supervisor's ``demand`` yet) is not taken twice; a restarted broker (a new
    ``broker_id``) numbers them from 1 again. Each pass tells the broker the states and the last seq."""
    import dataclasses

    from protocol.enums import ModelAction
    from protocol.messages import PendingOrder

    lines = {"a": (0, 0, 0), "b": (0, 0, 0)}
    orders, broker_id, told = [PendingOrder(1, ModelAction.LOAD, "a")], ["b1"], []
    sup = _supervised(monkeypatch, lines, frozen=False)
    fake = sup._connect()
    fake.status = lambda timeout_s: dataclasses.replace(status(**lines), broker_id=broker_id[0], orders=tuple(orders))
    fake.tell_demand = told.append
    assert sup.run_pass(0.0) == [Load("a")]
    assert told[-1].orders_taken == 1 and told[-1].broker_id == "b1"
    assert told[-1].models["a"].state is ModelState.LOADING
    lines.update(a=(0, 0, 1))
    orders.append(PendingOrder(2, ModelAction.UNLOAD, "a"))
    assert [type(x) for x in sup.run_pass(1.0)] == [Unload] and told[-1].orders_taken == 2
    assert told[-1].models["a"].state is ModelState.UNLOADING
    lines.update(a=(0, 0, 0))
    assert sup.run_pass(2.0) == [] and sup.run_pass(3.0) == []  # the load (seq 1) is not taken again
    assert told[-1].models["a"] == DemandState(ModelState.UNLOADED)
    broker_id[0], orders[:] = "b2", [PendingOrder(1, ModelAction.LOAD, "b")]
    assert sup.run_pass(4.0) == [Load("b")] and told[-1].orders_taken == 1 and told[-1].broker_id == "b2"


def test_a_loaded_models_worker_that_exits_is_no_failed_load(monkeypatch):
    """A model's worker that registered and then exited (stopped by someone else's SIGTERM -- its
    goodbye, which drops it from the broker at once -- or a crash while serving) loaded its model: the
    model is ``unloaded``, not ``failed`` ("its worker exited with code 0 before it registered", as a
    break-it pass saw with `slotserve up` and a `kill -TERM` of a loaded worker), and a request for it
    loads it again at the next pass, with no failed load's back-off."""
    from protocol.enums import ModelAction, ModelState
    from protocol.messages import Bye, Loading, ModelOrder, Register, Submit
    from tests.support.cores import INFO
    from tests.support.messages import envelope

    broker, clock, sup, procs = _supervised_over_a_broker_core(monkeypatch)
    sup.run_pass(0.0)
    broker.on_frontend(b"gateway", ModelOrder("a", ModelAction.LOAD), 0.05)
    clock[0] = 0.2
    assert sup.run_pass(0.2) == [Load("a")]
    broker.on_backend(b"w1", Loading("a", "w1"), 0.3)
    broker.on_backend(b"w1", Register("a", 2, 2, INFO, "w1"), 0.35)
    clock[0] = 0.4
    sup.run_pass(0.4)
    assert broker.status(0.4).on_demand["a"] == DemandState(ModelState.LOADED)
    broker.on_backend(b"w1", Bye("worker stopping"), 0.5)  # SIGTERM from outside: its goodbye, then it exits
    procs[0].alive, procs[0].exitcode = False, 0
    clock[0] = 0.6
    assert sup.run_pass(0.6) == []
    assert broker.status(0.6).on_demand["a"] == DemandState(ModelState.UNLOADED)
    broker.on_frontend(b"client", Submit("a", [envelope("r", [1], 5)]), 0.7)
    clock[0] = 0.8
    assert sup.run_pass(0.8) == [Load("a")] and len(procs) == 2  # (at once: not 1 s of back-off)


def test_a_loading_worker_told_to_stop_is_no_failed_load(monkeypatch):
    """A worker stopped by a signal from outside while it loads says goodbye without ``load_failed``
    and exits with code 0 (a failed load exits 1): a break-it pass's SIGTERM to the worker loading
    smollm2-135m left the model 'unloaded, failed (exit code 0)' with a failed load's back-off and
    its waiting request ended 500. Now the model is not failed, its request waits, and the pass that
    sees the worker exit loads the model again for it."""
    from protocol.enums import ModelState
    from protocol.messages import Bye, Loading, Results, Submit
    from tests.support.messages import envelope

    broker, clock, sup, procs = _supervised_over_a_broker_core(monkeypatch)
    sup.run_pass(0.0)
    out = broker.on_frontend(b"client", Submit("a", [envelope("r", [1], 5)]), 0.05)
    clock[0] = 0.2
    assert sup.run_pass(0.2) == [Load("a")]
    broker.on_backend(b"w1", Loading("a", "w1"), 0.3)
    out += broker.on_backend(b"w1", Bye("worker stopping"), 0.4)  # SIGTERM from outside while it loads
    procs[0].alive, procs[0].exitcode = False, 0
    assert broker.status(0.4).on_demand["a"] == DemandState(ModelState.LOADING)  # (its exit not seen yet)
    clock[0] = 0.5
    # the pass that sees it exit loads it again for its request: no failed load's back-off
    assert sup.run_pass(0.5) == [Load("a")] and len(procs) == 2
    assert broker.status(0.5).on_demand["a"] == DemandState(ModelState.LOADING)
    assert not [f for x in out if isinstance(x.message, Results) for f in x.message.finished]  # (still waits)


def test_a_model_still_loading_keeps_its_memory_from_the_next_pass_on(monkeypatch):
    """Two models wanted at once with memory for one (1.5 GiB available, 1 GiB each, max_loaded 3): the
    first loads and the second is refused. The next pass, 0.2 s on, read the machine's memory before
    the first worker had taken its own (a process's start-up and its load take seconds) and loaded the
    second too (a break-it pass: LocalCluster with tiny-a and tiny-b, both loaded, where only one fit).
    Now a model whose worker is starting counts its estimate, less what its process holds already, as
    taken: the second waits, refused, until the first is loaded (then, idle, it may make room)."""
    import types

    from slotserve import demand_supervisor
    from slotserve.demand_supervisor import DemandSupervisor
    from worker import host_memory
    from worker.config import WorkerConfig

    monkeypatch.setattr(demand_supervisor, "estimate_bytes", lambda model: GIB)
    monkeypatch.setattr(host_memory, "total_bytes", lambda: 64 * GIB)
    monkeypatch.setattr(host_memory, "available_bytes", lambda: 3 * GIB // 2)  # (the first has taken nothing yet)
    lines = {"a": (1, 0, 0), "b": (1, 0, 0)}
    broker = types.SimpleNamespace(status=lambda timeout_s: status(**lines), close=lambda: None,
                                   tell_demand=lambda msg: None)
    configs = tuple(WorkerConfig(model="simulated", served_model_names=(n,)) for n in ("a", "b"))
    sup = DemandSupervisor(configs, 3, 300.0, spawn=lambda model, config: _FakeProcess(), connect=lambda: broker)
    assert [type(x) for x in sup.run_pass(0.0)] == [Load, Refuse]
    for t in (0.2, 0.4, 0.6):
        assert sup.run_pass(t) == [] and set(sup.running) == {"a"}
    lines.update(a=(0, 1, 1))  # a registered (its memory taken: the machine's reading says so from now on)
    monkeypatch.setattr(host_memory, "available_bytes", lambda: GIB // 2)
    assert sup.run_pass(0.8) == [] and set(sup.running) == {"a"}


@pytest.mark.parametrize("idle, says", [("0", "never unloaded for being idle"), ("300", "unloaded after 300 s idle")])
def test_ups_banner_says_what_idle_unload_s_does(monkeypatch, tmp_path, idle, says):
    """``--idle-unload-s 0`` keeps an idle model (0: never); the banner said "unloaded after 0 s idle"."""
    from click.testing import CliRunner

    from slotserve.cli import main
    from tests.support.launcher import record_clusters

    record_clusters(monkeypatch)
    monkeypatch.chdir(tmp_path)
    for n in ("m1", "m2"):
        (tmp_path / f"{n}.gguf").write_bytes(b"GGUF")
    result = CliRunner().invoke(main, ["up", "--model", "m1.gguf", "--model", "m2.gguf", "--idle-unload-s", idle])
    assert result.exit_code == 0, result.output
    assert f"(at most 3 loaded, {says})" in result.output
