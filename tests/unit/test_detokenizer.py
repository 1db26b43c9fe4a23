import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from jpaged.engine.request import Detokenizer, Request
from jpaged.engine.sampling import SamplingParams

TEXT = "héllo wörld, 世界 🙂 naïve café — ok"


@pytest.fixture(scope="module")
def tokenizer():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(["hello world, the quick brown fox"] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_never_emits_half_a_character(tokenizer):
    ids = tokenizer.encode(TEXT)
    assert len(ids) > len(TEXT)  # multi-byte characters really are split into byte tokens
    detok = Detokenizer(tokenizer, tokenizer.encode("prompt: "))
    pieces = [detok.push(t) for t in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == TEXT


def test_stop_string_is_cut_and_held_back_while_streaming(tokenizer):
    req = Request(
        tokenizer.encode("x"), SamplingParams(max_tokens=100, stop=["wörld"]), tokenizer, ()
    )
    streamed = ""
    for t in tokenizer.encode(TEXT):
        req.append(t, 0.0)
        streamed += req.take_output([t]).text
        if req.finished:
            break
    assert req.finish_reason == "stop"
    assert streamed == req.text == "héllo "


def test_eos_and_max_tokens(tokenizer):
    eos = tokenizer.encode("!")[0]
    req = Request([1], SamplingParams(max_tokens=5), tokenizer, (eos,))
    req.append(tokenizer.encode("a")[0], 0.0, None)
    req.append(eos, 0.0)
    assert req.finish_reason == "stop" and req.text == "a"
    req = Request([1], SamplingParams(max_tokens=2, ignore_eos=True), tokenizer, (eos,))
    req.append(eos, 0.0)
    assert not req.finished
    req.append(eos, 0.0)
    assert req.finish_reason == "length"
