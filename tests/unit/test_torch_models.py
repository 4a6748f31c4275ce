"""The torch_models handler (random-weight ResNet-50, BERT-base, GPT-2 small) through the handler
contract, shrunk with DILU_TORCH_TINY=1 so it runs on a small CPU in seconds."""
import pytest

torch = pytest.importorskip("torch")

from dilu.services.node_agent.handlers import HandlerContext, load_module  # noqa: E402

HANDLER = "dilu.services.node_agent.handlers.torch_models"
MODELS = ["resnet50", "bert_base", "gpt2"]
ODD = [b"", b"\xff" * 5000, b"{not json", b'{"max_new_tokens": "many"}', b"[1, 2]", b"\x00"]


@pytest.fixture
def handler(monkeypatch):
    monkeypatch.setenv("DILU_TORCH_TINY", "1")
    return load_module(HANDLER)


def context(model: str, batch_size: int = 2, device: str = "cpu") -> HandlerContext:
    return HandlerContext(instance_id=f"{model}-0", function=model, model=model, batch_size=batch_size, device=device)


@pytest.mark.parametrize("model", MODELS)
def test_a_batch_of_three_gets_three_deterministic_outputs(handler, model):
    m = handler.load(context(model))  # batch_size 2: the batch of 3 runs in two chunks
    batch = [b"cat", b"dog", b"cat"]
    out = handler.predict(m, batch)
    assert len(out) == 3 and all(isinstance(o, bytes) and o for o in out)
    assert out[0] == out[2]
    assert handler.predict(m, batch) == out
    # a second instance holds the same weights: same answers
    assert handler.predict(handler.load(context(model)), batch) == out


@pytest.mark.parametrize("model", MODELS)
def test_empty_and_odd_payloads_do_not_crash(handler, model):
    m = handler.load(context(model, batch_size=4))
    out = handler.predict(m, ODD)
    assert len(out) == len(ODD)
    assert handler.predict(m, []) == []


@pytest.mark.parametrize("model", MODELS)
def test_the_input_comes_from_the_payload(handler, model):
    m = handler.load(context(model))
    a, b, a2 = m.inputs([b"one", b"two", b"one"])
    assert torch.equal(a, a2) and not torch.equal(a, b)


def test_outputs_are_class_indices_or_token_ids(handler):
    sizes = handler.TINY
    for model, bound in (("resnet50", sizes.classes), ("bert_base", sizes.bert_labels)):
        out = handler.predict(handler.load(context(model)), [b"a", b"b", b"c"])
        assert all(0 <= int(o) < bound for o in out)
    m = handler.load(context("gpt2", batch_size=4))
    out = handler.predict(m, [b"hello", b'{"max_new_tokens": 3}', b'{"max_new_tokens": 0}',
                              b'{"max_new_tokens": 100000}'])
    lengths = [len(o.split()) for o in out]
    assert lengths == [handler.DEFAULT_NEW_TOKENS, 3, 1, sizes.max_new_tokens_cap]
    assert all(0 <= int(t) < sizes.gpt_vocab for o in out for t in o.split())


def test_tiny_is_opt_in(monkeypatch, handler):
    monkeypatch.delenv("DILU_TORCH_TINY")
    assert handler.sizes_from_env() == handler.FULL
    full = handler.FULL
    assert (full.image, full.layers, full.d_model, full.heads, full.bert_seq) == (224, 12, 768, 12, 128)


def test_unknown_model_or_device_is_a_clear_error(handler):
    with pytest.raises(ValueError, match="unknown model"):
        handler.load(context("resnet9000"))
    with pytest.raises(ValueError, match="'cuda' or 'cpu'"):
        handler.load(context("resnet50", device="emulated"))
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="no CUDA GPU"):
            handler.load(context("resnet50", device="cuda"))
