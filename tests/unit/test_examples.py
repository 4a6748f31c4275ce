"""The example functions under examples/: each class built tiny on the CPU through the function
contract (dilu.client.functions), fed its sample payload and garbage; and each function.toml
checked with the spec loader, its entry imported from its own folder as an instance would."""
from __future__ import annotations

import importlib
import io
import json
import math
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from dilu.client.functions import FunctionContext  # noqa: E402
from dilu.services.common import functions, models  # noqa: E402
from dilu.services.node_agent.handlers import torch_models as tm  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
# folder -> (entry, kind, sample file or None)
CATALOGUE = {
    "image-classifier": ("image_classifier:ImageClassifier", "inference", "sample.png"),
    "text-encoder": ("text_encoder:TextEncoder", "inference", "sample.txt"),
    "text-generator": ("text_generator:TextGenerator", "llm", "sample.json"),
    "trainer": ("trainer:Trainer", "training", None),
}
METHOD = {"inference": "predict", "llm": "generate", "training": "train_step"}
GARBAGE = [b"", b"\xff\xfe\x00garbage{", b"\x89PNG\r\n\x1a\n truncated", bytes(range(256)) * 20]


def import_entry(folder: Path, entry: str) -> type:
    """The class ``module:Name`` imported with ``folder`` first on sys.path (as an instance
    imports from its unpacked bundle); the module must come from that folder."""
    module_name, _, name = entry.partition(":")
    sys.path.insert(0, str(folder))
    try:
        module = importlib.import_module(module_name)
    finally:
        sys.path.remove(str(folder))
    assert Path(module.__file__).resolve().parent == folder.resolve(), module.__file__
    return getattr(module, name)


@pytest.fixture(scope="module", autouse=True)
def _forget_example_modules():
    """The examples' modules leave sys.modules after this file (their names are the user's)."""
    yield
    for entry, _, _ in CATALOGUE.values():
        sys.modules.pop(entry.partition(":")[0], None)


def build(folder: str, batch_size: int = 2, **config: str):
    entry, kind, _ = CATALOGUE[folder]
    cls = import_entry(EXAMPLES / folder, entry)
    ctx = FunctionContext(instance_id="t", function=folder, device="cpu", kind=kind, batch_size=batch_size,
                          config={"size": "tiny", **config})
    return cls(ctx)


def sample(folder: str) -> bytes:
    return (EXAMPLES / folder / CATALOGUE[folder][2]).read_bytes()


@pytest.fixture(scope="module")
def classifier():
    return build("image-classifier")


@pytest.fixture(scope="module")
def encoder():
    return build("text-encoder")


@pytest.fixture(scope="module")
def generator():
    return build("text-generator", batch_size=8)


# ------------------------------------------------------------------------------ image classifier


def test_classifier_answers_class_and_score_deterministically(classifier):
    batch = [sample("image-classifier"), *GARBAGE]
    out = classifier.predict(batch)
    assert len(out) == len(batch)
    for answer in map(json.loads, out):
        assert set(answer) == {"class", "score"}
        assert isinstance(answer["class"], int) and 0 <= answer["class"] < tm.TINY.classes
        assert isinstance(answer["score"], float) and 0.0 < answer["score"] <= 1.0
    assert classifier.predict(batch) == out
    assert build("image-classifier").predict(batch) == out  # another instance holds the same weights


def test_classifier_class_depends_on_the_input_and_keeps_the_order(classifier):
    payloads = [b"image %d" % i for i in range(24)]
    classes = [json.loads(a)["class"] for a in classifier.predict(payloads)]  # chunks of 2
    assert len(set(classes)) >= 3
    alone = [json.loads(classifier.predict([p])[0])["class"] for p in payloads[:5]]
    assert alone == classes[:5]


def test_classifier_decodes_images_with_pillow(classifier):
    Image = pytest.importorskip("PIL.Image")  # optional: without Pillow every payload is hashed
    buf = io.BytesIO()
    Image.new("RGB", (50, 30), (255, 0, 0)).save(buf, format="PNG")
    x = classifier.image(buf.getvalue())
    assert x.shape == (3, tm.TINY.image, tm.TINY.image)
    expected = (torch.tensor([1.0, 0.0, 0.0]) - torch.tensor([0.485, 0.456, 0.406])) / torch.tensor([0.229, 0.224, 0.225])
    assert torch.allclose(x[:, 5, 5], expected, atol=1e-5)


def test_classifier_refuses_an_unknown_size_or_device():
    with pytest.raises(ValueError, match="size"):
        build("image-classifier", size="huge")
    cls = import_entry(EXAMPLES / "image-classifier", CATALOGUE["image-classifier"][0])
    with pytest.raises(ValueError, match="emulated"):
        cls(FunctionContext(instance_id="t", function="f", device="emulated", config={"size": "tiny"}))


# ---------------------------------------------------------------------------------- text encoder


def test_encoder_answers_embedding_and_label_deterministically(encoder):
    batch = [sample("text-encoder"), *GARBAGE]
    out = encoder.predict(batch)
    assert len(out) == len(batch)
    for answer in map(json.loads, out):
        assert set(answer) == {"embedding_dim", "embedding", "label"}
        assert answer["embedding_dim"] == tm.TINY.d_model
        assert len(answer["embedding"]) == 8 and all(isinstance(v, float) and -1 <= v <= 1 for v in answer["embedding"])
        assert answer["label"] in (0, 1)
    assert encoder.predict(batch) == out
    assert build("text-encoder").predict(batch) == out


def test_encoder_tokens_are_whitespace_words_case_folded(encoder):
    a, b, c = map(json.loads, encoder.predict([b"Hello   WORLD\n", b"hello world", b"world hello"]))
    assert a == b
    assert a["embedding"] != c["embedding"]  # positions matter: a different text


def test_encoder_answer_does_not_depend_on_the_batch(encoder):
    text = sample("text-encoder")
    in_batch = json.loads(encoder.predict([b"other words here", text, b"x"])[1])
    alone = json.loads(encoder.predict([text])[0])
    assert alone["label"] == in_batch["label"]
    assert alone["embedding"] == pytest.approx(in_batch["embedding"], abs=2e-4)


# -------------------------------------------------------------------------------- text generator


def collect(steps, n: int) -> tuple[int, list[list[bytes]]]:
    """(number of steps, each request's chunks), checking every step has one item a request and
    that a request's chunks come before its Nones (no gaps)."""
    count, chunks, done = 0, [[] for _ in range(n)], [False] * n
    for step in steps:
        count += 1
        assert isinstance(step, list) and len(step) == n
        for i, chunk in enumerate(step):
            if chunk is None:
                done[i] = True
            else:
                assert not done[i], f"request {i} produced a chunk after a None"
                assert isinstance(chunk, bytes) and chunk.strip()
                chunks[i].append(chunk)
    return count, chunks


def test_generator_streams_each_request_its_own_length(generator):
    cap = tm.TINY.max_new_tokens_cap
    batch = [sample("text-generator"), b'{"prompt": "a b", "max_new_tokens": 3}', b"a plain text prompt",
             b'{"prompt": "x", "max_new_tokens": 1}', b'{"max_new_tokens": 0}', b'{"prompt": 5, "max_new_tokens": "many"}',
             b'{"prompt": "long", "max_new_tokens": 100000}', GARBAGE[1]]
    wanted = [json.loads(sample("text-generator"))["max_new_tokens"], 3, 16, 1, 1, 16, cap, 16]
    count, chunks = collect(generator.generate(batch), len(batch))
    assert count == max(wanted)
    assert [len(c) for c in chunks] == wanted
    for c in chunks:
        assert not c[0].startswith(b" ") and all(x.startswith(b" ") for x in c[1:])
        assert all(x.decode().strip() in generator_words() for x in c)


def generator_words() -> tuple[str, ...]:
    return sys.modules["text_generator"].WORDS


def test_generator_is_deterministic_lazy_and_batch_independent(generator):
    prompt = sample("text-generator")
    batch = [prompt, b"something else entirely", prompt]
    _, first = collect(generator.generate(batch), 3)
    _, again = collect(build("text-generator").generate(batch), 3)
    assert first == again and first[0] == first[2]
    assert b"".join(first[0]) != b"".join(first[1])
    _, alone = collect(generator.generate([prompt]), 1)
    assert alone[0] == first[0]
    steps = generator.generate([prompt])
    assert next(steps)[0] == first[0][0]  # a step is available before the rest is computed
    steps.close()
    assert list(generator.generate([])) == []


# --------------------------------------------------------------------------------------- trainer


def parameters(net) -> list:
    return [p.detach().clone() for p in net.parameters()]


def test_trainer_steps_change_the_parameters_with_a_finite_loss():
    job = build("trainer")
    assert math.isnan(job.last_loss) and job.steps == 0
    before = parameters(job.net)
    assert job.train_step() is None
    assert math.isfinite(job.last_loss) and job.last_loss > 0 and job.steps == 1
    after = parameters(job.net)
    assert any(not torch.equal(a, b) for a, b in zip(before, after))
    job.train_step()
    assert any(not torch.equal(a, b) for a, b in zip(after, parameters(job.net)))


def test_trainer_is_seeded_and_reads_its_config():
    a, b = build("trainer"), build("trainer")
    losses = []
    for job in (a, b):
        for _ in range(3):
            job.train_step()
        losses.append(job.last_loss)
    assert losses[0] == losses[1]
    images, labels = build("trainer", batch="4").minibatch()
    assert images.shape == (4, 3, 16, 16) and labels.shape == (4,)
    assert int(labels.min()) >= 0 and int(labels.max()) < 10
    for bad in ({"batch": "0"}, {"batch": "many"}, {"lr": "-1"}, {"lr": "nan"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            build("trainer", **bad)


# ------------------------------------------------------------------------------ spec files, docs


@pytest.mark.parametrize("folder", ["image-classifier", "text-encoder"])
def test_the_inference_examples_park_and_answer_the_same_after_a_resume(folder):
    """They define ``park`` and ``resume`` (the platform parks an idle instance only then): the
    weights leave the device and come back, and the answers do not change."""
    fn = build(folder)
    before = fn.predict([sample(folder)])
    fn.park()
    assert all(p.device.type == "cpu" for p in fn.net.parameters())
    fn.resume()
    assert all(p.device.type == fn.device.type for p in fn.net.parameters())
    assert fn.predict([sample(folder)]) == before


def test_every_example_is_catalogued():
    assert sorted(p.parent.name for p in EXAMPLES.glob("*/function.toml")) == sorted(CATALOGUE)


@pytest.mark.parametrize("folder", sorted(CATALOGUE))
def test_spec_loads_and_its_entry_resolves_from_its_folder(folder):
    spec_mod = pytest.importorskip("dilu.client.spec", reason="dilu.client.spec (load_spec) not written yet")
    loaded = spec_mod.load_spec(EXAMPLES / folder / "function.toml")
    spec = loaded.spec
    entry, kind, _ = CATALOGUE[folder]
    assert (spec.name, spec.entry, spec.kind, spec.handler) == (folder, entry, kind, "")
    assert loaded.code_dir == (EXAMPLES / folder).resolve()
    cls = import_entry(loaded.code_dir, spec.entry)
    assert isinstance(cls, type) and callable(getattr(cls, METHOD[kind], None))
    # an emulated GPU allocates the emulation model's weights inside the instance's reservation
    assert spec.model in models.MODELS and spec.memory_bytes >= models.weight_bytes(spec.model)
    for device in functions.DEVICE_KINDS:
        assert functions.runs_on(spec, device) is None, device
    if kind == "training":
        assert (spec.priority, spec.min_instances, spec.slo_ms) == ("training", 1, 0.0)
        assert spec.profile is not None and spec.profile.backend == "operator"
        assert (spec.profile.request_quota, spec.profile.limit_quota, spec.profile.batch_size) == (0.1, 1.0, 1)
    else:
        assert spec.priority == "latency-sensitive" and spec.slo_ms > 0 and spec.max_batch == 8


@pytest.mark.parametrize("folder", sorted(CATALOGUE))
def test_readme_says_how_to_deploy_and_invoke(folder):
    readme = (EXAMPLES / folder / "README.md").read_text()
    assert f"dilu deploy examples/{folder}/function.toml" in readme
    sample_file = CATALOGUE[folder][2]
    if sample_file:
        assert (EXAMPLES / folder / sample_file).is_file()
        assert f"dilu invoke {folder} --data @examples/{folder}/{sample_file}" in readme
        assert (f"curl --data-binary @examples/{folder}/{sample_file} "
                f"http://127.0.0.1:8080/v1/functions/{folder}:invoke") in readme
