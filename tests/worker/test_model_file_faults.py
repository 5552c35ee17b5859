"""Each kind of fault in a model's files reaches clients as "its files could not be read": the loader
raises :class:`~worker.errors.ModelFileError` where it finds the file bad, and the worker's goodbye
(which the broker puts in the error of every request waiting for the model and in ``/v1/models``'
failed reason: tests/gateway/test_load_failure_words.py) is chosen by that type.

Before, the worker told a file fault from a configuration fault by the module the wrapped exception
was raised in (``worker.models.names``, ``worker.models.gguf_header``), and so said "its configuration
is not valid" for a split GGUF whose parts hash to another file, a part package missing or of another
version, an alias's package missing or without its file, a zipped model folder that does not unzip,
and a GGUF file without ``general.architecture``; and "an unexpected error" for a GGUF file without a
key its config needs or a tensor its layers need, and for a safetensors weights file cut short or
garbled (safetensors' own error, which the loader did not take). A fault that is the configuration's
(or the server's options') still says so."""

from __future__ import annotations

import threading
import uuid
import zipfile

import pytest

from tests.support.parts import make_parts
from worker.config import WorkerConfig
from worker.errors import ModelFileError, ModelLoadError
from worker.models import names
from worker.models.options import ModelOptions
from worker.models.parts import SplitGGUF
from worker.models.zipped import ZippedFolder
from worker.process import WorkerProcess, _load_failure

FILES = "model 'broken' failed to load: its files could not be read (missing, unreadable, cut short or not a model's)"
CONFIG = ("model 'broken' failed to load: its configuration is not valid (or the server's options for it do not "
          "fit it)")


def _goodbye(model: str, **options) -> tuple[str, ModelLoadError]:
    """What the worker says to clients when loading ``model`` (served as ``broken``) fails, and the
    error it ends with (the log's line)."""
    wp = WorkerProcess(WorkerConfig(model=model, served_model_names=("broken",), warmup=False,
                                    model_options=ModelOptions(**options)))
    with pytest.raises(ModelLoadError) as raised:
        wp._prepare(threading.Event())
    assert wp.load_failed  # (its goodbye tells the broker so: Bye.load_failed)
    return wp.goodbye, raised.value


def test_a_load_stopped_by_a_signal_is_no_failed_load(monkeypatch):
    """A stop asked for while the model loads (SIGTERM: the flag interrupts the main thread with
    LoadInterrupted) leaves the goodbye "worker stopping" without ``load_failed``: the broker keeps the
    model's requests waiting for its next load, where a failed load's goodbye ends them with its words
    (a break-it pass: SIGTERM to a worker loading a model on demand ended its waiting request 500,
    'fix the model or remove it')."""
    import contextlib

    from worker.errors import LoadInterrupted

    wp = WorkerProcess(WorkerConfig(model="simulated", served_model_names=("m",), warmup=False))

    def stopped():
        raise LoadInterrupted()

    monkeypatch.setattr(wp, "_load", stopped)
    stop = threading.Event()
    stop.interrupting = lambda exc: contextlib.nullcontext()
    wp._prepare(stop)
    assert wp.goodbye == "worker stopping" and not wp.load_failed


# ------------------------------------------------------------------ the type decides


@pytest.mark.parametrize("err, words", [
    (ModelFileError("x"), FILES),
    (FileNotFoundError(2, "gone"), FILES),
    (ValueError("x"), CONFIG),
    (RuntimeError("x"), "model 'broken' failed to load: an unexpected error"),
])
def test_the_cause_clients_read_is_chosen_by_the_errors_type(err, words):
    assert _load_failure("broken", err) == words


def test_a_wrapper_keeps_the_type_it_was_given_not_the_module_a_cause_came_from():
    # (a ValueError that wraps a ModelFileError says what its raiser chose; the loader's wrappers of file
    # faults raise a ModelFileError again)
    try:
        try:
            raise ModelFileError("cut short")
        except ModelFileError as e:
            raise ValueError("options do not fit") from e
    except ValueError as e:
        assert _load_failure("broken", e) == CONFIG


# ------------------------------------------------------------------ paths and names


def _path_fault(tmp_path, kind: str) -> str:
    if kind == "no such path":
        return str(tmp_path / "nowhere")
    if kind == "an unknown name":
        return "no-such-model-anywhere"
    if kind == "an empty .gguf":
        (tmp_path / "m.gguf").write_bytes(b"")
        return str(tmp_path / "m.gguf")
    if kind == "a .gguf that is no GGUF":
        (tmp_path / "m.gguf").write_bytes(b"PK\x03\x04 a zip, say")
        return str(tmp_path / "m.gguf")
    if kind == "a file that is no .gguf":
        (tmp_path / "m.bin").write_bytes(b"GGUF")
        return str(tmp_path / "m.bin")
    assert kind == "a folder without config.json"
    (tmp_path / "m").mkdir()
    return str(tmp_path / "m")


@pytest.mark.parametrize("kind", ["no such path", "an unknown name", "an empty .gguf", "a .gguf that is no GGUF",
                                  "a file that is no .gguf", "a folder without config.json"])
def test_a_name_that_names_no_models_files_says_its_files(tmp_path, kind):
    words, err = _goodbye(_path_fault(tmp_path, kind))
    assert words == FILES
    assert isinstance(err.__cause__, ModelFileError)


# ------------------------------------------------------------------ aliases: packages, parts, zips


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A folder on sys.path for fake packages; the models cache under ``tmp_path``."""
    folder = tmp_path / "site"
    folder.mkdir()
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return folder


def _package(site, files: dict[str, bytes | str]) -> str:
    """A fake package holding ``files`` (name -> content); its import name."""
    package = f"fake_model_{uuid.uuid4().hex[:8]}"
    (site / package).mkdir()
    for name, content in files.items():
        path = site / package / name
        path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
    return package


def _zip(site, members: dict[str, str] | None) -> ZippedFolder:
    """A package with ``model.zip`` holding ``members`` (None: bytes that are no zip)."""
    package = _package(site, {"__init__.py": ""})
    path = site / package / "model.zip"
    if members is None:
        path.write_bytes(b"PK not a zip")
    else:
        with zipfile.ZipFile(path, "w") as zf:
            for name, text in members.items():
                zf.writestr(name, text)
    return ZippedFolder(package, "model.zip", "fake", install=f"pip install {package}")


def _alias_fault(site, kind: str):
    data = b"GGUF" + bytes(range(200))
    split = dict(version="1.0", file_name=f"fake-{uuid.uuid4().hex[:8]}.gguf", size=len(data))
    if kind == "split: a part not installed":
        return SplitGGUF(parts=(f"fake-{uuid.uuid4().hex[:8]}-part1",), sha256="0" * 64, **split)
    if kind == "split: a part of another version":
        return SplitGGUF(parts=tuple(make_parts(site, [data], version="0.9")), sha256="0" * 64, **split)
    if kind == "split: parts that hash to another file":
        return SplitGGUF(parts=tuple(make_parts(site, [data[:50], data[50:]])), sha256="0" * 64, **split)
    if kind == "package not installed":
        return f"fake_model_{uuid.uuid4().hex[:8]}"
    if kind == "package without its .gguf":
        return _package(site, {"__init__.py": ""})
    if kind == "package whose assemble() fails":
        return _package(site, {"__init__.py": "def assemble(path):\n    raise ValueError('part 3 is damaged')\n"})
    if kind == "zip: package not installed":
        return ZippedFolder(f"fake_model_{uuid.uuid4().hex[:8]}", "model.zip", "fake", install="pip install fake")
    if kind == "zip: not a zip":
        return _zip(site, None)
    if kind == "zip: holds no file":
        return _zip(site, {"folder/": ""})
    assert kind == "zip: a path outside its folder"
    return _zip(site, {"config.json": "{}", "../escape.json": "{}"})


ALIAS_FAULTS = ["split: a part not installed", "split: a part of another version",
                "split: parts that hash to another file", "package not installed", "package without its .gguf",
                "package whose assemble() fails", "zip: package not installed", "zip: not a zip",
                "zip: holds no file", "zip: a path outside its folder"]


@pytest.mark.parametrize("kind", ALIAS_FAULTS)
def test_an_alias_whose_packages_are_missing_or_bad_says_its_files(site, monkeypatch, kind):
    monkeypatch.setitem(names.ALIASES, "fake-alias", _alias_fault(site, kind))
    monkeypatch.setitem(names.INSTALL, "fake-alias", "pip install fake-alias")
    words, err = _goodbye("fake-alias")
    assert words == FILES, err  # (each said "its configuration is not valid" before)
    assert isinstance(err.__cause__, ModelFileError)
    assert not list((site.parent / "cache").rglob("*.gguf"))  # nothing half-made left in the cache


# ------------------------------------------------------------------ GGUF files


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    pytest.importorskip("gguf")
    pytest.importorskip("transformers")
    from tests.support.tiny_gguf import write_quantized_gguf

    path = tmp_path_factory.mktemp("gguf") / "whole.gguf"
    write_quantized_gguf(str(path))
    return path.read_bytes()


def _gguf_fault(whole: bytes, kind: str) -> bytes:
    import struct

    def renamed(old: bytes, new: bytes) -> bytes:  # a key or tensor name made another of the same length
        assert len(old) == len(new) and whole.count(old) == 1
        return whole.replace(old, new)

    if kind == "cut in its header":
        return whole[:300]
    if kind == "cut in its tensor data":
        return whole[:len(whole) // 2]
    if kind == "an unknown tensor type":
        name = b"token_embd.weight"
        at = whole.index(name) + len(name)  # then: dimensions (u32), each dimension (u64), the ggml type (u32)
        dims = struct.unpack_from("<I", whole, at)[0]
        data = bytearray(whole)
        struct.pack_into("<I", data, at + 4 + 8 * dims, 999)
        return bytes(data)
    if kind == "no general.architecture":
        return renamed(b"general.architecture", b"general.architXcture")
    if kind == "no key its config needs":
        return renamed(b"llama.embedding_length", b"llama.embedding_lXngth")
    if kind == "no tensor a layer needs":
        return renamed(b"blk.1.ffn_down.weight", b"blk.1.ffn_dXwn.weight")
    assert kind == "no final norm"
    return renamed(b"output_norm.weight", b"output_nXrm.weight")


@pytest.mark.parametrize("kind", ["cut in its header", "cut in its tensor data", "an unknown tensor type",
                                  "no general.architecture", "no key its config needs", "no tensor a layer needs",
                                  "no final norm"])
def test_a_gguf_file_cut_short_garbled_or_incomplete_says_its_files(whole, tmp_path, kind):
    path = tmp_path / "m.gguf"
    path.write_bytes(_gguf_fault(whole, kind))
    words, err = _goodbye(str(path))
    # (no general.architecture said "its configuration is not valid" before; the missing key and tensors
    # "an unexpected error": a KeyError past the loader)
    assert words == FILES, err
    assert isinstance(err.__cause__, ModelFileError)
    assert str(tmp_path) in str(err)  # (the log's line names the file)


@pytest.mark.parametrize("arch, key", [("qwen2", "qwen2.attention.head_count"), ("llama", "llama.block_count"),
                                       ("llama", "llama.attention.layer_norm_rms_epsilon")])
def test_a_gguf_file_without_a_key_llama_cpp_requires_says_its_files(tmp_path, arch, key):
    # (before: the Qwen2 file loaded as Qwen2Config's 32 heads and served; the Llama file without its
    # block_count went to transformers' loader; the epsilon took LlamaConfig's default)
    import struct

    pytest.importorskip("gguf")
    from tests.support.tiny_gguf import write_quantized_gguf

    write_quantized_gguf(str(tmp_path / "whole.gguf"), arch)
    whole = (tmp_path / "whole.gguf").read_bytes()
    named = struct.pack("<Q", len(key)) + key.encode()  # the key as stored: its length, then its bytes
    assert whole.count(named) == 1
    path = tmp_path / "m.gguf"
    path.write_bytes(whole.replace(named, named[:-1] + b"X"))  # another key of the same length
    words, err = _goodbye(str(path))
    assert words == FILES, err
    assert isinstance(err.__cause__, ModelFileError) and key in str(err.__cause__) and str(path) in str(err)


def _with_metadata(whole: bytes, key: str, value: int) -> bytes:
    """The GGUF file ``whole`` with its u32 metadata ``key`` set to ``value`` (the rest as written)."""
    import struct

    named = struct.pack("<Q", len(key)) + key.encode()  # the key as stored: its length, then its bytes
    assert whole.count(named) == 1
    at = whole.index(named) + len(named)
    assert struct.unpack_from("<I", whole, at)[0] == 4  # (GGUF's type code of a u32)
    data = bytearray(whole)
    struct.pack_into("<I", data, at + 4, value)
    return bytes(data)


GGUF_UNFITTING = [  # (arch, metadata key, its new value, the first tensor named: the tiny file is 256 wide, FFN 512,
    # 4 heads of 64, 2 KV heads)
    ("llama", "feed_forward_length", 256, "model.layers.0.mlp.down_proj.weight is [256, 512] in the weights, "
                                          "[256, 256] by its metadata, and 5 other tensors"),
    ("llama", "attention.head_count_kv", 1, "model.layers.0.self_attn.k_proj.weight is [128, 256] in the weights, "
                                            "[64, 256] by its metadata, and 3 other tensors"),
    ("qwen2", "attention.head_count_kv", 4, "model.layers.0.self_attn.k_proj.bias is [128] in the weights, [256] "
                                            "by its metadata, and 7 other tensors"),
]


@pytest.mark.parametrize("options", [dict(runner="slotserve"), dict(runner="slotserve", precision="fp32"),
                                     dict(runner="hf")], ids=["slotserve-gguf", "slotserve-fp32", "hf"])
@pytest.mark.parametrize("arch, key, value, says", GGUF_UNFITTING, ids=[f"{u[0]}-{u[1]}" for u in GGUF_UNFITTING])
def test_a_gguf_files_tensors_that_do_not_fit_its_metadata_are_a_file_fault_on_every_runner(
        tmp_path, arch, key, value, says, options):
    # (before: slotserve's reader loaded the file and every request failed "model failed: RuntimeError: shape
    # '[5, 2, 1, 64]' is invalid for input of size 1280"; the hf runner said "an unexpected error")
    pytest.importorskip("gguf")
    pytest.importorskip("transformers")
    from tests.support.tiny_gguf import write_quantized_gguf
    from worker.models import load_model

    write_quantized_gguf(str(tmp_path / "whole.gguf"), arch)
    path = tmp_path / "m.gguf"
    path.write_bytes(_with_metadata((tmp_path / "whole.gguf").read_bytes(), f"{arch}.{key}", value))
    cause = f"its weights do not match its metadata ({says}); download the model again"
    with pytest.raises(ModelFileError) as raised:
        load_model(str(path), **options)
    assert cause in str(raised.value) and str(path) in str(raised.value), raised.value
    words, err = _goodbye(str(path), **options)
    assert words == f"model 'broken' failed to load: {cause}", words
    assert isinstance(err.__cause__, ModelFileError)


# ------------------------------------------------------------------ Hugging Face folders


LLAMA_CONFIG = ('{"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 1, '
                '"intermediate_size": 128, "vocab_size": 100}')


def _folder_fault(tmp_path, kind: str) -> str:
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text("{ not json" if kind == "config.json that is no JSON" else LLAMA_CONFIG)
    if kind == "safetensors garbled":
        (folder / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage")
    elif kind == "safetensors cut short":
        import torch
        from safetensors.torch import save_file

        save_file({"model.embed_tokens.weight": torch.zeros(100, 64)}, str(folder / "model.safetensors"))
        data = (folder / "model.safetensors").read_bytes()
        (folder / "model.safetensors").write_bytes(data[:len(data) // 2])
    return str(folder)


@pytest.mark.parametrize("kind", ["config.json that is no JSON", "no weights file", "safetensors garbled",
                                  "safetensors cut short"])
def test_a_model_folder_whose_files_are_missing_or_garbled_says_its_files(tmp_path, kind):
    pytest.importorskip("transformers")
    words, err = _goodbye(_folder_fault(tmp_path, kind))
    assert words == FILES, err  # (a safetensors file garbled or cut short said "an unexpected error" before)
    assert isinstance(err.__cause__, ModelFileError)


def _embedding_folder(tmp_path, kind: str) -> str:
    folder = tmp_path / "st"
    (folder / "1_Pooling").mkdir(parents=True)
    (folder / "config.json").write_text('{"model_type": "bert"}')
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if kind == "a Dense module":
        modules.append({"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    import json

    (folder / "modules.json").write_text("[ not json" if kind == "modules.json that is no JSON" else
                                         json.dumps(modules))
    (folder / "1_Pooling" / "config.json").write_text('["a list"]' if kind == "a pooling config that is no object"
                                                      else '{"pooling_mode": "mean"}')
    return str(folder)


@pytest.mark.parametrize("kind, words", [("modules.json that is no JSON", FILES),
                                         ("a pooling config that is no object", FILES),
                                         ("no weights file", FILES),
                                         ("a Dense module", CONFIG)])  # (a pipeline slotserve does not run)
def test_a_sentence_transformers_folder_whose_files_are_bad_says_its_files(tmp_path, kind, words):
    pytest.importorskip("transformers")
    said, err = _goodbye(_embedding_folder(tmp_path, kind))
    assert said == words, err
    assert isinstance(err.__cause__, ModelFileError) == (words == FILES)


def test_options_that_do_not_fit_a_whole_model_still_say_its_configuration(tmp_path):
    # precision gguf for a folder (no GGUF file): the files are whole, the server's options do not fit them
    pytest.importorskip("transformers")
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(LLAMA_CONFIG)
    words, err = _goodbye(str(folder), precision="gguf")
    assert words == CONFIG, err
    assert not isinstance(err.__cause__, ModelFileError)


# ------------------------------------------------------------------ weights that do not fit config.json


def _unfitting_folder(tmp_path, key: str, value, model: str = "llama") -> str:
    """A tiny checkpoint saved whole (config.json and model.safetensors), then its config.json's ``key``
    set to ``value``: a config.json that is not this checkpoint's (another size's, or edited). ``model``:
    ``"llama"`` (:func:`tests.support.slot_models.save_unfitting_llama`) or ``"bert"`` (an encoder, for
    an embedding model)."""
    if model == "llama":
        from tests.support.slot_models import save_unfitting_llama

        return save_unfitting_llama(tmp_path / "m", key, value)
    import json

    import torch
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    folder = tmp_path / "m"
    BertModel(BertConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=1, intermediate_size=128,
                         vocab_size=100, max_position_embeddings=64)).save_pretrained(str(folder))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, key: value}))
    return str(folder)


UNFITTING = [  # (config.json's key, its new value, what the message says; the tiny Llama: 64 wide, 2 layers)
    ("hidden_size", 128, "lm_head.weight is [320, 64] in the weights, [320, 128] by config.json, and 20 other "
                         "tensors"),
    ("vocab_size", 400, "lm_head.weight is [320, 64] in the weights, [400, 64] by config.json, and 1 other tensor"),
    ("num_key_value_heads", 4, "model.layers.0.self_attn.k_proj.weight is [32, 64] in the weights, [64, 64] by "
                               "config.json, and 3 other tensors"),
    ("intermediate_size", 64, "model.layers.0.mlp.down_proj.weight is [64, 128] in the weights, [64, 64] by "
                              "config.json, and 5 other tensors"),
    ("num_hidden_layers", 3, "config.json asks for model.layers.2.input_layernorm.weight, which the weights do not "
                             "hold, and 8 other tensors"),  # (was: their random initial values, served)
]


@pytest.mark.parametrize("runner", ["slotserve", "hf"])
@pytest.mark.parametrize("key, value, says", UNFITTING, ids=[u[0] for u in UNFITTING])
def test_weights_that_do_not_fit_config_json_are_a_file_fault_naming_the_tensor_in_process(
        tmp_path, runner, key, value, says):
    # (before: transformers' RuntimeError "You set `ignore_mismatched_sizes` to `False`, thus raising an error.
    # For details look at the above report!", naming no tensor; a missing layer loaded as noise)
    pytest.importorskip("transformers")
    from worker.models import load_model

    folder = _unfitting_folder(tmp_path, key, value)
    with pytest.raises(ModelFileError) as raised:
        load_model(folder, runner=runner)
    message = str(raised.value)
    assert f"its weights do not match its config.json ({says}); fix config.json or download the model again" \
        in message, message
    assert folder in message and "download" in message  # (the log's line names the folder and what to do)
    assert "ignore_mismatched_sizes" not in message


@pytest.mark.parametrize("runner", ["slotserve", "hf"])
def test_weights_that_do_not_fit_config_json_tell_clients_so_without_the_path(tmp_path, runner):
    pytest.importorskip("transformers")
    words, err = _goodbye(_unfitting_folder(tmp_path, "hidden_size", 128), runner=runner)
    # (before: "model 'broken' failed to load: an unexpected error")
    assert words == ("model 'broken' failed to load: its weights do not match its config.json (lm_head.weight is "
                     "[320, 64] in the weights, [320, 128] by config.json, and 20 other tensors); fix config.json "
                     "or download the model again"), words
    assert str(tmp_path) not in words
    assert isinstance(err.__cause__, ModelFileError) and str(tmp_path) in str(err)


def test_an_embedding_models_weights_that_do_not_fit_config_json_are_a_file_fault(tmp_path):
    pytest.importorskip("transformers")
    from worker.models import load_model

    folder = _unfitting_folder(tmp_path, "hidden_size", 128, model="bert")
    with pytest.raises(ModelFileError) as raised:
        load_model(folder, pooling="mean")
    assert "its weights do not match its config.json" in str(raised.value), raised.value
    assert "embeddings.LayerNorm.bias is [64] in the weights, [128] by config.json" in str(raised.value)
    words, _ = _goodbye(folder, pooling="mean")
    assert words.startswith("model 'broken' failed to load: its weights do not match its config.json"), words


def test_a_checkpoint_whose_weights_fit_its_config_loads_on_both_runners(tmp_path):
    # (the check refuses nothing whole: tied embeddings saved once, as transformers saves them)
    pytest.importorskip("transformers")
    from worker.models import load_model

    from tests.support.slot_models import save_tiny_llama

    folder = str(tmp_path / "m")
    save_tiny_llama(folder, tie_word_embeddings=True)
    for runner in ("slotserve", "hf"):
        assert load_model(folder, runner=runner).vocab_size == 320
