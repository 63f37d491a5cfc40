"""medusa_trt/data.py: the one reader of text sample files (.txt, .jsonl), its forms and its errors."""

from __future__ import annotations

import json

import pytest

from medusa_trt.data import DataError, read_samples
from medusa_trt.errors import MedusaTrtError


def write(path, text: str | bytes):
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def test_txt_is_one_sample_per_non_empty_line(tmp_path):
    # Blank and whitespace-only lines are skipped; other lines are kept as written (inner spaces, no
    # stripping), CRLF endings are line ends, and UTF-8 text survives.
    f = write(tmp_path / "a.txt", "first line\n\n   \n  indented  \r\nüñí ✓\nlast without newline")
    assert read_samples(f) == ["first line", "  indented  ", "üñí ✓", "last without newline"]


def test_jsonl_text_may_hold_newlines(tmp_path):
    code = "def f():\n    return 1\n"
    lines = [json.dumps({"text": code}), "", json.dumps({"text": "x", "other": 1}), json.dumps({"text": ""}),
             json.dumps({"text": "tab\there", "id": 7})]
    f = write(tmp_path / "a.jsonl", "\n".join(lines) + "\n")
    # An empty text is no sample; extra fields are ignored; order is the file's.
    assert read_samples(f) == [code, "x", "tab\there"]


def test_a_txt_line_is_never_parsed_as_json(tmp_path):
    f = write(tmp_path / "a.txt", '{"text": "kept as is"}\n')
    assert read_samples(f) == ['{"text": "kept as is"}']


def test_bad_json_line_names_its_line_number(tmp_path):
    f = write(tmp_path / "d.jsonl", '{"text": "ok"}\n\n{"text": "ok"}\n{"text": unquoted}\n')
    with pytest.raises(DataError, match=r"d\.jsonl:4: not valid JSON .*expected an object like") as e:
        read_samples(f)
    assert "\n" not in str(e.value)


def test_deeply_nested_json_is_a_clear_error(tmp_path):
    f = write(tmp_path / "deep.jsonl", "[" * 100_000 + "\n")
    with pytest.raises(DataError, match=r"deep\.jsonl:1: not valid JSON"):
        read_samples(f)


@pytest.mark.parametrize("line", ['[1, 2]', '"just a string"', '{"txt": "typo"}', '{"text": 5}', '{"text": null}'])
def test_a_line_that_is_not_an_object_with_string_text(tmp_path, line):
    f = write(tmp_path / "b.jsonl", '{"text": "fine"}\n' + line + "\n")
    with pytest.raises(DataError, match=r"b\.jsonl:2: expected an object with a string 'text' field, got") as e:
        read_samples(f)
    assert line[:20] in str(e.value)


@pytest.mark.parametrize("name", ["a.json", "a.csv", "a", "a.TXT", "a.jsonl.gz"])
def test_wrong_suffix(tmp_path, name):
    f = write(tmp_path / name, "some text\n")
    with pytest.raises(DataError, match=rf"{name}: unsupported suffix .*expected \.txt .*or \.jsonl"):
        read_samples(f)


@pytest.mark.parametrize("name,text", [("e.txt", ""), ("e.txt", "\n \n\t\n"), ("e.jsonl", ""),
                                       ("e.jsonl", '{"text": ""}\n\n')])
def test_empty_file_has_no_samples(tmp_path, name, text):
    f = write(tmp_path / name, text)
    with pytest.raises(DataError, match=rf"{name}: no samples"):
        read_samples(f)


def test_missing_file_and_not_utf8(tmp_path):
    with pytest.raises(DataError, match=r"nothere\.txt: file not found"):
        read_samples(tmp_path / "nothere.txt")
    f = write(tmp_path / "latin1.txt", "caf\xe9\n".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1\.txt: cannot read it as UTF-8 text"):
        read_samples(f)
    (tmp_path / "dir.jsonl").mkdir()
    with pytest.raises(DataError, match=r"dir\.jsonl: cannot read it as UTF-8 text"):
        read_samples(tmp_path / "dir.jsonl")


def test_data_error_is_the_project_error():
    """The CLIs turn MedusaTrtError into one line and exit 2: DataError must be one."""
    assert issubclass(DataError, MedusaTrtError)


def test_a_byte_order_mark_is_not_text(tmp_path):
    # Editors on Windows write one at the start of UTF-8 files: it must not join the first sample or
    # hide a ShareGPT JSONL file's shape (it was read as text samples and refused as such).
    from medusa_trt.data import read_sharegpt, sharegpt_shaped

    bom = "\ufeff".encode()
    assert read_samples(write(tmp_path / "a.txt", bom + b"first\nsecond\n")) == ["first", "second"]
    assert read_samples(write(tmp_path / "a.jsonl", bom + b'{"text": "x"}\n')) == ["x"]
    record = {"id": "c1", "conversations": [{"from": "human", "value": "hi"}]}
    shareg = write(tmp_path / "s.jsonl", bom + json.dumps(record).encode() + b"\n")
    assert sharegpt_shaped(shareg) and read_sharegpt(shareg)[0][0].first_human() == "hi"
    assert read_sharegpt(write(tmp_path / "s.json", bom + json.dumps([record]).encode()))[0][0].id == "c1"


def test_user_turns_are_human_turns():
    # ShareGPT variants exported with chat-template role names say "user" for ShareGPT's "human".
    from medusa_trt.data import Conversation

    assert Conversation("c", (("system", "be brief"), ("user", "hi"), ("assistant", "hello"))).first_human() == "hi"
    assert Conversation("c", (("gpt", "hello"),)).first_human() is None


def test_a_draft_vocabulary_holds_at_least_what_a_checkpoint_needs():
    # Targets of 9 distinct tokens: the drafter's vocabulary still holds MIN_DRAFT_VOCAB ids (the
    # next ones by id), or medusa-convert refuses what the training wrote.
    from medusa_trt.checkpoint import MIN_DRAFT_VOCAB
    from medusa_trt.tools.distill import Sample
    from medusa_trt.tools.train_drafter import draft_vocabulary

    samples = [Sample([1, 2] + [10 + i % 9 for i in range(30)], 2, None)]
    ids, share = draft_vocabulary(samples, 4096, 100)
    assert len(ids) == MIN_DRAFT_VOCAB and set(range(10, 19)) <= set(ids.tolist()) and share == 1.0
    assert ids.tolist() == sorted(ids.tolist())
    assert draft_vocabulary(samples, 20, 100)[0].tolist() == ids.tolist()
    assert len(draft_vocabulary([Sample(list(range(60)), 2, None)], 20, 100)[0]) == 20
