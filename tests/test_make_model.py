"""make_model: random checkpoints that transformers reloads, seeded, a round-tripping tokenizer."""

import json

import pytest
import torch
import transformers
from pagechat.core.errors import PagechatError
from pagechat.tools.make_model import (
    ARCHS,
    EOS_IDS,
    builtin_corpus,
    builtin_tokenizer,
    make_model,
    model_config,
    train_tokenizer,
)
from safetensors.torch import load_file

TEXTS = [
    "Hello, world!",
    "  leading spaces\tand tabs\n\nand blank lines  ",
    "naïve café — “quotes” ½ ∑ x² ≠ ∞",
    "日本語のテキスト、中文文本、한국어",
    "emoji 🦙🚀👩‍💻 mixed",
    "<|im_start|>user\nhi<|im_end|>\n",
    "\x00\x7f control bytes \u200b zero width",
    "",
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The four tiny checkpoints, made once for this module."""
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_model(root / arch, arch, "tiny") for arch in ARCHS}


def _load(path):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    return model.eval()


@pytest.mark.parametrize("arch", list(ARCHS))
def test_tiny_reloads_in_transformers_and_gives_finite_logits(tiny, arch):
    model = _load(tiny[arch])
    tok = transformers.AutoTokenizer.from_pretrained(tiny[arch], local_files_only=True)
    ids = tok("The KV cache is paged.", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tok)) and torch.isfinite(logits).all()
    assert logits.std() > 0.1  # not flat: greedy comparisons need clear argmax gaps
    cfg = json.loads((tiny[arch] / "config.json").read_text())
    assert cfg["architectures"] == [ARCHS[arch][1]] and cfg["torch_dtype"] == "float32"
    assert cfg["eos_token_id"] == EOS_IDS and cfg["bos_token_id"] is None
    gen = json.loads((tiny[arch] / "generation_config.json").read_text())
    assert gen["eos_token_id"] == EOS_IDS


def test_tiny_variants_cover_the_engine_features(tiny):
    llama, mistral, qwen2, qwen3 = (_load(tiny[a]) for a in ("llama", "mistral", "qwen2", "qwen3"))
    rope = (
        llama.config.rope_parameters
        if hasattr(llama.config, "rope_parameters")
        else llama.config.rope_scaling
    )
    assert rope["rope_type"] == "llama3" and rope["factor"] == 8.0
    raw = json.loads((tiny["llama"] / "config.json").read_text())
    assert raw["rope_scaling"]["rope_type"] == "llama3" and raw["rope_theta"] == 500000.0
    assert mistral.config.sliding_window == 4096
    assert not llama.config.tie_word_embeddings and not mistral.config.tie_word_embeddings
    for model in (qwen2, qwen3):
        assert model.config.tie_word_embeddings
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    attn2, attn3 = qwen2.model.layers[0].self_attn, qwen3.model.layers[0].self_attn
    assert attn2.q_proj.bias.abs().sum() > 0  # biases and norms are random, not 0 and 1
    assert qwen3.config.head_dim == 32 and attn3.q_proj.out_features == 4 * 32
    assert not torch.allclose(attn3.q_norm.weight, torch.ones(32))
    assert "lm_head.weight" not in load_file(tiny["qwen2"] / "model.safetensors")


def test_same_seed_same_weights_other_seed_differs(tiny, tmp_path):
    first = load_file(tiny["qwen3"] / "model.safetensors")
    again = load_file(make_model(tmp_path / "a", "qwen3", "tiny", seed=0) / "model.safetensors")
    other = load_file(make_model(tmp_path / "b", "qwen3", "tiny", seed=1) / "model.safetensors")
    assert first.keys() == again.keys() == other.keys()
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not any(torch.equal(first[k], other[k]) for k in first)


def test_make_model_prints_nothing_and_leaves_global_rng_alone(tmp_path, capfd):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    make_model(tmp_path / "m", "llama", "tiny")
    assert torch.equal(torch.rand(3), expected)
    assert capfd.readouterr() == ("", "")


def test_tokenizer_round_trips_any_text(tiny):
    saved = transformers.AutoTokenizer.from_pretrained(tiny["llama"], local_files_only=True)
    for tok in (builtin_tokenizer(), saved):
        for text in TEXTS:
            assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_tokenizer_special_tokens():
    tok = builtin_tokenizer()
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id == 0 and tok.bos_token is None
    assert tok.encode("<|im_start|>user", add_special_tokens=False)[0] == 1  # one token, not text
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi", add_special_tokens=False)


def test_chat_template_renders_chatml():
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = builtin_tokenizer().apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    plain = builtin_tokenizer().apply_chat_template(msgs[:1], tokenize=False)
    assert plain == "<|im_start|>system\nBe brief.<|im_end|>\n"


def test_train_tokenizer_is_deterministic_and_sized():
    corpus = builtin_corpus()
    a, b = train_tokenizer(corpus, 600), train_tokenizer(corpus, 600)
    assert len(a) == 600 and a.get_vocab() == b.get_vocab()
    assert a.backend_tokenizer.to_str() == b.backend_tokenizer.to_str()


def test_builtin_corpus_is_stable_and_bounded():
    corpus = builtin_corpus()
    assert corpus == builtin_corpus()
    assert 100_000 < sum(map(len, corpus)) < 2_000_000
    assert any("paged key-value cache" in t for t in corpus)


@pytest.mark.parametrize("arch,size,named", [("gpt2", "tiny", "llama"), ("llama", "huge", "small")])
def test_bad_arch_or_size_is_one_line_error_listing_choices(tmp_path, arch, size, named):
    with pytest.raises(PagechatError) as err:
        make_model(tmp_path / "x", arch, size)
    assert "\n" not in str(err.value) and named in str(err.value)
    assert not (tmp_path / "x").exists()


def test_non_empty_out_dir_is_refused_and_untouched(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(PagechatError, match="not an empty directory"):
        make_model(tmp_path, "llama", "tiny")
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert (make_model(empty, "mistral", "tiny") / "model.safetensors").exists()


@pytest.mark.parametrize("arch", list(ARCHS))
def test_small_has_the_smollm2_135m_shape(arch):
    cfg = model_config(arch, "small")
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (576, 30, 9)
    assert (cfg.num_key_value_heads, cfg.intermediate_size, cfg.vocab_size) == (3, 1536, 49152)
    assert cfg.max_position_embeddings == 2048 and cfg.tie_word_embeddings
    assert cfg.rms_norm_eps == 1e-5 and cfg.head_dim == 64
    with torch.device("meta"):
        model = getattr(transformers, ARCHS[arch][1])(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    extra = {"qwen2": 30 * (576 + 2 * 192), "qwen3": 30 * 2 * 64}.get(arch, 0)  # bias / q,k norm
    assert n_params == 134_515_008 + extra


def test_half_billion_shape_is_qwen2_05b():
    """The 0.5b size has Qwen2-0.5B's shape: its published parameter count, 494,032,768 (tied
    embeddings, q/k/v biases), counted on the meta device without making the weights."""
    config = model_config("qwen2", "0.5b", 151936)
    with torch.device("meta"):
        model = transformers.Qwen2ForCausalLM(config)
    assert sum(p.numel() for p in model.parameters()) == 494_032_768
    assert config.max_position_embeddings == 32768 and config.tie_word_embeddings
