"""``--chat-template`` takes a Jinja template or its file; a name of a template built into llama.cpp
(``--chat-template chatml``, what a llama.cpp user types) is refused, saying what to give instead."""

from __future__ import annotations

import pytest

from worker.models.options import chat_template_text


@pytest.mark.parametrize("value", ["chatml", "llama3", "mistral-v7", "no-such-file.jinja"])
def test_a_template_name_or_a_missing_file_says_what_to_give(value):
    with pytest.raises(ValueError) as e:
        chat_template_text(value)
    words = str(e.value)
    assert words.startswith(f"chat_template: '{value}' is no file, and no Jinja template"), words
    assert "give the template's file or its text" in words and "built into llama.cpp" in words, words


def test_a_file_and_jinja_text_are_taken(tmp_path):
    path = tmp_path / "chatml"  # (a file is read whatever its name)
    path.write_text("{{ messages[0]['content'] }}")
    assert chat_template_text(str(path)) == "{{ messages[0]['content'] }}"
    assert chat_template_text("{% for m in messages %}{{ m.content }}{% endfor %}").startswith("{% for")
