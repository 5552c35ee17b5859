"""worker/models/llama/extension.py: a kernel's first build says so; later processes import it silently."""

from __future__ import annotations

import logging

import pytest

torch = pytest.importorskip("torch")

from worker.models.llama import extension  # noqa: E402


def test_a_first_build_says_what_it_compiles_and_where_it_caches_it(tmp_path, monkeypatch, caplog):
    """A fresh machine's first start compiles for about a minute: the log says so (at the default
    level, a warning), naming the source and the cache folder; a build that fails says what runs instead."""
    from torch.utils import cpp_extension

    source = tmp_path / "k.cpp"
    source.write_text("// a kernel\n")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("SLOTSERVE_NO_KERNELS", raising=False)
    monkeypatch.setattr(extension, "cpu_has", lambda flag: True)
    calls = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: calls.append(kw) or "module")
    with caplog.at_level(logging.WARNING, logger=extension.__name__):
        assert extension.build("k", source, ["-O3"], "avx512_bf16", "pure torch runs") == "module"
    (record,) = caplog.records
    assert "compiling k.cpp" in record.getMessage() and str(tmp_path / "cache" / "slotserve" / "kernels") in \
        record.getMessage()
    assert calls[0]["build_directory"].startswith(str(tmp_path / "cache" / "slotserve" / "kernels"))

    caplog.clear()
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: (_ for _ in ()).throw(RuntimeError("no g++")))
    with caplog.at_level(logging.WARNING, logger=extension.__name__):
        assert extension.build("k", source, ["-O3"], "avx512_bf16", "pure torch runs") is None
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == ["compiling k.cpp for this machine: once per "
                                                                      "machine and torch version, about a minute on 2 cores",
                                                                      "k.cpp not built"]
    assert caplog.records[1].getMessage().endswith("pure torch runs")
