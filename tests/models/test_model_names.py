"""worker/models/names.py: what a ``--model`` name means, checked before anything loads -- a path that
does not exist or is no model, a near miss of an alias, a hub id served only from the local Hugging
Face cache -- each one line, with no request leaving the machine; and the cache root
(worker/models/cache_root.py) that the assembled models and the kernels share."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest

from worker.models import checkpoint
from worker.models.cache_root import cache_root, models_cache
from worker.models.names import ALIASES, locate_model

GGUF_BYTES = b"GGUF" + bytes(20)  # the magic, then anything: the name check reads four bytes


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Any host name looked up (the first step of a request to huggingface.co) fails the test, and
    huggingface_hub believes it may go online: nothing here may depend on HF_HUB_OFFLINE."""
    from huggingface_hub import constants

    def refuse(*args, **kwargs):
        pytest.fail(f"a host name was looked up: {args[:2]}")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty local Hugging Face cache (what huggingface_hub reads at each call)."""
    from huggingface_hub import constants

    folder = tmp_path / "hub"
    folder.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(folder))
    return folder


def cache_repo(hub: Path, repo_id: str, files: dict[str, bytes]) -> Path:
    """``repo_id`` as ``hf download`` leaves it in the cache ``hub``: refs/main naming a snapshot
    folder holding ``files``; returns that folder."""
    repo = hub / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    for name, data in files.items():
        (snapshot / name).write_bytes(data)
    return snapshot


# ---------------------------------------------------------------------- paths


@pytest.mark.parametrize("name", ["./no-such.gguf", "../no-such.gguf", "no-such.gguf", "NO-SUCH.GGUF"])
def test_a_relative_gguf_path_that_does_not_exist_says_so(tmp_path, monkeypatch, name):
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    with pytest.raises(ValueError) as e:
        locate_model(name)
    where = os.path.abspath(name)
    assert str(e.value) == f"model {name!r}: the file {where} does not exist"


@pytest.mark.parametrize("name, says", [("/nonexistent/x.gguf", "the file /nonexistent/x.gguf does not exist"),
                                        ("/nonexistent/model", "no file or folder /nonexistent/model exists"),
                                        ("/etc/hostname/x.gguf", "the file /etc/hostname/x.gguf does not exist")])
def test_an_absolute_path_that_does_not_exist_says_so(name, says):
    with pytest.raises(ValueError) as e:
        locate_model(name)
    assert str(e.value) == f"model {name!r}: {says}" and "\n" not in str(e.value)


def test_a_path_under_the_home_folder_is_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(ValueError, match=rf"the file {tmp_path}/m.gguf does not exist"):
        locate_model("~/m.gguf")
    (tmp_path / "m.gguf").write_bytes(GGUF_BYTES)
    assert locate_model("~/m.gguf") == tmp_path / "m.gguf"
    assert checkpoint.resolve_model_path("~/m.gguf") == (str(tmp_path), "m.gguf")


@pytest.mark.parametrize("content, says", [
    (b"", "is an empty file, not a GGUF model"),
    (b"hello, I am text\n", "is not a GGUF file (it does not start with GGUF's magic bytes)"),
    (b"GGU", "is not a GGUF file"),
])
def test_a_file_named_gguf_that_is_no_gguf_file_says_what_it_is(tmp_path, content, says):
    path = tmp_path / "m.gguf"
    path.write_bytes(content)
    with pytest.raises(ValueError) as e:
        locate_model(str(path))
    assert str(e.value).startswith(f"model {str(path)!r}: {path} {says}"), str(e.value)


def test_a_file_of_another_kind_names_what_a_model_is(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"x" * 16)
    with pytest.raises(ValueError, match=r"is not a \.gguf file; give a GGUF file or the folder of a Hugging Face "
                                         r"model \(the one with its config\.json\)"):
        locate_model(str(path))


def test_neither_a_file_nor_a_folder_is_refused():
    with pytest.raises(ValueError, match=r"model '/dev/null': /dev/null is neither a file nor a folder"):
        locate_model("/dev/null")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads every file")
def test_an_unreadable_file_says_it_cannot_be_read(tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(GGUF_BYTES)
    path.chmod(0)
    with pytest.raises(ValueError, match=rf"cannot read {path}: Permission denied"):
        locate_model(str(path))


def test_a_folder_without_config_or_gguf_is_no_model(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    for name in (str(tmp_path), str(tmp_path) + "/"):
        with pytest.raises(ValueError) as e:
            locate_model(name)
        assert str(e.value) == (f"model {name!r}: {tmp_path} is not a model folder: it has neither a config.json "
                                "(a Hugging Face checkpoint) nor a .gguf file")


def test_a_folder_of_gguf_files_names_one_to_give(tmp_path):
    (tmp_path / "b.gguf").write_bytes(GGUF_BYTES)
    with pytest.raises(ValueError, match=rf"has no config\.json\); to serve a GGUF file in it, give the file: "
                                         rf"{tmp_path}/b\.gguf$"):
        locate_model(str(tmp_path))
    (tmp_path / "a.gguf").write_bytes(GGUF_BYTES)
    with pytest.raises(ValueError, match=rf"give the file: {tmp_path}/a\.gguf \(or another of its 2 \.gguf files\)"):
        locate_model(str(tmp_path))


def test_a_relative_folder_that_exists_is_a_path_not_a_hub_id(tmp_path, monkeypatch, hub_cache):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "model").mkdir(parents=True)
    with pytest.raises(ValueError, match="is not a model folder"):
        locate_model("org/model")
    (tmp_path / "org" / "model" / "config.json").write_text("{}")
    assert locate_model("org/model") == Path("org/model")
    assert checkpoint.resolve_model_path("org/model") == ("org/model", None)


def test_a_gguf_file_and_a_model_folder_resolve(tmp_path):
    (tmp_path / "m.GGUF").write_bytes(GGUF_BYTES)
    assert checkpoint.resolve_model_path(str(tmp_path / "m.GGUF")) == (str(tmp_path), "m.GGUF")
    (tmp_path / "config.json").write_text("{}")
    assert checkpoint.resolve_model_path(str(tmp_path)) == (str(tmp_path), None)


# ---------------------------------------------------------------------- aliases and unknown names


def test_simulated_and_the_aliases_need_no_path():
    assert locate_model("simulated") is None
    assert all(locate_model(alias) is None for alias in ALIASES)


@pytest.mark.parametrize("name, meant", [("qwen2.5-coder-0.5B", "qwen2.5-coder-0.5b"),
                                         ("SmolLM2-135M", "smollm2-135m"), ("smollm2", "smollm2-135m"),
                                         ("qwen2.5-coder-1.5", "qwen2.5-coder-1.5b"), ("Simulated", "simulated")])
def test_a_near_miss_of_an_alias_is_answered_at_once_with_the_alias_meant(name, meant, hub_cache):
    with pytest.raises(ValueError) as e:
        locate_model(name)
    message = str(e.value)
    assert message.startswith(f"unknown model {name!r}; did you mean {meant!r}? Known aliases: "), message
    assert all(repr(alias) in message for alias in ALIASES) and "\n" not in message
    assert "give its .gguf file or its folder (with config.json)" in message
    assert "Nothing is downloaded from a model hub." in message


def test_a_name_near_nothing_lists_the_aliases(hub_cache):
    with pytest.raises(ValueError) as e:
        locate_model("zzzz")
    assert str(e.value).startswith("unknown model 'zzzz': no alias, file or folder has that name. Known aliases: ")


def test_a_hub_id_not_in_the_local_cache_fails_at_once_saying_how_to_get_it(hub_cache):
    with pytest.raises(ValueError) as e:
        locate_model("Qwen/Qwen2.5-Coder-0.5B-Instruct")
    message = str(e.value)
    assert message.startswith("unknown model 'Qwen/Qwen2.5-Coder-0.5B-Instruct'; did you mean 'qwen2.5-coder-0.5b'?")
    assert (f"A Hugging Face hub id is served from the local cache only ({hub_cache}): download it first "
            "(hf download Qwen/Qwen2.5-Coder-0.5B-Instruct).") in message


def test_a_hub_id_in_the_local_cache_is_its_snapshot_folder(hub_cache):
    snapshot = cache_repo(hub_cache, "org/tiny-model", {"config.json": b"{}"})
    assert locate_model("org/tiny-model") == snapshot
    assert checkpoint.resolve_model_path("org/tiny-model") == (str(snapshot), None)

    from slotserve.tokenizer import is_local_model

    assert is_local_model("org/tiny-model") and not is_local_model("org/other-model")


def test_a_cached_hub_repo_of_gguf_files_names_the_file_to_give(hub_cache):
    snapshot = cache_repo(hub_cache, "org/tiny-GGUF", {"tiny-q4_k_m.gguf": GGUF_BYTES})
    with pytest.raises(ValueError, match=rf"give the file: {snapshot}/tiny-q4_k_m\.gguf"):
        locate_model("org/tiny-GGUF")


def test_load_model_refuses_a_bad_name_before_loading_anything(tmp_path, hub_cache, monkeypatch):
    from worker.models import checkpoint, hf, load_model

    monkeypatch.setattr(checkpoint, "load_pretrained", lambda *a, **k: pytest.fail("transformers was asked"))
    monkeypatch.setattr(hf, "load_hf_model", lambda *a, **k: pytest.fail("transformers was asked"))
    for name, says in ((str(tmp_path / "no-such.gguf"), "does not exist"), ("qwen2.5-coder-0.5B", "did you mean"),
                       ("Qwen/Qwen2.5-Coder-0.5B-Instruct", "hf download")):
        for options in ({}, {"runner": "hf"}):
            with pytest.raises(ValueError, match=says):
                load_model(name, **options)


# ---------------------------------------------------------------------- the cache root


@pytest.mark.parametrize("value", [None, "", "relative/cache"])
def test_the_cache_root_is_under_the_home_folder_without_an_absolute_xdg_cache_home(tmp_path, monkeypatch, value):
    monkeypatch.setenv("HOME", str(tmp_path))
    if value is None:
        monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    else:
        monkeypatch.setenv("XDG_CACHE_HOME", value)  # the XDG spec: relative or empty values are ignored
    assert cache_root() == tmp_path / ".cache" / "slotserve"


def test_without_a_home_folder_the_cache_root_says_which_variable_to_set(monkeypatch):
    """HOME unset, no XDG_CACHE_HOME and a uid with no passwd entry: an OSError naming the variables
    (failed before: pathlib's RuntimeError 'Could not determine home directory.', which no cache
    caller passes by); an absolute XDG_CACHE_HOME alone still names the folder."""
    import pwd

    def no_entry(uid):
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("HOME", raising=False)
    monkeypatch.setattr(pwd, "getpwuid", no_entry)
    for call in (cache_root, models_cache):
        with pytest.raises(OSError, match="set XDG_CACHE_HOME or HOME"):
            call()
    monkeypatch.setenv("XDG_CACHE_HOME", "/xdg")
    assert cache_root() == Path("/xdg/slotserve")


def test_assembled_and_extracted_models_follow_xdg_cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "slotserve"
    assert models_cache() == tmp_path / "xdg" / "slotserve" / "models"
    split = ALIASES["qwen2.5-coder-0.5b"]
    assert split.path() == tmp_path / "xdg" / "slotserve" / "models" / split.file_name
    assert ALIASES["all-minilm-l6-v2"].cache_dir() == tmp_path / "xdg" / "slotserve" / "models"


def test_a_package_that_assembles_its_gguf_writes_it_in_the_same_cache(tmp_path, monkeypatch):
    """gemma3-270m's package's ``assemble()`` wrote into its own default, ``~/.cache/<package>``,
    whatever XDG_CACHE_HOME said; slotserve now gives it the path (the package's signature:
    ``assemble(output_path=None, overwrite=False)``, ``MODEL_NAME``), under the one cache root."""
    from worker.models import checkpoint

    package = tmp_path / "lib" / "fake_gemma_gguf"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(
        "from pathlib import Path\nMODEL_NAME = 'gemma.gguf'\nasked = []\n"
        "def assemble(output_path=None, overwrite=False):\n"
        "    p = Path.home() / '.cache' / 'fake_gemma_gguf' / MODEL_NAME if output_path is None else Path(output_path)\n"
        "    asked.append(output_path); p.parent.mkdir(parents=True, exist_ok=True); p.write_bytes(b'GGUF')\n"
        "    return p\n")
    monkeypatch.syspath_prepend(str(tmp_path / "lib"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setitem(checkpoint.ALIASES, "fake-gemma", "fake_gemma_gguf")
    sys.modules.pop("fake_gemma_gguf", None)  # (another test's fake package of the same name: not this one)
    try:
        for xdg, root in ((str(tmp_path / "xdg"), tmp_path / "xdg"), ("", tmp_path / "home" / ".cache")):
            monkeypatch.setenv("XDG_CACHE_HOME", xdg)
            folder = root / "slotserve" / "models" / "fake_gemma_gguf"
            assert checkpoint.resolve_model_path("fake-gemma") == (str(folder), "gemma.gguf")
            assert (folder / "gemma.gguf").read_bytes() == b"GGUF"
    finally:
        sys.modules.pop("fake_gemma_gguf", None)  # (leave no module of this folder to the next test)
    assert not (tmp_path / "home" / ".cache" / "fake_gemma_gguf").exists()  # (the package's own default: unused)


def test_the_kernels_are_built_under_the_same_cache_root(tmp_path, monkeypatch):
    """(A relative XDG_CACHE_HOME is ignored there too: it was taken as is, a cache in the working folder.)"""
    from torch.utils import cpp_extension

    from worker.models.llama import extension

    source = tmp_path / "k.cpp"
    source.write_text("// a kernel\n")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", "relative-cache")
    monkeypatch.delenv("SLOTSERVE_NO_KERNELS", raising=False)
    monkeypatch.setattr(extension, "cpu_has", lambda flag: True)
    folders = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: folders.append(kw["build_directory"]) or "module")
    assert extension.build("k", source, ["-O3"], "avx512_bf16", "pure torch runs") == "module"
    assert Path(folders[0]).parent == cache_root() / "kernels" == tmp_path / ".cache" / "slotserve" / "kernels"
