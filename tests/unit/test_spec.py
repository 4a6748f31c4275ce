"""Spec files (function.toml): every rule of the format, each error one line naming the file
and the field, and the mapping onto FunctionSpec."""
from __future__ import annotations

import pytest

from dilu.client.spec import SpecError, check_entry, load_spec, parse_spec
from dilu.services.common import functions, models

FULL = """
name = "image-classifier"
entry = "classifier:ImageClassifier"
code = "."
kind = "inference"
priority = "best-effort"
slo_ms = 500.0
max_batch = 16
memory_bytes = 2_000_000_000
min_instances = 1
max_instances = 4
initial_scale = 2
keep_alive_s = 600.0
cold_start_ms = 250.0

[emulation]
model = "resnet152"

[profile]
request_quota = 0.2
limit_quota = 0.5
batch_size = 4

[config]
labels = "imagenet"
"""

EMULATED = 'name = "f"\nslo_ms = 100\n[emulation]\nmodel = "bert_base"\n'


def parse(text: str, **kw):
    return parse_spec(text, source="function.toml", **kw)


def error(text: str, **kw) -> str:
    with pytest.raises(SpecError) as info:
        parse(text, **kw)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("function.toml: ")
    return msg


def test_a_full_spec_maps_every_key_onto_the_function_spec(tmp_path):
    (tmp_path / "function.toml").write_text(FULL)
    loaded = load_spec(tmp_path / "function.toml")
    s = loaded.spec
    assert loaded.code_dir == tmp_path.resolve()
    assert (s.name, s.entry, s.kind, s.priority, s.slo_ms, s.max_batch) == (
        "image-classifier", "classifier:ImageClassifier", "inference", "best-effort", 500.0, 16)
    assert (s.memory_bytes, s.min_instances, s.max_instances, s.initial_scale) == (2_000_000_000, 1, 4, 2)
    assert (s.keep_alive_s, s.cold_start_ms, s.model, s.config) == (600.0, 250.0, "resnet152", {"labels": "imagenet"})
    assert s.code == "" and s.handler == ""  # code is set at upload; the entry wins over the handler
    p = s.profile
    assert (p.function, p.request_quota, p.limit_quota, p.batch_size, p.backend) == (
        "image-classifier", 0.2, 0.5, 4, "operator")


def test_defaults_of_an_emulated_only_function():
    loaded = parse(EMULATED)
    s = loaded.spec
    assert loaded.code_dir is None  # no user code runs: nothing to ship
    assert s.handler.endswith("handlers.emulated") and s.entry == ""
    assert s.memory_bytes == models.memory_bytes("bert_base") and s.cold_start_ms == models.cold_start_ms("bert_base")
    assert (s.kind, s.priority, s.max_batch, s.min_instances, s.max_instances) == (
        "inference", "latency-sensitive", 8, 0, 8)
    assert (s.initial_scale, s.keep_alive_s, s.profile, s.config) == (-1, 0.0, None, {})


def test_code_is_relative_to_the_spec_file_and_must_be_a_folder(tmp_path):
    (tmp_path / "src").mkdir()
    text = 'name = "f"\nentry = "m:C"\nslo_ms = 1\nmemory_bytes = 1\ncode = "src"\n'
    assert parse(text, base_dir=tmp_path).code_dir == (tmp_path / "src").resolve()
    msg = error(text.replace('"src"', '"nope"'), base_dir=tmp_path)
    assert msg.startswith("function.toml: code: folder") and "does not exist" in msg
    assert parse(text.replace('"src"', '""'), base_dir=tmp_path).code_dir is None  # importable as it is


def test_a_code_folder_without_an_entry_is_refused_not_ignored(tmp_path):
    """An emulated-only function runs no code of its own: a code folder given with it would
    silently not be shipped, so it is an error; the default (the spec's folder) applies only with an entry."""
    text = 'name = "f"\ncode = "/nonexistent"\nslo_ms = 1\n[emulation]\nmodel = "bert_base"\n'
    assert error(text, base_dir=tmp_path).startswith("function.toml: code: a code folder is shipped only with an entry")
    assert parse(text.replace('"/nonexistent"', '""'), base_dir=tmp_path).code_dir is None
    with_entry = 'name = "f"\nentry = "m:C"\nslo_ms = 1\nmemory_bytes = 1\n'
    assert parse(with_entry, base_dir=tmp_path).code_dir == tmp_path.resolve()  # the default: the spec's folder


def test_missing_or_unreadable_files_are_spec_errors(tmp_path):
    with pytest.raises(SpecError, match="nope.toml: cannot read the spec file"):
        load_spec(tmp_path / "nope.toml")
    with pytest.raises(SpecError, match="function.toml: cannot read the spec file"):
        load_spec(tmp_path)  # a folder without one


def test_a_functions_folder_stands_for_its_function_toml(tmp_path):
    (tmp_path / "function.toml").write_text(FULL)
    loaded = load_spec(tmp_path)
    assert loaded.spec.name == "image-classifier" and loaded.code_dir == tmp_path.resolve()


@pytest.mark.parametrize("text, expected", [
    ('name = "f\nslo_ms = 1', "function.toml: not valid TOML: "),
    ('name = "f"\nslo_ms = "fast"\n[emulation]\nmodel = "bert_base"', "function.toml: slo_ms: Expected number, got str"),
    ('name = "f"\nmax_batch = 2.5\nslo_ms = 1\n[emulation]\nmodel = "bert_base"',
     "function.toml: max_batch: Expected integer, got number"),
    ('name = "f"\nmemory_bytes = true\nslo_ms = 1\nentry = "m:C"', "function.toml: memory_bytes: Expected integer, got bool"),
    ('slo_ms = 1', "function.toml: name: required"),
    ('name = "f"\nkind = "batch"\nslo_ms = 1', "function.toml: kind: 'batch' is not one of inference, llm, training"),
    ('name = "f"\npriority = "urgent"\nslo_ms = 1', "function.toml: priority: 'urgent' is not one of latency-sensitive, training, best-effort"),
    ('name = "f"\nemulation = 3', "function.toml: emulation: Expected table, got int"),
])
def test_type_errors_name_the_field(text, expected):
    assert error(text).startswith(expected)


def test_a_binary_spec_file_is_not_text():
    with pytest.raises(SpecError, match=r"^function.toml: not valid TOML: not a text file \(not UTF-8\)$"):
        parse(b"\x89PNG\r\n\x1a\n\xff\xfe")  # was the codec's "can't decode byte 0x89 in position 0"


def test_a_typo_is_an_unknown_key_and_lists_the_known_ones():
    msg = error(EMULATED + "modle = 5\n")
    assert msg.startswith("function.toml: emulation.modle: unknown key (known keys of [emulation]: model)")
    msg = error(EMULATED + "max_instances = 5\n")  # a top-level key written under a table
    assert msg.startswith("function.toml: emulation.max_instances: unknown key") and "move it above" in msg
    msg = error('slo = 5\n' + EMULATED)
    assert msg.startswith("function.toml: slo: unknown key (known keys: name, entry,")
    assert "slo_ms" in msg
    msg = error(EMULATED + "[profile]\nrequest_quota = 0.1\nlimit_quota = 0.2\nbatch = 1\n")
    assert msg.startswith("function.toml: profile.batch: unknown key")


@pytest.mark.parametrize("name", ["", "a.b", "has space", "x" * 64, "ümlaut", "a/b"])
def test_names_outside_the_charset_are_refused_not_sanitised(name):
    msg = error(EMULATED.replace('name = "f"', f'name = "{name}"'))
    assert msg.startswith("function.toml: name: ") and "1..63 characters" in msg


@pytest.mark.parametrize("name", ["a", "A-b_9", "x" * 63])
def test_names_in_the_charset_are_kept_as_written(name):
    assert parse(EMULATED.replace('name = "f"', f'name = "{name}"')).spec.name == name


@pytest.mark.parametrize("entry, ok", [
    ("classifier:ImageClassifier", True), ("pkg.sub.mod:Name", True), ("_m:_C", True),
    ("classifier", False), (":C", False), ("m:", False), ("m:C:D", False), ("my-mod:C", False),
    ("m.:C", False), ("class:C", False), ("m:C.D", False), ("1m:C", False),
])
def test_entry_is_module_colon_class_of_identifiers(entry, ok):
    assert (check_entry(entry) is None) == ok
    text = f'name = "f"\nentry = "{entry}"\nslo_ms = 1\nmemory_bytes = 1\ncode = ""\n'
    if ok:
        assert parse(text).spec.entry == entry
    else:
        assert error(text).startswith("function.toml: entry: ")


def test_entry_is_required_unless_emulated_only():
    msg = error('name = "f"\nslo_ms = 1\nmemory_bytes = 1\n')
    assert msg.startswith("function.toml: entry: required")


def test_an_unknown_emulation_model_names_the_known_ones():
    msg = error(EMULATED.replace("bert_base", "gpt5"))
    assert msg.startswith("function.toml: emulation.model: unknown model 'gpt5'") and "resnet152" in msg


def test_memory_is_required_without_an_emulation_model_and_positive():
    base = 'name = "f"\nentry = "m:C"\ncode = ""\nslo_ms = 1\n'
    assert error(base).startswith("function.toml: memory_bytes: required")
    assert error(base + "memory_bytes = 0\n").startswith("function.toml: memory_bytes: must be 1..")
    assert error(base + f"memory_bytes = {2**51}\n").startswith("function.toml: memory_bytes: must be 1..")
    assert parse("memory_bytes = 5\n" + EMULATED).spec.memory_bytes == 5  # given wins over the model's


def test_inference_needs_a_positive_finite_slo():
    base = 'name = "f"\n[emulation]\nmodel = "bert_base"\n'
    assert error(base).startswith("function.toml: slo_ms: required for inference")
    for bad in ("0", "-5", "nan", "inf"):
        assert error(f'slo_ms = {bad}\n' + base).startswith("function.toml: slo_ms: ")
    assert error('slo_ms = 1e308\n' + base) == "function.toml: slo_ms: must be <= 3600000, got 1e+308"
    assert parse('slo_ms = 3600000\n' + base).spec.slo_ms == 3_600_000


def test_llm_needs_ttft_and_tpot_and_derives_its_slo():
    base = 'name = "chat"\nkind = "llm"\n[emulation]\nmodel = "llama2"\n'
    assert error("tpot_ms = 50\n" + base).startswith("function.toml: ttft_ms: required for llm")
    assert error("ttft_ms = 500\n" + base).startswith("function.toml: tpot_ms: required for llm")
    assert error("ttft_ms = 500\ntpot_ms = 0\n" + base).startswith("function.toml: tpot_ms: must be > 0")
    assert error("ttft_ms = 1e308\ntpot_ms = 50\n" + base).startswith("function.toml: ttft_ms: must be <= 3600000")
    s = parse("ttft_ms = 500\ntpot_ms = 50\n" + base).spec
    assert s.slo_ms == functions.request_slo_ms("llm", ttft_ms=500, tpot_ms=50) and (s.ttft_ms, s.tpot_ms) == (500, 50)
    assert parse("ttft_ms = 500\ntpot_ms = 50\nslo_ms = 9000\n" + base).spec.slo_ms == 9000


def test_token_objectives_belong_to_llm_functions_only():
    assert error("ttft_ms = 5\n" + EMULATED).startswith("function.toml: ttft_ms: only llm functions")


def test_training_has_no_objectives_and_defaults_to_one_instance_and_its_priority():
    base = 'name = "job"\nkind = "training"\n[emulation]\nmodel = "gpt2_large"\n'
    s = parse(base).spec
    assert (s.slo_ms, s.priority, s.min_instances) == (0.0, "training", 1)
    assert error("slo_ms = 5\n" + base).startswith("function.toml: slo_ms: training functions take no requests")
    assert parse("priority = \"best-effort\"\n" + base).spec.priority == "best-effort"


@pytest.mark.parametrize("lines, says", [
    ("min_instances = 3\nmax_instances = 2", "max_instances: must be >= min_instances (3), got 2"),
    ("min_instances = 10", "max_instances: must be >= min_instances (10), got 8 (the default)"),
])
def test_a_max_below_the_min_is_worded_as_the_pair(lines, says):
    """Each is within its own range: the message names what is wrong, the pair."""
    assert error(lines + "\n" + EMULATED) == f"function.toml: {says}"


@pytest.mark.parametrize("line, field", [
    ("max_batch = 0", "max_batch"), ("max_batch = 1025", "max_batch"),
    ("min_instances = -1", "min_instances"), ("max_instances = 0", "max_instances"),
    ("min_instances = 3\nmax_instances = 2", "max_instances"), ("min_instances = 1000\nmax_instances = 100000", "max_instances"),
    ("min_instances = 2000", "min_instances"),
    ("initial_scale = -2", "initial_scale"), ("initial_scale = 9", "initial_scale"),
    ("keep_alive_s = -1", "keep_alive_s"), ("cold_start_ms = -1", "cold_start_ms"),
    ("keep_alive_s = 604801", "keep_alive_s"), ("cold_start_ms = 3600001", "cold_start_ms"),
])
def test_bounds_of_counts_and_times(line, field):
    assert error(line + "\n" + EMULATED).startswith(f"function.toml: {field}: must be")


def test_bounds_that_hold_are_accepted():
    s = parse("max_batch = 1024\nmin_instances = 2\nmax_instances = 2\ninitial_scale = 2\n" + EMULATED).spec
    assert (s.max_batch, s.min_instances, s.max_instances, s.initial_scale) == (1024, 2, 2, 2)


@pytest.mark.parametrize("table, field, why", [
    ("request_quota = 0\nlimit_quota = 0.5\nbatch_size = 1", "profile.request_quota", "must be > 0"),
    ("request_quota = 1.5\nlimit_quota = 1.5\nbatch_size = 1", "profile.request_quota", "must be <= 1"),
    ("request_quota = 0.5\nlimit_quota = 0.4\nbatch_size = 1", "profile.limit_quota", "must be >= 0.5"),
    ("request_quota = 0.5\nlimit_quota = 1.1\nbatch_size = 1", "profile.limit_quota", "must be <= 1"),
    ("request_quota = 0.5\nlimit_quota = 0.5\nbatch_size = 0", "profile.batch_size", "must be 1..8"),
    ("request_quota = 0.5\nlimit_quota = 0.5\nbatch_size = 9", "profile.batch_size", "must be 1..8"),
    ("request_quota = 0.5\nlimit_quota = 0.5", "profile.batch_size", "required"),
])
def test_profile_bounds(table, field, why):
    assert error(EMULATED + "[profile]\n" + table + "\n").startswith(f"function.toml: {field}: {why}")


def test_config_values_are_strings_and_errors_name_the_key():
    assert parse(EMULATED + '[config]\na = "1"\nb = "x"\n').spec.config == {"a": "1", "b": "x"}
    msg = error(EMULATED + "[config]\nthreshold = 0.5\n")
    assert msg.startswith("function.toml: config.threshold: values are strings, got float")


def test_a_long_bad_name_is_shown_cut_in_every_message():
    """One rule words a bad name for the spec loader, the CLI and the gateway: its first 40
    characters, then '...'."""
    from dilu.client.spec import NAME_SHOWN, name_problem

    assert name_problem("a" * 63) is None
    why = name_problem("a" * 5000)
    assert why == f"'{'a' * NAME_SHOWN}...' is not a function name (1..63 characters of A-Z a-z 0-9 _ -)"
    assert name_problem("a.b") == "'a.b' is not a function name (1..63 characters of A-Z a-z 0-9 _ -)"


def test_a_byte_order_mark_is_read_past_a_second_one_is_an_error(tmp_path):
    (tmp_path / "function.toml").write_bytes(b"\xef\xbb\xbf" + EMULATED.encode())
    assert load_spec(tmp_path).spec.name == "f"
    assert parse("\ufeff" + EMULATED).spec.model == "bert_base"
    assert "not valid TOML" in error("\ufeff\ufeff" + EMULATED)
