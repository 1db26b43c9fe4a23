import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from jpaged.engine.contract import CoreOutputs
from jpaged.engine.output import Detokenizer, OutputProcessor
from jpaged.engine.request import Request, Status
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


def test_the_backend_decodes_where_the_wrapper_would_not_change_its_text():
    tok = Tokenizer(models.WordLevel({"a": 0, ",": 1, "b": 2, "?": 3}, unk_token="?"))
    tok.decoder = decoders.WordPiece(cleanup=False)  # "a , b"
    tok.add_special_tokens(["<s>"])
    for clean, text in ((False, "a , b"), (True, "a, b")):  # transformers' clean-up after it
        wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=clean)
        assert Detokenizer(wrapped, []).decode([0, 1, 2]) == wrapped.decode([0, 1, 2]) == text
        # a token's own text (logprobs) keeps special tokens, as transformers' decode does
        assert Detokenizer(wrapped, []).token(4) == wrapped.decode([4]) == "<s>"


def feed(tokenizer, req, tokens):
    """Hand `req` the tokens as the scheduler and the engine would; the streamed text."""
    out = OutputProcessor(tokenizer)
    state = out.add(req)
    streamed = ""
    for t in tokens:
        step = CoreOutputs([req], [t], [0.0])
        reason = req.append(t)
        if reason:  # what Scheduler.finish does to it
            req.status, req.finish_reason = Status.FINISHED, reason
            step.finished[req] = (reason, None)
        outputs, stopped = out.process(step)
        streamed += "".join(o.text for o in outputs)
        if req.finished or stopped:
            break
    return streamed, state.choices[0]


def test_stop_string_is_cut_and_held_back_while_streaming(tokenizer):
    req = Request(tokenizer.encode("x"), SamplingParams(max_tokens=100, stop=["wörld"]), ())
    streamed, choice = feed(tokenizer, req, tokenizer.encode(TEXT))
    assert choice.finish_reason == "stop"
    assert streamed == choice.text == "héllo "


def test_eos_and_max_tokens(tokenizer):
    eos = tokenizer.encode("!")[0]
    req = Request([1], SamplingParams(max_tokens=5), (eos,))
    _, choice = feed(tokenizer, req, [tokenizer.encode("a")[0], eos])
    assert choice.finish_reason == "stop" and choice.text == "a"
    req = Request([1], SamplingParams(max_tokens=2, ignore_eos=True), (eos,))
    assert req.append(eos) is None
    assert req.append(eos) == "length"


def test_the_stream_emits_what_the_window_of_the_wrapper_emits(tokenizer):
    """`DecodeStream` (the backend's, one call a token) and the window decoded twice a token
    by the wrapper (tokenizers whose text transformers cleans up) split a text alike, random
    byte tokens and contexts ending in half a character among them."""
    rng = np.random.default_rng(0)
    streamed = 0
    for skip in (True, False):
        for _ in range(20):
            ids = rng.integers(0, len(tokenizer), 40).tolist()
            stream = Detokenizer(tokenizer, ids[:8], skip)
            window = Detokenizer(tokenizer, ids[:8], skip)
            window.stream = None
            streamed += stream.stream is not None
            assert [stream.push(t) for t in ids[8:]] == [window.push(t) for t in ids[8:]]
    assert streamed > 10
