"""pi0.5 prompt text, state discretization and tokenization, checked against hand-computed values."""
import pathlib

import numpy as np
import pytest
import torch

from flashrt_core.errors import InputError
from flashrt_core.models.pi05 import (SentencePieceTokenizer, TinyTokenizer, discretize_state, format_prompt,
                                      tokenize_prompt)

# Tolerances: none; every value here is an exact integer or string.
TOL = {}


def test_discretize_by_hand():
    # 256 bins of width 1/128 over [-1, 1): bin = floor((x + 1) * 128), edges inclusive on the left,
    # everything >= 1 - 1/128 in bin 255, and values below -1 give -1 (LeRobot does not clip).
    state = np.array([-1.0, -0.99, -0.5, 0.0, 0.5, 0.999, 1.0, 3.0, -1.5], dtype=np.float32)
    assert discretize_state(state).tolist() == [0, 1, 64, 128, 192, 255, 255, 255, -1]
    # torch input and a batch dimension work the same way.
    t = torch.tensor([[0.25, -0.25]])
    assert discretize_state(t).tolist() == [[160, 96]]


def test_discretize_keeps_float32_like_lerobot():
    # 0.1 in fp32 is 0.100000001490116...; (x + 1) * 128 = 140.8 either way, but an edge value like
    # -1 + 141/128 = 0.1015625 is exact in both: it must land in bin 141, not 140.
    assert discretize_state(np.float32([0.1015625])).tolist() == [141]
    assert discretize_state(np.float32([np.nextafter(np.float32(0.1015625), np.float32(0))])).tolist() == [140]
    with pytest.raises(InputError, match="NaN"):
        discretize_state(np.array([0.0, np.nan]))


def test_format_prompt_by_hand():
    text = format_prompt("  pick_up\nthe red_cube ", np.float32([-1.0, 0.0, 0.5, 1.0]))
    assert text == "Task: pick up the red cube, State: 0 128 192 255;\nAction: "
    with pytest.raises(InputError, match="1-D"):
        format_prompt("x", np.zeros((2, 3), np.float32))


def test_tiny_tokenizer_and_padding():
    tok = TinyTokenizer()
    ids = tok.encode("Ab é")
    assert ids == [65 + 3, 98 + 3, 32 + 3, 0xC3 + 3, 0xA9 + 3]  # UTF-8 bytes shifted past pad/eos/bos
    assert tok.decode(ids) == "Ab é"
    tokens, mask = tokenize_prompt(tok, "Hi", 6)
    assert tokens.tolist() == [[2, 72 + 3, 105 + 3, 0, 0, 0]]  # BOS first, right-padded with pad id 0
    assert mask.tolist() == [[True, True, True, False, False, False]]
    assert tokens.dtype == torch.long and mask.dtype == torch.bool
    long_tokens, long_mask = tokenize_prompt(tok, "abcdef", 4)  # truncation keeps BOS and the first ids
    assert long_tokens.tolist() == [[2, 100, 101, 102]] and long_mask.all()
    full = format_prompt("pick up the red cube", np.float32(np.linspace(-1, 1, 8)))
    t, m = tokenize_prompt(tok, full, 128)
    assert int(m.sum()) == 1 + len(full.encode()) <= 128 and int(t.max()) < 1024  # fits the tiny model
    with pytest.raises(InputError, match="max_len"):
        tokenize_prompt(tok, "x", 0)
    with pytest.raises(InputError, match=r"prompt: 7 tokens with BOS, more than prompt_len = 4; the end of 'abcdef'"):
        tokenize_prompt(tok, "abcdef", 4, truncate=False)  # the contract runtime's form: never cut
    assert tokenize_prompt(tok, "abc", 4, truncate=False)[1].all()


def test_the_full_size_stand_in_tokenizer_fits_w2_prompts_in_48_tokens():
    """The full-size model without a checkpoint (benchmarks) has no SentencePiece file: its stand-in gives a
    token per word or number, as SentencePiece roughly does, so W2's 48 tokens hold a task and an 8-value
    state (one token per byte needed 100); ids stay inside the vocabulary and are the same in every process."""
    from flashrt_core.models.pi05.binding import Pi05Binding
    from flashrt_core.contract.spec import load_contract
    from flashrt_core.models.pi05.policy import choose_tokenizer
    from flashrt_core.models.pi05 import WordTokenizer

    tok = WordTokenizer(257152)
    text = format_prompt("pick up the red cube and put it in the bowl", np.ones(8, np.float32))
    tokens, mask = tokenize_prompt(tok, text, 48, truncate=False)
    assert int(mask.sum()) == 1 + len(text.split()) == 23 and 3 <= int(tokens[0, 1:23].min())
    assert int(tokens.max()) < 257152 and tok.encode("State: 12") == tok.encode("State:   12")
    assert len(set(tok.encode("a b c d e f g h"))) == 8  # distinct words, distinct ids (CRC32: fixed)
    full = load_contract(pathlib.Path(__file__).resolve().parents[1] / "config" / "pi05.yaml")
    # the project's one tokenizer rule, as the binding applies it (no 4B-parameter model on a CPU): the plan
    tiny = load_contract(pathlib.Path(__file__).resolve().parents[1] / "config" / "pi05_tiny.yaml")
    assert Pi05Binding.plan(full.model, full.dims, "cpu")["tokenizer"] == "WordTokenizer"
    assert full.dims["prompt_len"] == 48
    assert Pi05Binding.plan(tiny.model, tiny.dims, "cpu")["tokenizer"] == "TinyTokenizer"
    assert isinstance(choose_tokenizer(Pi05Binding.model_config(full.model), None), WordTokenizer)
    assert isinstance(choose_tokenizer(Pi05Binding.model_config(tiny.model), None), TinyTokenizer)


def test_a_task_too_long_for_the_state_is_refused_at_set_prompt():
    """The state comes last in the prompt: a task that fits the prompt buffer (256 bytes) but pushes the
    state digits past prompt_len (128 tokens of the tiny model) would leave the policy blind to the robot,
    so set_prompt refuses it, and the runtime keeps the prompt it had."""
    from flashrt_core.contract import Runtime

    rt = Runtime.from_config(pathlib.Path(__file__).resolve().parents[1] / "config" / "pi05_tiny.yaml", seed=0)
    fits = "x" * 60  # "Task: " + 60 + ", State: " + 8 x "255" + 7 spaces + ";\nAction: " + BOS = 117 tokens
    rt.set_prompt(fits)
    with pytest.raises(InputError) as e:
        rt.set_prompt("y" * 127)
    assert "more than prompt_len = 128" in str(e.value) and "task of 127 characters with 8 state values" in str(e.value)
    assert rt._prompt == fits


def test_sentencepiece_tokenizer_adds_bos(tmp_path):
    import sentencepiece as spm

    corpus = ["Task: pick up the red cube, State: 1 2 3;", "Action: move the arm", "put the block in the bowl"] * 20
    model = tmp_path / "tok.model"
    with open(model, "wb") as f:
        spm.SentencePieceTrainer.train(sentence_iterator=iter(corpus), model_writer=f, vocab_size=60,
                                       hard_vocab_limit=False,
                                       pad_id=0, eos_id=1, bos_id=2, unk_id=3, minloglevel=2)
    tok = SentencePieceTokenizer(model)
    assert (tok.bos_id, tok.pad_id) == (2, 0)
    sp = spm.SentencePieceProcessor(model_file=str(model))
    text = "Task: pick up the cube, State: 3 2;\nAction: "
    tokens, mask = tokenize_prompt(tok, text, 48)
    n = int(mask.sum())
    assert tokens[0, :n].tolist() == sp.encode(text, add_bos=True)
    assert (tokens[0, n:] == 0).all() and n > 5
    with pytest.raises(InputError, match="not found"):
        SentencePieceTokenizer(tmp_path / "missing.model")
