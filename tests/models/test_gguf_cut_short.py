"""A GGUF file cut short (a download or copy that did not finish) or corrupt says so in slotserve's
words, wherever it ends: the header (metadata, tensor table) was read by transformers' reader, whose
``struct.error`` came out as "unpack_from requires a buffer of at least 5004 bytes ..."; a file whose
header was whole but whose tensor data was cut was read as far as it went (numpy's slice of the map
past its end is short), failing later in a reshape or not at all."""

from __future__ import annotations

import pytest

pytest.importorskip("gguf")
pytest.importorskip("transformers")

from tests.support.tiny_gguf import write_quantized_gguf  # noqa: E402
from worker.models.checkpoint import read_gguf  # noqa: E402
from worker.models.gguf_header import read_table  # noqa: E402


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "whole.gguf"
    write_quantized_gguf(str(path))
    return path


def _cut(whole, tmp_path, size: int):
    data = whole.read_bytes()
    cut = tmp_path / f"cut{size}.gguf"
    cut.write_bytes(data[:size])
    return cut


def _data_start(whole) -> int:
    """The first tensor's offset: where the header (and its alignment padding) ends."""
    return min(start for *_, start in read_table(str(whole)).entries)


@pytest.mark.parametrize("where", ["magic and version", "metadata", "late metadata", "tensor table"])
def test_a_file_cut_in_its_header_says_so(whole, tmp_path, where):
    start = _data_start(whole)
    size = {"magic and version": 10, "metadata": 200, "late metadata": start // 2, "tensor table": start - 40}[where]
    with pytest.raises(ValueError) as e:
        read_table(str(_cut(whole, tmp_path, size)))
    assert str(e.value) == (f"the file is cut short or corrupt: its header (metadata and tensor table) runs past the "
                            f"file's end ({size:,} bytes); a download or copy that did not finish leaves this")


@pytest.mark.parametrize("keep", ["half", "all but a byte"])
def test_a_file_cut_in_its_tensor_data_names_the_first_tensor_past_its_end(whole, tmp_path, keep):
    full = whole.stat().st_size
    size = full // 2 if keep == "half" else full - 1
    table = read_table(str(whole))
    import gguf
    import math

    def end(entry):
        _, shape, ggml_type, start = entry
        block, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
        return start + math.prod(shape) // block * nbytes

    first = next(e for e in table.entries if end(e) > size)
    with pytest.raises(ValueError) as e:
        read_table(str(_cut(whole, tmp_path, size)))
    assert str(e.value) == (f"the file is cut short: tensor {first[0]!r} ends at byte {end(first):,}, past the "
                            f"file's {size:,} bytes; a download or copy that did not finish leaves this")


def test_the_loader_names_the_file_once(whole, tmp_path):
    cut = _cut(whole, tmp_path, whole.stat().st_size // 2)
    with pytest.raises(ValueError) as e:
        read_gguf(str(cut))
    message = str(e.value)
    assert message.startswith(f"cannot read GGUF file {str(cut)!r}: the file is cut short: tensor ")
    assert message.count(str(cut)) == 1


def test_a_whole_file_reads(whole):
    table = read_table(str(whole))
    assert table.entries and table.metadata["general.architecture"] == "llama"
