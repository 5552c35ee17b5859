"""llama-server's flags at slotserve's command line: its names for settings slotserve has (-m, -np,
-t, --host, --port, -cb, --api-key's comma list) are aliases; its flags a command lacks get a message
that names the flag as typed and what to give instead (before: `slotserve up -np 4` said
"No such option '-n'", click reading -np as -n p). In process, nothing started."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from slotserve.cli import main
from slotserve.llama_flags import LLAMA_NOT_TAKEN, LLAMA_TAKEN, WordOption
from tests.support.launcher import record_clusters

TAKERS = {  # llama-server's flag -> the commands that take it
    "-m": ("worker", "up", "run"), "--model": ("worker", "up", "run"),
    "-np": ("worker", "up", "run"), "--parallel": ("worker", "up", "run"),
    "-t": ("worker", "up", "run"), "--threads": ("worker", "up", "run"),
    "-cb": ("worker", "up"), "--cont-batching": ("worker", "up"),
    "--host": ("serve", "up"), "--port": ("serve", "up"),
    "--api-key": ("serve", "up"), "--api-key-file": ("serve", "up"),
}
VALUES = {"-cb": [], "--cont-batching": [], "-nocb": [], "--no-cont-batching": []}  # flags without a value


def invoke(*args: str, env: dict | None = None):
    return CliRunner().invoke(main, list(args), env=env)


def parse(command: str, *args: str) -> dict:
    """The parameters ``slotserve COMMAND ARGS`` parses to (nothing run)."""
    parent = main.context_class(main, info_name="slotserve", **main.context_settings)  # (-h: click keeps the first)
    return main.commands[command].make_context(command, list(args), parent=parent).params


@pytest.fixture
def clusters(monkeypatch):
    return record_clusters(monkeypatch)


@pytest.fixture
def workers(monkeypatch):
    import worker.process

    configs = []
    monkeypatch.setattr(worker.process, "run_worker", lambda cfg, stop=None: configs.append(cfg))
    return configs


def test_up_takes_llama_servers_names_for_the_same_settings(clusters):
    llama = invoke("up", "-m", "simulated", "--workers", "1", "-np", "3", "-t", "2", "-cb", "--host", "0.0.0.0",
                   "--port", "0", "--api-key", "k1,k2")
    assert llama.exit_code == 0, llama.output
    ours = invoke("up", "--model", "simulated", "--workers", "1", "--slots", "3", "--threads", "2",
                  "--http-host", "0.0.0.0", "--http-port", "0", "--api-key", "k1", "--api-key", "k2")
    assert ours.exit_code == 0, ours.output
    assert clusters[0] == clusters[1]
    (w,) = clusters[0].workers
    assert w.num_slots == 3 and w.model_options.num_threads == 2
    assert (clusters[0].gateway.host, clusters[0].gateway.port, clusters[0].gateway.api_keys) == \
        ("0.0.0.0", 0, ("k1", "k2"))
    assert invoke("up", "--parallel", "5", "--cont-batching").exit_code == 0 and clusters[-1].workers[0].num_slots == 5
    assert invoke("up", "-np=6").exit_code == 0 and clusters[-1].workers[0].num_slots == 6


def test_worker_and_run_take_them_too(workers, monkeypatch, tmp_path):
    assert invoke("worker", "-m", "simulated", "-np", "3", "-t", "2", "-cb").exit_code == 0
    assert invoke("worker", "--model", "simulated", "--slots", "3", "--threads", "2").exit_code == 0
    assert workers[0] == workers[1] and workers[0].num_slots == 3 and workers[0].model_options.num_threads == 2

    import slotserve.batch

    clusters = []

    def run_batch(inp, out, *, cluster, **kwargs):
        clusters.append(cluster)
        inp.close()
        return slotserve.batch.BatchOutcome(None, 0)

    monkeypatch.setattr(slotserve.batch, "run_batch", run_batch)
    rows = tmp_path / "in.jsonl"
    rows.write_text('{"prompt": [1, 2], "max_tokens": 2}\n')
    out = str(tmp_path / "out.jsonl")
    r = invoke("run", str(rows), "-o", out, "-m", "simulated", "--workers", "1", "-np", "3", "-t", "2")
    assert r.exit_code == 0, r.output
    assert invoke("run", str(rows), "-o", out, "--model", "simulated", "--workers", "1", "--slots", "3",
                  "--threads", "2").exit_code == 0
    assert clusters[0] == clusters[1] and clusters[0].workers[0].num_slots == 3


def test_the_slotserve_names_and_their_variables_are_unchanged(clusters):
    r = invoke("up", env={"SLOTSERVE_UP_SLOTS": "4", "SLOTSERVE_UP_HTTP_PORT": "0", "SLOTSERVE_UP_HTTP_HOST": "::1",
                          "SLOTSERVE_UP_THREADS": "3", "SLOTSERVE_UP_MODEL": "simulated", "SLOTSERVE_UP_WORKERS": "1"})
    assert r.exit_code == 0, r.output
    cfg = clusters[-1]
    assert cfg.workers[0].num_slots == 4 and cfg.workers[0].model_options.num_threads == 3
    assert (cfg.gateway.host, cfg.gateway.port) == ("::1", 0)


def test_help_lists_the_aliases_and_hides_the_no_op():
    text = invoke("up", "-h").output
    for names in ("-np, --slots, --parallel", "-m, --model", "-t, --threads", "--http-port, --port",
                  "--http-host, --host"):
        assert names in text, names
    assert "-cb" not in text and "--cont-batching" not in text


@pytest.mark.parametrize("flag", [f for flags in LLAMA_NOT_TAKEN for f in flags])
def test_a_llama_server_flag_slotserve_has_not_says_what_to_give_instead(flag):
    r = invoke("up", flag, *VALUES.get(flag, ["8"]))
    assert r.exit_code == 2
    why = next(w for flags, w in LLAMA_NOT_TAKEN.items() if flag in flags)
    assert f"No such option '{flag}' for `slotserve up`: {why}." in r.output, r.output
    assert "No such option '-n'." not in r.output and "No such option '-c'." not in r.output


def test_the_refusals_name_the_setting_to_use():
    says = {"-c": "--max-model-len", "--ctx-size": "--max-model-len", "-ngl": "--device", "--n-gpu-layers": "--device",
            "--gpu-layers": "--device", "-nocb": "always batches continuously", "-n": "max_tokens"}
    for flag, name in says.items():
        r = invoke("serve", flag, *VALUES.get(flag, ["8"]))
        assert r.exit_code == 2 and f"No such option '{flag}' for `slotserve serve`" in r.output and name in r.output


@pytest.mark.parametrize("flag", sorted(TAKERS))
def test_a_llama_server_flag_of_another_command_names_the_commands_that_take_it(flag):
    takers = [f"`slotserve {c}`" for c in main.commands if c in TAKERS[flag]]
    listed = ", ".join(takers[:-1]) + " and " + takers[-1]
    what = next(w for flags, w in LLAMA_TAKEN.items() if flag in flags)
    for command in sorted({"serve", "worker", "broker", "status"} - set(TAKERS[flag])):
        r = invoke(command, flag, *VALUES.get(flag, ["8"]))
        assert r.exit_code == 2, (command, r.output)
        assert (f"No such option '{flag}' for `slotserve {command}`: llama-server's {flag} ({what}) is an option of "
                f"{listed}.") in " ".join(r.output.split()), (command, r.output)
    for command in TAKERS[flag]:  # (what the message says is so)
        assert any(flag in p.opts for p in main.commands[command].params if isinstance(p, click.Option)), command


@pytest.mark.parametrize("word", ["-tb", "-mg", "-mm", "-to", "-fa", "-hf", "-ctk", "-mu"])
def test_an_unknown_llama_server_word_is_named_whole_not_read_as_a_short_option_and_its_value(word):
    """-m and -t are words, as llama-server reads them: -tb 4 is no --threads 'b', -mg 0 no model 'g'
    (click's short options take an attached value)."""
    r = invoke("up", word, "4")
    assert r.exit_code == 2
    assert f"No such option '{word}'. Of llama-server's flags, slotserve takes -m, -np, -t" in r.output, r.output
    assert "'-t' / '--threads'" not in r.output and "extra argument" not in r.output


def test_existing_short_options_and_click_messages_are_kept(tmp_path):
    assert parse("humaneval", "-n", "3")["limit"] == 3 and parse("humaneval", "-n3")["limit"] == 3
    r = invoke("humaneval", "-n", "0")
    assert r.exit_code == 2 and "Invalid value for '-n' / '--limit'" in r.output
    rows = tmp_path / "in.jsonl"
    rows.write_text("{}\n")
    assert parse("run", str(rows), "-o", "x.jsonl")["output"] == "x.jsonl"
    assert parse("run", str(rows), "-ox.jsonl")["output"] == "x.jsonl"
    assert invoke("up", "-h").exit_code == 0 and invoke("serve", "-h").exit_code == 0
    r = invoke("up", "-x")
    assert r.exit_code == 2 and "No such option '-x'.\n" in r.output  # (no flag of llama-server's)
    r = invoke("up", "--prt", "4")
    assert r.exit_code == 2 and "No such option '--prt'. (Did you mean one of: '--http-port', '--port'?)" in r.output
    r = invoke("up", "-np", "0")
    assert r.exit_code == 2 and "0 is not in the range x>=1" in r.output


def test_api_keys_comma_separated_as_llama_server_lists_them(clusters):
    r = invoke("up", "--port", "0", "--api-key", "k1,k2", "--api-key", "k3", "--metrics-api-key", "m1,m2")
    assert r.exit_code == 0, r.output
    assert clusters[-1].gateway.api_keys == ("k1", "k2", "k3") and clusters[-1].gateway.metrics_api_keys == ("m1", "m2")
    r = invoke("up", "--port", "0", "--api-key", "k1,")
    assert r.exit_code == 2 and "key 2 given is not a usable API key" in r.output


def test_a_click_whose_parser_keeps_no_name_tables_still_takes_the_option():
    """WordOption moves names between click's parser tables (private to click); a click whose parser
    has none leaves the option as click adds it, rather than failing every command line."""

    class Parser:  # (a parser with add_option and no _short_opt / _long_opt)
        def __init__(self) -> None:
            self.added = []

        def add_option(self, obj, opts, dest, action=None, nargs=1, const=None):
            self.added.append(tuple(opts))

    parser = Parser()
    option = WordOption(["-m", "--model"])
    option.add_to_parser(parser, click.Context(click.Command("x")))
    assert parser.added == [("-m", "--model")]
